//! Intake and claims: the order's next attempt starts, or it waits in
//! its agent's line.

use sas_messages::StatusEvent;

use super::Draft;
use crate::machine::HistoryEvent;
use crate::model::ProcessState;

/// Intake: the order is held by the intake scheduler and its first step
/// starts; or, stored not before a later time (its tenant's quota holds it
/// back), it is received and left pending for a claim at that time.
pub(super) fn submitted(draft: &mut Draft<'_>) {
    if draft.process.state != ProcessState::Pending || draft.steps.iter().any(|s| s.attempt > 0) {
        return draft.unchanged("the order was already taken in");
    }
    let by = draft
        .snapshot
        .submitted_by
        .as_ref()
        .map(|who| format!("submitted by {who}"));
    let held_until = draft.process.not_before;
    if held_until > draft.ctx.now {
        let until = held_until.format("%Y-%m-%dT%H:%M:%S%.3fZ");
        let detail = match by {
            Some(by) => format!("{by}; over its tenant's quota: starts at {until}"),
            None => format!("over its tenant's quota: starts at {until}"),
        };
        draft.log(HistoryEvent::Received, None, None, Some(detail));
        draft.notify(StatusEvent::Received, None, None);
        return;
    }
    draft.log(HistoryEvent::Received, None, None, by);
    draft.notify(StatusEvent::Received, None, None);
    draft.process.state = ProcessState::Processing;
    draft.advance();
}

/// A claim: a pending order runs forward again; a compensation nobody holds resumes.
pub(super) fn claimed(draft: &mut Draft<'_>) {
    let process = &draft.process;
    let claimable = match process.state {
        ProcessState::Pending => true,
        ProcessState::Compensating => process.locked_by.is_none(),
        _ => false,
    };
    if !claimable || process.not_before > draft.ctx.now {
        return draft.unchanged("the order is not ready to be claimed");
    }
    if let Some(index) = super::park::parked_step(draft) {
        return super::park::wake(draft, index);
    }
    draft.log(HistoryEvent::Claimed, None, None, None);
    draft.process.waiting_for = None;
    draft.process.waiting_key = None;
    draft.process.admit_key = None;
    if draft.process.state == ProcessState::Pending {
        draft.process.state = ProcessState::Processing;
    }
    draft.advance();
}
