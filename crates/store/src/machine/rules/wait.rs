//! Wait steps: the order parks until an event it waits for comes (by its
//! id, or by a business key the step reads), or until the step's timeout,
//! and `on_timeout` says what follows then (see
//! [`crate::machine::kind::WaitStep`]). What every parked kind shares is
//! in [`super::park`].

use super::park::{end_wait, fail_step, park};
use super::{Draft, Failure};
use crate::machine::call::context_of;
use crate::machine::dispatch::payload;
use crate::machine::kind::{Kind, WaitStep};
use crate::machine::park::{MailboxEvent, OnTimeout, WaitKey};
use crate::machine::{AlertKind, HistoryEvent};

/// The order reaches wait step `index` (`wait`): an event it waits for that is in
/// the mailbox already is used at once (it arrived early); otherwise the
/// order parks until the step's timeout, waiting with its business key if
/// the step reads one.
pub(super) fn start(draft: &mut Draft<'_>, index: usize, wait: &WaitStep) {
    let WaitStep {
        event,
        correlation_key,
        ..
    } = wait;
    if let Some(found) = usable_event(draft, wait) {
        let (data, id) = (found.data.clone(), found.event_id.clone());
        let detail = format!("event {event} ({id}){} was in the mailbox", from(found));
        return end_wait(draft, index, data, Some(id), &detail);
    }
    let timeout = chrono::Duration::milliseconds(i64::from(draft.steps[index].timeout_ms));
    let until = crate::machine::to_micros(draft.ctx.now + timeout);
    let mut detail = format!("waiting for event {event} until {until}");
    if let Some(pointer) = correlation_key {
        // Qualified by the order's tenant, as the events of its senders
        // are: a key reaches only its own tenant's orders.
        let tenant = draft.snapshot.order_id.tenant();
        match read_key(draft, pointer).map(|key| sas_messages::ids::qualified_key(&key, tenant)) {
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
    park(draft, index, until, &detail);
}

/// A claim of an order parked at wait step `index` (`wait`), due: its
/// event did not come in time, and the step's `on_timeout` says what
/// follows.
pub(super) fn timed_out(draft: &mut Draft<'_>, index: usize, wait: &WaitStep) {
    let step = &draft.steps[index];
    let until = step.complete_by.unwrap_or(draft.ctx.now);
    let WaitStep {
        event, on_timeout, ..
    } = wait;
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

/// An event arrived: the order, if it waits for it, goes on with the event
/// as the step's result; otherwise the event stays in the mailbox.
pub(super) fn event_arrived(draft: &mut Draft<'_>) {
    let Some(index) = super::park::parked_step(draft) else {
        return draft.unchanged("the order waits for no event now; the event stays in its mailbox");
    };
    let wait = match &draft.steps[index].kind {
        Kind::Wait(wait) => wait.clone(),
        Kind::Delay(_) | Kind::Child(_) | Kind::Call(_) => {
            return draft.unchanged("the order waits for a time or a child order, not an event");
        }
    };
    let event = wait.event.clone();
    let Some(found) = usable_event(draft, &wait) else {
        return draft.unchanged("the order waits for another event (or one from an allowed sender); this one stays in its mailbox");
    };
    let (data, id) = (found.data.clone(), found.event_id.clone());
    let detail = format!("event {event} ({id}){}", from(found));
    end_wait(draft, index, data, Some(id), &detail);
}

/// The first event in the mailbox that `wait` waits for and accepts
/// from its sender (an event from a sender the wait does not accept stays
/// unused: the scheduler refuses such events as they come, and this holds
/// for one kept before the order existed).
fn usable_event<'d>(draft: &'d Draft<'_>, wait: &WaitStep) -> Option<&'d MailboxEvent> {
    let tenant = draft.snapshot.order_id.tenant();
    draft
        .snapshot
        .mailbox
        .iter()
        .find(|e| e.name == wait.event && wait.accepts(&e.principals, tenant))
}

/// `" from <sender>"` for a mailbox event whose sender is known: the
/// history names who ended each wait.
fn from(event: &MailboxEvent) -> String {
    event
        .sender
        .as_ref()
        .map(|sender| format!(" from {sender}"))
        .unwrap_or_default()
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
