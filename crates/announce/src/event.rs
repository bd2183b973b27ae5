//! Sending an event to orders' wait steps: the one use case the console,
//! `sasctl signal` and the gateway share (each then publishes the message
//! with its own connection and confirm). Written once, so that the three
//! build the same [`OrderEvent`], refuse the same bad ones with the same
//! words, and address the schedulers the same way.
//!
//! What differs stays with each: the console first checks that the order
//! waits for this event from this operator (an operator's mistake is
//! answered at once); the gateway answers for a client of one tenant (its
//! ids and keys are that tenant's); `sasctl` sends as its own broker user.

use sas_broker::publish::{json_properties, order_headers, string_headers, Outgoing};
use sas_messages::{OrderEvent, QueueNames, SCHEMA_VERSION};

/// Whom an event is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventAddress {
    /// One order, by the id its client gave it.
    Order(String),
    /// Every order parked at a wait with this business key (a payment id),
    /// or the first to park with it.
    Key(String),
}

/// An event a front end sends: what it says, and on whose behalf.
#[derive(Debug, Clone)]
pub struct NewEvent<'a> {
    /// Whom it is for.
    pub address: EventAddress,
    /// Its name, as the wait step names it (`approved`).
    pub name: String,
    /// The sender's id for it (the same id again is the same event);
    /// `None`: a new one, `<origin>-<uuid v7>`.
    pub event_id: Option<String>,
    /// What it says: the wait step's result.
    pub data: Option<serde_json::Map<String, serde_json::Value>>,
    /// Who sends it, for new ids and message ids: `console`, `sasctl`,
    /// `gateway`.
    pub origin: &'a str,
    /// The identity it is sent on behalf of (`console:ann`,
    /// `gateway:shop`), which the schedulers believe from a delegating
    /// broker user only (`amqp.delegating_users`); `None`: the broker user
    /// that publishes it.
    pub on_behalf_of: Option<&'a str>,
    /// The tenant the order belongs to, when the sender answers for one
    /// (a dead letter of the event is then recorded under the order's
    /// stored id).
    pub tenant: Option<&'a str>,
}

/// Why an event cannot be sent: what is wrong with it, as the schedulers
/// would say it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the event is not valid: {0}")]
pub struct InvalidEvent(pub String);

/// The event, validated as the schedulers validate it, and the message
/// that carries it to the deployment's (`names`) events exchange
/// (persistent, mandatory).
///
/// # Errors
/// [`InvalidEvent`] naming the field that is wrong.
pub fn event_message(
    names: &QueueNames,
    new: NewEvent<'_>,
) -> Result<(OrderEvent, Outgoing), InvalidEvent> {
    let (order_id, correlation_key) = match new.address {
        EventAddress::Order(order_id) => (Some(order_id.into()), None),
        EventAddress::Key(key) => (None, Some(key)),
    };
    let event = OrderEvent {
        schema_version: SCHEMA_VERSION,
        order_id,
        correlation_key,
        name: new.name,
        event_id: new
            .event_id
            .unwrap_or_else(|| format!("{}-{}", new.origin, uuid::Uuid::now_v7().simple())),
        data: new.data,
    };
    event
        .validate()
        .map_err(|invalid| InvalidEvent(invalid.0))?;
    let mut headers = match (&event.order_id, new.tenant) {
        (Some(order_id), Some(tenant)) => order_headers(&order_id.qualified(tenant), None),
        _ => string_headers([]),
    };
    if let Some(identity) = new.on_behalf_of {
        headers.insert(
            sas_messages::headers::SENDER.into(),
            sas_broker::lapin::types::AMQPValue::LongString(identity.into()),
        );
    }
    let properties =
        json_properties(&format!("{}-event-{}", new.origin, event.event_id)).with_headers(headers);
    let message = Outgoing {
        exchange: names.events(),
        routing_key: names.events(),
        body: serde_json::to_vec(&event).expect("wire types always serialize"),
        properties,
        mandatory: true,
    };
    Ok((event, message))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> QueueNames {
        QueueNames::new("t1.")
    }

    fn new(address: EventAddress, name: &str) -> NewEvent<'static> {
        NewEvent {
            address,
            name: name.to_owned(),
            event_id: None,
            data: None,
            origin: "console",
            on_behalf_of: Some("console:ann"),
            tenant: None,
        }
    }

    #[test]
    fn an_event_gets_a_new_id_of_its_origin_and_names_its_sender() {
        let (event, message) = event_message(
            &names(),
            new(EventAddress::Order("ord-1".into()), "approved"),
        )
        .unwrap();
        assert!(event.event_id.starts_with("console-"), "{}", event.event_id);
        assert_eq!(message.routing_key, "t1.sas.events");
        assert_eq!(message.exchange, "t1.sas.events");
        assert!(message.mandatory);
        let headers = message.properties.headers().clone().unwrap_or_default();
        assert_eq!(
            headers.inner().get(sas_messages::headers::SENDER),
            Some(&sas_broker::lapin::types::AMQPValue::LongString(
                "console:ann".into()
            )),
        );
        let sent: OrderEvent = serde_json::from_slice(&message.body).unwrap();
        assert_eq!(sent, event);
    }

    #[test]
    fn a_bad_event_is_refused_as_the_schedulers_would_refuse_it() {
        for (address, name) in [
            (EventAddress::Order("ord 1".into()), "approved"),
            (EventAddress::Key(String::new()), "approved"),
            (EventAddress::Order("ord-1".into()), "not a name!"),
        ] {
            let refused = event_message(&names(), new(address.clone(), name));
            assert!(refused.is_err(), "{address:?} {name:?}");
        }
    }
}
