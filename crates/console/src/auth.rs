//! Who is asking, and may they: users from a secret, HTTP basic auth or a
//! bearer token, two roles, and the CSRF tokens of actions.
//!
//! Users are configured as `name:role:secret` entries (`console.users`,
//! normally from a `_FILE` secret). A request authenticates with basic auth
//! (`name` and `secret`, what a browser prompts for) or `Authorization:
//! Bearer <secret>` (scripts). Secrets are compared in constant time.
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

use base64::Engine as _;
use hmac::{Hmac, Mac};
use serde::Serialize;
use sha2::Sha256;
use subtle::ConstantTimeEq;

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
    secret: String,
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

/// Shortest secret accepted: a guessable one would make the console an open door.
pub const MIN_SECRET_CHARS: usize = 16;

/// Reads `name:role:secret` entries separated by commas or new lines.
///
/// # Errors
/// A message naming `console.users` and the entry (never its secret).
pub fn parse_users(text: &str) -> Result<Vec<User>, String> {
    let mut users: Vec<User> = Vec::new();
    for (index, entry) in text
        .split([',', '\n'])
        .map(str::trim)
        .filter(|entry| !entry.is_empty())
        .enumerate()
    {
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
        if secret.chars().count() < MIN_SECRET_CHARS {
            return Err(format!(
                "console.users entry {} ({name}): the secret must have at least {MIN_SECRET_CHARS} characters",
                index + 1
            ));
        }
        if users.iter().any(|user| user.name == name) {
            return Err(format!("console.users names {name} twice"));
        }
        if users.iter().any(|user| user.secret == secret) {
            return Err(format!(
                "console.users entry {} ({name}) has another user's secret: a bearer token must name one user",
                index + 1
            ));
        }
        users.push(User {
            name: name.to_owned(),
            role,
            secret: secret.to_owned(),
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
    users: Vec<User>,
    anonymous: Option<Role>,
    csrf_key: Vec<u8>,
}

fn same(a: &str, b: &str) -> bool {
    a.as_bytes().ct_eq(b.as_bytes()).into()
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
            users,
            anonymous,
            csrf_key,
        }
    }

    /// Who sent a request with this `Authorization` header value.
    ///
    /// # Errors
    /// A [`Refusal`] saying what is wrong with the credentials.
    pub fn authenticate(&self, authorization: Option<&str>) -> Result<Principal, Refusal> {
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
            // Every user is compared, so the time taken does not tell which names exist.
            let mut found = None;
            for user in &self.users {
                if same(&user.name, name) & same(&user.secret, secret) {
                    found = Some(user);
                }
            }
            found
        } else if scheme.eq_ignore_ascii_case("bearer") {
            let mut found = None;
            for user in &self.users {
                if same(&user.secret, value.trim()) {
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

    #[test]
    fn basic_auth_and_bearer_tokens_name_the_user_and_their_role() {
        let auth = Authenticator::new(parse_users(USERS).unwrap(), None, "");
        let ann = auth
            .authenticate(Some(&basic("ann", "ann-secret-0123456789")))
            .unwrap();
        assert_eq!((ann.name.as_str(), ann.role), ("ann", Role::Operator));
        let bob = auth
            .authenticate(Some("Bearer bob-secret-0123456789"))
            .unwrap();
        assert_eq!((bob.name.as_str(), bob.role), ("bob", Role::Viewer));
        assert_eq!(ann.actor(), "console:ann");
    }

    #[test]
    fn missing_wrong_and_malformed_credentials_are_refused() {
        let auth = Authenticator::new(parse_users(USERS).unwrap(), None, "");
        assert_eq!(auth.authenticate(None), Err(Refusal::Missing));
        assert_eq!(
            auth.authenticate(Some(&basic("ann", "bob-secret-0123456789"))),
            Err(Refusal::Wrong),
            "another user's secret does not open ann's account"
        );
        assert_eq!(auth.authenticate(Some("Bearer nope")), Err(Refusal::Wrong));
        assert_eq!(auth.authenticate(Some("Digest x")), Err(Refusal::Malformed));
        assert_eq!(auth.authenticate(Some("Basic !!")), Err(Refusal::Malformed));
    }

    #[test]
    fn anonymous_viewers_only_when_configured() {
        let auth = Authenticator::new(Vec::new(), Some(Role::Viewer), "");
        assert_eq!(auth.authenticate(None).unwrap().role, Role::Viewer);
        assert_eq!(auth.authenticate(Some("Bearer x")), Err(Refusal::Wrong));
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
