//! The broker's error type.

use std::time::Duration;

/// What went wrong talking to RabbitMQ.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// The AMQP client reported an error (connection or channel closed, refused, ...).
    #[error("AMQP error while {doing}: {source}")]
    Amqp {
        /// What we were doing.
        doing: &'static str,
        /// lapin's error.
        #[source]
        source: lapin::Error,
    },
    /// The broker did not answer in time; the connection is presumed dead.
    #[error("RabbitMQ did not answer within {timeout:?} while {doing}")]
    Timeout {
        /// What we were doing.
        doing: &'static str,
        /// How long we waited.
        timeout: Duration,
    },
    /// The broker refused a published message (negative confirm).
    #[error("RabbitMQ refused the message published to {routing_key:?} (negative confirm)")]
    Nacked {
        /// Where it was going.
        routing_key: String,
    },
    /// A mandatory message had no queue to go to: the topology is missing.
    #[error("no queue is bound for {routing_key:?}: the message was returned (is the topology declared?)")]
    Unroutable {
        /// Where it was going.
        routing_key: String,
    },
    /// The `[amqp]` settings cannot be used (checked at start, so only a
    /// caller that skipped validation sees it).
    #[error("unusable amqp settings: {reason}")]
    Settings {
        /// What is wrong, naming the key.
        reason: String,
    },
    /// No connection is up at the moment.
    #[error("not connected to RabbitMQ")]
    NotConnected,
    /// The consumer's stream ended: the channel or connection closed.
    #[error("the consumer of {queue} stopped: channel or connection closed")]
    ConsumerEnded {
        /// The queue consumed.
        queue: String,
    },
}

/// Runs `future` with `timeout`, turning both lapin errors and a timeout into
/// a [`BrokerError`] that says what we were `doing`.
pub(crate) async fn timed<T>(
    doing: &'static str,
    timeout: Duration,
    future: impl std::future::Future<Output = lapin::Result<T>>,
) -> Result<T, BrokerError> {
    match tokio::time::timeout(timeout, future).await {
        Ok(Ok(value)) => Ok(value),
        Ok(Err(source)) => Err(BrokerError::Amqp { doing, source }),
        Err(_) => Err(BrokerError::Timeout { doing, timeout }),
    }
}
