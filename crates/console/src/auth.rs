//! Who is asking, and may they: users from a secret, HTTP basic auth or a
//! bearer token, two roles, and the CSRF tokens of actions.
//!
//! Users are configured as `name:role:secret` entries (`console.users`,
//! normally from a `_FILE` secret). The secret is stored as its argon2id
//! hash (a PHC string, `$argon2id$v=19$...`, made by `console hash-secret`),
//! so a leaked users file does not open the console; a secret in clear is
//! still read, with a warning at start. A request authenticates with basic
//! auth (`name` and `secret`, what a browser prompts for) or `Authorization:
//! Bearer <secret>` (scripts). Secrets in clear are compared in constant
//! time. Checking a hash costs tens of milliseconds of CPU on purpose, so
//! it runs off the async threads, and a credential that passed is
//! remembered for [`VERIFIED_FOR`] by its SHA-256 (a browser sends it with
//! every request); failures are never remembered, and
//! [`sas_runtime::login_limit`] slows guessing down.
//!
//! CSRF: a browser resends basic-auth credentials to the console on any
//! request, also one a hostile page makes it send. So every action (every
//! request that is not GET or HEAD) must carry the user's CSRF token, in the
//! `X-CSRF-Token` header or the `csrf_token` form field. The token is
//! HMAC-SHA256 of the user's name under the console's key: the pages embed
//! it in their forms and `GET /api/session` returns it; another site cannot
//! read either (same-origin policy), so it cannot forge an action. A request
//! whose `Origin` header names another host is refused as well. No cookie is
//! involved, so there is no session to steal or fixate.

use std::sync::Arc;
use std::time::Duration;

use base64::Engine as _;
use hmac::{Hmac, Mac};
use sas_runtime::secret::{config_entries, same, Remembered, StoredSecret};
use serde::Serialize;
use sha2::Sha256;

pub use sas_runtime::secret::{hash_secret, MIN_SECRET_CHARS};

/// How long a credential that passed a hash check is taken without another.
pub const VERIFIED_FOR: Duration = Duration::from_secs(300);
/// Most credentials remembered at once (the oldest go first).
const VERIFIED_MAX: usize = 1024;

/// What a user may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// Reads every page and the API; acts on nothing.
    Viewer,
    /// Also resubmits, cancels, acknowledges and resolves alerts, replays and discards dead letters.
    Operator,
}

impl Role {
    /// The name used in settings.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Viewer => "viewer",
            Self::Operator => "operator",
        }
    }
}

/// One configured user.
#[derive(Clone)]
pub struct User {
    /// Login name, recorded in the history of what they do.
    pub name: String,
    /// What they may do.
    pub role: Role,
    secret: StoredSecret,
}

impl User {
    /// True when the secret is configured in clear rather than hashed.
    pub fn secret_in_clear(&self) -> bool {
        self.secret.in_clear()
    }
}

/// The caller of a request, once authenticated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Principal {
    /// Login name (`anonymous` without credentials).
    pub name: String,
    /// What they may do.
    pub role: Role,
}

impl Principal {
    /// How the order's history names them: `console:<name>`.
    pub fn actor(&self) -> String {
        format!("console:{}", self.name)
    }
}

/// Reads `name:role:secret` entries separated by commas or new lines.
///
/// # Errors
/// A message naming `console.users` and the entry (never its secret).
pub fn parse_users(text: &str) -> Result<Vec<User>, String> {
    let mut users: Vec<User> = Vec::new();
    for (index, entry) in config_entries(text).iter().enumerate() {
        let mut parts = entry.splitn(3, ':');
        let (Some(name), Some(role), Some(secret)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(format!(
                "console.users entry {} is not name:role:secret",
                index + 1
            ));
        };
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'@'))
        {
            return Err(format!(
                "console.users entry {}: the name must be 1 to 64 of A-Z a-z 0-9 - _ . @",
                index + 1
            ));
        }
        let role = match role {
            "viewer" => Role::Viewer,
            "operator" => Role::Operator,
            other => {
                return Err(format!(
                "console.users entry {} ({name}): role {other:?} is neither viewer nor operator",
                index + 1
            ))
            }
        };
        let secret = StoredSecret::parse(secret)
            .map_err(|error| format!("console.users entry {} ({name}): {error}", index + 1))?;
        if users.iter().any(|user| user.name == name) {
            return Err(format!("console.users names {name} twice"));
        }
        if let StoredSecret::Plain(plain) = &secret {
            if users
                .iter()
                .any(|user| matches!(&user.secret, StoredSecret::Plain(other) if other == plain))
            {
                return Err(format!(
                    "console.users entry {} ({name}) has another user's secret: a bearer token must name one user",
                    index + 1
                ));
            }
        }
        users.push(User {
            name: name.to_owned(),
            role,
            secret,
        });
    }
    Ok(users)
}

/// Why a request was not authenticated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// No credentials, and anonymous access is off.
    #[error("authentication required: use basic auth (user name and secret) or Authorization: Bearer <secret>")]
    Missing,
    /// Credentials that match no user.
    #[error("unknown user or wrong secret")]
    Wrong,
    /// An `Authorization` header of another scheme, or malformed.
    #[error("unsupported Authorization header: expected Basic or Bearer")]
    Malformed,
}

/// Checks credentials and CSRF tokens.
#[derive(Clone)]
pub struct Authenticator {
    users: Arc<Vec<User>>,
    anonymous: Option<Role>,
    csrf_key: Vec<u8>,
    verified: Arc<Remembered>,
}

impl Authenticator {
    /// An authenticator for `users`; requests without credentials get
    /// `anonymous` (or are refused when `None`). An empty `csrf_key` picks a
    /// random one.
    pub fn new(users: Vec<User>, anonymous: Option<Role>, csrf_key: &str) -> Self {
        let csrf_key = if csrf_key.is_empty() {
            let key: [u8; 32] = rand::random();
            key.to_vec()
        } else {
            csrf_key.as_bytes().to_vec()
        };
        Self {
            users: Arc::new(users),
            anonymous,
            csrf_key,
            verified: Arc::new(Remembered::new(VERIFIED_FOR, VERIFIED_MAX)),
        }
    }

    /// Who sent a request with this `Authorization` header value; a hash
    /// check runs on a blocking thread, and a credential that passed is
    /// taken again for [`VERIFIED_FOR`] without one.
    ///
    /// # Errors
    /// A [`Refusal`] saying what is wrong with the credentials.
    pub async fn authenticate(&self, authorization: Option<&str>) -> Result<Principal, Refusal> {
        let Some(header) = authorization.map(str::trim).filter(|h| !h.is_empty()) else {
            return self.check(None);
        };
        let key = Remembered::key(header);
        if let Some(index) = self.verified.get(&key) {
            let user = &self.users[index];
            return Ok(Principal {
                name: user.name.clone(),
                role: user.role,
            });
        }
        let (this, header) = (self.clone(), header.to_owned());
        let checked = tokio::task::spawn_blocking(move || this.check(Some(&header)))
            .await
            .unwrap_or(Err(Refusal::Wrong))?;
        if let Some(index) = self.users.iter().position(|u| u.name == checked.name) {
            self.verified.insert(key, index);
        }
        Ok(checked)
    }

    /// The check itself, slow for hashed secrets.
    fn check(&self, authorization: Option<&str>) -> Result<Principal, Refusal> {
        let Some(header) = authorization.map(str::trim).filter(|h| !h.is_empty()) else {
            return self
                .anonymous
                .map(|role| Principal {
                    name: "anonymous".into(),
                    role,
                })
                .ok_or(Refusal::Missing);
        };
        let (scheme, value) = header.split_once(' ').ok_or(Refusal::Malformed)?;
        let user = if scheme.eq_ignore_ascii_case("basic") {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(value.trim())
                .map_err(|_| Refusal::Malformed)?;
            let decoded = String::from_utf8(decoded).map_err(|_| Refusal::Malformed)?;
            let (name, secret) = decoded.split_once(':').ok_or(Refusal::Malformed)?;
            // Every name is compared, so the time taken does not tell which
            // names exist; an unknown name costs a hash check too.
            let mut found = None;
            for user in self.users.iter() {
                if same(&user.name, name) {
                    found = Some(user);
                }
            }
            match found {
                Some(user) if user.secret.accepts(secret) => Some(user),
                Some(_) => None,
                None => {
                    if self.users.iter().any(|user| !user.secret_in_clear()) {
                        let _ = StoredSecret::decoy().accepts(secret);
                    }
                    None
                }
            }
        } else if scheme.eq_ignore_ascii_case("bearer") {
            // A bearer token names no user: each is tried.
            let mut found = None;
            for user in self.users.iter() {
                if user.secret.accepts(value.trim()) {
                    found = Some(user);
                }
            }
            found
        } else {
            return Err(Refusal::Malformed);
        };
        user.map(|user| Principal {
            name: user.name.clone(),
            role: user.role,
        })
        .ok_or(Refusal::Wrong)
    }

    /// The CSRF token of `principal`: HMAC-SHA256 of its name, in hex.
    pub fn csrf_token(&self, principal: &Principal) -> String {
        let mut mac =
            Hmac::<Sha256>::new_from_slice(&self.csrf_key).expect("HMAC takes keys of any length");
        mac.update(b"sas-console-csrf:");
        mac.update(principal.name.as_bytes());
        hex::encode(mac.finalize().into_bytes())
    }

    /// Whether `token` is `principal`'s CSRF token.
    pub fn csrf_matches(&self, principal: &Principal, token: &str) -> bool {
        same(&self.csrf_token(principal), token.trim())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const USERS: &str = "ann:operator:ann-secret-0123456789\n bob:viewer:bob-secret-0123456789 ";

    fn basic(name: &str, secret: &str) -> String {
        format!(
            "Basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{name}:{secret}"))
        )
    }

    #[tokio::test]
    async fn basic_auth_and_bearer_tokens_name_the_user_and_their_role() {
        let auth = Authenticator::new(parse_users(USERS).unwrap(), None, "");
        let ann = auth
            .authenticate(Some(&basic("ann", "ann-secret-0123456789")))
            .await
            .unwrap();
        assert_eq!((ann.name.as_str(), ann.role), ("ann", Role::Operator));
        let bob = auth
            .authenticate(Some("Bearer bob-secret-0123456789"))
            .await
            .unwrap();
        assert_eq!((bob.name.as_str(), bob.role), ("bob", Role::Viewer));
        assert_eq!(ann.actor(), "console:ann");
    }

    #[tokio::test]
    async fn missing_wrong_and_malformed_credentials_are_refused() {
        let auth = Authenticator::new(parse_users(USERS).unwrap(), None, "");
        assert_eq!(auth.authenticate(None).await, Err(Refusal::Missing));
        assert_eq!(
            auth.authenticate(Some(&basic("ann", "bob-secret-0123456789")))
                .await,
            Err(Refusal::Wrong),
            "another user's secret does not open ann's account"
        );
        assert_eq!(
            auth.authenticate(Some("Bearer nope")).await,
            Err(Refusal::Wrong)
        );
        assert_eq!(
            auth.authenticate(Some("Digest x")).await,
            Err(Refusal::Malformed)
        );
        assert_eq!(
            auth.authenticate(Some("Basic !!")).await,
            Err(Refusal::Malformed)
        );
    }

    #[tokio::test]
    async fn anonymous_viewers_only_when_configured() {
        let auth = Authenticator::new(Vec::new(), Some(Role::Viewer), "");
        assert_eq!(auth.authenticate(None).await.unwrap().role, Role::Viewer);
        assert_eq!(
            auth.authenticate(Some("Bearer x")).await,
            Err(Refusal::Wrong)
        );
    }

    #[test]
    fn csrf_tokens_are_per_user_and_per_key() {
        let users = parse_users(USERS).unwrap();
        let one = Authenticator::new(users.clone(), None, "key-one-0123456789");
        let two = Authenticator::new(users, None, "key-two-0123456789");
        let ann = Principal {
            name: "ann".into(),
            role: Role::Operator,
        };
        let bob = Principal {
            name: "bob".into(),
            role: Role::Viewer,
        };
        let token = one.csrf_token(&ann);
        assert!(one.csrf_matches(&ann, &token));
        assert!(!one.csrf_matches(&bob, &token), "not another user's token");
        assert!(!two.csrf_matches(&ann, &token), "not under another key");
        assert!(!one.csrf_matches(&ann, ""));
    }

    #[tokio::test]
    async fn hashed_secrets_are_checked_and_a_passed_credential_is_remembered() {
        let ann = hash_secret("ann-secret-0123456789").unwrap();
        let bob = hash_secret("bob-secret-0123456789").unwrap();
        assert!(ann.contains(','), "the parameters hold commas: {ann}");
        let users = parse_users(&format!(
            "ann:operator:{ann},bob:viewer:{bob}\ncid:viewer:cid-secret-0123456789"
        ))
        .unwrap();
        let clear: Vec<_> = users
            .iter()
            .map(|u| (u.name.as_str(), u.secret_in_clear()))
            .collect();
        assert_eq!(clear, [("ann", false), ("bob", false), ("cid", true)]);
        let auth = Authenticator::new(users, None, "");
        let header = basic("ann", "ann-secret-0123456789");
        assert_eq!(
            auth.authenticate(Some(&header)).await.unwrap().role,
            Role::Operator
        );
        assert_eq!(auth.verified.get(&Remembered::key(&header)), Some(0));
        assert_eq!(
            auth.authenticate(Some("Bearer bob-secret-0123456789"))
                .await
                .unwrap()
                .name,
            "bob"
        );
        assert_eq!(
            auth.authenticate(Some(&basic("ann", "bob-secret-0123456789")))
                .await,
            Err(Refusal::Wrong)
        );
        assert_eq!(
            auth.authenticate(Some(&basic("nobody", "ann-secret-0123456789")))
                .await,
            Err(Refusal::Wrong)
        );
        let wrong = basic("ann", "wrong-secret-0123456789");
        assert_eq!(auth.authenticate(Some(&wrong)).await, Err(Refusal::Wrong));
        assert_eq!(
            auth.verified.get(&Remembered::key(&wrong)),
            None,
            "a failure is not remembered"
        );
        let error = parse_users("ann:operator:$argon2id$v=19$nonsense")
            .err()
            .unwrap();
        assert!(error.contains("hash-secret"), "{error}");
    }

    #[test]
    fn bad_user_entries_are_refused_without_showing_the_secret() {
        for (text, needle) in [
            (
                "ann:admin:0123456789abcdefgh",
                "neither viewer nor operator",
            ),
            ("ann:operator:short", "at least 16"),
            ("ann:operator", "name:role:secret"),
            ("a b:viewer:0123456789abcdefgh", "the name"),
            (
                "ann:viewer:0123456789abcdefgh,ann:operator:0123456789abcdefgX",
                "twice",
            ),
            (
                "ann:viewer:0123456789abcdefgh,bob:operator:0123456789abcdefgh",
                "another user's secret",
            ),
        ] {
            let error = parse_users(text).err().unwrap();
            assert!(error.contains(needle), "{text}: {error}");
            assert!(!error.contains("0123456789abcdef"), "{error}");
        }
    }
}
