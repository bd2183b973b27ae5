//! Consuming with manual acks, concurrent handlers and dead-lettering.
//!
//! A handler decides what becomes of a message by returning [`Consumed`];
//! this module is the one place that turns that into ack, requeue or
//! dead-letter, and acks only after the handler's effect is committed and
//! its own publishes are confirmed.

use std::future::Future;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::acker::Acker;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use sas_messages::headers;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::timed;
use crate::publish::{header_str, Publisher};
use crate::{AmqpSettings, BrokerError};

/// What a handler decided about a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Consumed {
    /// Done (or a harmless duplicate): acknowledge.
    Ack,
    /// Could not be handled now (shutting down, broker or database away):
    /// give it back to the queue for another consumer.
    Requeue,
    /// Can never be handled: send it to the dead-letter exchange with this
    /// reason, then acknowledge.
    DeadLetter(String),
}

/// A message handed to a handler: everything but the acknowledgement, which
/// stays with the consume loop.
#[derive(Debug, Clone)]
pub struct Delivery {
    /// Queue it came from.
    pub queue: String,
    /// Body bytes.
    pub body: Vec<u8>,
    /// AMQP properties (correlation id, reply-to, headers ...).
    pub properties: BasicProperties,
    /// Set by the broker when this message was delivered before and not acknowledged.
    pub redelivered: bool,
}

impl Delivery {
    /// The `correlation_id` property, if any.
    pub fn correlation_id(&self) -> Option<&str> {
        self.properties
            .correlation_id()
            .as_ref()
            .map(|id| id.as_str())
    }

    /// The `reply_to` property, if any.
    pub fn reply_to(&self) -> Option<&str> {
        self.properties
            .reply_to()
            .as_ref()
            .map(|queue| queue.as_str())
    }

    /// A string header, if present.
    pub fn header(&self, key: &str) -> Option<String> {
        header_str(&self.properties, key)
    }
}

/// Consumes `queue` until `shutdown` or until the channel fails, running
/// `handler` on up to `settings.prefetch` messages at once.
///
/// On shutdown it cancels the consumer (no new work), waits up to `drain`
/// for handlers in flight, and returns `Ok`; what is still unacknowledged
/// then goes back to the queue when the channel closes.
///
/// # Errors
/// When the consumer cannot start or its channel fails; the caller reconnects.
pub async fn consume<H, Fut>(
    connection: &Connection,
    settings: &AmqpSettings,
    queue: &str,
    publisher: Publisher,
    shutdown: CancellationToken,
    drain: Duration,
    handler: H,
) -> Result<(), BrokerError>
where
    H: Fn(Delivery) -> Fut,
    Fut: Future<Output = Consumed> + Send + 'static,
{
    let timeout = settings.operation_timeout();
    let channel = timed(
        "opening a consuming channel",
        timeout,
        connection.create_channel(),
    )
    .await?;
    timed(
        "setting prefetch",
        timeout,
        channel.basic_qos(settings.prefetch, BasicQosOptions::default()),
    )
    .await?;
    let mut consumer = timed(
        "starting a consumer",
        timeout,
        channel.basic_consume(
            queue,
            "",
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    let tag = consumer.tag();
    tracing::info!(queue, prefetch = settings.prefetch, "consuming");

    let tracker = TaskTracker::new();
    let result = loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => break Ok(()),
            next = consumer.next() => next,
        };
        let delivery = match next {
            Some(Ok(delivery)) => delivery,
            Some(Err(source)) => {
                break Err(BrokerError::Amqp {
                    doing: "consuming",
                    source,
                })
            }
            None => {
                break Err(BrokerError::ConsumerEnded {
                    queue: queue.to_owned(),
                })
            }
        };
        let acker = delivery.acker.clone();
        let message = Delivery {
            queue: queue.to_owned(),
            body: delivery.data,
            properties: delivery.properties,
            redelivered: delivery.redelivered,
        };
        let work = handler(message.clone());
        let publisher = publisher.clone();
        let settings = settings.clone();
        tracker.spawn(async move {
            let outcome = work.await;
            settle(&settings, &publisher, &acker, &message, outcome).await;
        });
    };

    if result.is_ok() {
        let _ = timed(
            "cancelling a consumer",
            timeout,
            channel.basic_cancel(tag.as_str(), BasicCancelOptions::default()),
        )
        .await;
    }
    tracker.close();
    if tokio::time::timeout(drain, tracker.wait()).await.is_err() {
        tracing::warn!(
            queue,
            in_flight = tracker.len(),
            "handlers still running after the drain limit; their messages go back to the queue"
        );
    }
    let _ = timed("closing a channel", timeout, channel.close(200, "done")).await;
    result
}

async fn settle(
    settings: &AmqpSettings,
    publisher: &Publisher,
    acker: &Acker,
    message: &Delivery,
    outcome: Consumed,
) {
    let timeout = settings.operation_timeout();
    let result = match outcome {
        Consumed::Ack => {
            timed(
                "acknowledging",
                timeout,
                acker.ack(BasicAckOptions::default()),
            )
            .await
        }
        Consumed::Requeue => requeue(acker, timeout).await,
        Consumed::DeadLetter(reason) => {
            tracing::warn!(queue = %message.queue, reason = %reason, "dead-lettering a message");
            match dead_letter(settings, publisher, message, &reason).await {
                Ok(()) => {
                    timed(
                        "acknowledging",
                        timeout,
                        acker.ack(BasicAckOptions::default()),
                    )
                    .await
                }
                Err(error) => {
                    tracing::error!(error = %error, "could not dead-letter; requeueing instead");
                    requeue(acker, timeout).await
                }
            }
        }
    };
    if let Err(error) = result {
        // The channel is gone: the broker requeues the message by itself.
        tracing::warn!(error = %error, queue = %message.queue, "could not settle a delivery; it will be redelivered");
    }
}

async fn requeue(acker: &Acker, timeout: Duration) -> Result<(), BrokerError> {
    timed(
        "requeueing",
        timeout,
        acker.nack(BasicNackOptions {
            requeue: true,
            ..BasicNackOptions::default()
        }),
    )
    .await
}

/// Publishes `message` to the dead-letter exchange with `reason` and its
/// source queue in headers (keeping its other properties).
///
/// # Errors
/// When the broker does not confirm the dead letter.
pub async fn dead_letter(
    settings: &AmqpSettings,
    publisher: &Publisher,
    message: &Delivery,
    reason: &str,
) -> Result<(), BrokerError> {
    let mut table = message.properties.headers().clone().unwrap_or_default();
    for (key, value) in [
        (headers::DEAD_LETTER_REASON, reason),
        (headers::DEAD_LETTER_SOURCE_QUEUE, message.queue.as_str()),
    ] {
        table.insert(
            key.into(),
            lapin::types::AMQPValue::LongString(value.to_owned().into()),
        );
    }
    let properties = message
        .properties
        .clone()
        .with_headers(table)
        .with_delivery_mode(2);
    publisher
        .publish(
            &settings.names().dead_letter_exchange(),
            "",
            &message.body,
            properties,
            true,
        )
        .await
}
