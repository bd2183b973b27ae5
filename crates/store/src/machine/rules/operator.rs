//! An operator's resubmission, resume or cancellation.

use sas_messages::StatusEvent;

use super::Draft;
use crate::machine::dispatch::resubmitted_key;
use crate::machine::{HistoryEvent, ResubmitAction, StepRow, Verdict};
use crate::model::{ProcessState, StepState};

/// Why the order may not be put back: a child its parent no longer waits
/// for ([`crate::machine::child::put_back_refusal`]).
fn orphaned(draft: &Draft<'_>) -> Option<String> {
    crate::machine::child::put_back_refusal(
        &draft.snapshot.order_id,
        draft.snapshot.parent.as_ref(),
    )
}

/// An operator put an order that ended `error` or `compensated` back: a
/// failed compensation resumes; otherwise the workflow restarts, every step
/// not completed with a fresh key (the old one is decided at the remote).
pub(super) fn resubmitted(draft: &mut Draft<'_>, earlier: i64) {
    if let Some(why) = orphaned(draft) {
        draft.verdict = Verdict::NotPutBack(why);
        return;
    }
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
            let step = &draft.steps[index];
            if step.state == StepState::Completed {
                continue;
            }
            // A step whose action may have applied and was never undone (an
            // order stopped by `on_failure = "stop"` after an unknown
            // outcome) keeps its key and stays to be undone: a fresh key
            // could apply it twice. One undone (compensated) starts afresh.
            if step.maybe_applied && step.state != StepState::Compensated {
                draft.change_step(index, |step| {
                    step.state = StepState::NotStarted;
                    step.attempt_id = None;
                    step.last_error = None;
                });
                continue;
            }
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

/// An operator resumed an order stopped in `error` from the step that
/// failed, once its cause is fixed: completed steps keep their results and
/// are not called again; the failed step starts again with its key kept
/// when an attempt's outcome is unknown (the remote may have applied it:
/// the same key lets it answer with what it did, never do it twice), and
/// with a fresh key when its remote refused (that key is decided there).
/// Refused, with the reason, where the order's compensation began: its
/// undo is in doubt, and running actions again on top of it could leave
/// effects nobody undoes (`resubmit` resumes the compensation instead).
pub(super) fn resumed(draft: &mut Draft<'_>, reason: &str, earlier: i64) {
    if let Some(why) = orphaned(draft) {
        draft.verdict = Verdict::NotPutBack(why);
        return;
    }
    let state = draft.process.state;
    if state != ProcessState::Error {
        draft.verdict = Verdict::Refused(state);
        return;
    }
    if let Some(step) = draft.steps.iter().find(|s| s.undo_began()) {
        draft.verdict = Verdict::NotResumable(format!(
            "its compensation began (step {} is {}{}): an action sent now could not be undone with certainty; resubmit it to finish the compensation, or fix the undo by hand",
            step.name,
            step.state,
            if step.undo_refused { ", its undo refused" } else { "" }
        ));
        return;
    }
    let Some(from) = draft
        .steps
        .iter()
        .position(|s| s.state != StepState::Completed)
    else {
        draft.verdict = Verdict::NotResumable("every step completed: nothing to resume".into());
        return;
    };
    let order_id = draft.snapshot.order_id.clone();
    let name = draft.steps[from].name.clone();
    let key_kept = draft.steps[from].maybe_applied;
    for index in from..draft.steps.len() {
        let step = &draft.steps[index];
        if !matches!(step.state, StepState::Failed | StepState::Running) {
            continue;
        }
        let fresh =
            (!step.maybe_applied).then(|| resubmitted_key(&order_id, &step.name, earlier + 1));
        draft.change_step(index, |step| {
            step.state = StepState::NotStarted;
            step.attempt_id = None;
            step.last_error = None;
            // maybe_applied stays, and the deadline of the attempt that may
            // have applied: a compensation after the resume still undoes
            // it, and not before that attempt could land.
            if let Some(key) = fresh {
                step.idempotency_key = key;
                step.complete_by = None;
            }
        });
    }
    let key = if key_kept {
        "its key kept (an earlier attempt's outcome is unknown: the remote answers it once)"
    } else {
        "a fresh key (no attempt of it may have applied)"
    };
    draft.process.state = ProcessState::Pending;
    draft.process.failure_count = 0;
    draft.process.last_error = None;
    draft.resolve_alerts = true;
    draft.log(
        HistoryEvent::Resumed,
        Some(&name),
        None,
        Some(format!(
            "resumed by {} from step {name}, with {key}: {reason}",
            draft.ctx.actor
        )),
    );
    draft.release_to_claim(draft.ctx.now);
    draft.verdict = Verdict::Resumed {
        from: name,
        key_kept,
    };
}

/// An operator cancelled a running order, or one stopped in error before
/// any undo began: it is compensated, by a claim. The undo of a step in flight waits for that attempt's deadline plus the
/// grace period ([`crate::machine::undo`]), so it never reaches the remote
/// service before the action it undoes.
pub(super) fn cancelled(draft: &mut Draft<'_>, reason: &str) {
    let state = draft.process.state;
    // An order stopped in error before any undo began (a step that says
    // `on_failure = "stop"`, a wait that says `on_timeout = "fail"`) may be
    // cancelled too: that is how its operator has it undone.
    let stopped = state == ProcessState::Error && !draft.steps.iter().any(StepRow::undo_began);
    if !(stopped || matches!(state, ProcessState::Pending | ProcessState::Processing)) {
        draft.verdict = Verdict::Refused(state);
        return;
    }
    if stopped {
        draft.resolve_alerts = true;
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
