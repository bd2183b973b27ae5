//! Events for orders' wait steps over HTTP: a payment provider's webhook, a
//! warehouse system, a manager's approval from another application.
//!
//! `POST /v1/orders/{order_id}/events` takes the event's name, id and data,
//! validates it as the schedulers do and publishes an [`OrderEvent`] to the
//! events exchange like any client, persistent and confirmed. The
//! scheduler keeps it in the order's mailbox, once per event id: sending
//! the same event again is safe, and an event for an order that does not
//! exist yet waits for it (`scheduler.event_ttl_secs`).
//! `POST /v1/correlation-keys/{key}/events` does the same for the orders
//! parked at a wait with that business key (a payment id the provider's
//! webhook carries), or keeps it until one parks with it.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use sas_announce::event::{event_message, EventAddress, NewEvent};
use sas_broker::publish::Outgoing;
use sas_messages::{OrderEvent, QueueNames, SCHEMA_VERSION};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::orders::{
    not_confirmed, problem, publish_confirmed, store_unavailable, unreadable_body,
};
use crate::{Caller, Gateway};
use sas_store::machine::wait::EventAdmission;

/// An event for an order's wait step, as a client sends it (the order is
/// the path's).
#[derive(Debug, Clone, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct EventSubmission {
    /// Must equal the system's schema version (1), as on every body.
    #[schemars(extend("const" = SCHEMA_VERSION))]
    pub schema_version: u32,
    /// What happened, as the wait step names it (`approved`).
    pub name: String,
    /// The sender's id for this event: the same id again is the same event.
    pub event_id: String,
    /// What the event says (at most 16 KiB): the wait step's result.
    #[serde(default)]
    pub data: Option<serde_json::Map<String, serde_json::Value>>,
}

/// The answer to an event taken.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct EventAccepted {
    /// The order it is for, when it was sent for an order.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub order_id: Option<String>,
    /// The business key it is for, when it was sent for a key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub correlation_key: Option<String>,
    /// Its id.
    pub event_id: String,
    /// Where the order's status is read (for an event sent for an order).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status_url: Option<String>,
}

/// Who sends an event over HTTP: a client, for its tenant, in the
/// deployment `names`.
struct Sender<'a> {
    names: &'a QueueNames,
    identity: &'a str,
    tenant: &'a str,
}

/// `POST /v1/orders/{order_id}/events`.
pub async fn submit(
    State(gateway): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
    Path(order_id): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body {
        Ok(body) => take(&gateway, &caller, EventAddress::Order(order_id), &body).await,
        Err(rejection) => unreadable_body(&rejection),
    }
}

/// `POST /v1/correlation-keys/{key}/events`.
pub async fn submit_for_key(
    State(gateway): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
    Path(key): Path<String>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    match body {
        Ok(body) => take(&gateway, &caller, EventAddress::Key(key), &body).await,
        Err(rejection) => unreadable_body(&rejection),
    }
}

/// Validates and publishes an event for `address`, answering 202 once the
/// broker confirmed it.
async fn take(gateway: &Gateway, caller: &Caller, address: EventAddress, body: &Bytes) -> Response {
    let tenant = match gateway.tenant_of(caller) {
        Ok(tenant) => tenant,
        Err(refused) => return *refused,
    };
    let identity = caller.identity();
    let sender = Sender {
        names: &gateway.names,
        identity: &identity,
        tenant: &tenant,
    };
    let (event, message) = match parse(
        address,
        body,
        gateway.settings.amqp.max_message_bytes,
        &sender,
    ) {
        Ok(parsed) => parsed,
        Err((status, error)) => {
            counted("invalid");
            return problem(status, error);
        }
    };
    let separator = sas_messages::ids::TENANT_SEPARATOR;
    if event.names_a_tenant() {
        counted("invalid");
        return problem(
            StatusCode::BAD_REQUEST,
            format!("name the order by the id you submitted, the key as your orders give it (without '{separator}')"),
        );
    }
    if let Some(order_id) = &event.order_id {
        let principals = gateway.tenancy.sender(&identity).principals;
        let stored_id = order_id.qualified(&tenant);
        if let Err(refused) = check(gateway, &stored_id, &event, &identity, &principals).await {
            return refused;
        }
    }
    let order_id = event.order_id.as_ref().map(ToString::to_string);
    let about = order_id
        .clone()
        .or_else(|| event.correlation_key.clone())
        .unwrap_or_default();
    match deliver_confirmed(gateway, message).await {
        Ok(()) => {
            counted("accepted");
            tracing::info!(order_id = %about, event = %event.name, event_id = %event.event_id, client = %caller.0, "event accepted over HTTP");
            (
                StatusCode::ACCEPTED,
                Json(EventAccepted {
                    status_url: order_id.as_ref().map(|id| format!("/v1/orders/{id}")),
                    order_id,
                    correlation_key: event.correlation_key,
                    event_id: event.event_id,
                }),
            )
                .into_response()
        }
        Err(error) => {
            counted("unavailable");
            tracing::warn!(order_id = %about, %error, "event not confirmed by the broker");
            not_confirmed(&format!("the event was not accepted: the broker did not confirm it ({error}); send the same event again, which is safe (one event per event_id)"))
        }
    }
}

/// Answers, before anything is sent, an event the order `stored_id` would
/// not take from the client `identity` (known by `principals`), by the rule the console and `sasctl signal` follow
/// ([`sas_store::machine::wait::admission`]): 403 when every wait of the
/// order for it refuses this client (the scheduler would refuse it), 409
/// when nothing in the order will use it (it ended, or no wait for it is
/// ahead). An event the order waits for, has a wait for ahead, or had
/// before (a retried webhook), or for an order not stored yet, is sent.
async fn check(
    gateway: &Gateway,
    stored_id: &str,
    event: &OrderEvent,
    identity: &str,
    principals: &[String],
) -> Result<(), Response> {
    let admission = gateway
        .store
        .reads()
        .event_admission(stored_id, &event.name, &event.event_id, principals)
        .await
        .map_err(|error| {
            counted("unavailable");
            store_unavailable(&error)
        })?;
    if admission.sendable() {
        return Ok(());
    }
    let status = match admission {
        EventAdmission::Refused { .. } => {
            counted("refused");
            StatusCode::FORBIDDEN
        }
        _ => {
            counted("unused");
            StatusCode::CONFLICT
        }
    };
    // Said with the client's id, as it knows the order.
    let own = sas_messages::ids::client_id(stored_id);
    Err(problem(
        status,
        admission.describe(own, &event.name, identity),
    ))
}

fn counted(outcome: &'static str) {
    metrics::counter!("sas_gateway_events_total", "outcome" => outcome).increment(1);
}

/// The event the body says for `address`, validated as the schedulers
/// validate it, and its message on the sender's behalf (see
/// [`sas_announce::event`]), or the status and reason to refuse it with:
/// 413 over `limit` bytes, 400 otherwise.
fn parse(
    address: EventAddress,
    body: &[u8],
    limit: usize,
    sender: &Sender<'_>,
) -> Result<(OrderEvent, Outgoing), (StatusCode, String)> {
    let submission: EventSubmission = match sas_messages::decode::decode(body, limit) {
        Ok(submission) => submission,
        Err(error @ sas_messages::decode::DecodeError::TooLarge { .. }) => {
            return Err((StatusCode::PAYLOAD_TOO_LARGE, error.to_string()));
        }
        Err(error) => return Err((StatusCode::BAD_REQUEST, error.to_string())),
    };
    if submission.schema_version != SCHEMA_VERSION {
        return Err((
            StatusCode::BAD_REQUEST,
            format!(
                "unsupported schema_version {} (this system reads {SCHEMA_VERSION})",
                submission.schema_version
            ),
        ));
    }
    // Sent on the client's behalf: the schedulers address the event within
    // its tenant and check it against the wait's senders; a dead letter of
    // it is recorded under the order's stored id.
    event_message(
        sender.names,
        NewEvent {
            address,
            name: submission.name,
            event_id: Some(submission.event_id),
            data: submission.data,
            origin: "gateway",
            on_behalf_of: Some(sender.identity),
            tenant: Some(sender.tenant),
        },
    )
    .map_err(|invalid| (StatusCode::BAD_REQUEST, invalid.0))
}

/// Publishes `message` and waits for the broker's confirm (up to
/// `gateway.publish_timeout_ms`).
///
/// # Errors
/// When the broker has not confirmed it by then.
async fn deliver_confirmed(
    gateway: &Gateway,
    message: Outgoing,
) -> Result<(), sas_broker::BrokerError> {
    publish_confirmed(gateway, message.exchange, message.body, message.properties).await
}

#[cfg(test)]
mod tests {
    use super::*;
    use sas_messages::OrderId;

    fn order() -> EventAddress {
        EventAddress::Order("ord-1".into())
    }

    fn parse(
        address: EventAddress,
        body: &[u8],
        limit: usize,
    ) -> Result<OrderEvent, (StatusCode, String)> {
        let names = QueueNames::new("t1.");
        let sender = Sender {
            names: &names,
            identity: "gateway:shop",
            tenant: "shop",
        };
        super::parse(address, body, limit, &sender).map(|(event, _)| event)
    }

    #[test]
    fn a_bad_name_an_unknown_field_and_an_oversized_body_are_refused() {
        let ok = parse(
            order(),
            br#"{"schema_version":1,"name":"approved","event_id":"e-1","data":{"by":"ann"}}"#,
            4096,
        )
        .unwrap();
        assert_eq!(
            (ok.order_id.as_ref().map(OrderId::as_str), ok.name.as_str()),
            (Some("ord-1"), "approved")
        );
        for (body, status, reason) in [
            (
                &br#"{"schema_version":1,"name":"ap proved","event_id":"e"}"#[..],
                StatusCode::BAD_REQUEST,
                "name",
            ),
            (
                br#"{"schema_version":1,"name":"a","event_id":"e","colour":1}"#,
                StatusCode::BAD_REQUEST,
                "colour",
            ),
            (
                br#"{"schema_version":1,"name":"a","event_id":""}"#,
                StatusCode::BAD_REQUEST,
                "event_id",
            ),
        ] {
            let (code, error) = parse(order(), body, 4096).unwrap_err();
            assert_eq!(code, status);
            assert!(error.contains(reason), "{error}");
        }
        let (code, _) = parse(
            EventAddress::Order("a b".into()),
            br#"{"schema_version":1,"name":"a","event_id":"e"}"#,
            4096,
        )
        .unwrap_err();
        assert_eq!(code, StatusCode::BAD_REQUEST);
        let big = format!(
            r#"{{"schema_version":1,"name":"a","event_id":"e","data":{{"x":"{}"}}}}"#,
            "y".repeat(5000)
        );
        let (code, _) = parse(order(), big.as_bytes(), 4096).unwrap_err();
        assert_eq!(code, StatusCode::PAYLOAD_TOO_LARGE);
    }

    #[test]
    fn an_event_for_a_key_names_the_key_and_no_order() {
        let body = br#"{"schema_version":1,"name":"settled","event_id":"e-1"}"#;
        let keyed = parse(EventAddress::Key("INV-2031".into()), body, 4096).unwrap();
        assert_eq!(
            (keyed.order_id, keyed.correlation_key.as_deref()),
            (None, Some("INV-2031"))
        );
        let long = "k".repeat(sas_messages::event::MAX_CORRELATION_KEY_LEN + 1);
        let (code, error) = parse(EventAddress::Key(long), body, 4096).unwrap_err();
        assert_eq!(code, StatusCode::BAD_REQUEST);
        assert!(error.contains("correlation_key"), "{error}");
    }
}
