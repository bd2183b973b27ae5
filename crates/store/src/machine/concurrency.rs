//! Concurrency limits by key: a call step may declare that at most `limit`
//! of its attempts are in flight at once for each value of a key (a
//! merchant's API that takes five calls at a time), across every scheduler
//! and agent.
//!
//! - The key is a JSON pointer into what a template reads
//!   (`/attributes/merchant_id`; see [`super::call`]), and each value is a
//!   line of its own, named `<agent>:<value>`; or a fixed name
//!   (`partner_api`), one line shared by every step of every workflow that
//!   names it. An order whose pointer finds no value (or one that is not a
//!   string, number or boolean, or is longer than [`MAX_KEY_LEN`]) takes
//!   the declared `default`, or [`DEFAULT_KEY`].
//! - An attempt holds its key while it is in flight, exactly as it holds
//!   its agent's slot ([`super::admission::slots_held`]): the store counts
//!   a key's attempts from the steps themselves (`steps.limit_key`), so a
//!   slot is given back by whatever ends the attempt (a reply, a missed
//!   deadline, a dead letter, a cancel) and none can leak. A key with
//!   nothing in flight and nobody waiting has no state at all.
//! - An attempt whose key is full is not started: its order waits in the
//!   key's line (`order_process.waiting_key`), held by nobody and with no
//!   deadline, so waiting never fails and never burns a retry, placed by
//!   priority and waiting time as in an agent's line (undo first).
//!
//! This module decides which line a step's attempt belongs to and whether
//! a key has room; the store counts and locks (`crate::writes::apply`,
//! `crate::writes::progress`).

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The key value of an order whose key pointer finds none, when the step
/// declares no `default`.
pub const DEFAULT_KEY: &str = "none";

/// The longest key value taken from an order; a longer one takes the
/// default, so that one order cannot make an unbounded line name.
pub const MAX_KEY_LEN: usize = 200;

/// The most attempts a step may let run at once per key.
pub const MAX_LIMIT: i32 = 10_000;

/// The longest a remote's `Retry-After` pauses a key: a pause of a day
/// would hold the key's orders for a day (the longer ask is logged in the
/// order's history).
pub const LONGEST_KEY_PAUSE: std::time::Duration = std::time::Duration::from_secs(3600);

/// A key the remote asked to rest (a 429 with `Retry-After` for an attempt
/// in it): no attempt in it starts before `until`, and its orders wait in
/// its line meanwhile, keeping their places. Other keys go on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeyPause {
    /// The key line.
    pub key: String,
    /// No attempt in it starts before then (database clock).
    pub until: DateTime<Utc>,
}

/// A call step's concurrency limit, as its workflow declares it
/// (`concurrency = { key = "/attributes/merchant_id", limit = 5 }`); kept
/// with the order's plan, as its templates are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Concurrency {
    /// A JSON pointer (`/attributes/merchant_id`): one line per value and
    /// agent; or a fixed name (letters, digits, `_`, `-`): one line shared
    /// by every step naming it.
    pub key: String,
    /// The most attempts in flight at once per key, 1 to [`MAX_LIMIT`].
    pub limit: i32,
    /// The value an order without one takes ([`DEFAULT_KEY`] when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
}

impl Concurrency {
    /// Whether the key is a pointer into the order (one line per value),
    /// rather than a fixed name.
    pub fn is_pointer(&self) -> bool {
        self.key.starts_with('/')
    }

    /// The line an attempt of a step of `agent` joins, for an order whose
    /// template context (see [`super::call::context_of`]) is `context`.
    pub fn line(&self, agent: &str, context: &Value) -> String {
        if !self.is_pointer() {
            return self.key.clone();
        }
        let found = match context.pointer(&self.key) {
            Some(Value::String(text)) => Some(text.clone()),
            Some(value @ (Value::Number(_) | Value::Bool(_))) => Some(value.to_string()),
            _ => None,
        };
        let value = found
            .filter(|v| (1..=MAX_KEY_LEN).contains(&v.len()) && !v.chars().any(char::is_control))
            .or_else(|| self.default.clone())
            .unwrap_or_else(|| DEFAULT_KEY.to_owned());
        format!("{agent}:{value}")
    }

    /// Checks the declaration (the pointer's reach is the workflow's to
    /// check, as a template's is).
    ///
    /// # Errors
    /// What is wrong, naming the field.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=MAX_LIMIT).contains(&self.limit) {
            return Err(format!(
                "concurrency.limit must be between 1 and {MAX_LIMIT} (got {})",
                self.limit
            ));
        }
        let plain = |name: &str| {
            (1..=64).contains(&name.len())
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
        };
        if !self.is_pointer() && !plain(&self.key) {
            return Err(format!(
                "concurrency.key must be a JSON pointer (/attributes/merchant_id) or a name of 1 to 64 letters, digits, '_' or '-' (got {:?})",
                self.key
            ));
        }
        match &self.default {
            Some(_) if !self.is_pointer() => {
                Err("concurrency.default is for a key read from the order (a JSON pointer); a fixed name needs none".into())
            }
            Some(default) if !plain(default) => Err(format!(
                "concurrency.default must be 1 to 64 letters, digits, '_' or '-' (got {default:?})"
            )),
            _ => Ok(()),
        }
    }
}

/// Whether a key with `in_flight` attempts under `limit` has room for one
/// more: fewer in flight than the limit and, for new forward work, nobody
/// in its line (`first_in_line`: an undo, or an order taken from the
/// line, does not queue behind others). As an agent's
/// ([`super::admission::has_room`]), without urgent work passing a full
/// limit: a key's limit is the remote's, never exceeded.
pub fn key_has_room(in_flight: i64, limit: i32, waiting: bool, first_in_line: bool) -> bool {
    in_flight < i64::from(limit) && (!waiting || first_in_line)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn merchant(default: Option<&str>) -> Concurrency {
        Concurrency {
            key: "/attributes/merchant_id".into(),
            limit: 5,
            default: default.map(str::to_owned),
        }
    }

    #[test]
    fn a_pointer_key_makes_one_line_per_value_and_agent() {
        let context = json!({"attributes": {"merchant_id": "m-17", "n": 4}});
        assert_eq!(merchant(None).line("payment", &context), "payment:m-17");
        assert_eq!(merchant(None).line("refunds", &context), "refunds:m-17");
        let number = Concurrency {
            key: "/attributes/n".into(),
            ..merchant(None)
        };
        assert_eq!(number.line("payment", &context), "payment:4");
    }

    #[test]
    fn an_order_without_a_usable_value_takes_the_default() {
        let long = "x".repeat(MAX_KEY_LEN + 1);
        for context in [
            json!({"attributes": {}}),
            json!({"attributes": {"merchant_id": null}}),
            json!({"attributes": {"merchant_id": {"id": 1}}}),
            json!({"attributes": {"merchant_id": ""}}),
            json!({"attributes": {"merchant_id": "a\nb"}}),
            json!({"attributes": {"merchant_id": long}}),
        ] {
            assert_eq!(merchant(None).line("payment", &context), "payment:none");
            assert_eq!(
                merchant(Some("unknown")).line("payment", &context),
                "payment:unknown"
            );
        }
    }

    #[test]
    fn a_fixed_name_is_one_line_for_every_step_naming_it() {
        let fixed = Concurrency {
            key: "partner_api".into(),
            limit: 2,
            default: None,
        };
        assert_eq!(fixed.line("payment", &json!({})), "partner_api");
        assert_eq!(fixed.line("shipping", &json!({})), "partner_api");
        assert!(fixed.check().is_ok());
    }

    #[test]
    fn bad_declarations_are_refused_naming_the_field() {
        let cases = [
            (
                Concurrency {
                    limit: 0,
                    ..merchant(None)
                },
                "concurrency.limit",
            ),
            (
                Concurrency {
                    key: "partner api".into(),
                    ..merchant(None)
                },
                "concurrency.key",
            ),
            (
                Concurrency {
                    key: "partner".into(),
                    ..merchant(Some("x"))
                },
                "concurrency.default is for",
            ),
            (merchant(Some("a b")), "concurrency.default must"),
        ];
        for (declared, said) in cases {
            let error = declared.check().expect_err(said);
            assert!(error.starts_with(said), "{error}");
        }
        assert!(merchant(Some("unknown")).check().is_ok());
    }

    #[test]
    fn a_key_has_room_under_its_limit_and_behind_its_line() {
        assert!(key_has_room(4, 5, false, false));
        assert!(!key_has_room(5, 5, false, true), "never past the limit");
        assert!(!key_has_room(1, 5, true, false), "new work queues behind");
        assert!(key_has_room(1, 5, true, true), "the line's head goes");
    }
}
