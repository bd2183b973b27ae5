//! Strict decoding of message bodies.
//!
//! Every consumer decodes through [`decode`], so that every rejection has the
//! same shape of reason in its dead-letter header.

use serde::de::DeserializeOwned;

use crate::SCHEMA_VERSION;

/// Why bytes could not become a message. The text goes into the dead-letter
/// reason header, so it says what was wrong in terms a publisher can fix.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// Larger than the configured limit.
    #[error("message of {size} bytes exceeds the limit of {limit} bytes")]
    TooLarge {
        /// Size of the body.
        size: usize,
        /// Configured limit.
        limit: usize,
    },
    /// Not JSON at all.
    #[error("malformed JSON: {0}")]
    Malformed(String),
    /// JSON, but of another schema version.
    #[error("unsupported schema_version {found} (this system reads {SCHEMA_VERSION})")]
    WrongVersion {
        /// The version the message carried.
        found: String,
    },
    /// JSON of the right version, but not the expected shape (missing or unknown field, wrong type).
    #[error("invalid message: {0}")]
    Invalid(String),
}

/// Decodes `body` as a `T`, checking the size limit and `schema_version` first,
/// so that a message of a future version is reported as such rather than as
/// an unknown field.
///
/// # Errors
/// [`DecodeError`] saying what is wrong with the bytes.
pub fn decode<T: DeserializeOwned>(body: &[u8], limit: usize) -> Result<T, DecodeError> {
    if body.len() > limit {
        return Err(DecodeError::TooLarge {
            size: body.len(),
            limit,
        });
    }
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| DecodeError::Malformed(e.to_string()))?;
    match value.get("schema_version") {
        Some(serde_json::Value::Number(n)) if n.as_u64() == Some(u64::from(SCHEMA_VERSION)) => {}
        Some(other) => {
            return Err(DecodeError::WrongVersion {
                found: other.to_string(),
            })
        }
        None => {
            return Err(DecodeError::Invalid(
                "missing field `schema_version`".into(),
            ))
        }
    }
    serde_json::from_value(value).map_err(|e| DecodeError::Invalid(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{StepOutcome, StepReply, SubmitOrder};

    fn order_json() -> serde_json::Value {
        serde_json::to_value(crate::order::sample()).unwrap()
    }

    #[test]
    fn a_valid_order_decodes() {
        let body = serde_json::to_vec(&order_json()).unwrap();
        let order: SubmitOrder = decode(&body, 1 << 20).unwrap();
        assert_eq!(order.order_id, "ord-1");
    }

    #[test]
    fn malformed_bytes_are_reported_as_malformed() {
        let error = decode::<SubmitOrder>(b"{not json", 1024).unwrap_err();
        assert!(matches!(error, DecodeError::Malformed(_)), "{error}");
    }

    #[test]
    fn an_unknown_field_is_named_in_the_reason() {
        let mut value = order_json();
        value["colour"] = "red".into();
        let error = decode::<SubmitOrder>(&serde_json::to_vec(&value).unwrap(), 1024).unwrap_err();
        assert!(error.to_string().contains("colour"), "{error}");
    }

    #[test]
    fn a_future_schema_version_is_reported_as_such() {
        let mut value = order_json();
        value["schema_version"] = 7.into();
        let error = decode::<SubmitOrder>(&serde_json::to_vec(&value).unwrap(), 1024).unwrap_err();
        assert!(matches!(error, DecodeError::WrongVersion { .. }), "{error}");
    }

    #[test]
    fn an_oversized_body_is_refused_before_parsing() {
        let error = decode::<SubmitOrder>(&[b' '; 100], 10).unwrap_err();
        assert!(matches!(
            error,
            DecodeError::TooLarge {
                size: 100,
                limit: 10
            }
        ));
    }

    #[test]
    fn a_reply_round_trips_with_its_outcome_tagged() {
        let reply = StepReply {
            queued_ms: None,
            slot_wait_ms: None,
            retry_after_ms: None,
            call_ms: None,
            schema_version: SCHEMA_VERSION,
            order_id: "o".into(),
            step: "charge_payment".into(),
            attempt_id: uuid::Uuid::nil().into(),
            agent_id: "a".into(),
            outcome: StepOutcome::Failed {
                error: "declined".into(),
                permanent: true,
                maybe_applied: false,
            },
        };
        let body = serde_json::to_vec(&reply).unwrap();
        let text = String::from_utf8(body.clone()).unwrap();
        assert!(text.contains(r#""status":"failed""#), "{text}");
        assert_eq!(decode::<StepReply>(&body, 1024).unwrap(), reply);
    }
}
