//! Steps that call no agent: a wait for an event from the outside world,
//! or for a time. Such a step parks its order: pending, held by nobody, its
//! `not_before` the moment it must look again (the event's timeout, or the
//! end of the delay). The claims wake it then, from the index on
//! `not_before`, with no poll of each order; an event wakes it at once.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::StepRow;
use crate::model::{ProcessState, StepState};

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
    (step.kind.parks() && step.state == StepState::Running).then_some(index)
}
