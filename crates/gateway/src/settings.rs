//! The gateway's settings (defaults in `defaults.toml`).

use sas_broker::AmqpSettings;
use sas_runtime::{HttpSettings, LogSettings, Validate};
use sas_store::DatabaseSettings;
use serde::Deserialize;

use crate::clients::parse_clients;

/// Compiled-in defaults.
pub const DEFAULTS: &str = include_str!("../defaults.toml");

/// Every setting of the gateway.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Logs.
    pub log: LogSettings,
    /// Where the client API and the operations endpoints are served.
    pub http: HttpSettings,
    /// RabbitMQ: where submitted orders are published.
    pub amqp: AmqpSettings,
    /// Postgres, read for an order's status.
    pub database: DatabaseSettings,
    /// The gateway itself.
    pub gateway: GatewaySettings,
}

/// The `[gateway]` section.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GatewaySettings {
    /// `name:secret` entries (see [`parse_clients`]); a secret.
    pub clients: String,
    /// Failed authentications allowed per minute per client address.
    pub login_failures_per_minute: u32,
    /// Longest a GET may wait for an outcome, in seconds.
    pub max_wait_secs: u64,
    /// Waiting GETs (`?wait=`) one client may hold open at once; past it,
    /// 429 at once (see [`crate::long_polls`]).
    pub max_long_polls_per_client: usize,
    /// How long a submission waits for the broker's confirm, in milliseconds.
    pub publish_timeout_ms: u64,
    /// Instance name; empty picks `gateway-<random>`.
    pub id: String,
    /// The tenancy file (see [`sas_runtime::tenancy`]); empty: one tenant.
    #[serde(default)]
    pub tenancy_file: String,
    /// Where `/metrics`, `/healthz` and `/readyz` are served, apart from
    /// the clients' port (`http.listen`), so that clients reach neither the
    /// metrics nor a readiness probe that queries the store. Empty: on the
    /// clients' port, as before.
    #[serde(default)]
    pub ops_listen: String,
}

impl std::fmt::Debug for GatewaySettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GatewaySettings")
            .field("clients", &"<redacted>")
            .field("login_failures_per_minute", &self.login_failures_per_minute)
            .field("max_wait_secs", &self.max_wait_secs)
            .field("max_long_polls_per_client", &self.max_long_polls_per_client)
            .field("publish_timeout_ms", &self.publish_timeout_ms)
            .field("id", &self.id)
            .field("tenancy_file", &self.tenancy_file)
            .field("ops_listen", &self.ops_listen)
            .finish()
    }
}

impl Validate for Settings {
    fn validate(&self) -> Result<(), String> {
        self.amqp.validate()?;
        self.database.validate()?;
        let g = &self.gateway;
        if parse_clients(&g.clients)?.is_empty() {
            return Err(
                "gateway.clients is empty: no client could submit an order; \
                        set SAS_GATEWAY__CLIENTS_FILE to a file of name:secret lines"
                    .into(),
            );
        }
        if !(1..=600).contains(&g.max_wait_secs) {
            return Err("gateway.max_wait_secs must be between 1 and 600".into());
        }
        if !(1..=10_000).contains(&g.max_long_polls_per_client) {
            return Err("gateway.max_long_polls_per_client must be between 1 and 10000".into());
        }
        if !(100..=120_000).contains(&g.publish_timeout_ms) {
            return Err("gateway.publish_timeout_ms must be between 100 and 120000".into());
        }
        Ok(())
    }
}

impl sas_runtime::HasLog for Settings {
    fn log(&self) -> &LogSettings {
        &self.log
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(clients: &str) -> Settings {
        let mut table: toml::Table = toml::from_str(DEFAULTS).unwrap();
        let gateway = table["gateway"].as_table_mut().unwrap();
        gateway.insert("clients".into(), clients.into());
        table.try_into().unwrap()
    }

    #[test]
    fn a_gateway_no_client_may_use_is_refused_and_secrets_stay_out_of_logs() {
        let error = settings("").validate().unwrap_err();
        assert!(error.contains("SAS_GATEWAY__CLIENTS_FILE"), "{error}");
        let fine = settings("shop:0123456789abcdef-secret");
        assert!(fine.validate().is_ok());
        let text = format!("{fine:?}");
        assert!(!text.contains("0123456789abcdef"), "{text}");
    }
}
