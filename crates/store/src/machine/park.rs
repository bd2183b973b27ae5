//! Steps that call no agent: a wait for an event from the outside world,
//! or for a time. Such a step parks its order: pending, held by nobody, its
//! `not_before` the moment it must look again (the event's timeout, or the
//! end of the delay). The claims wake it then, from the index on
//! `not_before`, with no poll of each order; an event wakes it at once.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::StepRow;
use crate::model::{ProcessState, StepState};

/// What a parked step waits for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Park {
    /// An [`sas_messages::OrderEvent`] named `event`, for at most the
    /// step's timeout.
    Event {
        /// The event's name.
        event: String,
        /// What a timeout means.
        on_timeout: OnTimeout,
        /// A JSON pointer into `{order, attributes, results}` giving the
        /// business key that events may name instead of the order id
        /// (`/results/charge_payment/payment_id`), read when the order
        /// reaches the wait.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        correlation_key: Option<String>,
        /// Who may send the event (see [`Park::accepts`]); empty: whoever
        /// may address the order (its tenant's clients and operators).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        senders: Vec<String>,
    },
    /// A time: `delay_ms` after the previous step, and not before the time
    /// the order holds at `not_before` (a JSON pointer into the order, such
    /// as `/attributes/ship_after`), whichever is later.
    Delay {
        /// Milliseconds after the previous step.
        #[serde(default)]
        delay_ms: u64,
        /// A pointer to an RFC 3339 time in the order; a missing or
        /// unreadable value is no constraint.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        not_before: Option<String>,
    },
    /// An order of another workflow, started by this step (see
    /// [`crate::machine::child`]): the step waits for it to end, for at
    /// most the step's timeout, and takes its results.
    Child {
        /// The child's workflow.
        workflow: String,
        /// Its version, pinned when the parent was taken in (the plan the
        /// schedulers registered, `workflow_plans`).
        version: i32,
        /// The child's attributes: a template over `{order, attributes,
        /// results}` as a call's body is (absent: the parent's attributes).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        attributes: Option<serde_json::Value>,
    },
}

/// What a wait for an event that does not come within its timeout does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnTimeout {
    /// Undo the steps done, as for a step that failed for good.
    Compensate,
    /// End the order in error with an alert, undoing nothing.
    Fail,
    /// Go on to the next step, the wait's result `{"timed_out": true}`.
    Continue,
}

/// The business key an order parked at a wait can be found by: events
/// naming it (instead of the order id) go to the order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WaitKey {
    /// The wait step.
    pub step: String,
    /// The key, as its pointer read it from the order.
    pub key: String,
}

/// An event kept in an order's mailbox, not used yet.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MailboxEvent {
    /// The sender's id (one per order is used at most once).
    pub event_id: String,
    /// The event's name.
    pub name: String,
    /// What it says: the wait step's result.
    pub data: serde_json::Value,
    /// When it arrived.
    pub received_at: DateTime<Utc>,
    /// What its sender may be named by (its identity, `tenant:<t>`,
    /// `role:<r>`), as the scheduler resolved it on arrival.
    pub principals: Vec<String>,
    /// Who sent it (`gateway:manager`), when known.
    pub sender: Option<String>,
}

/// The step an order is parked at, if it is: a pending order whose first
/// step not completed is a wait or delay step that started. The one rule
/// the state machine and the console use (the store's lookup by
/// correlation key only preselects candidates with SQL; the machine then
/// decides for each).
pub fn parked_at(state: ProcessState, steps: &[StepRow]) -> Option<usize> {
    if state != ProcessState::Pending {
        return None;
    }
    let index = steps.iter().position(|s| s.state != StepState::Completed)?;
    let step = &steps[index];
    (step.kind().parks() && step.state == StepState::Running).then_some(index)
}

impl Park {
    /// Whether a wait for an event accepts it from a sender named by
    /// `principals`, for an order of tenant `order_tenant`: yes when the
    /// wait names no senders, else when one of its `senders` is one of the
    /// principals. `"tenant"` stands for the order's own tenant
    /// (`tenant:<order_tenant>`); `"role:approver"`, `"gateway:manager"`,
    /// `"tenant:ops"` name themselves. A sender whose principals hold `*`
    /// (every sender, when tenancy is open) is accepted by every wait. A
    /// delay accepts no event.
    pub fn accepts(&self, principals: &[String], order_tenant: &str) -> bool {
        let Self::Event { senders, .. } = self else {
            return false;
        };
        senders.is_empty()
            || principals.iter().any(|p| p == "*")
            || senders.iter().any(|sender| {
                if sender == "tenant" {
                    let own = format!("tenant:{order_tenant}");
                    principals.contains(&own)
                } else {
                    principals.iter().any(|p| p == sender)
                }
            })
    }

    /// The senders a wait for an event names, for messages.
    pub fn senders(&self) -> &[String] {
        match self {
            Self::Event { senders, .. } => senders,
            Self::Delay { .. } | Self::Child { .. } => &[],
        }
    }

    /// When a delay started at `now` ends for an order whose body is `body`.
    pub fn delay_end(&self, body: &serde_json::Value, now: DateTime<Utc>) -> DateTime<Utc> {
        let Self::Delay {
            delay_ms,
            not_before,
        } = self
        else {
            return now;
        };
        let after =
            now + chrono::Duration::milliseconds(i64::try_from(*delay_ms).unwrap_or(i64::MAX / 2));
        let at = not_before
            .as_deref()
            .and_then(|pointer| body.pointer(pointer))
            .and_then(serde_json::Value::as_str)
            .and_then(|text| DateTime::parse_from_rfc3339(text).ok())
            .map(|at| at.with_timezone(&Utc));
        at.map_or(after, |at| at.max(after))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_wait_accepts_its_event_only_from_the_senders_it_names() {
        let wait = |senders: &[&str]| Park::Event {
            event: "approved".into(),
            on_timeout: OnTimeout::Compensate,
            correlation_key: None,
            senders: senders.iter().map(|s| (*s).to_owned()).collect(),
        };
        let shop = ["gateway:shop".to_owned(), "tenant:shop".to_owned()];
        let manager = ["gateway:manager".to_owned(), "role:approver".to_owned()];
        assert!(wait(&[]).accepts(&shop, "shop"), "no senders: anyone");
        assert!(wait(&[]).accepts(&[], "shop"));
        let approvers = wait(&["role:approver"]);
        assert!(!approvers.accepts(&shop, "shop"), "the customer itself");
        assert!(approvers.accepts(&manager, "shop"));
        let own = wait(&["tenant"]);
        assert!(own.accepts(&shop, "shop"));
        assert!(!own.accepts(&shop, "rival"), "another tenant's order");
        assert!(wait(&["gateway:manager"]).accepts(&manager, "shop"));
        assert!(approvers.accepts(&["amqp:x".to_owned(), "*".to_owned()], "default"));
        let delay = Park::Delay {
            delay_ms: 1,
            not_before: None,
        };
        assert!(!delay.accepts(&shop, "shop"));
    }

    #[test]
    fn a_delay_ends_at_the_later_of_its_delay_and_the_order_s_time() {
        let now = DateTime::parse_from_rfc3339("2026-11-26T10:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let body = serde_json::json!({"attributes": {"ship_after": "2026-11-27T00:00:00Z", "bad": "soon"}});
        let delay = |ms, pointer: Option<&str>| Park::Delay {
            delay_ms: ms,
            not_before: pointer.map(str::to_owned),
        };
        assert_eq!(
            delay(1000, None).delay_end(&body, now),
            now + chrono::Duration::seconds(1)
        );
        assert_eq!(
            delay(1000, Some("/attributes/ship_after"))
                .delay_end(&body, now)
                .to_rfc3339(),
            "2026-11-27T00:00:00+00:00"
        );
        assert_eq!(delay(0, Some("/attributes/bad")).delay_end(&body, now), now);
    }
}
