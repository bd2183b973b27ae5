//! The order a client submits to the orders queue.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{OrderId, SCHEMA_VERSION};

/// Longest accepted order id, SKU or customer id, in bytes.
pub const MAX_ID_LEN: usize = 64;
/// Most lines one order may carry.
pub const MAX_LINES: usize = 100;
/// What [`SubmitOrder::validate`] accepts as an order id, customer id or
/// SKU, as a regular expression for the JSON Schema: 1 to [`MAX_ID_LEN`]
/// characters of `A-Z a-z 0-9 - _ . :`.
pub const ID_PATTERN: &str = "^[A-Za-z0-9._:-]{1,64}$";
/// The currency code [`SubmitOrder::validate`] accepts, for the JSON Schema.
pub const CURRENCY_PATTERN: &str = "^[A-Z]{3}$";
/// A `reply_to` [`SubmitOrder::validate`] accepts has no ASCII control
/// character, for the JSON Schema (the length is checked apart, in bytes).
pub const QUEUE_NAME_PATTERN: &str = "^[^\\u0000-\\u001F\\u007F]+$";

/// True when `name` can be a client's queue name: 1 to 255 bytes (an AMQP
/// short string) and no ASCII control character (Postgres, which keeps it
/// with the order, refuses a NUL byte).
pub fn is_queue_name(name: &str) -> bool {
    (1..=255).contains(&name.len()) && !name.bytes().any(|b| b.is_ascii_control())
}

/// Longest message property intake keeps with an order (`correlation_id`,
/// `reply_to`), in bytes: an AMQP short string's limit, so that nothing
/// stored is longer than what the broker can carry back.
pub const MAX_PROPERTY_BYTES: usize = 255;

/// The first control character of `text` (any [`char::is_control`]:
/// U+0000 to U+001F and U+007F to U+009F) and its byte offset, if it has
/// one. Intake refuses a message property it would store or echo that has
/// one: Postgres `text` cannot hold U+0000, and one such value failed the
/// batched statement of every order beside it.
pub fn first_control_character(text: &str) -> Option<(usize, char)> {
    text.char_indices().find(|(_, c)| c.is_control())
}

/// Where `object` (an order's `attributes`) holds U+0000 (NUL) in a string
/// or a key, as a JSON Pointer, if it does: `jsonb` cannot hold that
/// character, so intake refuses such an order rather than fail the batched
/// statement of every order beside it. Other control characters (a
/// newline in an address) are stored as they are. The pointer's segments
/// are escaped as in RFC 6901 and their control characters written as
/// `\0`, `\n`, ..., so that the pointer itself can be stored in a reason.
pub fn first_nul(object: &serde_json::Map<String, serde_json::Value>) -> Option<String> {
    fn segment(key: &str) -> String {
        key.chars().fold(String::new(), |mut out, c| {
            match c {
                '~' => out.push_str("~0"),
                '/' => out.push_str("~1"),
                c if c.is_control() => out.extend(c.escape_debug()),
                c => out.push(c),
            }
            out
        })
    }
    fn in_object(
        object: &serde_json::Map<String, serde_json::Value>,
        path: &str,
    ) -> Option<String> {
        object.iter().find_map(|(key, value)| {
            let here = format!("{path}/{}", segment(key));
            if key.contains('\0') {
                return Some(here);
            }
            in_value(value, &here)
        })
    }
    fn in_value(value: &serde_json::Value, path: &str) -> Option<String> {
        match value {
            serde_json::Value::String(text) if text.contains('\0') => Some(path.to_owned()),
            serde_json::Value::Array(items) => items
                .iter()
                .enumerate()
                .find_map(|(index, item)| in_value(item, &format!("{path}/{index}"))),
            serde_json::Value::Object(object) => in_object(object, path),
            _ => None,
        }
    }
    in_object(object, "")
}

/// The workflow an order follows when it names none.
pub const DEFAULT_WORKFLOW: &str = "order";
/// What [`SubmitOrder::validate`] accepts as a workflow name, for the JSON
/// Schema: 1 to 64 letters, digits, `_` or `-`.
pub const WORKFLOW_PATTERN: &str = "^[A-Za-z0-9_-]{1,64}$";
/// Largest accepted `attributes` object, in bytes of compact JSON: they are
/// stored with the order and sent with every step request, so they stay
/// far below the message size limit.
pub const MAX_ATTRIBUTES_BYTES: usize = 16 * 1024;

/// True when `name` can name a workflow: 1 to 64 letters, digits, `_` or
/// `-` (see [`WORKFLOW_PATTERN`]).
pub fn is_workflow_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

/// Highest priority an order may ask for; 0 is the lowest.
pub const MAX_PRIORITY: u8 = 9;
/// The priority of an order that names none: the middle of the range, so
/// that background work can ask to go after it.
pub const DEFAULT_PRIORITY: u8 = 5;

/// Levels of priority are worth this much waiting: an order of priority p
/// goes before orders of priority p-1 that started waiting less than this
/// before it, and never waits more than this per level behind later ones.
/// Admission's lines and an agent's call slots both order by it.
pub const PRIORITY_STEP: chrono::TimeDelta = chrono::TimeDelta::seconds(10);

/// Compensations go before any new work of the same agent, in its line and
/// at its call slots.
pub const UNDO_HEAD_START: chrono::TimeDelta = chrono::TimeDelta::days(1);

/// A client's order, published as JSON to [`crate::QueueNames::orders`].
///
/// Unknown fields are refused: a misspelt `reply_to` would otherwise silently
/// leave a client without status messages.
///
/// The schema's constraints are those of [`SubmitOrder::validate`], which
/// intake applies: an order that breaks one is answered `rejected`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SubmitOrder {
    /// Must equal [`SCHEMA_VERSION`].
    #[schemars(extend("const" = SCHEMA_VERSION))]
    pub schema_version: u32,
    /// The client's id for the order: submitting the same id twice is a
    /// no-op; the same id with other content is rejected.
    #[schemars(regex(pattern = ID_PATTERN))]
    pub order_id: OrderId,
    /// Who is buying; passed to the payment service.
    #[schemars(regex(pattern = ID_PATTERN))]
    pub customer_id: String,
    /// What to reserve and ship.
    #[schemars(length(min = 1, max = MAX_LINES))]
    pub items: Vec<OrderLine>,
    /// Amount to charge, in the currency's minor unit.
    #[schemars(range(min = 0))]
    pub amount_cents: i64,
    /// ISO 4217 code, three upper-case letters.
    #[schemars(regex(pattern = CURRENCY_PATTERN))]
    pub currency: String,
    /// Queue that receives [`crate::OrderStatus`] messages for this order,
    /// if any; it wins over the message's `reply_to` property.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 255), regex(pattern = QUEUE_NAME_PATTERN))]
    pub reply_to: Option<String>,
    /// 0 (lowest) to [`MAX_PRIORITY`]; [`DEFAULT_PRIORITY`] when absent. Under
    /// a backlog, higher priorities start first (see docs/design-decisions.md, admission).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(max = MAX_PRIORITY))]
    pub priority: Option<u8>,
    /// The workflow the order follows, by name; `order` when absent
    /// ([`DEFAULT_WORKFLOW`]). A name the deployment does not run is
    /// rejected with the names it does run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = WORKFLOW_PATTERN))]
    pub workflow: Option<String>,
    /// Open order data (a shipping address, a tax id, a coupon, a channel):
    /// a JSON object of at most 16 KiB of compact JSON
    /// ([`MAX_ATTRIBUTES_BYTES`]) that every step request carries, and that
    /// a workflow may check with its own JSON Schema at intake.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attributes: Option<serde_json::Map<String, serde_json::Value>>,
}

impl SubmitOrder {
    /// The order's priority, its default filled in.
    pub fn priority(&self) -> u8 {
        self.priority.unwrap_or(DEFAULT_PRIORITY)
    }

    /// The workflow the order follows, its default filled in.
    pub fn workflow(&self) -> &str {
        self.workflow.as_deref().unwrap_or(DEFAULT_WORKFLOW)
    }
}

/// One line of an order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct OrderLine {
    /// Stock keeping unit.
    #[schemars(regex(pattern = ID_PATTERN))]
    pub sku: String,
    /// How many, at least one.
    #[schemars(range(min = 1))]
    pub quantity: u32,
}

/// Why an order was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid order: {0}")]
pub struct InvalidOrder(pub String);

/// Checks an id field (order id, customer id, SKU): 1 to [`MAX_ID_LEN`]
/// characters of `A-Z a-z 0-9 - _ . :`.
pub(crate) fn check_id(field: &str, value: &str) -> Result<(), InvalidOrder> {
    let ok = !value.is_empty()
        && value.len() <= MAX_ID_LEN
        && value
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'));
    if ok {
        Ok(())
    } else {
        Err(InvalidOrder(format!(
            "{field} must be 1 to {MAX_ID_LEN} characters of A-Z, a-z, 0-9, '-', '_', '.', ':' (got {value:?})"
        )))
    }
}

impl SubmitOrder {
    /// Checks what the type system cannot: version, id syntax, quantities.
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
        check_id("order_id", &self.order_id)?;
        check_id("customer_id", &self.customer_id)?;
        if self.items.is_empty() || self.items.len() > MAX_LINES {
            return Err(InvalidOrder(format!(
                "items must hold 1 to {MAX_LINES} lines (got {})",
                self.items.len()
            )));
        }
        for (index, line) in self.items.iter().enumerate() {
            check_id(&format!("items[{index}].sku"), &line.sku)?;
            if line.quantity == 0 {
                return Err(InvalidOrder(format!(
                    "items[{index}].quantity must be at least 1"
                )));
            }
        }
        if self.amount_cents < 0 {
            return Err(InvalidOrder(format!(
                "amount_cents must not be negative (got {})",
                self.amount_cents
            )));
        }
        if self.currency.len() != 3 || !self.currency.bytes().all(|b| b.is_ascii_uppercase()) {
            return Err(InvalidOrder(format!(
                "currency must be three upper-case letters (got {:?})",
                self.currency
            )));
        }
        if self.priority() > MAX_PRIORITY {
            return Err(InvalidOrder(format!(
                "priority must be 0 to {MAX_PRIORITY} (got {})",
                self.priority()
            )));
        }
        if let Some(reply_to) = &self.reply_to {
            if !is_queue_name(reply_to) {
                return Err(InvalidOrder(
                    "reply_to must be a queue name of 1 to 255 bytes without control characters"
                        .into(),
                ));
            }
        }
        if !is_workflow_name(self.workflow()) {
            return Err(InvalidOrder(format!(
                "workflow must be 1 to 64 letters, digits, '_' or '-' (got {:?})",
                self.workflow()
            )));
        }
        if let Some(attributes) = &self.attributes {
            let bytes = serde_json::to_vec(attributes).map_or(usize::MAX, |b| b.len());
            if bytes > MAX_ATTRIBUTES_BYTES {
                return Err(InvalidOrder(format!(
                    "attributes must be at most {MAX_ATTRIBUTES_BYTES} bytes of JSON (got {bytes})"
                )));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) fn sample() -> SubmitOrder {
    SubmitOrder {
        schema_version: SCHEMA_VERSION,
        order_id: "ord-1".into(),
        customer_id: "cust-1".into(),
        items: vec![OrderLine {
            sku: "sku-1".into(),
            quantity: 2,
        }],
        amount_cents: 1999,
        currency: "EUR".into(),
        reply_to: None,
        priority: None,
        workflow: None,
        attributes: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_well_formed_order_is_valid() {
        sample().validate().unwrap();
    }

    #[test]
    fn an_order_id_with_spaces_is_refused_naming_the_field() {
        let mut order = sample();
        order.order_id = "has space".into();
        let error = order.validate().unwrap_err();
        assert!(error.0.contains("order_id"), "{error}");
    }

    #[test]
    fn a_zero_quantity_is_refused_naming_the_line() {
        let mut order = sample();
        order.items[0].quantity = 0;
        assert!(order
            .validate()
            .unwrap_err()
            .0
            .contains("items[0].quantity"));
    }

    #[test]
    fn another_schema_version_is_refused() {
        let mut order = sample();
        order.schema_version = 2;
        assert!(order.validate().unwrap_err().0.contains("schema_version"));
    }

    #[test]
    fn a_reply_to_with_a_control_character_or_over_255_bytes_is_refused() {
        for bad in ["client\0queue", "tab\there", "", &"q".repeat(256)] {
            let mut order = sample();
            order.reply_to = Some(bad.to_owned());
            assert!(
                order.validate().unwrap_err().0.contains("reply_to"),
                "{bad:?}"
            );
        }
        let mut order = sample();
        order.reply_to = Some("sas.client.alice.é-1".into());
        order.validate().unwrap();
    }

    #[test]
    fn an_empty_order_and_a_lower_case_currency_are_refused() {
        let mut order = sample();
        order.items.clear();
        assert!(order.validate().is_err());
        let mut order = sample();
        order.currency = "eur".into();
        assert!(order.validate().is_err());
    }

    #[test]
    fn attributes_over_the_limit_and_a_bad_workflow_name_are_refused() {
        let mut order = sample();
        let mut attributes = serde_json::Map::new();
        attributes.insert("note".into(), "x".repeat(MAX_ATTRIBUTES_BYTES).into());
        order.attributes = Some(attributes);
        assert!(order.validate().unwrap_err().0.contains("attributes"));
        let mut order = sample();
        order.workflow = Some("re turn".into());
        assert!(order.validate().unwrap_err().0.contains("workflow"));
        order.workflow = Some("return".into());
        order.validate().unwrap();
        assert_eq!(sample().workflow(), DEFAULT_WORKFLOW);
    }

    #[test]
    fn a_control_character_is_found_with_its_byte_offset_whatever_its_kind() {
        assert_eq!(first_control_character("c-\u{0}31"), Some((2, '\0')));
        assert_eq!(first_control_character("é\t"), Some((2, '\t')));
        assert_eq!(first_control_character("del\u{7f}"), Some((3, '\u{7f}')));
        assert_eq!(first_control_character("c1\u{85}"), Some((2, '\u{85}')));
        for clean in ["", "ord-1", "sas.client.alice.é-1", "a b\u{a0}c"] {
            assert_eq!(first_control_character(clean), None, "{clean:?}");
        }
    }

    #[test]
    fn a_nul_in_the_attributes_is_found_by_its_pointer_and_other_control_characters_are_not() {
        let object = |value: serde_json::Value| match value {
            serde_json::Value::Object(map) => map,
            other => panic!("not an object: {other}"),
        };
        let nested = object(serde_json::json!({
            "note": "line\none",
            "address": { "lines": ["1 Main St", "flat\u{0}2"] }
        }));
        assert_eq!(first_nul(&nested).as_deref(), Some("/address/lines/1"));
        let key = object(serde_json::json!({ "a/b": { "x~\u{0}": 1 } }));
        assert_eq!(first_nul(&key).as_deref(), Some("/a~1b/x~0\\0"));
        let clean = object(serde_json::json!({ "note": "tab\there", "n": [1, null, true] }));
        assert_eq!(first_nul(&clean), None);
    }

    #[test]
    fn an_old_order_without_workflow_or_attributes_still_reads_and_writes_the_same() {
        let old = r#"{"schema_version":1,"order_id":"o","customer_id":"c","items":[{"sku":"s","quantity":1}],"amount_cents":1,"currency":"EUR"}"#;
        let order: SubmitOrder = serde_json::from_str(old).unwrap();
        assert_eq!(serde_json::to_string(&order).unwrap(), old);
    }
}
