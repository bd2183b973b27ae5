//! Limits by key: a call step may declare that at most `limit` of its
//! attempts are in flight at once for each value of a key (a merchant's
//! API that takes five calls at a time, [`Concurrency`]), and that at most
//! `per_second` of them start a second ([`Rate`]), across every scheduler
//! and agent.
//!
//! - The key is a JSON pointer into what a template reads
//!   (`/attributes/merchant_id`; see [`super::call`]), and each value is a
//!   line of its own, named `<agent>:<value>`; or a fixed name
//!   (`partner_api`), one line shared by every step of every workflow that
//!   names it. An order whose pointer finds no value (or one that is not a
//!   string, number or boolean, or is longer than [`MAX_KEY_LEN`]) takes
//!   the declared `default`, or [`DEFAULT_KEY`]. A step limited both ways
//!   names one key.
//! - An attempt holds its key while it is in flight: the store counts a
//!   key's attempts from the steps themselves (`steps.limit_key`), so a
//!   slot is given back by whatever ends the attempt (a reply, a missed
//!   deadline, a dead letter) and none can leak; one its order let go of
//!   while its call may still run (a cancel) holds it until its deadline
//!   plus the grace. A rate keeps one time per key (`key_rates`). A key
//!   with nothing in flight, nobody waiting and a quiet rate has no state
//!   that anything reads.
//! - An attempt whose key has no room is not started: its order waits in
//!   the key's line (`order_process.waiting_key`), held by nobody and with
//!   no deadline, so waiting never fails and never burns a retry, placed by
//!   priority and waiting time as in an agent's line (undo first).
//! - A remote's 429 with `Retry-After` for an attempt in a key pauses the
//!   key ([`KeyPause`]).
//!
//! This module decides which line a step's attempt belongs to and whether
//! a key has room; the store counts and locks (`crate::writes::key_room`,
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
    /// Whether each key learns its limit from its remote's answers, `limit`
    /// being the most it may learn (see [`super::key_learning`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub adaptive: bool,
}

impl Concurrency {
    /// Whether the key is a pointer into the order (one line per value),
    /// rather than a fixed name.
    pub fn is_pointer(&self) -> bool {
        is_pointer(&self.key)
    }

    /// The line an attempt of a step of `agent` joins, for an order whose
    /// template context (see [`super::call::context_of`]) is `context`.
    pub fn line(&self, agent: &str, context: &Value) -> String {
        line(&self.key, self.default.as_deref(), agent, context)
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
        check_key("concurrency", &self.key, self.default.as_deref())
    }
}

/// A call step's rate limit, as its workflow declares it
/// (`rate = { key = "/attributes/merchant_id", per_second = 20, burst = 40 }`):
/// at most `per_second` attempts start a second per key, on average, and
/// at most `burst` at once after a quiet spell (the generic cell rate
/// algorithm: each start moves the key's theoretical arrival time on by
/// `1 / per_second`; a start may not put it more than `burst` starts
/// ahead of now).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Rate {
    /// As [`Concurrency::key`]; a step limited both ways names one key.
    pub key: String,
    /// Attempts started a second per key, 1 to [`MAX_LIMIT`].
    pub per_second: i32,
    /// Attempts that may start at once after a quiet spell (1 when absent).
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub burst: i32,
    /// As [`Concurrency::default`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub default: Option<String>,
}

fn one() -> i32 {
    1
}

#[allow(clippy::trivially_copy_pass_by_ref)] // serde's skip_serializing_if
fn is_one(n: &i32) -> bool {
    *n == 1
}

impl Rate {
    /// The line an attempt joins (see [`Concurrency::line`]).
    pub fn line(&self, agent: &str, context: &Value) -> String {
        line(&self.key, self.default.as_deref(), agent, context)
    }

    /// Checks the declaration.
    ///
    /// # Errors
    /// What is wrong, naming the field.
    pub fn check(&self) -> Result<(), String> {
        if !(1..=MAX_LIMIT).contains(&self.per_second) {
            return Err(format!(
                "rate.per_second must be between 1 and {MAX_LIMIT} (got {})",
                self.per_second
            ));
        }
        if !(1..=MAX_LIMIT).contains(&self.burst) {
            return Err(format!(
                "rate.burst must be between 1 and {MAX_LIMIT} (got {})",
                self.burst
            ));
        }
        check_key("rate", &self.key, self.default.as_deref())
    }

    /// The time one start moves the key on by (rounded up to the
    /// microsecond: never faster than declared).
    fn interval(&self) -> chrono::Duration {
        let per_second = i64::from(self.per_second.max(1));
        chrono::Duration::microseconds((1_000_000 + per_second - 1) / per_second)
    }

    /// How many attempts may start now in a key whose theoretical arrival
    /// time is `tat` (`None`: the key has been quiet).
    pub fn room(&self, tat: Option<DateTime<Utc>>, now: DateTime<Utc>) -> i64 {
        let Some(tat) = tat.filter(|tat| *tat > now) else {
            return i64::from(self.burst);
        };
        let ahead = (tat - now).num_microseconds().unwrap_or(i64::MAX);
        let interval = self.interval().num_microseconds().unwrap_or(1).max(1);
        // Each start already ahead of now uses one of the burst (rounded up).
        let used = ahead.div_euclid(interval) + i64::from(ahead % interval != 0);
        (i64::from(self.burst) - used).max(0)
    }

    /// The first instant a key whose theoretical arrival time is `tat` has
    /// room for a start ([`Rate::room`] 1 or more): once no more than
    /// `burst - 1` starts are ahead of it.
    pub fn next_room_at(&self, tat: DateTime<Utc>) -> DateTime<Utc> {
        tat - self.interval() * (self.burst.max(1) - 1)
    }

    /// The key's theoretical arrival time after one more start now.
    pub fn after_start(&self, tat: Option<DateTime<Utc>>, now: DateTime<Utc>) -> DateTime<Utc> {
        tat.filter(|tat| *tat > now).unwrap_or(now) + self.interval()
    }
}

/// The limits a key line holds a step's attempts to: in flight at once,
/// started a second, or both (one key).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyLimits<'a> {
    /// The most in flight at once (the ceiling of what an adaptive key
    /// learns).
    pub in_flight: Option<i32>,
    /// Whether the key learns its limit within `in_flight` (see
    /// [`super::key_learning`]).
    pub adaptive: bool,
    /// The rate of starts.
    pub rate: Option<&'a Rate>,
}

impl std::fmt::Display for KeyLimits<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let in_flight = self.in_flight.map(|limit| {
            if self.adaptive {
                format!("its learnt limit (at most {limit}) in flight")
            } else {
                format!("its limit of {limit} in flight")
            }
        });
        let rate = self
            .rate
            .map(|rate| format!("its rate of {}/s (burst {})", rate.per_second, rate.burst));
        match (in_flight, rate) {
            (Some(limit), None) => write!(f, "{limit}"),
            (None, Some(rate)) => write!(f, "{rate}"),
            (Some(limit), Some(rate)) => write!(f, "{limit} and {rate}"),
            (None, None) => write!(f, "no limit"),
        }
    }
}

impl super::call::StepCalls {
    /// The step's key limits, if its workflow declares any (one key, the
    /// workflow checks).
    pub fn key_limits(&self) -> Option<(KeyLimits<'_>, &str, Option<&str>)> {
        let limits = KeyLimits {
            in_flight: self.concurrency.as_ref().map(|c| c.limit),
            adaptive: self.concurrency.as_ref().is_some_and(|c| c.adaptive),
            rate: self.rate.as_ref(),
        };
        match (&self.concurrency, &self.rate) {
            (Some(c), _) => Some((limits, c.key.as_str(), c.default.as_deref())),
            (None, Some(r)) => Some((limits, r.key.as_str(), r.default.as_deref())),
            (None, None) => None,
        }
    }

    /// The line an attempt of the step, of `agent`, joins for `context`,
    /// with its limits.
    pub fn key_line(&self, agent: &str, context: &Value) -> Option<(String, KeyLimits<'_>)> {
        let (limits, key, default) = self.key_limits()?;
        Some((line(key, default, agent, context), limits))
    }
}

fn is_pointer(key: &str) -> bool {
    key.starts_with('/')
}

/// The line of key `key` (a pointer into `context`, with `default` for an
/// order without a value, or a fixed name) for an attempt of `agent`.
fn line(key: &str, default: Option<&str>, agent: &str, context: &Value) -> String {
    if !is_pointer(key) {
        return key.to_owned();
    }
    let found = match context.pointer(key) {
        Some(Value::String(text)) => Some(text.clone()),
        Some(value @ (Value::Number(_) | Value::Bool(_))) => Some(value.to_string()),
        _ => None,
    };
    let value = found
        .filter(|v| (1..=MAX_KEY_LEN).contains(&v.len()) && !v.chars().any(char::is_control))
        .or_else(|| default.map(str::to_owned))
        .unwrap_or_else(|| DEFAULT_KEY.to_owned());
    format!("{agent}:{value}")
}

/// Checks a declaration's `key` and `default` (`what`: the field's name).
fn check_key(what: &str, key: &str, default: Option<&str>) -> Result<(), String> {
    let plain = |name: &str| {
        (1..=64).contains(&name.len())
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
    };
    if !is_pointer(key) && !plain(key) {
        return Err(format!(
            "{what}.key must be a JSON pointer (/attributes/merchant_id) or a name of 1 to 64 letters, digits, '_' or '-' (got {key:?})"
        ));
    }
    match default {
        Some(_) if !is_pointer(key) => Err(format!(
            "{what}.default is for a key read from the order (a JSON pointer); a fixed name needs none"
        )),
        Some(default) if !plain(default) => Err(format!(
            "{what}.default must be 1 to 64 letters, digits, '_' or '-' (got {default:?})"
        )),
        _ => Ok(()),
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
            adaptive: false,
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
            adaptive: false,
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
    fn a_rate_lets_a_burst_start_then_one_start_per_interval() {
        let rate = Rate {
            key: "/attributes/merchant_id".into(),
            per_second: 10,
            burst: 3,
            default: None,
        };
        let t0 = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let ms = |n: i64| chrono::Duration::milliseconds(n);
        assert_eq!(rate.room(None, t0), 3, "a quiet key has its burst");
        let mut tat = None;
        for _ in 0..3 {
            assert!(rate.room(tat, t0) > 0);
            tat = Some(rate.after_start(tat, t0));
        }
        assert_eq!(tat, Some(t0 + ms(300)));
        assert_eq!(rate.room(tat, t0), 0, "the burst is spent");
        assert_eq!(rate.room(tat, t0 + ms(99)), 0);
        assert_eq!(
            rate.room(tat, t0 + ms(100)),
            1,
            "one interval later, one start"
        );
        assert_eq!(rate.room(tat, t0 + ms(250)), 2);
        assert_eq!(
            rate.room(tat, t0 + ms(10_000)),
            3,
            "never more than the burst"
        );
        // Sustained: 10 starts a second, whatever the burst.
        let mut tat = None;
        let mut started = 0;
        for tick in 0..=1000 {
            let now = t0 + ms(tick * 10);
            while rate.room(tat, now) > 0 {
                tat = Some(rate.after_start(tat, now));
                started += 1;
            }
        }
        assert_eq!(started, 3 + 100, "the burst, then 10 a second for 10 s");
        // The next room comes when one fewer than the burst is ahead.
        let tat = t0 + ms(450);
        let at = rate.next_room_at(tat);
        assert_eq!(at, t0 + ms(250));
        assert_eq!(rate.room(Some(tat), at), 1);
        assert_eq!(
            rate.room(Some(tat), at - chrono::Duration::microseconds(1)),
            0
        );
        let bad = Rate {
            per_second: 0,
            ..rate.clone()
        };
        assert!(bad.check().unwrap_err().starts_with("rate.per_second"));
        let bad = Rate { burst: 0, ..rate };
        assert!(bad.check().unwrap_err().starts_with("rate.burst"));
    }

    #[test]
    fn a_key_has_room_under_its_limit_and_behind_its_line() {
        assert!(key_has_room(4, 5, false, false));
        assert!(!key_has_room(5, 5, false, true), "never past the limit");
        assert!(!key_has_room(1, 5, true, false), "new work queues behind");
        assert!(key_has_room(1, 5, true, true), "the line's head goes");
    }
}
