//! Wait steps: a step that calls no agent parks its order until an event
//! or a time (see [`crate::machine::park`]).
//!
//! Parked, an order is `pending`, held by nobody, with no deadline: the
//! supervisor does not look at it, and no slot of any agent is held. Its
//! `not_before` is when it must look again (a delay's end, an event's
//! timeout), and a claim then wakes it. An event for it wakes it at once.

use sas_messages::StatusEvent;

use super::{Draft, Failure};
use crate::machine::call::context_of;
use crate::machine::dispatch::payload;
use crate::machine::park::{OnTimeout, Park, WaitKey};
use crate::machine::{AlertKind, HistoryEvent};
use crate::model::{ProcessState, StepState};

/// The step the order waits at ([`crate::machine::park::parked_at`]).
pub(super) fn parked_step(draft: &Draft<'_>) -> Option<usize> {
    crate::machine::park::parked_at(draft.process.state, &draft.steps)
}

/// The order reaches wait step `index`: an event it waits for that is in
/// the mailbox already is used at once (it arrived early), a delay already
/// over ends at once; otherwise the order parks.
pub(super) fn start(draft: &mut Draft<'_>, index: usize) {
    let now = draft.ctx.now;
    let Some(park) = draft.steps[index].park.clone() else {
        return;
    };
    let (until, detail) = match &park {
        Park::Event {
            event,
            correlation_key,
            ..
        } => {
            if let Some(found) = usable_event(draft, &park) {
                let (data, id) = (found.data.clone(), found.event_id.clone());
                let detail = format!("event {event} ({id}){} was in the mailbox", from(found));
                return end_wait(draft, index, data, Some(id), &detail);
            }
            let timeout = chrono::Duration::milliseconds(i64::from(draft.steps[index].timeout_ms));
            let until = crate::machine::to_micros(now + timeout);
            let mut detail = format!("waiting for event {event} until {until}");
            if let Some(pointer) = correlation_key {
                // Qualified by the order's tenant, as the events of its
                // senders are: a key reaches only its own tenant's orders.
                let tenant = draft.snapshot.order_id.tenant();
                match read_key(draft, pointer)
                    .map(|key| sas_messages::ids::qualified_key(&key, tenant))
                {
                    Some(key) => {
                        detail.push_str(&format!(", or for key {key}"));
                        draft.wait_key = Some(WaitKey {
                            step: draft.steps[index].name.clone(),
                            key,
                        });
                    }
                    None => detail.push_str(&format!(
                        " (no correlation key at {pointer}: events must name the order)"
                    )),
                }
            }
            (until, detail)
        }
        Park::Delay { .. } => {
            let until = crate::machine::to_micros(park.delay_end(&draft.snapshot.body, now));
            if until <= now {
                let result = serde_json::json!({ "waited_until": until });
                return end_wait(draft, index, result, None, "the delay was already over");
            }
            (until, format!("waiting until {until}"))
        }
        // Started by the child rules (see `Draft::start_attempt`).
        Park::Child { .. } => {
            return super::child::start(draft, index, sas_messages::StepKind::Action)
        }
    };
    let attempt_id = draft.park_at(index, StepState::Running, ProcessState::Pending, until);
    let name = draft.steps[index].name.clone();
    draft.log(
        HistoryEvent::Waiting,
        Some(&name),
        Some(attempt_id),
        Some(detail.clone()),
    );
    draft.notify(StatusEvent::Waiting, Some(&name), Some(&detail));
}

/// A claim of a parked order, due: its delay is over, or its event did not
/// come in time and the step's `on_timeout` says what follows.
pub(super) fn wake(draft: &mut Draft<'_>, index: usize) {
    let step = &draft.steps[index];
    let until = step.complete_by.unwrap_or(draft.ctx.now);
    match step.park.clone() {
        Some(Park::Delay { .. }) => {
            let result = serde_json::json!({ "waited_until": until });
            end_wait(draft, index, result, None, "the delay is over");
        }
        Some(Park::Event {
            event, on_timeout, ..
        }) => {
            let name = step.name.clone();
            let why = format!("no event {event} came by {until}");
            draft.log(
                HistoryEvent::WaitTimedOut,
                Some(&name),
                None,
                Some(why.clone()),
            );
            match on_timeout {
                OnTimeout::Continue => {
                    let result = serde_json::json!({ "timed_out": true });
                    end_wait(draft, index, result, None, "went on without it");
                }
                OnTimeout::Compensate => {
                    fail_step(draft, index, &why);
                    draft.start_compensation(Some(&name), None, &why);
                    draft.advance();
                }
                OnTimeout::Fail => {
                    fail_step(draft, index, &why);
                    let message = format!(
                        "order {}: {why}; its workflow says to stop here, nothing was undone: resume it to wait again (sasctl resume), or cancel it to undo it",
                        draft.snapshot.order_id
                    );
                    draft.fail(Failure {
                        step: Some(&name),
                        attempt_id: None,
                        kind: AlertKind::WaitTimedOut,
                        detail: why.clone(),
                        last_error: &why,
                        message: &message,
                    });
                }
            }
        }
        Some(Park::Child { .. }) => super::child::timed_out(draft, index),
        None => {}
    }
}

/// An event arrived: the order, if it waits for it, goes on with the event
/// as the step's result; otherwise the event stays in the mailbox.
pub(super) fn event_arrived(draft: &mut Draft<'_>) {
    let Some(index) = parked_step(draft) else {
        return draft.unchanged("the order waits for no event now; the event stays in its mailbox");
    };
    let Some(park) = draft.steps[index].park.clone() else {
        return draft.unchanged("the order waits for no event now; the event stays in its mailbox");
    };
    let Park::Event { event, .. } = &park else {
        return draft.unchanged("the order waits for a time or a child order, not an event");
    };
    let event = event.clone();
    let Some(found) = usable_event(draft, &park) else {
        return draft.unchanged("the order waits for another event (or one from an allowed sender); this one stays in its mailbox");
    };
    let (data, id) = (found.data.clone(), found.event_id.clone());
    let detail = format!("event {event} ({id}){}", from(found));
    end_wait(draft, index, data, Some(id), &detail);
}

/// The first event in the mailbox that wait `park` waits for and accepts
/// from its sender (an event from a sender the wait does not accept stays
/// unused: the scheduler refuses such events as they come, and this holds
/// for one kept before the order existed).
fn usable_event<'d>(
    draft: &'d Draft<'_>,
    park: &Park,
) -> Option<&'d crate::machine::park::MailboxEvent> {
    let Park::Event { event, .. } = park else {
        return None;
    };
    let tenant = draft.snapshot.order_id.tenant();
    draft
        .snapshot
        .mailbox
        .iter()
        .find(|e| &e.name == event && park.accepts(&e.principals, tenant))
}

/// `" from <sender>"` for a mailbox event whose sender is known: the
/// history names who ended each wait.
fn from(event: &crate::machine::park::MailboxEvent) -> String {
    event
        .sender
        .as_ref()
        .map(|sender| format!(" from {sender}"))
        .unwrap_or_default()
}

/// Ends every wait in progress (an operator cancelled the order): the step
/// fails, with `why`.
pub(super) fn end_waits(draft: &mut Draft<'_>, why: &str) {
    for index in 0..draft.steps.len() {
        let step = &draft.steps[index];
        if step.kind().ends_on_cancel() && step.state == StepState::Running {
            fail_step(draft, index, why);
        }
    }
}

/// Wait step `index` is done with `result` (an event's data, or what the
/// wait saw), using mailbox event `used` if any: the order runs on.
fn end_wait(
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

/// The correlation key `pointer` reads from the order, its attributes and
/// the results so far: a string as it is, a number or boolean as its text;
/// nothing for a missing, empty or structured value, or one too long for an
/// event to name.
fn read_key(draft: &Draft<'_>, pointer: &str) -> Option<String> {
    let results = draft
        .steps
        .iter()
        .filter_map(|s| s.result.as_ref().map(|r| (s.name.as_str(), r)));
    let context = context_of(&payload(&draft.snapshot.body, results));
    let key = match context.pointer(pointer)? {
        serde_json::Value::String(text) => text.clone(),
        value @ (serde_json::Value::Number(_) | serde_json::Value::Bool(_)) => value.to_string(),
        _ => return None,
    };
    let fits = (1..=sas_messages::event::MAX_CORRELATION_KEY_LEN).contains(&key.len());
    (fits && !key.chars().any(char::is_control)).then_some(key)
}

/// Wait step `index` ends without what it waited for.
fn fail_step(draft: &mut Draft<'_>, index: usize, why: &str) {
    draft.change_step(index, |step| {
        step.state = StepState::Failed;
        step.last_error = Some(why.to_owned());
    });
}
