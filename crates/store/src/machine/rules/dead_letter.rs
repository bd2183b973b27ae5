//! A step request or reply the broker dead-lettered.

use sas_messages::{AttemptId, StatusEvent};

use super::{Draft, Failure};
use crate::machine::{AlertKind, HistoryEvent, ProcessRow};
use crate::model::{ProcessState, StepState};

/// A message of the current attempt was dead-lettered: it would fail again,
/// so the order is not retried. A forward run is compensated; a compensation
/// ends in error with an alert. A dead letter of an old attempt changes nothing.
pub(super) fn dead_lettered(draft: &mut Draft<'_>, attempt_id: AttemptId, reason: &str) {
    let state = draft.process.state;
    let expected = if state == ProcessState::Compensating {
        StepState::Compensating
    } else {
        StepState::Running
    };
    let Some(index) = draft
        .steps
        .iter()
        .position(|s| s.attempt_id == Some(attempt_id) && s.state == expected && s.park.is_none())
    else {
        return draft.unchanged("the dead letter is not of the step's current attempt");
    };
    let name = draft.steps[index].name.clone();
    // Other members of a parallel group may be in flight: no undo before
    // their deadlines.
    let until = super::group::in_flight_until(draft, Some(index));
    let why = format!("a message of step {name} was dead-lettered: {reason}");
    match state {
        ProcessState::Processing | ProcessState::Pending => {
            draft.process = ProcessRow {
                state: ProcessState::Compensating,
                locked_by: None,
                complete_by: None,
                failure_count: 0,
                not_before: until.map_or(draft.ctx.now, |by| by.max(draft.ctx.now)),
                last_error: Some(why.clone()),
                waiting_for: None,
                admit_key: None,
            };
            draft.log(
                HistoryEvent::CompensationStarted,
                Some(&name),
                Some(attempt_id),
                Some(why.clone()),
            );
            draft.notify(StatusEvent::Compensating, Some(&name), Some(&why));
        }
        ProcessState::Compensating => {
            draft.fail(Failure {
                step: Some(&name),
                attempt_id: Some(attempt_id),
                kind: AlertKind::CompensationDeadLettered,
                detail: why.clone(),
                last_error: &why,
                message: &why,
            });
        }
        _ => draft.unchanged("the order is not running"),
    }
}
