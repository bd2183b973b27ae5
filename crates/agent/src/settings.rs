//! The agent's settings (defaults in `defaults.toml`).

use sas_broker::AmqpSettings;
use sas_runtime::{HttpSettings, LogSettings, Validate};
use serde::Deserialize;

/// Compiled-in defaults.
pub const DEFAULTS: &str = include_str!("../defaults.toml");

/// Every setting of an agent.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Logs.
    pub log: LogSettings,
    /// Operations endpoint.
    pub http: HttpSettings,
    /// RabbitMQ.
    pub amqp: AmqpSettings,
    /// The agent itself.
    pub agent: AgentSettings,
    /// Circuit breaker.
    pub circuit: CircuitSettings,
}

/// The `[agent]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentSettings {
    /// Agent name: the queue it consumes is `<prefix>sas.agent.<name>`. A
    /// comma-separated list makes one replica serve several queues.
    pub name: String,
    /// Instance id; empty picks `<name>-<random>`.
    pub id: String,
    /// Base URL of the remote service; `{agent}` is replaced by the agent name.
    pub remote_url: String,
    /// Longest single call, in milliseconds.
    pub call_timeout_ms: u64,
    /// Calls to the remote service in flight at once, per agent name.
    pub concurrency: usize,
    /// First retry wait, in milliseconds.
    pub retry_base_ms: u64,
    /// Longest retry wait, in milliseconds.
    pub retry_max_ms: u64,
    /// Longest wait for in-flight requests at shutdown, in milliseconds.
    pub drain_ms: u64,
}

/// The `[circuit]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CircuitSettings {
    /// Consecutive transient faults that open the circuit.
    pub failure_threshold: u32,
    /// How long the circuit stays open before a probe, in milliseconds.
    pub cool_down_ms: u64,
}

impl AgentSettings {
    /// The agent names this replica serves.
    pub fn names(&self) -> Vec<String> {
        self.name
            .split(',')
            .map(|name| name.trim().to_owned())
            .collect()
    }

    /// The remote service URL of agent `name`.
    pub fn remote_url_for(&self, name: &str) -> String {
        self.remote_url.replace("{agent}", name)
    }
}

impl Validate for Settings {
    fn validate(&self) -> Result<(), String> {
        self.amqp.validate()?;
        let agent = &self.agent;
        for name in agent.names() {
            if name.is_empty()
                || !name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
            {
                return Err(format!(
                    "agent.name must be one name or a comma-separated list of letters, digits, '_' or '-' (got {:?})",
                    agent.name
                ));
            }
        }
        if !(agent.remote_url.starts_with("http://") || agent.remote_url.starts_with("https://")) {
            return Err(format!(
                "agent.remote_url must be an http:// or https:// URL (got {:?})",
                agent.remote_url
            ));
        }
        if agent.call_timeout_ms == 0
            || agent.retry_base_ms == 0
            || agent.retry_max_ms < agent.retry_base_ms
        {
            return Err("agent.call_timeout_ms and agent.retry_base_ms must be positive, and agent.retry_max_ms at least agent.retry_base_ms".into());
        }
        if agent.concurrency == 0 {
            return Err("agent.concurrency must be at least 1".into());
        }
        if self.circuit.failure_threshold == 0 || self.circuit.cool_down_ms == 0 {
            return Err(
                "circuit.failure_threshold and circuit.cool_down_ms must be positive".into(),
            );
        }
        Ok(())
    }
}

impl sas_runtime::HasLog for Settings {
    fn log(&self) -> &LogSettings {
        &self.log
    }
}
