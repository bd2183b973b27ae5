//! When a step may be undone: the one rule every road to compensation
//! follows.
//!
//! An undo must never reach a remote service before the action it undoes.
//! Whatever starts a compensation (a refusal, a missed deadline, an
//! operator's cancel or resumption, a dead letter, a parallel group's
//! member refused while others are in flight, a wait that timed out), the
//! undo of a step is sent no earlier than [`undo_not_before`] says:
//!
//! - at once when the outcome of the step's action is known: it completed
//!   (its answer came), or it was refused or never sent (nothing to undo,
//!   and [`crate::machine::StepRow::needs_undo`] leaves it out anyway);
//! - otherwise (an attempt in flight, one given up without an answer, one
//!   that failed after a call whose outcome is unknown) not before the
//!   attempt's `complete_by` plus the grace period: agents start no call
//!   after the attempt's start-by and abandon every call at its
//!   `complete_by`, and the grace covers what is still on the wire and the
//!   clocks' difference (see [`crate::timing`]).
//!
//! The rules call it through the draft: `advance` will not start an undo
//! before it (the order waits, held by nobody, until then), and every rule
//! that hands a compensation to a claim sets the order's `not_before` from
//! it. An answer of the action that arrives meanwhile settles the step,
//! and its undo may go at once.

use std::time::Duration;

use chrono::{DateTime, Utc};

use super::StepRow;
use crate::model::StepState;

/// The earliest moment the undo of `step` may be sent, given the
/// deployment's `grace` (`deadlines.grace_ms`): `None` when it may be sent
/// now, because no call of its action can still land.
pub fn undo_not_before(step: &StepRow, grace: Duration) -> Option<DateTime<Utc>> {
    let unsettled = match step.state {
        StepState::Running => step.kind.calls_out(),
        // A step an operator resumed or resubmitted keeps "maybe applied"
        // and the deadline of the attempt that may have applied.
        StepState::Failed | StepState::NotStarted => step.maybe_applied,
        StepState::Completed | StepState::Compensating | StepState::Compensated => false,
    };
    if !unsettled {
        return None;
    }
    let grace = chrono::Duration::from_std(grace).unwrap_or(chrono::Duration::MAX);
    step.complete_by
        .map(|by| super::to_micros(by.checked_add_signed(grace).unwrap_or(by)))
}

#[cfg(test)]
mod tests {
    use chrono::TimeZone;

    use super::*;
    use crate::machine::kind::{CallStep, Kind};
    use crate::model::NewStep;

    fn charge(state: StepState, maybe_applied: bool) -> StepRow {
        let definition = NewStep {
            name: "charge".into(),
            kind: Kind::Call(CallStep::new("payment", "charge", Some("refund"))),
            timeout: Duration::from_secs(5),
            group: None,
        };
        let mut step = StepRow::new("o-1", 1, &definition);
        step.state = state;
        step.maybe_applied = maybe_applied;
        step.complete_by = Some(Utc.timestamp_opt(1_800_000_000, 0).unwrap());
        step
    }

    #[test]
    fn an_action_whose_outcome_is_unknown_is_undone_only_after_its_deadline_and_the_grace() {
        let grace = Duration::from_secs(2);
        let deadline = Utc.timestamp_opt(1_800_000_000, 0).unwrap();
        let later = Some(deadline + chrono::Duration::seconds(2));
        assert_eq!(
            undo_not_before(&charge(StepState::Running, false), grace),
            later
        );
        assert_eq!(
            undo_not_before(&charge(StepState::Failed, true), grace),
            later
        );
    }

    #[test]
    fn an_action_whose_outcome_is_known_may_be_undone_at_once() {
        let grace = Duration::from_secs(2);
        for (state, maybe_applied) in [
            (StepState::Completed, true),
            (StepState::Failed, false),
            (StepState::Compensating, true),
            (StepState::NotStarted, false),
        ] {
            assert_eq!(
                undo_not_before(&charge(state, maybe_applied), grace),
                None,
                "{state:?}"
            );
        }
    }
}
