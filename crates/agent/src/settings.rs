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
    /// PEM file of extra CA certificates trusted for an https remote, besides
    /// the system's roots; empty adds none.
    pub remote_ca_file: String,
    /// PEM client certificate for mutual TLS; empty sends none.
    pub remote_client_cert_file: String,
    /// PEM private key of `remote_client_cert_file`.
    pub remote_client_key_file: String,
    /// The whole `Authorization` header value sent to the remote (a secret,
    /// never logged); empty sends none.
    pub remote_auth_header: Secret,
    /// Largest answer body read from the remote service, in bytes.
    pub max_answer_bytes: usize,
    /// Without a `start_by` in the request, no call starts later than
    /// `complete_by` minus this, in milliseconds.
    pub start_margin_ms: u64,
    /// Test only: shifts this agent's idea of "now", in milliseconds
    /// (negative: the clock runs behind), to simulate a skewed host.
    pub clock_offset_ms: i64,
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

/// A secret setting: its `Debug` never shows the value.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// A secret holding `value`.
    pub fn new(value: impl Into<String>) -> Self {
        Self(value.into())
    }

    /// The value, for the one place that must send it.
    pub fn expose(&self) -> &str {
        &self.0
    }

    /// True when unset.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.0.is_empty() {
            f.write_str("\"\"")
        } else {
            f.write_str("[redacted]")
        }
    }
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

/// What the TLS files of the `[agent]` section hold, read and parsed.
#[derive(Default)]
pub struct TlsFiles {
    /// Extra trusted CA certificates.
    pub roots: Vec<reqwest::Certificate>,
    /// The client certificate and key, for mutual TLS.
    pub identity: Option<reqwest::Identity>,
}

impl AgentSettings {
    /// Reads and parses `remote_ca_file`, `remote_client_cert_file` and
    /// `remote_client_key_file`.
    ///
    /// # Errors
    /// A message naming the key whose file cannot be read or parsed.
    pub fn tls_files(&self) -> Result<TlsFiles, String> {
        let read = |key: &str, path: &str| {
            std::fs::read(path)
                .map_err(|error| format!("agent.{key}: cannot read {path:?}: {error}"))
        };
        let mut files = TlsFiles::default();
        if !self.remote_ca_file.is_empty() {
            let pem = read("remote_ca_file", &self.remote_ca_file)?;
            files.roots = reqwest::Certificate::from_pem_bundle(&pem).map_err(|error| {
                format!(
                    "agent.remote_ca_file: {:?} is not PEM certificates: {error}",
                    self.remote_ca_file
                )
            })?;
            if files.roots.is_empty() {
                return Err(format!(
                    "agent.remote_ca_file: {:?} holds no PEM certificate",
                    self.remote_ca_file
                ));
            }
        }
        match (
            self.remote_client_cert_file.is_empty(),
            self.remote_client_key_file.is_empty(),
        ) {
            (true, true) => {}
            (false, false) => {
                let mut pem = read("remote_client_cert_file", &self.remote_client_cert_file)?;
                let key = read("remote_client_key_file", &self.remote_client_key_file)?;
                pem.push(b'\n');
                pem.extend_from_slice(&key);
                files.identity = Some(reqwest::Identity::from_pem(&pem).map_err(|error| {
                    format!(
                        "agent.remote_client_cert_file and agent.remote_client_key_file are not a PEM certificate and its key: {error}"
                    )
                })?);
            }
            (false, true) => {
                return Err(
                    "agent.remote_client_key_file is required with agent.remote_client_cert_file"
                        .into(),
                )
            }
            (true, false) => {
                return Err(
                    "agent.remote_client_cert_file is required with agent.remote_client_key_file"
                        .into(),
                )
            }
        }
        Ok(files)
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
        for name in agent.names() {
            let url = agent.remote_url_for(&name);
            let parsed = reqwest::Url::parse(&url)
                .map_err(|error| format!("agent.remote_url is not a URL ({error}): {url:?}"))?;
            if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
                return Err(format!(
                    "agent.remote_url must be an http:// or https:// URL with a host; this binary serves no other (got {url:?})"
                ));
            }
        }
        agent.tls_files()?;
        if !agent.remote_auth_header.is_empty() {
            reqwest::header::HeaderValue::from_str(agent.remote_auth_header.expose()).map_err(
                |_| "agent.remote_auth_header is not a valid header value (one line of visible ASCII)".to_owned(),
            )?;
        }
        if agent.max_answer_bytes < 64 {
            return Err("agent.max_answer_bytes must be at least 64".into());
        }
        if agent.start_margin_ms >= 3_600_000 {
            return Err("agent.start_margin_ms must be below an hour".into());
        }
        if agent.clock_offset_ms.unsigned_abs() >= 3_600_000 {
            return Err("agent.clock_offset_ms (test only) must be within an hour".into());
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
