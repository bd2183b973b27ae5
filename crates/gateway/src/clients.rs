//! Who may use the gateway: clients with a secret each, apart from the
//! console's operators (a client submits and reads orders; it cannot
//! cancel, resubmit or see alerts). Secrets are stored as argon2 hashes
//! ([`sas_runtime::secret`]); a client sends its secret as
//! `Authorization: Bearer <secret>`. A bearer secret names no client, so
//! each is tried (a few hash checks, on a blocking thread); a secret that
//! passed is taken again for [`VERIFIED_FOR`] without one.

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
    /// A secret no client has.
    Wrong,
}

/// Checks clients' secrets.
#[derive(Clone)]
pub struct Clients {
    clients: Arc<Vec<Client>>,
    verified: Arc<Remembered>,
}

impl Clients {
    /// The checker for `clients`.
    pub fn new(clients: Vec<Client>) -> Self {
        Self {
            clients: Arc::new(clients),
            verified: Arc::new(Remembered::new(VERIFIED_FOR, 1024)),
        }
    }

    /// The client whose secret `authorization` (the header's value) carries.
    ///
    /// # Errors
    /// [`Refusal`] when there is none or it matches no client.
    pub async fn authenticate(&self, authorization: Option<&str>) -> Result<String, Refusal> {
        let secret = authorization
            .map(str::trim)
            .and_then(|value| value.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, secret)| secret.trim().to_owned())
            .filter(|secret| !secret.is_empty())
            .ok_or(Refusal::Missing)?;
        let key = Remembered::key(&secret);
        if let Some(index) = self.verified.get(&key) {
            return Ok(self.clients[index].name.clone());
        }
        let clients = self.clients.clone();
        let found = tokio::task::spawn_blocking(move || {
            clients
                .iter()
                .position(|client| client.secret.accepts(&secret))
        })
        .await
        .ok()
        .flatten()
        .ok_or(Refusal::Wrong)?;
        self.verified.insert(key, found);
        Ok(self.clients[found].name.clone())
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
