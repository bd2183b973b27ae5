//! What the parked step kinds share: a wait ([`super::wait`]), a delay
//! ([`super::delay`]) and a child step ([`super::child`]) call no agent and
//! park their order until an event, a time, or the child's end (see
//! [`crate::machine::park`]).
//!
//! Parked, an order is `pending`, held by nobody, with no deadline: the
//! supervisor does not look at it, and no slot of any agent is held. Its
//! `not_before` is when it must look again (a delay's end, an event's
//! timeout, a child's), and a claim then wakes it. An event for it wakes it
//! at once.

use sas_messages::StatusEvent;

use super::Draft;
use crate::machine::kind::Kind;
use crate::machine::HistoryEvent;
use crate::model::{ProcessState, StepState};

/// The step the order waits at ([`crate::machine::park::parked_at`]).
pub(super) fn parked_step(draft: &Draft<'_>) -> Option<usize> {
    crate::machine::park::parked_at(draft.process.state, &draft.steps)
}

/// Parks the order at step `index` until `until`: pending, held by nobody,
/// its history and its client told what it waits for (`detail`).
pub(super) fn park(
    draft: &mut Draft<'_>,
    index: usize,
    until: chrono::DateTime<chrono::Utc>,
    detail: &str,
) {
    let attempt_id = draft.park_at(index, StepState::Running, ProcessState::Pending, until);
    let name = draft.steps[index].name.clone();
    draft.log(
        HistoryEvent::Waiting,
        Some(&name),
        Some(attempt_id),
        Some(detail.to_owned()),
    );
    draft.notify(StatusEvent::Waiting, Some(&name), Some(detail));
}

/// A claim of an order parked at step `index`, due: what its kind does when
/// its time comes (a delay is over, a wait or a child step timed out).
pub(super) fn wake(draft: &mut Draft<'_>, index: usize) {
    match &draft.steps[index].kind {
        Kind::Wait(wait) => super::wait::timed_out(draft, index, &wait.clone()),
        Kind::Delay(_) => super::delay::over(draft, index),
        Kind::Child(_) => super::child::timed_out(draft, index),
        // A call never parks its order.
        Kind::Call(_) => {}
    }
}

/// Ends every wait in progress (an operator cancelled the order): the step
/// fails, with `why`.
pub(super) fn end_waits(draft: &mut Draft<'_>, why: &str) {
    for index in 0..draft.steps.len() {
        let step = &draft.steps[index];
        if step.kind.ends_on_cancel() && step.state == StepState::Running {
            fail_step(draft, index, why);
        }
    }
}

/// Parked step `index` (a wait or a delay) is done with `result` (an event's data, or what the
/// wait saw), using mailbox event `used` if any: the order runs on.
pub(super) fn end_wait(
    draft: &mut Draft<'_>,
    index: usize,
    result: serde_json::Value,
    used: Option<String>,
    detail: &str,
) {
    let now = draft.ctx.now;
    draft.change_step(index, |step| {
        if step.state == StepState::NotStarted {
            step.attempt += 1;
        }
        step.state = StepState::Completed;
        step.result = Some(crate::machine::storable(&result));
        step.complete_by = Some(step.complete_by.unwrap_or(now));
    });
    draft.used_event = used;
    draft.process.state = ProcessState::Processing;
    draft.process.not_before = now;
    let name = draft.steps[index].name.clone();
    draft.log(
        HistoryEvent::WaitEnded,
        Some(&name),
        None,
        Some(detail.to_owned()),
    );
    draft.notify(StatusEvent::StepCompleted, Some(&name), None);
    draft.advance();
}

/// Parked step `index` ends without what it waited for.
pub(super) fn fail_step(draft: &mut Draft<'_>, index: usize, why: &str) {
    draft.change_step(index, |step| {
        step.state = StepState::Failed;
        step.last_error = Some(why.to_owned());
    });
}
