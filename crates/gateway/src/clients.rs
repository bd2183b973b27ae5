//! Who may use the gateway: clients with a secret each, apart from the
//! console's operators (a client submits and reads orders; it cannot
//! cancel, resubmit or see alerts). Secrets are stored as argon2 hashes
//! ([`sas_runtime::secret`]); a client sends its secret as
//! `Authorization: Bearer <name>:<secret>`: one hash check (on a blocking
//! thread, one at a time per client), failures counted per client and
//! address. `Bearer <secret>` alone still works: each client's secret is
//! tried, failures counted per address. A secret that passed is taken
//! again for [`VERIFIED_FOR`] without a check.

use std::sync::Arc;
use std::time::Duration;

use sas_runtime::secret::{config_entries, Remembered, StoredSecret};

/// How long a secret that passed is taken without another check.
pub const VERIFIED_FOR: Duration = Duration::from_secs(300);

/// One client.
#[derive(Clone)]
pub struct Client {
    /// Its name, in logs and metrics.
    pub name: String,
    secret: StoredSecret,
}

impl Client {
    /// True when its secret is configured in clear.
    pub fn secret_in_clear(&self) -> bool {
        self.secret.in_clear()
    }
}

/// Reads `name:secret` entries separated by commas or new lines.
///
/// # Errors
/// A message naming `gateway.clients` and the entry (never its secret).
pub fn parse_clients(text: &str) -> Result<Vec<Client>, String> {
    let mut clients: Vec<Client> = Vec::new();
    for (index, entry) in config_entries(text).iter().enumerate() {
        let Some((name, secret)) = entry.split_once(':') else {
            return Err(format!(
                "gateway.clients entry {} is not name:secret",
                index + 1
            ));
        };
        if name.is_empty()
            || name.len() > 64
            || !name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        {
            return Err(format!(
                "gateway.clients entry {}: the name must be 1 to 64 of A-Z a-z 0-9 - _ .",
                index + 1
            ));
        }
        let secret = StoredSecret::parse(secret)
            .map_err(|error| format!("gateway.clients entry {} ({name}): {error}", index + 1))?;
        if clients.iter().any(|client| client.name == name) {
            return Err(format!("gateway.clients names {name} twice"));
        }
        clients.push(Client {
            name: name.to_owned(),
            secret,
        });
    }
    Ok(clients)
}

/// Why a request was not let in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A secret no client has (or not the named client's).
    Wrong,
}

/// The credentials a request presents: `Bearer <name>:<secret>` names its
/// client (one hash check, of that client's secret); `Bearer <secret>`
/// names none (each client's secret is tried).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Presented {
    /// The client it names, by index, when it names a known one.
    client: Option<usize>,
    /// The secret.
    secret: String,
}

impl Presented {
    /// The keys failed logins are counted under: the named client from
    /// this address (a guesser there locks out that client from that
    /// address only, never another client behind the same proxy), or, for
    /// a secret that names no client, the address.
    pub fn limit_keys(&self, clients: &Clients, address: Option<&str>) -> Vec<String> {
        let address = address.unwrap_or("unknown");
        match self.client {
            Some(index) => vec![format!(
                "client:{}@ip:{address}",
                clients.clients[index].name
            )],
            None => vec![format!("ip:{address}")],
        }
    }
}

/// Checks clients' secrets, one check at a time per client.
#[derive(Clone)]
pub struct Clients {
    clients: Arc<Vec<Client>>,
    verified: Arc<Remembered>,
    /// One per client, then one for secrets that name no client: a hash
    /// check runs only while its turn is held, so concurrent wrong secrets
    /// for one name cost one core, one check after another.
    turns: Arc<Vec<Arc<tokio::sync::Mutex<()>>>>,
}

impl Clients {
    /// The checker for `clients`.
    pub fn new(clients: Vec<Client>) -> Self {
        let turns = (0..=clients.len())
            .map(|_| Arc::new(tokio::sync::Mutex::new(())))
            .collect();
        Self {
            clients: Arc::new(clients),
            verified: Arc::new(Remembered::new(VERIFIED_FOR, 1024)),
            turns: Arc::new(turns),
        }
    }

    /// What the `Authorization` header's value presents.
    ///
    /// # Errors
    /// [`Refusal::Missing`] without a bearer secret.
    pub fn presented(&self, authorization: Option<&str>) -> Result<Presented, Refusal> {
        let token = authorization
            .map(str::trim)
            .and_then(|value| value.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim().to_owned())
            .filter(|token| !token.is_empty())
            .ok_or(Refusal::Missing)?;
        let named = token.split_once(':').and_then(|(name, secret)| {
            let index = self.clients.iter().position(|c| c.name == name)?;
            Some(Presented {
                client: Some(index),
                secret: secret.to_owned(),
            })
        });
        Ok(named.unwrap_or(Presented {
            client: None,
            secret: token,
        }))
    }

    /// The client `presented` authenticated as lately (within
    /// [`VERIFIED_FOR`]), without a hash check or a turn: a client with a
    /// good secret never queues behind someone guessing its name.
    pub fn remembered(&self, presented: &Presented) -> Option<String> {
        let index = self.verified.get(&Self::remembered_key(presented))?;
        Some(self.clients[index].name.clone())
    }

    /// The key a secret that passed is remembered under (with the client
    /// it named, if any).
    fn remembered_key(presented: &Presented) -> [u8; 32] {
        Remembered::key(&format!(
            "{}\n{}",
            presented.client.map_or(usize::MAX, |i| i),
            presented.secret
        ))
    }

    /// Waits for the turn to check `presented`'s secret: at most one hash
    /// check at a time per client (and one for secrets naming none).
    pub async fn turn(&self, presented: &Presented) -> tokio::sync::OwnedMutexGuard<()> {
        let index = presented.client.unwrap_or(self.clients.len());
        self.turns[index].clone().lock_owned().await
    }

    /// The client `presented` authenticates as (hold its [`Clients::turn`]).
    ///
    /// # Errors
    /// [`Refusal::Wrong`] when its secret is not the named client's, or,
    /// naming none, no client's.
    pub async fn check(&self, presented: &Presented) -> Result<String, Refusal> {
        if let Some(name) = self.remembered(presented) {
            return Ok(name);
        }
        let key = Self::remembered_key(presented);
        let (clients, secret, named) = (
            self.clients.clone(),
            presented.secret.clone(),
            presented.client,
        );
        let found = tokio::task::spawn_blocking(move || match named {
            Some(index) => clients[index].secret.accepts(&secret).then_some(index),
            None => clients
                .iter()
                .position(|client| client.secret.accepts(&secret)),
        })
        .await
        .ok()
        .flatten()
        .ok_or(Refusal::Wrong)?;
        self.verified.insert(key, found);
        Ok(self.clients[found].name.clone())
    }

    /// The client whose secret `authorization` (the header's value) carries.
    ///
    /// # Errors
    /// [`Refusal`] when there is none or it matches no client.
    pub async fn authenticate(&self, authorization: Option<&str>) -> Result<String, Refusal> {
        let presented = self.presented(authorization)?;
        let _turn = self.turn(&presented).await;
        self.check(&presented).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_client_is_known_by_its_secret_hashed_or_not() {
        let hash = sas_runtime::secret::hash_secret("shop-secret-0123456789").unwrap();
        let parsed =
            parse_clients(&format!("shop:{hash},\nbatch:batch-secret-0123456789")).unwrap();
        let names: Vec<_> = parsed
            .iter()
            .map(|c| (c.name.as_str(), c.secret_in_clear()))
            .collect();
        assert_eq!(names, [("shop", false), ("batch", true)]);
        let clients = Clients::new(parsed);
        assert_eq!(
            clients
                .authenticate(Some("Bearer shop-secret-0123456789"))
                .await,
            Ok("shop".to_owned())
        );
        assert_eq!(
            clients
                .authenticate(Some("bearer batch-secret-0123456789"))
                .await,
            Ok("batch".to_owned())
        );
        assert_eq!(
            clients.authenticate(Some("Bearer nope")).await,
            Err(Refusal::Wrong)
        );
        assert_eq!(
            clients
                .authenticate(Some("Bearer shop:shop-secret-0123456789"))
                .await,
            Ok("shop".to_owned()),
            "named"
        );
        assert_eq!(
            clients
                .authenticate(Some("Bearer batch:shop-secret-0123456789"))
                .await,
            Err(Refusal::Wrong),
            "another client's secret under a name"
        );
        assert_eq!(clients.authenticate(None).await, Err(Refusal::Missing));
        assert_eq!(
            clients.authenticate(Some("Basic abc")).await,
            Err(Refusal::Missing)
        );
    }

    #[test]
    fn bad_entries_are_refused_without_showing_the_secret() {
        for (text, needle) in [
            ("shop", "name:secret"),
            ("shop:short", "16 characters"),
            ("sh op:0123456789abcdefgh", "the name"),
            ("shop:0123456789abcdefgh,shop:0123456789abcdefgX", "twice"),
        ] {
            let error = parse_clients(text).err().unwrap();
            assert!(error.contains(needle), "{text}: {error}");
            assert!(!error.contains("0123456789abcdef"), "{error}");
        }
    }
}

#[cfg(test)]
mod turn_tests {
    use super::*;

    #[tokio::test]
    async fn a_named_client_s_failures_are_counted_apart_and_its_checks_wait_their_turn() {
        let clients = Clients::new(
            parse_clients("shop:shop-secret-0123456789,batch:batch-secret-0123456789").unwrap(),
        );
        let named = clients.presented(Some("Bearer shop:guess")).unwrap();
        let bare = clients.presented(Some("Bearer guess")).unwrap();
        let unknown_name = clients.presented(Some("Bearer nobody:guess")).unwrap();
        assert_eq!(
            named.limit_keys(&clients, Some("10.0.0.1")),
            ["client:shop@ip:10.0.0.1"]
        );
        assert_eq!(bare.limit_keys(&clients, Some("10.0.0.1")), ["ip:10.0.0.1"]);
        assert_eq!(
            unknown_name.limit_keys(&clients, Some("10.0.0.1")),
            ["ip:10.0.0.1"],
            "a name no client has is a bare secret"
        );
        // shop's turn is held: another check for shop waits, batch's does not.
        let held = clients.turn(&named).await;
        let batch = clients.presented(Some("Bearer batch:x")).unwrap();
        let batch_turn =
            tokio::time::timeout(Duration::from_millis(100), clients.turn(&batch)).await;
        assert!(batch_turn.is_ok(), "another client's turn is free");
        let waiting = tokio::time::timeout(Duration::from_millis(100), clients.turn(&named)).await;
        assert!(waiting.is_err(), "shop's second check waits for the first");
        drop(held);
        assert!(
            tokio::time::timeout(Duration::from_millis(100), clients.turn(&named))
                .await
                .is_ok()
        );
    }
}
