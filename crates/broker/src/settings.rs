//! The `[amqp]` settings section shared by every service.

use std::time::Duration;

use sas_messages::QueueNames;
use serde::Deserialize;

/// How to reach RabbitMQ and how to use it.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AmqpSettings {
    /// `amqp://user:password@host:port/vhost?heartbeat=10` (or `amqps://` for TLS).
    pub url: String,
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
            prefix: String::new(),
            prefetch: 1,
            operation_timeout_ms: 1_000,
            delivery_limit: 3,
            max_message_bytes: 65_536,
            reconnect_base_ms: 100,
            reconnect_max_ms: 1_000,
            status_exchange: true,
        }
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
    fn a_password_never_reaches_a_log_line() {
        assert_eq!(
            redact("amqp://sas:s3cret@rabbit:5672/%2f"),
            "amqp://sas:***@rabbit:5672/%2f"
        );
        assert_eq!(redact("amqp://rabbit:5672"), "amqp://rabbit:5672");
    }
}
