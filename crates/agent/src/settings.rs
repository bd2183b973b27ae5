//! The agent's settings (defaults in `defaults.toml`).

use sas_broker::ServiceAmqpSettings;
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
    /// RabbitMQ, and the broker users whose step requests this agent obeys:
    /// `amqp.service_users`, the schedulers' and supervisors' (see
    /// [`ServiceAmqpSettings::accepts_request_from`]). `amqp.agent_users`
    /// means nothing to an agent.
    pub amqp: ServiceAmqpSettings,
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
    /// Headers added to every call to the remote service, as `Name: value`
    /// pairs separated by `;` or newlines (`X-Api-Version: 2; X-Tenant:
    /// acme`); empty adds none. Spaces around names, values and separators
    /// are dropped, so a value cannot begin or end with one, nor hold `;`.
    /// Checked at start ([`AgentSettings::remote_header_map`]): a pair
    /// without `:`, an empty pair (`;;`, a trailing `;`), a name that is not
    /// a header name, a value that is not a header value, a name given
    /// twice, and the headers the agent sets itself (`Idempotency-Key`,
    /// `traceparent`, `Content-Type`, `Content-Length`, `Host`) or that
    /// have their own setting (`Authorization`: `remote_auth_header`) are
    /// refused. Not a secret (credentials belong in `remote_auth_header`).
    pub remote_headers: String,
    /// Largest answer body read from the remote service, in bytes (as read,
    /// and as written again). A 2xx answer over it fails for good and may
    /// have been applied. At most a quarter of `amqp.max_message_bytes`
    /// ([`MAX_ANSWER_SHARE`]): the reply carries the answer, and later
    /// requests carry it beside the order and the other steps' results.
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
    /// Longest pause a remote's `Retry-After` may ask of the lane, in
    /// milliseconds (see [`crate::pause`]).
    pub max_pause_ms: u64,
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

/// `agent.max_answer_bytes` may be at most `amqp.max_message_bytes` divided
/// by this: an answer travels in the agent's reply, then in the later
/// requests of its order beside the order itself and the other steps'
/// results, each a message under the broker's limit.
pub const MAX_ANSWER_SHARE: usize = 4;

/// Headers `agent.remote_headers` may not name, each with what to do instead.
const RESERVED_HEADERS: [(&str, &str); 6] = [
    (
        "idempotency-key",
        "the agent sends the step's idempotency key in it on every call",
    ),
    (
        "traceparent",
        "the agent sends the order's trace context in it on every call",
    ),
    (
        "authorization",
        "set it with agent.remote_auth_header (a secret: SAS_AGENT__REMOTE_AUTH_HEADER_FILE)",
    ),
    (
        "content-type",
        "the agent sends every body as application/json",
    ),
    ("content-length", "the agent sets it from the body"),
    ("host", "the agent sets it from agent.remote_url"),
];

/// Parses `agent.remote_headers`: `Name: value` pairs separated by `;` or
/// newlines, spaces around each part dropped (see
/// [`AgentSettings::remote_headers`]).
///
/// # Errors
/// A message naming the setting, the pair and what is wrong with it.
pub fn parse_remote_headers(text: &str) -> Result<reqwest::header::HeaderMap, String> {
    use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
    let mut headers = HeaderMap::new();
    let text = text.trim();
    if text.is_empty() {
        return Ok(headers);
    }
    for (index, pair) in text.split([';', '\n']).enumerate() {
        let number = index + 1;
        let pair = pair.trim();
        if pair.is_empty() {
            return Err(format!(
                "agent.remote_headers: pair {number} is empty; write `Name: value` pairs separated by one ';' or newline (got {text:?})"
            ));
        }
        let Some((name, value)) = pair.split_once(':') else {
            return Err(format!(
                "agent.remote_headers: pair {number} ({pair:?}) is not `Name: value` (no ':')"
            ));
        };
        let (name, value) = (name.trim(), value.trim());
        let Ok(header) = HeaderName::from_bytes(name.as_bytes()) else {
            return Err(format!(
                "agent.remote_headers: {name:?} (pair {number}) is not a valid header name: use letters, digits and !#$%&'*+-.^_`|~ only"
            ));
        };
        if let Some((_, instead)) = RESERVED_HEADERS
            .iter()
            .find(|(reserved, _)| header.as_str() == *reserved)
        {
            return Err(format!(
                "agent.remote_headers: {name} may not be set there: {instead}; remove it from agent.remote_headers"
            ));
        }
        let visible = value
            .bytes()
            .all(|b| b == b' ' || b == b'\t' || b.is_ascii_graphic());
        let (true, Ok(value)) = (visible, HeaderValue::from_str(value)) else {
            return Err(format!(
                "agent.remote_headers: the value of {name} (pair {number}) is not a valid header value: use visible ASCII and spaces only"
            ));
        };
        if headers.contains_key(&header) {
            return Err(format!(
                "agent.remote_headers: {name} is named twice; give it once (with a comma-separated list if the service takes several values)"
            ));
        }
        headers.insert(header, value);
    }
    Ok(headers)
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
    /// `remote_headers`, parsed: the headers added to every call.
    ///
    /// # Errors
    /// See [`parse_remote_headers`].
    pub fn remote_header_map(&self) -> Result<reqwest::header::HeaderMap, String> {
        parse_remote_headers(&self.remote_headers)
    }

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
        agent.remote_header_map()?;
        if agent.max_answer_bytes < 64 {
            return Err("agent.max_answer_bytes must be at least 64".into());
        }
        let most = self.amqp.max_message_bytes / MAX_ANSWER_SHARE;
        if agent.max_answer_bytes > most {
            return Err(format!(
                "agent.max_answer_bytes ({}) must be at most a quarter of amqp.max_message_bytes ({}), {most}: the reply that carries an answer, and the later requests that carry it beside the order and the other steps' results, must fit under the message limit, or the scheduler dead-letters them and the result is lost; lower agent.max_answer_bytes, or raise amqp.max_message_bytes on every service",
                agent.max_answer_bytes, self.amqp.max_message_bytes
            ));
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
        if !(1..=86_400_000).contains(&agent.max_pause_ms) {
            return Err(format!(
                "agent.max_pause_ms must be between 1 and 86400000 (a day), got {}",
                agent.max_pause_ms
            ));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn pairs(text: &str) -> Vec<(String, String)> {
        parse_remote_headers(text)
            .unwrap()
            .iter()
            .map(|(name, value)| (name.to_string(), value.to_str().unwrap().to_owned()))
            .collect()
    }

    /// The compiled-in defaults, as a service loads them.
    fn defaults() -> Settings {
        sas_runtime::load_settings(DEFAULTS, None).expect("the defaults are valid")
    }

    #[test]
    fn an_answer_limit_over_a_quarter_of_the_message_limit_is_refused_naming_both_keys() {
        let mut settings = defaults();
        assert_eq!(settings.agent.max_answer_bytes, 16_384);
        settings.agent.max_answer_bytes = settings.amqp.max_message_bytes / 4;
        assert_eq!(settings.validate(), Ok(()));
        for (answer, message) in [(16_385, 65_536), (65_536, 65_536), (4_096, 16_000)] {
            settings.agent.max_answer_bytes = answer;
            settings.amqp.broker.max_message_bytes = message;
            let error = settings.validate().unwrap_err();
            assert!(
                error.starts_with(&format!("agent.max_answer_bytes ({answer})")),
                "{error}"
            );
            assert!(
                error.contains(&format!("amqp.max_message_bytes ({message})")),
                "{error}"
            );
            assert!(error.contains("reply"), "says why: {error}");
        }
    }

    #[test]
    fn remote_headers_are_pairs_separated_by_semicolons_or_newlines() {
        assert!(pairs("").is_empty());
        assert!(pairs("  \n").is_empty());
        let expected = vec![
            ("x-api-version".to_owned(), "2".to_owned()),
            ("x-tenant".to_owned(), "acme".to_owned()),
        ];
        assert_eq!(pairs("X-Api-Version: 2; X-Tenant: acme"), expected);
        assert_eq!(pairs("X-Api-Version:2\nX-Tenant:acme"), expected);
        assert_eq!(pairs("X-Api-Version: 2\r\nX-Tenant: acme\r\n"), expected);
        assert_eq!(
            pairs("Accept: application/json, text/plain; X-Empty:"),
            vec![
                (
                    "accept".to_owned(),
                    "application/json, text/plain".to_owned()
                ),
                ("x-empty".to_owned(), String::new()),
            ]
        );
        assert_eq!(
            pairs("X-Url: http://a:8080/b"),
            vec![("x-url".to_owned(), "http://a:8080/b".to_owned())],
            "a value may hold ':'"
        );
    }

    fn refused(text: &str) -> String {
        parse_remote_headers(text).unwrap_err()
    }

    #[test]
    fn unusable_remote_headers_are_refused_with_what_to_do() {
        for (text, expected) in [
            ("X-A: 1;; X-B: 2", "pair 2 is empty"),
            ("X-A: 1;", "pair 2 is empty"),
            ("X-A: 1\n\nX-B: 2", "pair 2 is empty"),
            ("X-A 1", "pair 1 (\"X-A 1\") is not `Name: value`"),
            ("X A: 1", "\"X A\" (pair 1) is not a valid header name"),
            (": 1", "\"\" (pair 1) is not a valid header name"),
            ("X-(a): 1", "is not a valid header name"),
            (
                "X-A: caf\u{e9}",
                "the value of X-A (pair 1) is not a valid header value",
            ),
            ("X-A: a\u{7f}b", "is not a valid header value"),
            ("X-A: 1; x-a: 2", "x-a is named twice"),
        ] {
            let error = refused(text);
            assert!(error.starts_with("agent.remote_headers: "), "{error}");
            assert!(error.contains(expected), "{text:?}: {error}");
        }
    }

    #[test]
    fn headers_the_agent_sets_itself_or_that_have_a_setting_are_refused() {
        for name in [
            "Idempotency-Key",
            "traceparent",
            "Authorization",
            "content-type",
            "Content-Length",
            "HOST",
        ] {
            let error = refused(&format!("X-A: 1; {name}: x"));
            assert!(
                error.contains(&format!("{name} may not be set there")),
                "{error}"
            );
            assert!(
                error.contains("remove it from agent.remote_headers"),
                "{error}"
            );
        }
        assert!(refused("Authorization: Bearer x").contains("agent.remote_auth_header"));
    }
}
