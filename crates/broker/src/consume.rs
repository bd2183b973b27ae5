//! Consuming with manual acks, concurrent handlers and dead-lettering.
//!
//! A handler decides what becomes of a message by returning [`Consumed`];
//! this module is the one place that turns that into ack, requeue or
//! dead-letter, and acks only after the handler's effect is committed and
//! its own publishes are confirmed.
//!
//! Acknowledgements are coalesced: every delivery finished below the oldest
//! one still being handled goes in one `basic.ack` with `multiple` set. Each
//! ack is a frame for the client's IO thread and a settle command in the
//! quorum queue's Raft log, so under load this saves both. An ack held back
//! behind a slow delivery is sent on its own after at most [`ACK_HOLD`], so a
//! slow message never keeps the others' prefetch slots.

use std::future::Future;
use std::time::{Duration, Instant};

use std::collections::{BTreeMap, BTreeSet};

use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection};
use sas_messages::headers;
use tokio::sync::mpsc;
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
    let refused = |_: Delivery, _: String| std::future::ready(());
    consume_answering(
        connection, settings, queue, publisher, shutdown, drain, handler, refused,
    )
    .await
}

/// As [`consume`], and `refused` runs for each message refused before any
/// handler saw it (over the size limit), with its properties (its body is
/// not passed: it was not read) and the reason, before it is dead-lettered:
/// so that a scheduler can answer the client of an order refused unread.
///
/// # Errors
/// As [`consume`].
// The arguments of `consume` and the one hook it lacks.
#[allow(clippy::too_many_arguments)]
pub async fn consume_answering<H, Fut, R, RFut>(
    connection: &Connection,
    settings: &AmqpSettings,
    queue: &str,
    publisher: Publisher,
    shutdown: CancellationToken,
    drain: Duration,
    handler: H,
    refused: R,
) -> Result<(), BrokerError>
where
    H: Fn(Delivery) -> Fut,
    Fut: Future<Output = Consumed> + Send + 'static,
    R: Fn(Delivery, String) -> RFut,
    RFut: Future<Output = ()> + Send + 'static,
{
    let timeout = settings.operation_timeout();
    let (channel, mut consumer) = start_consumer(connection, settings, queue).await?;
    let consumer_tag = consumer.tag();
    tracing::info!(queue, prefetch = settings.prefetch, "consuming");
    let _consuming = Consuming::start(queue);

    let tracker = TaskTracker::new();
    let (settle, settled) = mpsc::unbounded_channel();
    let settler = tokio::spawn(settle_loop(channel.clone(), timeout, settled));
    let result = loop {
        let next = tokio::select! {
            () = shutdown.cancelled() => break Ok(()),
            next = consumer.next() => next,
        };
        let delivery = match delivered(next, queue) {
            Ok(delivery) => delivery,
            Err(error) => break Err(error),
        };
        let tag = delivery.delivery_tag;
        if let Some(waited) = crate::publish::published_ago(&delivery.properties) {
            // A line of the latency budget: publish to delivery.
            metrics::histogram!("sas_queue_wait_seconds", "queue" => queue.to_owned())
                .record(waited.as_secs_f64());
        }
        let message = Delivery {
            queue: queue.to_owned(),
            body: delivery.data,
            properties: delivery.properties,
            redelivered: delivery.redelivered,
        };
        // Registered before the handler starts, so the settler knows every
        // delivery in flight before any later one can be acknowledged.
        let _ = settle.send(Settle::Delivered(tag));
        let pending = Pending {
            tag,
            settings: settings.clone(),
            publisher: publisher.clone(),
            settle: settle.clone(),
        };
        spawn_handling(&tracker, &handler, &refused, message, pending);
    };

    if result.is_ok() {
        let _ = timed(
            "cancelling a consumer",
            timeout,
            channel.basic_cancel(consumer_tag, BasicCancelOptions::default()),
        )
        .await;
    }
    drain_and_close(queue, &channel, timeout, drain, &tracker, &settle, settler).await;
    result
}

/// The delivery the consumer's stream yielded, or why the consumer stopped:
/// an error on its channel, or the end of its stream.
fn delivered(
    next: Option<lapin::Result<lapin::message::Delivery>>,
    queue: &str,
) -> Result<lapin::message::Delivery, BrokerError> {
    match next {
        Some(Ok(delivery)) => Ok(delivery),
        Some(Err(source)) => Err(BrokerError::Amqp {
            doing: "consuming",
            source,
        }),
        None => Err(BrokerError::ConsumerEnded {
            queue: queue.to_owned(),
        }),
    }
}

/// Starts the task for one delivery: `handler`'s, or, for a message over
/// the size limit, `refused`'s answer and its dead-lettering; either way
/// the task settles the delivery when it is done.
fn spawn_handling<H, Fut, R, RFut>(
    tracker: &TaskTracker,
    handler: &H,
    refused: &R,
    message: Delivery,
    pending: Pending,
) where
    H: Fn(Delivery) -> Fut,
    Fut: Future<Output = Consumed> + Send + 'static,
    R: Fn(Delivery, String) -> RFut,
    RFut: Future<Output = ()> + Send + 'static,
{
    match oversized(&pending.settings, &message) {
        // Refused before any handler sees (and parses, and copies) it.
        Some(reason) => {
            let unread = Delivery {
                queue: message.queue.clone(),
                body: Vec::new(),
                properties: message.properties.clone(),
                redelivered: message.redelivered,
            };
            let answer = refused(unread, reason.clone());
            tracker.spawn(async move {
                answer.await;
                pending.finish(&message, Consumed::DeadLetter(reason)).await;
            });
        }
        None => {
            let work = handler(message.clone());
            tracker.spawn(async move {
                let outcome = work.await;
                pending.finish(&message, outcome).await;
            });
        }
    }
}

/// A delivery handed out and not yet settled: what its task needs to turn
/// the outcome into a settlement for the settler.
struct Pending {
    /// The delivery's tag on the consuming channel.
    tag: u64,
    /// Where a dead letter goes and how much of its body it keeps.
    settings: AmqpSettings,
    /// Publishes a dead letter.
    publisher: Publisher,
    /// To the settler.
    settle: mpsc::UnboundedSender<Settle>,
}

impl Pending {
    /// Carries out `outcome` for `message` (dead-lettering it first where
    /// asked) and tells the settler to acknowledge or requeue it.
    async fn finish(self, message: &Delivery, outcome: Consumed) {
        let requeue = decide(&self.settings, &self.publisher, message, outcome).await;
        let _ = self.settle.send(Settle::Finished {
            tag: self.tag,
            requeue,
        });
    }
}

/// Opens a channel on `connection` with the settings' prefetch, and starts
/// a consumer of `queue` on it.
async fn start_consumer(
    connection: &Connection,
    settings: &AmqpSettings,
    queue: &str,
) -> Result<(Channel, lapin::Consumer), BrokerError> {
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
    let consumer = timed(
        "starting a consumer",
        timeout,
        channel.basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        ),
    )
    .await?;
    Ok((channel, consumer))
}

/// The end of a consumer: waits up to `drain` for its handlers, sends the
/// settlements of those that finished, and closes the channel; what is
/// unfinished goes back to the queue.
async fn drain_and_close(
    queue: &str,
    channel: &Channel,
    timeout: Duration,
    drain: Duration,
    tracker: &TaskTracker,
    settle: &mpsc::UnboundedSender<Settle>,
    settler: tokio::task::JoinHandle<()>,
) {
    tracker.close();
    if tokio::time::timeout(drain, tracker.wait()).await.is_err() {
        tracing::warn!(
            queue,
            in_flight = tracker.len(),
            "handlers still running after the drain limit; their messages go back to the queue"
        );
    }
    // Send what is finished, then close: the rest goes back to the queue.
    let _ = settle.send(Settle::Stop);
    let _ = tokio::time::timeout(timeout, settler).await;
    let _ = timed(
        "closing a channel",
        timeout,
        channel.close(200, "done".into()),
    )
    .await;
}

/// `sas_consumers{queue}`: the consumers this process holds on `queue`, up
/// from the moment the broker accepted one until its loop ends (shutdown,
/// channel or connection lost), so that "nobody consumes this queue" can be
/// alerted on.
struct Consuming(String);

impl Consuming {
    fn start(queue: &str) -> Self {
        metrics::gauge!("sas_consumers", "queue" => queue.to_owned()).increment(1.0);
        Self(queue.to_owned())
    }
}

impl Drop for Consuming {
    fn drop(&mut self) {
        metrics::gauge!("sas_consumers", "queue" => self.0.clone()).decrement(1.0);
    }
}

/// Why `message` is refused for its size, if it is over
/// `amqp.max_message_bytes`.
///
/// The dead-letter record queue is the exception: dead-lettering from it
/// would feed it again, so its handler (the supervisor) keeps a bounded part
/// of a large body itself.
fn oversized(settings: &AmqpSettings, message: &Delivery) -> Option<String> {
    let limit = settings.max_message_bytes;
    let size = message.body.len();
    (size > limit && message.queue != settings.names().dead_letter_records()).then(|| {
        format!(
            "message of {size} bytes is over the limit of {limit} bytes (amqp.max_message_bytes); \
             refused unread, the dead letter keeps its first {limit} bytes"
        )
    })
}

/// Longest an acknowledgement waits for an older delivery to finish so that
/// both go in one frame.
pub const ACK_HOLD: Duration = Duration::from_millis(20);

/// What the consume loop and its handlers tell the settler.
enum Settle {
    /// A delivery was handed to a handler.
    Delivered(u64),
    /// Its handler finished: acknowledge it, or give it back to the queue.
    Finished { tag: u64, requeue: bool },
    /// Send what is finished and stop (the channel is about to close).
    Stop,
}

/// Turns a handler's decision into ack (true: requeue), dead-lettering
/// first where asked.
async fn decide(
    settings: &AmqpSettings,
    publisher: &Publisher,
    message: &Delivery,
    outcome: Consumed,
) -> bool {
    match outcome {
        Consumed::Ack => false,
        Consumed::Requeue => true,
        Consumed::DeadLetter(reason) => {
            tracing::warn!(queue = %message.queue, reason = %reason, "dead-lettering a message");
            match dead_letter(settings, publisher, message, &reason).await {
                Ok(()) => false,
                Err(error) => {
                    tracing::error!(error = %error, "could not dead-letter; requeueing instead");
                    true
                }
            }
        }
    }
}

/// Acknowledges finished deliveries of one channel, coalesced (see the
/// module docs); requeues are sent at once, one by one.
async fn settle_loop(
    channel: Channel,
    timeout: Duration,
    mut inbox: mpsc::UnboundedReceiver<Settle>,
) {
    // Delivered and not finished; finished (and when) and not yet acknowledged.
    let (mut in_flight, mut finished) = (BTreeSet::new(), BTreeMap::new());
    let mut hold_until: Option<tokio::time::Instant> = None;
    let mut batch = Vec::new();
    loop {
        batch.clear();
        let stop = match hold_until {
            None => inbox.recv_many(&mut batch, 1024).await == 0,
            Some(deadline) => {
                match tokio::time::timeout_at(deadline, inbox.recv_many(&mut batch, 1024)).await {
                    Ok(received) => received == 0,
                    Err(_) => {
                        // Held long enough behind a slow delivery: one by one.
                        ack_each(&channel, timeout, &mut finished).await;
                        hold_until = None;
                        continue;
                    }
                }
            }
        };
        let mut stopping = stop;
        for message in batch.drain(..) {
            match message {
                Settle::Delivered(tag) => {
                    in_flight.insert(tag);
                }
                Settle::Finished { tag, requeue } => {
                    in_flight.remove(&tag);
                    if requeue {
                        requeue_one(&channel, timeout, tag).await;
                    } else {
                        finished.insert(tag, Instant::now());
                    }
                }
                Settle::Stop => stopping = true,
            }
        }
        // Everything finished below the oldest delivery still in flight: one frame.
        let oldest = in_flight.first().copied().unwrap_or(u64::MAX);
        if let Some((&upto, _)) = finished.range(..oldest).next_back() {
            ack(&channel, timeout, upto, true).await;
            let rest = finished.split_off(&(upto + 1));
            acked(&finished);
            finished = rest;
        }
        if stopping {
            ack_each(&channel, timeout, &mut finished).await;
            return;
        }
        hold_until = match (finished.is_empty(), hold_until) {
            (true, _) => None,
            (false, None) => Some(tokio::time::Instant::now() + ACK_HOLD),
            // A busy inbox never lets the timer fire: check it here too.
            (false, Some(deadline)) if tokio::time::Instant::now() >= deadline => {
                ack_each(&channel, timeout, &mut finished).await;
                None
            }
            (false, held) => held,
        };
    }
}

/// Acknowledges each of `finished` on its own, and empties it: for acks
/// held too long behind a slow delivery, and at stop.
async fn ack_each(channel: &Channel, timeout: Duration, finished: &mut Finished) {
    let finished = std::mem::take(finished);
    for &tag in finished.keys() {
        ack(channel, timeout, tag, false).await;
    }
    acked(&finished);
}

/// Deliveries whose handlers finished, by tag, with when they finished.
type Finished = BTreeMap<u64, Instant>;

/// Counts deliveries just acknowledged in `sas_acks_total`, and how long
/// each waited for its ack after its handler finished in
/// `sas_ack_delay_seconds` (the coalescing's cost, a line of the latency
/// budget).
fn acked(finished: &Finished) {
    metrics::counter!("sas_acks_total").increment(finished.len() as u64);
    let delay = metrics::histogram!("sas_ack_delay_seconds");
    for at in finished.values() {
        delay.record(at.elapsed().as_secs_f64());
    }
}

/// Sends one `basic.ack` (counted in `sas_ack_frames_total`; with
/// `sas_acks_total`, the deliveries it settled, that shows the coalescing).
async fn ack(channel: &Channel, timeout: Duration, tag: u64, multiple: bool) {
    metrics::counter!("sas_ack_frames_total").increment(1);
    if let Err(error) = timed(
        "acknowledging",
        timeout,
        channel.basic_ack(tag, BasicAckOptions { multiple }),
    )
    .await
    {
        // The channel is gone: the broker requeues the messages by itself.
        tracing::warn!(error = %error, "could not acknowledge; the messages will be redelivered");
    }
}

async fn requeue_one(channel: &Channel, timeout: Duration, tag: u64) {
    if let Err(error) = timed(
        "requeueing",
        timeout,
        channel.basic_nack(
            tag,
            BasicNackOptions {
                requeue: true,
                ..BasicNackOptions::default()
            },
        ),
    )
    .await
    {
        tracing::warn!(error = %error, "could not requeue; the message will be redelivered");
    }
}

/// Header of a dead letter published by one of our services: the
/// `user_id` of the message it copies (the identity RabbitMQ validated when
/// that message was published), absent when it had none. The dead letter
/// itself carries the `user_id` of the service that dead-lettered it, so
/// the supervisor can tell a service's word from a client's. Whatever a
/// publisher put in this header is removed first.
pub const ORIGINAL_USER_HEADER: &str = headers::ORIGINAL_USER;

/// Publishes `message` to the dead-letter exchange with `reason` and its
/// source queue in headers (keeping its other properties), and the
/// `user_id` of its publisher in [`ORIGINAL_USER_HEADER`].
///
/// A body over `amqp.max_message_bytes` is cut to that size, so that no
/// queue or table downstream holds more than the limit of one message.
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
    let mut entries = table.inner().clone();
    entries.remove(&lapin::types::ShortString::from(ORIGINAL_USER_HEADER));
    table = entries.into();
    let original_user = message
        .properties
        .user_id()
        .as_ref()
        .map(|user| user.as_str().to_owned());
    for (key, value) in [
        (headers::DEAD_LETTER_REASON, Some(reason)),
        (
            headers::DEAD_LETTER_SOURCE_QUEUE,
            Some(message.queue.as_str()),
        ),
        (ORIGINAL_USER_HEADER, original_user.as_deref()),
    ] {
        if let Some(value) = value {
            table.insert(
                key.into(),
                lapin::types::AMQPValue::LongString(value.to_owned().into()),
            );
        }
    }
    let properties = message
        .properties
        .clone()
        .with_headers(table)
        .with_delivery_mode(2);
    let body = &message.body[..message.body.len().min(settings.max_message_bytes)];
    publisher
        .publish(
            &settings.names().dead_letter_exchange(),
            "",
            body,
            properties,
            true,
        )
        .await
}
