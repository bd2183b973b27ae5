//! An event from the outside world that an order's wait step waits for: a
//! manager's approval, a warehouse's "picked", a payment provider's webhook.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::order::{InvalidOrder, MAX_ATTRIBUTES_BYTES};
use crate::{OrderId, SCHEMA_VERSION};

/// Longest accepted event id, in bytes.
pub const MAX_EVENT_ID_LEN: usize = 128;
/// Longest accepted correlation key, in bytes.
pub const MAX_CORRELATION_KEY_LEN: usize = 256;
/// What [`OrderEvent::validate`] accepts as an event name, for the JSON
/// Schema: 1 to 64 letters, digits, `_` or `-`.
pub const EVENT_NAME_PATTERN: &str = "^[A-Za-z0-9_-]{1,64}$";

/// An event for an order, published as JSON to
/// [`crate::QueueNames::events`] (by a client, `sasctl signal`, or the
/// console's button), addressed by `order_id` or by `correlation_key`
/// (exactly one of them).
///
/// An event for an order id is kept in the order's durable mailbox: a wait
/// step for `name` uses it, whether it arrived before the order reached the
/// step or while it waits. One `event_id` is used at most once per order,
/// so a redelivered or repeated event changes nothing. An event for an
/// order that does not exist yet is kept for the deployment's event time to
/// live, then dead-lettered with its reason.
///
/// An event for a correlation key (a business id the sender knows: a
/// payment provider's payment id, an invoice number) goes to every order
/// parked at a wait whose `correlation_key` pointer gave that key, into its
/// mailbox as above. When no order waits with the key yet, it is kept (once
/// per key and event id) and given to the first order that parks with it,
/// at the supervisors' next pass; after the event time to live it is
/// dead-lettered.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OrderEvent {
    /// Must equal [`SCHEMA_VERSION`].
    #[schemars(extend("const" = SCHEMA_VERSION))]
    pub schema_version: u32,
    /// The order the event is for (or set `correlation_key`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = crate::order::ID_PATTERN))]
    pub order_id: Option<OrderId>,
    /// The business key of the orders the event is for, as their wait
    /// steps' `correlation_key` gives it (or set `order_id`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = MAX_CORRELATION_KEY_LEN))]
    pub correlation_key: Option<String>,
    /// What happened (`approved`); a wait step names the event it waits for.
    #[schemars(regex(pattern = EVENT_NAME_PATTERN))]
    pub name: String,
    /// The sender's id for this event: the same id twice is one event.
    #[schemars(length(min = 1, max = MAX_EVENT_ID_LEN))]
    pub event_id: String,
    /// What the event says (who approved, the parcel number), at most
    /// 16 KiB of compact JSON: it becomes the wait step's result, which
    /// later steps' templates read as `/results/<step>/...`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub data: Option<serde_json::Map<String, serde_json::Value>>,
}

impl OrderEvent {
    /// True when the event names a tenant: an order id or a correlation
    /// key holding [`crate::ids::TENANT_SEPARATOR`] (a stored id,
    /// `ord-1@shop`). Only operators may; a client names its orders by the
    /// ids it sent, and the schedulers qualify them by its tenant.
    pub fn names_a_tenant(&self) -> bool {
        let separator = crate::ids::TENANT_SEPARATOR;
        self.order_id
            .as_ref()
            .is_some_and(|id| id.contains(separator))
            || self
                .correlation_key
                .as_ref()
                .is_some_and(|key| key.contains(separator))
    }

    /// Checks what the type system cannot: version, exactly one of the
    /// order id and the correlation key (and its syntax), name and event id
    /// syntax, the size of `data`.
    ///
    /// # Errors
    /// [`InvalidOrder`] naming the first offending field.
    pub fn validate(&self) -> Result<(), InvalidOrder> {
        if self.schema_version != SCHEMA_VERSION {
            return Err(InvalidOrder(format!(
                "unsupported schema_version {} (this system reads {SCHEMA_VERSION})",
                self.schema_version
            )));
        }
        match (&self.order_id, &self.correlation_key) {
            (Some(order_id), None) => match order_id.rsplit_once(crate::ids::TENANT_SEPARATOR) {
                // A stored id with its tenant: only operators may use one
                // (the schedulers check who sent it).
                Some((client, tenant)) if crate::ids::is_tenant_name(tenant) => {
                    crate::order::check_id("order_id", client)?;
                }
                _ => crate::order::check_id("order_id", order_id)?,
            },
            (None, Some(key)) => {
                if key.is_empty()
                    || key.len() > MAX_CORRELATION_KEY_LEN
                    || key.chars().any(char::is_control)
                {
                    return Err(InvalidOrder(format!(
                        "correlation_key must be 1 to {MAX_CORRELATION_KEY_LEN} bytes without control characters"
                    )));
                }
            }
            _ => {
                return Err(InvalidOrder(
                    "an event names exactly one of order_id and correlation_key".into(),
                ))
            }
        }
        if !crate::order::is_workflow_name(&self.name) {
            return Err(InvalidOrder(format!(
                "name must be 1 to 64 letters, digits, '_' or '-' (got {:?})",
                self.name
            )));
        }
        if self.event_id.is_empty()
            || self.event_id.len() > MAX_EVENT_ID_LEN
            || self.event_id.chars().any(char::is_control)
        {
            return Err(InvalidOrder(format!(
                "event_id must be 1 to {MAX_EVENT_ID_LEN} bytes without control characters"
            )));
        }
        if let Some(data) = &self.data {
            let bytes = serde_json::to_vec(data).map_or(usize::MAX, |b| b.len());
            if bytes > MAX_ATTRIBUTES_BYTES {
                return Err(InvalidOrder(format!(
                    "data must be at most {MAX_ATTRIBUTES_BYTES} bytes of JSON (got {bytes})"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event() -> OrderEvent {
        OrderEvent {
            schema_version: SCHEMA_VERSION,
            order_id: Some("ord-1".into()),
            correlation_key: None,
            name: "approved".into(),
            event_id: "mail-7".into(),
            data: None,
        }
    }

    #[test]
    fn a_bad_name_event_id_or_oversized_data_is_refused_naming_the_field() {
        event().validate().unwrap();
        let mut bad = event();
        bad.name = "ap proved".into();
        assert!(bad.validate().unwrap_err().0.contains("name"));
        let mut bad = event();
        bad.event_id = String::new();
        assert!(bad.validate().unwrap_err().0.contains("event_id"));
        let mut bad = event();
        let mut data = serde_json::Map::new();
        data.insert("x".into(), "y".repeat(MAX_ATTRIBUTES_BYTES).into());
        bad.data = Some(data);
        assert!(bad.validate().unwrap_err().0.contains("data"));
        let mut bad = event();
        bad.order_id = Some("a b".into());
        assert!(bad.validate().unwrap_err().0.contains("order_id"));
        let mut keyed = event();
        keyed.order_id = None;
        keyed.correlation_key = Some("pi_3MtwBw".into());
        keyed.validate().unwrap();
        let mut both = keyed.clone();
        both.order_id = Some("ord-1".into());
        assert!(both.validate().unwrap_err().0.contains("exactly one"));
        let mut neither = keyed.clone();
        neither.correlation_key = None;
        assert!(neither.validate().unwrap_err().0.contains("exactly one"));
        keyed.correlation_key = Some("a\nb".into());
        assert!(keyed.validate().unwrap_err().0.contains("correlation_key"));
    }

    #[test]
    fn an_unknown_field_is_refused() {
        let text = r#"{"schema_version":1,"order_id":"o","name":"n","event_id":"e","colour":1}"#;
        assert!(serde_json::from_str::<OrderEvent>(text).is_err());
    }
}

#[cfg(test)]
mod tenant_tests {
    use super::*;

    #[test]
    fn an_event_names_a_tenant_by_a_stored_id_or_a_qualified_key_only() {
        let event = |order_id: Option<&str>, key: Option<&str>| OrderEvent {
            schema_version: SCHEMA_VERSION,
            order_id: order_id.map(OrderId::from),
            correlation_key: key.map(str::to_owned),
            name: "approved".into(),
            event_id: "e-1".into(),
            data: None,
        };
        assert!(!event(Some("ord-1"), None).names_a_tenant());
        assert!(!event(None, Some("pay-7")).names_a_tenant());
        assert!(event(Some("ord-1@shop"), None).names_a_tenant());
        assert!(event(None, Some("pay-7@rival")).names_a_tenant());
    }
}
