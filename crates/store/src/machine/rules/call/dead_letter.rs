//! A step request or reply the broker dead-lettered.

use sas_messages::{AttemptId, StatusEvent};

use crate::machine::rules::{Draft, Failure};
use crate::machine::{AlertKind, HistoryEvent};
use crate::model::{ProcessState, StepState};

/// A message of the current attempt was dead-lettered: it would fail again,
/// so the order is not retried. A forward run is compensated (or stopped,
/// where the step says `on_failure = "stop"`), by a claim
/// once the step's undo may be sent ([`crate::machine::undo`]); a
/// compensation ends in error with an alert. A dead letter of an old
/// attempt changes nothing.
///
/// `no_call` says the message was a request its agent refused unread (it
/// could not be decoded or named no call the agent may make): the agent
/// made no call for this attempt, so the attempt applied nothing. Any other
/// dead letter (RabbitMQ's delivery limit: an agent may have died mid-call;
/// a reply that could not be read) leaves the attempt's outcome unknown.
///
/// A request of an action given up when compensation began (the order is
/// compensating, the step still running) settles that step the same way.
pub(in crate::machine::rules) fn dead_lettered(
    draft: &mut Draft<'_>,
    attempt_id: AttemptId,
    reason: &str,
    no_call: bool,
) {
    let state = draft.process.state;
    let current = |expected: StepState| {
        draft.steps.iter().position(|s| {
            s.attempt_id == Some(attempt_id) && s.state == expected && s.kind.calls_out()
        })
    };
    let (index, given_up) = match state {
        ProcessState::Compensating => match current(StepState::Compensating) {
            Some(index) => (index, false),
            None => match current(StepState::Running) {
                Some(index) => (index, true),
                None => {
                    return draft.unchanged("the dead letter is not of the step's current attempt")
                }
            },
        },
        _ => match current(StepState::Running) {
            Some(index) => (index, false),
            None => return draft.unchanged("the dead letter is not of the step's current attempt"),
        },
    };
    let name = draft.steps[index].name.clone();
    let why = format!("a message of step {name} was dead-lettered: {reason}");
    match state {
        ProcessState::Processing | ProcessState::Pending => {
            settle_action(draft, index, &why, no_call);
            if draft.steps[index].stops_on_failure() {
                return draft.stop_at(index, Some(attempt_id), &why);
            }
            draft.process.state = ProcessState::Compensating;
            draft.process.failure_count = 0;
            draft.process.last_error = Some(why.clone());
            draft.log(
                HistoryEvent::CompensationStarted,
                Some(&name),
                Some(attempt_id),
                Some(why.clone()),
            );
            draft.notify(StatusEvent::Compensating, Some(&name), Some(&why));
            draft.compensate_later();
        }
        ProcessState::Compensating if given_up && !no_call && draft.steps[index].maybe_applied => {
            // The same dead letter again (a supervisor redelivered it), or
            // another one of the attempt: nothing new to learn.
            draft.unchanged("the attempt is already counted as maybe applied");
        }
        ProcessState::Compensating if given_up => {
            settle_action(draft, index, &why, no_call);
            draft.log(
                HistoryEvent::LateAnswer,
                Some(&name),
                Some(attempt_id),
                Some(why.clone()),
            );
            if draft.process.locked_by.is_none() {
                draft.compensate_later();
            }
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

/// What a dead letter says of action `index`: refused unread (`no_call`),
/// it applied nothing this attempt, and the step failed (still to be
/// undone if an earlier attempt may have applied it); otherwise its outcome
/// is unknown, and it stays to be undone after its deadline and the grace.
fn settle_action(draft: &mut Draft<'_>, index: usize, why: &str, no_call: bool) {
    draft.change_step(index, |step| {
        step.last_error = Some(why.to_owned());
        if no_call {
            step.state = StepState::Failed;
        } else {
            step.maybe_applied = true;
        }
    });
}
