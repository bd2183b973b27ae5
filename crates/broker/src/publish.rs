//! Publishing with confirms.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, PublisherConfirm};
use sas_messages::CONTENT_TYPE_JSON;
use serde::Serialize;

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
        })
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
        .await?;
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
    }

    /// Serializes `message` as JSON and sends it (see [`Publisher::send`]).
    ///
    /// # Errors
    /// As [`Publisher::send`].
    pub async fn send_json<T: Serialize>(
        &self,
        exchange: &str,
        routing_key: &str,
        message: &T,
        properties: BasicProperties,
        mandatory: bool,
    ) -> Result<Pending, BrokerError> {
        let body = serde_json::to_vec(message).expect("wire types always serialize");
        self.send(exchange, routing_key, &body, properties, mandatory)
            .await
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
pub async fn confirm_all(pending: Vec<Pending>) -> Result<(), BrokerError> {
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
    let traceparent = trace_id.map(|id| sas_messages::TraceParent::child_of(id).to_string());
    let mut pairs = vec![(sas_messages::headers::ORDER_ID, order_id)];
    if let Some(traceparent) = &traceparent {
        pairs.push((sas_messages::headers::TRACEPARENT, traceparent.as_str()));
    }
    string_headers(pairs)
}

/// The trace id of a message's `traceparent` header, if valid.
pub fn trace_id_of(properties: &BasicProperties) -> Option<String> {
    header_str(properties, sas_messages::headers::TRACEPARENT)
        .and_then(|value| sas_messages::TraceParent::parse(&value))
        .map(|context| context.trace_id)
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
#[derive(Clone, Default)]
pub struct SharedPublisher {
    current: Arc<RwLock<Option<Publisher>>>,
}

impl SharedPublisher {
    pub(crate) fn set(&self, publisher: Option<Publisher>) {
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = publisher;
    }

    /// The current publisher.
    ///
    /// # Errors
    /// [`BrokerError::NotConnected`] while no connection is up.
    pub fn get(&self) -> Result<Publisher, BrokerError> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
            .ok_or(BrokerError::NotConnected)
    }
}
