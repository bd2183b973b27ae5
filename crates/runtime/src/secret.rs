//! Secrets people and programs log in with, stored as their argon2id hash
//! (a PHC string, `$argon2id$v=19$m=19456,t=2,p=1$...`) so that a leaked
//! configuration opens nothing: the console's users and the HTTP gateway's
//! clients. A secret in clear is still read (the caller warns about it).
//!
//! A hash check costs some milliseconds of CPU on purpose, so callers run
//! [`StoredSecret::accepts`] off the async threads, and [`Remembered`] takes
//! a credential that passed again for a while by its SHA-256 without one.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use argon2::password_hash::phc::PasswordHash;
use argon2::password_hash::{PasswordHasher, PasswordVerifier};
use argon2::Argon2;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// Shortest secret accepted: a guessable one would be an open door.
pub const MIN_SECRET_CHARS: usize = 16;

/// A secret as configured.
#[derive(Clone)]
pub enum StoredSecret {
    /// Its argon2 hash, a PHC string.
    Hashed(String),
    /// In clear.
    Plain(String),
}

impl StoredSecret {
    /// Reads a configured secret: a PHC string starting `$argon2`, or a
    /// secret in clear of at least [`MIN_SECRET_CHARS`] characters.
    ///
    /// # Errors
    /// What is wrong with it, never the secret itself.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.starts_with("$argon2") {
            PasswordHash::new(text).map_err(|error| {
                format!("it starts like an argon2 hash but is not one ({error}): make it with `hash-secret`")
            })?;
            Ok(Self::Hashed(text.to_owned()))
        } else if text.chars().count() < MIN_SECRET_CHARS {
            Err(format!(
                "the secret must have at least {MIN_SECRET_CHARS} characters"
            ))
        } else {
            Ok(Self::Plain(text.to_owned()))
        }
    }

    /// True when configured in clear rather than hashed.
    pub fn in_clear(&self) -> bool {
        matches!(self, Self::Plain(_))
    }

    /// Whether `given` is this secret: constant time in clear, a hash check
    /// (slow) otherwise.
    pub fn accepts(&self, given: &str) -> bool {
        match self {
            Self::Plain(secret) => same(secret, given),
            Self::Hashed(phc) => PasswordHash::new(phc).is_ok_and(|hash| {
                Argon2::default()
                    .verify_password(given.as_bytes(), &hash)
                    .is_ok()
            }),
        }
    }

    /// A hashed secret nobody has, checked when a name is unknown so that
    /// the answer takes as long as for a known one.
    pub fn decoy() -> &'static Self {
        static DECOY: std::sync::OnceLock<StoredSecret> = std::sync::OnceLock::new();
        DECOY.get_or_init(|| {
            Self::Hashed(hash_secret("no-user-has-this-secret-ever").unwrap_or_default())
        })
    }
}

/// The entries of a list of `name:...:secret` (the console's users, the
/// gateway's clients): split at commas and new lines, except
/// the commas inside a hash's parameters (`m=19456,t=2,p=1`), which hold
/// no colon, as every entry does.
pub fn config_entries(text: &str) -> Vec<String> {
    let mut entries: Vec<String> = Vec::new();
    for (piece, after_comma) in text
        .split('\n')
        .flat_map(|line| line.split(',').enumerate().map(|(i, piece)| (piece, i > 0)))
    {
        match entries.last_mut() {
            Some(last) if after_comma && !piece.contains(':') && !piece.trim().is_empty() => {
                last.push(',');
                last.push_str(piece);
            }
            _ => entries.push(piece.to_owned()),
        }
    }
    entries
        .into_iter()
        .map(|entry| entry.trim().to_owned())
        .filter(|entry| !entry.is_empty())
        .collect()
}

/// Constant-time equality of two strings.
pub fn same(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
}

/// The argon2id hash of `secret` as a PHC string, to configure in its place.
///
/// # Errors
/// When the secret is shorter than [`MIN_SECRET_CHARS`].
pub fn hash_secret(secret: &str) -> Result<String, String> {
    if secret.chars().count() < MIN_SECRET_CHARS {
        return Err(format!(
            "the secret must have at least {MIN_SECRET_CHARS} characters"
        ));
    }
    Argon2::default()
        .hash_password(secret.as_bytes())
        .map(|hash| hash.to_string())
        .map_err(|e| format!("cannot hash the secret: {e}"))
}

/// Reads one line from standard input and prints its hash: the
/// `hash-secret` subcommand of the binaries that take hashed secrets.
pub fn hash_secret_command(binary: &str) -> std::process::ExitCode {
    use std::io::BufRead as _;
    let mut line = String::new();
    if let Err(error) = std::io::stdin().lock().read_line(&mut line) {
        eprintln!("{binary} hash-secret: cannot read the secret from standard input: {error}");
        return std::process::ExitCode::from(2);
    }
    match hash_secret(line.trim_end_matches(['\r', '\n'])) {
        Ok(hash) => {
            println!("{hash}");
            std::process::ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("{binary} hash-secret: {error}");
            std::process::ExitCode::from(2)
        }
    }
}

/// Credentials that passed, by the SHA-256 of what was presented, with
/// whom they named (an index into the caller's list) and when; entries
/// older than their time to live are not taken, and the oldest go first
/// past a bound. Failures are never remembered.
pub struct Remembered {
    ttl: Duration,
    max: usize,
    entries: Mutex<HashMap<[u8; 32], (usize, Instant)>>,
}

impl Remembered {
    /// Remembers up to `max` credentials for `ttl` each.
    pub fn new(ttl: Duration, max: usize) -> Self {
        Self {
            ttl,
            max,
            entries: Mutex::new(HashMap::new()),
        }
    }

    /// The key of a presented credential.
    pub fn key(credential: &str) -> [u8; 32] {
        Sha256::digest(credential.as_bytes()).into()
    }

    /// Whom `key` named, if it passed within the time to live.
    pub fn get(&self, key: &[u8; 32]) -> Option<usize> {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        match entries.get(key) {
            Some((who, at)) if at.elapsed() < self.ttl => Some(*who),
            Some(_) => {
                entries.remove(key);
                None
            }
            None => None,
        }
    }

    /// Remembers that `key` passed as `who`.
    pub fn insert(&self, key: [u8; 32], who: usize) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.len() >= self.max {
            let oldest = entries
                .iter()
                .min_by_key(|(_, (_, at))| *at)
                .map(|(k, _)| *k);
            if let Some(oldest) = oldest {
                entries.remove(&oldest);
            }
        }
        entries.insert(key, (who, Instant::now()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashed_and_clear_secrets_accept_only_themselves() {
        let hash = hash_secret("the-secret-0123456789").unwrap();
        let hashed = StoredSecret::parse(&hash).unwrap();
        assert!(!hashed.in_clear());
        assert!(hashed.accepts("the-secret-0123456789"));
        assert!(!hashed.accepts("the-secret-012345678"));
        let clear = StoredSecret::parse("the-secret-0123456789").unwrap();
        assert!(clear.in_clear() && clear.accepts("the-secret-0123456789"));
        assert!(StoredSecret::parse("short").is_err());
        let error = StoredSecret::parse("$argon2id$v=19$nonsense")
            .err()
            .unwrap();
        assert!(error.contains("hash-secret"), "{error}");
        assert!(hash_secret("short").is_err());
    }

    #[test]
    fn remembered_credentials_expire_and_stay_bounded() {
        let remembered = Remembered::new(Duration::from_secs(60), 2);
        let (a, b, c) = (
            Remembered::key("a"),
            Remembered::key("b"),
            Remembered::key("c"),
        );
        remembered.insert(a, 0);
        remembered.insert(b, 1);
        remembered.insert(c, 2);
        assert_eq!(remembered.get(&a), None, "the oldest went first");
        assert_eq!((remembered.get(&b), remembered.get(&c)), (Some(1), Some(2)));
        let expired = Remembered::new(Duration::ZERO, 2);
        expired.insert(a, 0);
        assert_eq!(expired.get(&a), None);
    }
}
