//! An operator's resubmission or cancellation.

use sas_messages::StatusEvent;

use super::Draft;
use crate::machine::dispatch::resubmitted_key;
use crate::machine::{HistoryEvent, ResubmitAction, Verdict};
use crate::model::{ProcessState, StepState};

/// An operator put an order that ended `error` or `compensated` back: a
/// failed compensation resumes; otherwise the workflow restarts, every step
/// not completed with a fresh key (the old one is decided at the remote).
pub(super) fn resubmitted(draft: &mut Draft<'_>, earlier: i64) {
    let state = draft.process.state;
    if !matches!(state, ProcessState::Error | ProcessState::Compensated) {
        draft.verdict = Verdict::Refused(state);
        return;
    }
    let compensation_underway = draft
        .steps
        .iter()
        .any(|s| s.state == StepState::Compensating);
    let (reopened, action) = if state == ProcessState::Error && compensation_underway {
        for index in 0..draft.steps.len() {
            if draft.steps[index].undo_refused {
                draft.change_step(index, |step| {
                    step.undo_generation += 1;
                    step.undo_refused = false;
                });
            }
        }
        (
            ProcessState::Compensating,
            ResubmitAction::CompensationResumed,
        )
    } else {
        let order_id = draft.snapshot.order_id.clone();
        for index in 0..draft.steps.len() {
            if draft.steps[index].state != StepState::Completed {
                draft.change_step(index, |step| {
                    step.state = StepState::NotStarted;
                    step.attempt_id = None;
                    step.complete_by = None;
                    step.result = None;
                    step.last_error = None;
                    step.maybe_applied = false;
                    step.undo_generation = 0;
                    step.undo_refused = false;
                    step.undo_result = None;
                    step.idempotency_key = resubmitted_key(&order_id, &step.name, earlier + 1);
                });
            }
        }
        (ProcessState::Pending, ResubmitAction::WorkflowRestarted)
    };
    // Held by nobody: a scheduler claims it at its next claim, a resumed
    // compensation once its next undo may be sent.
    draft.process.state = reopened;
    draft.process.failure_count = 0;
    draft.resolve_alerts = true;
    draft.log(
        HistoryEvent::Resubmitted,
        None,
        None,
        Some(action.as_str().to_owned()),
    );
    if reopened == ProcessState::Compensating {
        draft.compensate_later();
    } else {
        draft.release_to_claim(draft.ctx.now);
    }
    draft.verdict = Verdict::Resubmitted(action);
}

/// An operator cancelled a running order: it is compensated, by a claim.
/// The undo of a step in flight waits for that attempt's deadline plus the
/// grace period ([`crate::machine::undo`]), so it never reaches the remote
/// service before the action it undoes.
pub(super) fn cancelled(draft: &mut Draft<'_>, reason: &str) {
    let state = draft.process.state;
    if !matches!(state, ProcessState::Pending | ProcessState::Processing) {
        draft.verdict = Verdict::Refused(state);
        return;
    }
    // A wait step has no call in flight: it ends here, and what was done
    // before it is undone at once.
    super::park::end_waits(draft, &format!("cancelled by {}", draft.ctx.actor));
    let why = format!("cancelled by {}: {reason}", draft.ctx.actor);
    draft.process.state = ProcessState::Compensating;
    draft.process.failure_count = 0;
    draft.process.last_error = Some(why.clone());
    draft.log(HistoryEvent::Cancelled, None, None, Some(why.clone()));
    draft.compensate_later();
    draft.notify(StatusEvent::Compensating, None, Some(&why));
}
