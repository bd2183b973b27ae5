//! The `[amqp]` settings section shared by every service.

use std::time::Duration;

use lapin::uri::AMQPUri;
use sas_messages::QueueNames;
use serde::Deserialize;

/// How to reach RabbitMQ and how to use it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AmqpSettings {
    /// `amqp://user:password@host:port/vhost?heartbeat=10` (or `amqps://` for TLS).
    pub url: String,
    /// The other nodes of a RabbitMQ cluster, as `host:port`, reached with
    /// the url's user, vhost and parameters (`SAS_AMQP__NODES=rabbit-2:5672,rabbit-3:5672`).
    /// A session connects to one node of the url's and these, trying the
    /// next one at once when a node cannot be reached, so a cluster that
    /// lost a node is reached without a load balancer in front.
    #[serde(default, deserialize_with = "crate::identity::string_list")]
    pub nodes: Vec<String>,
    /// Prefix of every queue and exchange name (lets deployments and tests share a broker).
    pub prefix: String,
    /// Unacknowledged deliveries per consumer (`basic.qos`), which also bounds
    /// how many messages a consumer handles at once.
    pub prefetch: u16,
    /// Longest wait for any broker operation (connect, declare, confirm, ack), in milliseconds.
    pub operation_timeout_ms: u64,
    /// Deliveries of one message before a quorum queue dead-letters it (poison message).
    pub delivery_limit: u32,
    /// Largest accepted message body, in bytes; larger ones are dead-lettered.
    pub max_message_bytes: usize,
    /// First wait before reconnecting, in milliseconds (doubled up to `reconnect_max_ms`).
    pub reconnect_base_ms: u64,
    /// Longest wait between reconnection attempts, in milliseconds.
    pub reconnect_max_ms: u64,
    /// Also send every status message to the status exchange, where
    /// `sasctl watch` listens (5 of an order's 12 messages). Status messages
    /// to an order's own `reply_to` are sent either way.
    #[serde(default = "default_true")]
    pub status_exchange: bool,
    /// A PEM file of the CA that signed the broker's certificate, for an
    /// `amqps://` url whose certificate the system's roots do not vouch for
    /// (a development CA, a company's own): trusted beside them. Empty: the
    /// system's roots only.
    #[serde(default)]
    pub tls_ca_file: String,
}

fn default_true() -> bool {
    true
}

impl AmqpSettings {
    /// Checks values that would otherwise fail late.
    ///
    /// # Errors
    /// A message naming the bad key.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.url.starts_with("amqp://") || self.url.starts_with("amqps://")) {
            return Err(format!(
                "amqp.url must start with amqp:// or amqps:// (got {:?})",
                redact(&self.url)
            ));
        }
        self.node_uris()?;
        self.tls_config()?;
        if self.prefetch == 0 {
            return Err("amqp.prefetch must be at least 1".into());
        }
        if self.operation_timeout_ms == 0 {
            return Err("amqp.operation_timeout_ms must be positive".into());
        }
        if self.delivery_limit == 0 {
            return Err("amqp.delivery_limit must be at least 1".into());
        }
        if self.max_message_bytes < 1024 {
            return Err("amqp.max_message_bytes must be at least 1024".into());
        }
        if self.reconnect_base_ms == 0 || self.reconnect_max_ms < self.reconnect_base_ms {
            return Err(
                "amqp.reconnect_base_ms must be positive and at most amqp.reconnect_max_ms".into(),
            );
        }
        if self
            .prefix
            .bytes()
            .any(|b| !(b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.')))
        {
            return Err(format!(
                "amqp.prefix may hold only A-Z, a-z, 0-9, '-', '_', '.' (got {:?})",
                self.prefix
            ));
        }
        Ok(())
    }

    /// The TLS settings of an `amqps://` connection: the CA of
    /// [`AmqpSettings::tls_ca_file`] trusted beside the system's roots.
    ///
    /// # Errors
    /// A message naming the key: the file cannot be read or holds no
    /// PEM certificate.
    pub fn tls_config(&self) -> Result<lapin::tcp::OwnedTLSConfig, String> {
        if self.tls_ca_file.is_empty() {
            return Ok(lapin::tcp::OwnedTLSConfig::default());
        }
        let pem = std::fs::read_to_string(&self.tls_ca_file).map_err(|error| {
            format!(
                "amqp.tls_ca_file {:?} cannot be read: {error}",
                self.tls_ca_file
            )
        })?;
        if !pem.contains("-----BEGIN CERTIFICATE-----") {
            return Err(format!(
                "amqp.tls_ca_file {:?} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                self.tls_ca_file
            ));
        }
        Ok(lapin::tcp::OwnedTLSConfig {
            identity: None,
            cert_chain: Some(pem),
        })
    }

    /// The names of this deployment's queues and exchanges.
    pub fn names(&self) -> QueueNames {
        QueueNames::new(self.prefix.clone())
    }

    /// The broker user of [`AmqpSettings::url`] (percent-decoded; `guest`
    /// when the URL names none, as the client then logs in as guest), or
    /// `None` when the URL does not parse. Publishers stamp it as `user_id`.
    pub fn user(&self) -> Option<String> {
        self.url
            .parse::<lapin::uri::AMQPUri>()
            .ok()
            .map(|uri| uri.authority.userinfo.username)
    }

    /// The URI of every node a session may connect to: the url's first, then
    /// [`AmqpSettings::nodes`], each with the url's user, vhost and parameters.
    ///
    /// # Errors
    /// A message naming the bad key: the url does not parse, or a node is not `host:port`.
    pub fn node_uris(&self) -> Result<Vec<AMQPUri>, String> {
        let first: AMQPUri = self.url.parse().map_err(|error| {
            format!("amqp.url does not parse ({error}): {:?}", redact(&self.url))
        })?;
        let mut uris = vec![first.clone()];
        for node in &self.nodes {
            let (host, port) = node
                .rsplit_once(':')
                .and_then(|(host, port)| Some((host, port.parse::<u16>().ok()?)))
                .filter(|(host, port)| !host.is_empty() && *port > 0)
                .ok_or_else(|| format!("amqp.nodes must hold host:port entries (got {node:?})"))?;
            let mut uri = first.clone();
            uri.authority.host = host.to_owned();
            uri.authority.port = port;
            uris.push(uri);
        }
        Ok(uris)
    }

    /// [`AmqpSettings::operation_timeout_ms`] as a duration.
    pub fn operation_timeout(&self) -> Duration {
        Duration::from_millis(self.operation_timeout_ms)
    }
}

/// The URL with its password replaced, fit for logs and error messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.find(':') {
                Some(colon) => format!(
                    "{}{}:***{}",
                    &url[..scheme + 3],
                    &userinfo[..colon],
                    &url[at..]
                ),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::{redact, AmqpSettings};

    fn with_url(url: &str) -> AmqpSettings {
        AmqpSettings {
            url: url.into(),
            nodes: Vec::new(),
            prefix: String::new(),
            prefetch: 1,
            operation_timeout_ms: 1_000,
            delivery_limit: 20,
            max_message_bytes: 65_536,
            reconnect_base_ms: 100,
            reconnect_max_ms: 1_000,
            status_exchange: true,
            tls_ca_file: String::new(),
        }
    }

    #[test]
    fn a_ca_file_must_be_readable_pem() {
        let mut settings = with_url("amqps://broker:5671/%2f");
        assert!(settings.tls_config().unwrap().cert_chain.is_none());
        settings.tls_ca_file = "/no/such/ca.pem".into();
        let error = settings.validate().unwrap_err();
        assert!(
            error.contains("amqp.tls_ca_file \"/no/such/ca.pem\" cannot be read"),
            "{error}"
        );
        let not_pem = std::env::temp_dir().join(format!("not-pem-{}", std::process::id()));
        std::fs::write(&not_pem, "hello").unwrap();
        settings.tls_ca_file = not_pem.display().to_string();
        let error = settings.validate().unwrap_err();
        assert!(error.contains("holds no PEM certificate"), "{error}");
        std::fs::remove_file(not_pem).unwrap();
    }

    #[test]
    fn the_user_of_the_url_is_the_identity_stamped_on_messages() {
        assert_eq!(
            with_url("amqp://sas-agent:pw@rabbit:5672/%2f?heartbeat=10")
                .user()
                .as_deref(),
            Some("sas-agent")
        );
        assert_eq!(
            with_url("amqp://sas%2Dx:pw@rabbit/%2f").user().as_deref(),
            Some("sas-x")
        );
        assert_eq!(
            with_url("amqp://rabbit:5672/%2f").user().as_deref(),
            Some("guest")
        );
    }

    #[test]
    fn every_node_is_reached_with_the_urls_user_vhost_and_parameters() {
        let mut settings = with_url("amqp://sas-agent:pw@rabbit-1:5672/sas?heartbeat=10");
        settings.nodes = vec!["rabbit-2:5672".into(), "10.0.0.3:5673".into()];
        let uris = settings.node_uris().unwrap();
        let hosts: Vec<(String, u16)> = uris
            .iter()
            .map(|uri| (uri.authority.host.clone(), uri.authority.port))
            .collect();
        assert_eq!(
            hosts,
            [
                ("rabbit-1".to_owned(), 5672),
                ("rabbit-2".to_owned(), 5672),
                ("10.0.0.3".to_owned(), 5673)
            ]
        );
        for uri in &uris {
            assert_eq!(uri.authority.userinfo.username, "sas-agent");
            assert_eq!(uri.authority.userinfo.password, "pw");
            assert_eq!(uri.vhost, "sas");
            assert_eq!(uri.query.heartbeat, Some(10));
        }
    }

    #[test]
    fn a_node_that_is_not_host_and_port_is_refused_naming_the_key() {
        for bad in ["rabbit-2", "rabbit-2:", ":5672", "rabbit-2:99999"] {
            let mut settings = with_url("amqp://guest:guest@rabbit-1:5672/%2f");
            settings.nodes = vec![bad.into()];
            let error = settings.validate().unwrap_err();
            assert!(error.contains("amqp.nodes"), "{bad}: {error}");
        }
    }

    #[test]
    fn a_password_never_reaches_a_log_line() {
        assert_eq!(
            redact("amqp://sas:s3cret@rabbit:5672/%2f"),
            "amqp://sas:***@rabbit:5672/%2f"
        );
        assert_eq!(redact("amqp://rabbit:5672"), "amqp://rabbit:5672");
    }
}
