//! The typed names the state machine writes: history events and alert kinds.
//!
//! Both are stored as text (`history.event`, `alerts.kind`) under the names
//! they always had, so databases written by earlier versions read back
//! unchanged; [`std::str::FromStr`] refuses a name this version does not know.

use std::fmt;
use std::str::FromStr;

use serde::Serialize;

/// Declares a text-backed enum: its variants, their stored names, `as_str`,
/// `Display`, `FromStr` and `TryFrom<String>` (for sqlx's `try_from`).
macro_rules! stored_names {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($(#[$vmeta])* $variant,)+
        }

        impl $name {
            /// Every value, in declaration order.
            pub const ALL: &'static [Self] = &[$(Self::$variant,)+];

            /// The name stored in the database.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Self::$variant => $text,)+
                }
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl FromStr for $name {
            type Err = String;

            fn from_str(text: &str) -> Result<Self, Self::Err> {
                Self::ALL
                    .iter()
                    .copied()
                    .find(|value| value.as_str() == text)
                    .ok_or_else(|| {
                        let known: Vec<&str> = Self::ALL.iter().map(|v| v.as_str()).collect();
                        format!(
                            "unknown {} {text:?}: this version knows {}",
                            stringify!($name),
                            known.join(", ")
                        )
                    })
            }
        }

        impl TryFrom<String> for $name {
            type Error = String;

            fn try_from(text: String) -> Result<Self, String> {
                text.parse()
            }
        }
    };
}

stored_names! {
    /// One line of an order's history: what was decided.
    HistoryEvent {
        /// The order was stored.
        Received = "received",
        /// A scheduler took a pending order, or a compensation nobody held.
        Claimed = "claimed",
        /// An attempt of a step's action was started.
        Dispatched = "dispatched",
        /// An attempt of a step's compensation was started.
        CompensationDispatched = "compensation_dispatched",
        /// A step's action succeeded.
        StepCompleted = "step_completed",
        /// A step's compensation succeeded.
        StepCompensated = "step_compensated",
        /// A reply for an attempt that is not current was ignored.
        StaleReply = "stale_reply",
        /// An agent reported a transient failure; the supervisor decides next.
        TransientFailure = "transient_failure",
        /// The order started undoing its steps.
        CompensationStarted = "compensation_started",
        /// The next undo waits: its step's action may still land until its
        /// attempt's deadline plus the grace period (see
        /// [`crate::machine::undo`]). The order is held by nobody until then.
        UndoWaits = "undo_waits",
        /// An answer to an action given up when compensation began: what it
        /// says of the action is kept (a refusal or a call never made leaves
        /// nothing to undo; an outcome still unknown stays to be undone).
        /// A late success is recorded as `step_completed`.
        LateAnswer = "late_answer",
        /// A step missed its deadline and will be retried after a backoff.
        RetryScheduled = "retry_scheduled",
        /// A compensation missed its deadline and will be retried after a backoff.
        CompensationRetryScheduled = "compensation_retry_scheduled",
        /// The order could neither finish nor be undone; an alert was raised.
        Error = "error",
        /// Every step succeeded.
        Processed = "processed",
        /// Every step that had an effect was undone.
        Compensated = "compensated",
        /// An operator put the order back into the workflow.
        Resubmitted = "resubmitted",
        /// An operator resumed an order stopped in error from its failed step.
        Resumed = "resumed",
        /// An operator cancelled the order: what was done is undone.
        Cancelled = "cancelled",
        /// The step's agent had no free slot: the order waits in its line.
        Queued = "waiting_for_admission",
        /// An agent made no call for the attempt (its start-by passed while
        /// it waited): no failure; the order goes back to the agent's line.
        NotStarted = "not_started",
        /// An operator moved the waiting order to another version of its
        /// workflow.
        Moved = "moved",
        /// A wait step parked the order until an event or a time.
        Waiting = "waiting",
        /// A wait step's event or time came: the step is done.
        WaitEnded = "wait_ended",
        /// A wait step's event did not come within its timeout.
        WaitTimedOut = "wait_timed_out",
        /// A child step started its child order, and the order waits for it.
        ChildStarted = "child_started",
        /// A child step's child order ended: the step takes its results,
        /// or fails (the child undid itself), or is undone (the child was
        /// undone for its parent).
        ChildEnded = "child_ended",
        /// A child step's child order is asked to undo itself as a whole
        /// (the parent is undone): cancelled while it runs, compensated
        /// once processed.
        ChildUndoRequested = "child_undo_requested",
        /// A child step's child order stopped in `error` (it waits for an
        /// operator): the order goes on waiting for it, and says so.
        ChildStopped = "child_stopped",
        /// An order started by a parent's child step is undone because its
        /// parent is: cancelled, or compensated after it was processed.
        UndoneForParent = "undone_for_parent",
        /// An event came from a sender the order's wait for it does not
        /// accept: refused, not kept. Written by the store's event
        /// delivery, not by the state machine.
        EventRefused = "event_refused",
        /// An operator acknowledged an alert about the order (someone is on it).
        /// Written by the store's operator actions, not by the state machine:
        /// it changes nothing about the order's run.
        AlertAcknowledged = "alert_acknowledged",
        /// An operator resolved an alert about the order, with a note.
        AlertResolved = "alert_resolved",
        /// An operator replayed a dead letter of the order to its source queue.
        DeadLetterReplayed = "dead_letter_replayed",
        /// An operator discarded a dead letter of the order.
        DeadLetterDiscarded = "dead_letter_discarded",
    }
}

stored_names! {
    /// Why an operator alert was raised.
    AlertKind {
        /// A compensation was refused for good by the remote service.
        CompensationFailed = "compensation_failed",
        /// A compensation kept missing its deadline past `max_failures`.
        CompensationExhausted = "compensation_exhausted",
        /// A compensation's message was dead-lettered.
        CompensationDeadLettered = "compensation_dead_lettered",
        /// A wait step whose timeout means failure saw no event in time.
        WaitTimedOut = "wait_timed_out",
        /// A step's request could not be built (a template placeholder that
        /// finds no value, a request over the message limit): nothing was
        /// sent.
        RequestNotBuilt = "request_not_built",
        /// A step failed for good and its workflow says to stop there
        /// (`on_failure = "stop"`): nothing was undone.
        StepFailed = "step_failed",
        /// Orders a scheduler acknowledged are not in the database it
        /// reaches after losing its connections: the primary it reaches now
        /// does not hold commits an earlier one acknowledged (a failover
        /// that lost them).
        OrdersLost = "orders_lost",
    }
}

/// What an operator's resubmission will do, decided from the order's steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ResubmitAction {
    /// A compensation that failed resumes where it stopped.
    CompensationResumed,
    /// The workflow runs again, with fresh idempotency keys for the steps
    /// that did not complete.
    WorkflowRestarted,
}

impl ResubmitAction {
    /// How the history and the CLI say it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::CompensationResumed => "compensation resumed",
            Self::WorkflowRestarted => "workflow restarted",
        }
    }
}

impl fmt::Display for ResubmitAction {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stored_name_reads_back_as_itself() {
        for event in HistoryEvent::ALL {
            assert_eq!(event.as_str().parse::<HistoryEvent>(), Ok(*event));
        }
        for kind in AlertKind::ALL {
            assert_eq!(kind.as_str().parse::<AlertKind>(), Ok(*kind));
        }
    }

    #[test]
    fn an_unknown_name_is_refused_with_the_known_ones() {
        let error = "shipped".parse::<HistoryEvent>().unwrap_err();
        assert!(
            error.contains("shipped") && error.contains("stale_reply"),
            "{error}"
        );
    }
}
