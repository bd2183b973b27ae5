//! Publishing with confirms.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, PublisherConfirm};
use sas_messages::{headers, CONTENT_TYPE_JSON};
use serde::Serialize;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::error::timed;
use crate::BrokerError;

/// A channel in confirm mode: every publish waits for the broker's ack.
///
/// A publisher opened by a [`crate::Session`] knows the broker user of its
/// connection and stamps it on every message as the AMQP `user_id`
/// property. RabbitMQ refuses a `user_id` other than the authenticated
/// user, so a consumer can trust it: that is how the scheduler knows a reply
/// comes from an agent, and the supervisor that a dead letter comes from one
/// of our services.
#[derive(Clone)]
pub struct Publisher {
    channel: Channel,
    timeout: Duration,
    user_id: Option<ShortString>,
    /// The number of the [`crate::Session`] connection it publishes on (0
    /// for one opened by hand): a message a connection left unconfirmed is
    /// sent again only on a later one.
    generation: u64,
    /// The session's token for its connection being lost (none for one
    /// opened by hand): a publishing channel the broker closed (a publish to
    /// an exchange not declared yet, a refused permission) never opens
    /// again by itself, so the publisher cancels it and the session makes a
    /// new connection, with a new publisher, instead of failing every send
    /// after that until a restart.
    lost: Option<CancellationToken>,
}

impl Publisher {
    /// Opens a dedicated publishing channel and puts it in confirm mode.
    ///
    /// # Errors
    /// When the channel cannot be opened in time.
    pub async fn open(connection: &Connection, timeout: Duration) -> Result<Self, BrokerError> {
        let channel = timed(
            "opening a publishing channel",
            timeout,
            connection.create_channel(),
        )
        .await?;
        timed(
            "enabling publisher confirms",
            timeout,
            channel.confirm_select(ConfirmSelectOptions::default()),
        )
        .await?;
        Ok(Self {
            channel,
            timeout,
            user_id: None,
            generation: 0,
            lost: None,
        })
    }

    /// Marks the publisher as the one of the session's connection number `generation`.
    pub(crate) fn of_generation(mut self, generation: u64) -> Self {
        self.generation = generation;
        self
    }

    /// Makes the publisher cancel `lost` (its session's connection) when it
    /// finds its channel closed.
    pub(crate) fn losing(mut self, lost: CancellationToken) -> Self {
        self.lost = Some(lost);
        self
    }

    /// After a failed send: when the broker has closed the channel, the
    /// session must replace it (see `lost`).
    /// Whether its channel is open: a publisher of a lost connection is not.
    pub fn is_open(&self) -> bool {
        self.channel.status().connected()
    }

    fn check_channel(&self, error: &BrokerError) {
        if self.channel.status().connected() {
            return;
        }
        if let Some(lost) = self.lost.as_ref().filter(|lost| !lost.is_cancelled()) {
            tracing::warn!(error = %error, "RabbitMQ closed the publishing channel; reconnecting for a new one");
            lost.cancel();
        }
    }

    /// Stamps `user` (the broker user of this publisher's connection) as the
    /// `user_id` of every message it sends, replacing whatever `user_id` the
    /// properties carry (a dead letter keeps the properties of the message
    /// it copies, whose `user_id` is another identity's).
    #[must_use]
    pub fn identified_as(mut self, user: impl Into<String>) -> Self {
        self.user_id = Some(ShortString::from(user.into()));
        self
    }

    /// The `user_id` this publisher stamps on its messages, if any.
    pub fn user_id(&self) -> Option<&str> {
        self.user_id.as_ref().map(ShortString::as_str)
    }

    /// Sends `body` without waiting for its confirm: the returned [`Pending`]
    /// resolves when the broker confirms it. Sending several messages before
    /// awaiting their confirms pipelines them (one round trip, not one each).
    ///
    /// With `mandatory`, a message no queue accepts is an error rather than
    /// silently dropped: requests to agents and replies are mandatory, status
    /// messages to a client queue that may be gone are not.
    ///
    /// # Errors
    /// When the message cannot be handed to the connection in time.
    pub async fn send(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
        mandatory: bool,
    ) -> Result<Pending, BrokerError> {
        let options = BasicPublishOptions {
            mandatory,
            ..BasicPublishOptions::default()
        };
        let properties = match &self.user_id {
            Some(user) => properties.with_user_id(user.clone()),
            None => properties,
        };
        let properties = stamp_published_at(properties);
        let confirm = timed(
            "publishing",
            self.timeout,
            self.channel.basic_publish(
                exchange.into(),
                routing_key.into(),
                options,
                body,
                properties,
            ),
        )
        .await
        .inspect_err(|error| self.check_channel(error))?;
        Ok(Pending {
            confirm,
            routing_key: routing_key.to_owned(),
            timeout: self.timeout,
        })
    }

    /// Publishes `body` and waits for the broker to confirm it (see [`Publisher::send`]).
    ///
    /// # Errors
    /// [`BrokerError`] when the broker refuses, returns or does not confirm the message in time.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        properties: BasicProperties,
        mandatory: bool,
    ) -> Result<(), BrokerError> {
        self.send(exchange, routing_key, body, properties, mandatory)
            .await?
            .confirmed()
            .await
            .inspect_err(|error| self.check_channel(error))
    }

    /// Serializes `message` as JSON and publishes it, waiting for the confirm.
    ///
    /// # Errors
    /// As [`Publisher::publish`].
    pub async fn publish_json<T: Serialize>(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &T,
        properties: BasicProperties,
        mandatory: bool,
    ) -> Result<(), BrokerError> {
        let body = serde_json::to_vec(message).expect("wire types always serialize");
        self.publish(exchange, routing_key, &body, properties, mandatory)
            .await
    }

    /// Sends `messages` together, in order (each hands its frames to the
    /// channel in its first poll, and they are first polled in order), and
    /// awaits every confirm: one round trip for all of them.
    ///
    /// # Errors
    /// The first message the broker does not take, refuses, returns or does
    /// not confirm in time.
    pub async fn send_batch(&self, messages: &[Outgoing]) -> Result<(), BrokerError> {
        let started = std::time::Instant::now();
        let pending = futures_util::future::try_join_all(messages.iter().map(|message| {
            self.send(
                &message.exchange,
                &message.routing_key,
                &message.body,
                message.properties.clone(),
                message.mandatory,
            )
        }))
        .await?;
        confirm_all(pending)
            .await
            .inspect_err(|error| self.check_channel(error))?;
        // A line of the latency budget: handing over and confirming.
        metrics::histogram!("sas_publish_seconds").record(started.elapsed().as_secs_f64());
        Ok(())
    }
}

/// `properties` with the [`headers::PUBLISHED_AT`] header set to now.
fn stamp_published_at(properties: BasicProperties) -> BasicProperties {
    let micros = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX));
    let mut table = properties.headers().clone().unwrap_or_default();
    table.insert(
        ShortString::from(headers::PUBLISHED_AT),
        AMQPValue::LongLongInt(micros),
    );
    properties.with_headers(table)
}

/// How long ago the message was published, from its
/// [`headers::PUBLISHED_AT`] header (none when it has none, when the
/// publisher's clock is ahead of this one's, or when the value is beyond
/// this platform's time range). A client may set the header on an order
/// itself: what it says is what is measured, which is why the figure is
/// only informational.
pub fn published_ago(properties: &BasicProperties) -> Option<Duration> {
    let micros = match properties
        .headers()
        .as_ref()?
        .inner()
        .get(headers::PUBLISHED_AT)?
    {
        AMQPValue::LongLongInt(micros) => u64::try_from(*micros).ok()?,
        _ => return None,
    };
    // Any value a client sets: never a panic, whatever it says.
    let published = std::time::UNIX_EPOCH.checked_add(Duration::from_micros(micros))?;
    std::time::SystemTime::now().duration_since(published).ok()
}

/// The pause before a message refused by a negative confirm is sent again.
const NACK_PAUSE: Duration = Duration::from_millis(200);

/// The longest wait for a new connection before an unconfirmed message is
/// sent again on the current one.
const RESEND_PAUSE: Duration = Duration::from_secs(1);

/// A message ready to publish, kept whole so that it can be sent again
/// unchanged (the same bytes and `message_id`; only the
/// [`headers::PUBLISHED_AT`] stamp is the resend's own) on another connection.
#[derive(Debug, Clone)]
pub struct Outgoing {
    /// The exchange (empty: the default exchange, `routing_key` names the queue).
    pub exchange: String,
    /// The routing key.
    pub routing_key: String,
    /// The body.
    pub body: Vec<u8>,
    /// The properties (the publisher stamps `user_id`).
    pub properties: BasicProperties,
    /// A message no queue takes is an error rather than dropped.
    pub mandatory: bool,
}

/// Persistent JSON message properties with a message id and a timestamp.
pub fn json_properties(message_id: &str) -> BasicProperties {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    BasicProperties::default()
        .with_content_type(CONTENT_TYPE_JSON.into())
        .with_delivery_mode(2)
        .with_message_id(message_id.into())
        .with_timestamp(now)
}

/// A message handed to the broker whose confirm has not been awaited yet.
#[must_use = "a message is only safe once its confirm has been awaited"]
pub struct Pending {
    confirm: PublisherConfirm,
    routing_key: String,
    timeout: Duration,
}

impl Pending {
    /// Waits for the broker's confirm.
    ///
    /// # Errors
    /// When the broker refuses or returns the message, or does not confirm it in time.
    pub async fn confirmed(self) -> Result<(), BrokerError> {
        match timed(
            "waiting for a publisher confirm",
            self.timeout,
            self.confirm,
        )
        .await?
        {
            Confirmation::Ack(None) | Confirmation::NotRequested => Ok(()),
            Confirmation::Ack(Some(_returned)) => Err(BrokerError::Unroutable {
                routing_key: self.routing_key,
            }),
            Confirmation::Nack(_) => Err(BrokerError::Nacked {
                routing_key: self.routing_key,
            }),
        }
    }
}

/// Waits for every confirm of `pending`.
///
/// # Errors
/// The first refusal or timeout.
async fn confirm_all(pending: Vec<Pending>) -> Result<(), BrokerError> {
    futures_util::future::try_join_all(pending.into_iter().map(Pending::confirmed)).await?;
    Ok(())
}

/// Builds an AMQP header table from string pairs.
pub fn string_headers<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> FieldTable {
    let mut table = FieldTable::default();
    for (key, value) in pairs {
        table.insert(
            ShortString::from(key.to_owned()),
            AMQPValue::LongString(value.to_owned().into()),
        );
    }
    table
}

/// Headers of a message about one order: its id, and the order's trace
/// context (same trace id, a new span id for this hop) when it has one.
pub fn order_headers(order_id: &str, trace_id: Option<&str>) -> FieldTable {
    // The current span's context when spans are exported and it belongs to
    // the order's trace (the receiver's spans become its children); else
    // the order's trace with a new span id.
    let traceparent = trace_id.map(|id| {
        sas_runtime::telemetry::current_traceparent()
            .filter(|current| current.contains(id))
            .unwrap_or_else(|| sas_messages::TraceParent::child_of(id).to_string())
    });
    let mut pairs = vec![(sas_messages::headers::ORDER_ID, order_id)];
    if let Some(traceparent) = &traceparent {
        pairs.push((sas_messages::headers::TRACEPARENT, traceparent.as_str()));
    }
    string_headers(pairs)
}

/// The trace id of a message's `traceparent` header, if valid.
pub fn trace_id_of(properties: &BasicProperties) -> Option<String> {
    traceparent_of(properties).map(|context| context.trace_id)
}

/// A message's `traceparent` header, if valid.
pub fn traceparent_of(properties: &BasicProperties) -> Option<sas_messages::TraceParent> {
    header_str(properties, sas_messages::headers::TRACEPARENT)
        .and_then(|value| sas_messages::TraceParent::parse(&value))
}

/// `table` with a whole-number header: how the agents send a reply's queue
/// times ([`headers::QUEUED_MS`], [`headers::SLOT_WAIT_MS`]).
pub fn with_number_header(mut table: FieldTable, key: &str, value: u64) -> FieldTable {
    table.insert(
        ShortString::from(key.to_owned()),
        AMQPValue::LongLongInt(i64::try_from(value).unwrap_or(i64::MAX)),
    );
    table
}

/// Reads a whole-number header that is not negative, if present: none for
/// any other value, whoever set it.
pub fn header_u64(properties: &BasicProperties, key: &str) -> Option<u64> {
    match properties.headers().as_ref()?.inner().get(key)? {
        AMQPValue::LongLongInt(value) => u64::try_from(*value).ok(),
        AMQPValue::LongInt(value) => u64::try_from(*value).ok(),
        AMQPValue::LongUInt(value) => Some(u64::from(*value)),
        _ => None,
    }
}

/// Reads a string header (long or short string), if present.
pub fn header_str(properties: &BasicProperties, key: &str) -> Option<String> {
    let headers = properties.headers().as_ref()?;
    match headers.inner().get(key)? {
        AMQPValue::LongString(value) => {
            Some(String::from_utf8_lossy(value.as_bytes()).into_owned())
        }
        AMQPValue::ShortString(value) => Some(value.as_str().to_owned()),
        _ => None,
    }
}

/// The publisher of whatever connection is up, shared with tasks that live
/// longer than one connection.
#[derive(Clone)]
pub struct SharedPublisher {
    current: Arc<watch::Sender<Option<Publisher>>>,
}

impl Default for SharedPublisher {
    fn default() -> Self {
        Self {
            current: Arc::new(watch::Sender::new(None)),
        }
    }
}

impl SharedPublisher {
    pub(crate) fn set(&self, publisher: Option<Publisher>) {
        self.current.send_replace(publisher);
    }

    /// The current publisher.
    ///
    /// # Errors
    /// [`BrokerError::NotConnected`] while no connection is up.
    pub fn get(&self) -> Result<Publisher, BrokerError> {
        self.current
            .borrow()
            .clone()
            .ok_or(BrokerError::NotConnected)
    }

    /// Waits for the publisher of a connection made after the one of
    /// generation `after`.
    async fn next_after(&self, after: u64) -> Publisher {
        let mut changes = self.current.subscribe();
        let found = changes
            .wait_for(|publisher| publisher.as_ref().is_some_and(|p| p.generation > after))
            .await
            .map(|publisher| publisher.clone());
        match found {
            Ok(Some(publisher)) => publisher,
            // The sender lives as long as self, and the value waited for is Some.
            _ => std::future::pending().await,
        }
    }

    /// Sends `messages` and awaits their confirms, through `first` (the
    /// publisher of the connection the caller works on) or the current one;
    /// when the connection is lost before every confirm came back, sends them
    /// all again, unchanged but for their publish-time stamp, on the next connection the session makes (any
    /// node of the cluster), and so on until they are confirmed, `give_up`
    /// passes or `shutdown` fires. Without a new connection they are sent
    /// again on the current one after a pause: after a negative confirm (a
    /// quorum queue nacks while it has no leader), or a confirm that did not
    /// come in time on a connection still up. A message no queue takes is not retried: the topology is
    /// missing, and sending again would not help.
    ///
    /// A message that reached its queue before the connection died is then
    /// delivered twice: every receiver of ours is idempotent (intake on the
    /// order id, agents on the idempotency key, schedulers fence replies by
    /// attempt id), and each resend is counted in `sas_republished_total`.
    ///
    /// # Errors
    /// The last failure, once `give_up` passed or on shutdown; or at once
    /// for a returned message.
    pub async fn deliver(
        &self,
        first: Option<&Publisher>,
        messages: &[Outgoing],
        give_up: tokio::time::Instant,
        shutdown: &CancellationToken,
    ) -> Result<(), BrokerError> {
        let mut publisher = first.cloned().or_else(|| self.get().ok());
        let mut failed_generation = 0;
        loop {
            let error = match &publisher {
                Some(current) => match current.send_batch(messages).await {
                    Ok(()) => return Ok(()),
                    Err(
                        error @ (BrokerError::Unroutable { .. } | BrokerError::Settings { .. }),
                    ) => return Err(error),
                    Err(error) => {
                        failed_generation = current.generation;
                        error
                    }
                },
                None => BrokerError::NotConnected,
            };
            tracing::warn!(error = %error, messages = messages.len(), "messages not confirmed; sending them again once a connection is up");
            // A new connection is used as soon as it is up. Without one, the
            // current publisher is tried again after a pause: a negative
            // confirm (a quorum queue without a leader yet) or a confirm that
            // timed out on a connection that is still alive.
            let pause = if matches!(error, BrokerError::Nacked { .. }) {
                NACK_PAUSE
            } else {
                RESEND_PAUSE
            };
            let next = async {
                tokio::select! {
                    newer = self.next_after(failed_generation) => newer,
                    () = tokio::time::sleep(pause) => match self.get() {
                        Ok(current) => current,
                        Err(_) => self.next_after(0).await,
                    },
                }
            };
            tokio::select! {
                next = next => publisher = Some(next),
                () = tokio::time::sleep_until(give_up) => return Err(error),
                () = shutdown.cancelled() => return Err(error),
            }
            metrics::counter!("sas_republished_total").increment(messages.len() as u64);
        }
    }
}
