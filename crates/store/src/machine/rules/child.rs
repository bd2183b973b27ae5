//! Child steps (see [`crate::machine::child`]): the parent starts its
//! child and parks while it runs; goes on with its results, or undoes
//! itself when the child ended compensated; and, undone itself, has the
//! child undo itself as a whole and waits for that before going on.

use sas_messages::{StatusEvent, StepKind};

use super::{Draft, Failure};
use crate::machine::call::render_json;
use crate::machine::child::{child_body, child_order_id, ChildCommand};
use crate::machine::dispatch::{payload, Unbuilt};
use crate::machine::kind::ChildStep;
use crate::machine::{AlertKind, HistoryEvent, NewAlert};
use crate::model::{ProcessState, StepState};

/// The order reaches child step `index` (`kind`: forward, or undoing it):
/// forward, its child is started with this decision and the order parks
/// until the child ends or the step's timeout passes; undoing, the child
/// is asked to undo itself.
pub(super) fn start(draft: &mut Draft<'_>, index: usize, kind: StepKind, child: ChildStep) {
    match kind {
        StepKind::Action => start_child(draft, index, child),
        StepKind::Compensation => undo_child(draft, index),
    }
}

fn start_child(draft: &mut Draft<'_>, index: usize, child: ChildStep) {
    let ChildStep {
        workflow,
        version,
        attributes,
        ..
    } = child;
    let name = draft.steps[index].name.clone();
    let attributes = match attributes
        .map(|template| render(draft, &template))
        .transpose()
    {
        Ok(attributes) => attributes,
        Err(unbuilt) => return draft.refuse_unbuilt(index, StepKind::Action, &unbuilt),
    };
    let child = child_order_id(&draft.snapshot.order_id, &draft.steps[index]);
    let body = child_body(&draft.snapshot.body, &child, &workflow, attributes);
    let until = parked_until(draft, index);
    let attempt_id = draft.park_at(index, StepState::Running, ProcessState::Pending, until);
    // A child that started may have run steps: undone if the parent is.
    draft.change_step(index, |step| step.maybe_applied = true);
    // "Starting": the write kernel stores the child in this transaction,
    // and a start it refuses (an id taken, no such plan, too deep) is the
    // next line, `compensation_started` or `error`, at the same instant.
    let detail = format!(
        "starting child order {child} (workflow {workflow} version {version}), to wait for it to end until {until}"
    );
    draft.log(
        HistoryEvent::ChildStarted,
        Some(&name),
        Some(attempt_id),
        Some(detail.clone()),
    );
    draft.notify(StatusEvent::Waiting, Some(&name), Some(&detail));
    draft.child = Some(ChildCommand::Start {
        child,
        step: name,
        workflow,
        version,
        body,
    });
}

/// The order undoes child step `index`: the child is asked to undo itself
/// as a whole, and the order, compensating, waits for it held by nobody.
/// If the child has not ended compensated by the step's timeout, a claim
/// asks again (the child ignores a second ask while it compensates).
fn undo_child(draft: &mut Draft<'_>, index: usize) {
    let name = draft.steps[index].name.clone();
    let child = child_order_id(&draft.snapshot.order_id, &draft.steps[index]);
    // Asked again only if it has not ended by then (its end reaches the
    // order in the transaction that ends it): at most once a minute.
    let until = parked_until(draft, index).max(draft.ctx.now + chrono::Duration::minutes(1));
    let attempt_id = draft.park_at(
        index,
        StepState::Compensating,
        ProcessState::Compensating,
        until,
    );
    let reason = format!(
        "its parent {} is undone (step {name})",
        draft.snapshot.order_id
    );
    draft.log(
        HistoryEvent::ChildUndoRequested,
        Some(&name),
        Some(attempt_id),
        Some(format!(
            "child order {child} asked to undo itself as a whole; waiting for it until {until}"
        )),
    );
    draft.child = Some(ChildCommand::Undo {
        child,
        step: name,
        reason,
    });
}

/// When the order parked at step `index` looks again: the step's timeout
/// from now.
fn parked_until(draft: &Draft<'_>, index: usize) -> chrono::DateTime<chrono::Utc> {
    let timeout = chrono::Duration::milliseconds(i64::from(draft.steps[index].timeout_ms));
    crate::machine::to_micros(draft.ctx.now + timeout)
}

/// The child's attributes, rendered from the order and the results so far.
fn render(draft: &Draft<'_>, template: &serde_json::Value) -> Result<serde_json::Value, Unbuilt> {
    let results = draft
        .steps
        .iter()
        .filter_map(|s| s.result.as_ref().map(|r| (s.name.as_str(), r)));
    Ok(render_json(
        template,
        &payload(&draft.snapshot.body, results),
    )?)
}

/// A claim found the order parked at child step `index` past its timeout:
/// the child took too long and the order is undone (the child with it).
pub(super) fn timed_out(draft: &mut Draft<'_>, index: usize) {
    let step = &draft.steps[index];
    let name = step.name.clone();
    match step.state {
        StepState::Running => {
            let why = format!(
                "child order {} did not end by {}",
                child_order_id(&draft.snapshot.order_id, step),
                step.complete_by.unwrap_or(draft.ctx.now)
            );
            draft.log(
                HistoryEvent::WaitTimedOut,
                Some(&name),
                None,
                Some(why.clone()),
            );
            draft.start_compensation(Some(&name), None, &why);
            draft.advance();
        }
        // A parent waiting for its child's undo is compensating, never
        // parked: its claims ask again through `Draft::advance`.
        _ => draft.unchanged("the step waits for no child"),
    }
}

/// The child of step `step` ended in `state` with `results` (its steps'
/// results by name): forward, a processed child completes the step with
/// them and the order runs on, a compensated one (it failed and undid
/// itself) fails the step and the order is undone; undoing, a compensated
/// child undoes the step and the compensation goes on.
pub(super) fn ended(
    draft: &mut Draft<'_>,
    (step, child): (&str, &str),
    state: ProcessState,
    results: &serde_json::Value,
) {
    let Some(index) = draft.steps.iter().position(|s| s.name == step) else {
        return draft.unchanged("the order has no such step");
    };
    let current = child_order_id(&draft.snapshot.order_id, &draft.steps[index]);
    if current.as_str() != child {
        // An earlier child of a step an operator restarted: it ended, and
        // the step waits for its own.
        return draft.unchanged("the step waits for another child");
    }
    let child = current;
    let now = draft.ctx.now;
    match (draft.steps[index].state, state) {
        (StepState::Running, ProcessState::Processed)
            if draft.process.state == ProcessState::Pending =>
        {
            let result = serde_json::json!({ "order_id": child.client_id(), "results": results });
            draft.change_step(index, |s| {
                s.state = StepState::Completed;
                s.result = Some(crate::machine::storable(&result));
            });
            draft.process.state = ProcessState::Processing;
            draft.process.not_before = now;
            let detail = format!("child order {child} processed");
            draft.log(HistoryEvent::ChildEnded, Some(step), None, Some(detail));
            draft.notify(StatusEvent::StepCompleted, Some(step), None);
            draft.advance();
        }
        (StepState::Running, ProcessState::Compensated)
            if draft.process.state == ProcessState::Pending =>
        {
            let why = format!("child order {child} failed and was undone (compensated)");
            draft.change_step(index, |s| {
                s.state = StepState::Failed;
                s.maybe_applied = false;
                s.last_error = Some(why.clone());
            });
            draft.log(
                HistoryEvent::ChildEnded,
                Some(step),
                None,
                Some(why.clone()),
            );
            if draft.steps[index].stops_on_failure() {
                return draft.stop_at(index, None, &why);
            }
            draft.start_compensation(Some(step), None, &why);
            draft.advance();
        }
        (StepState::Compensating | StepState::Running, ProcessState::Compensated)
            if draft.process.state == ProcessState::Compensating =>
        {
            draft.change_step(index, |s| {
                s.state = StepState::Compensated;
                s.undo_result = Some(serde_json::json!({ "order_id": child.client_id() }));
            });
            let detail = format!("child order {child} undone (compensated)");
            draft.log(HistoryEvent::ChildEnded, Some(step), None, Some(detail));
            draft.process.locked_by = None;
            draft.process.not_before = now;
            draft.advance();
        }
        _ => draft.unchanged("the step does not wait for its child to end so"),
    }
}

/// The child of step `step` stopped in `error` (`reason` says why and
/// what to do, see [`crate::machine::child::end_told`]): forward, the
/// order records it and waits on for the child until the step's timeout,
/// when it undoes itself and the child. Undoing, nothing changes here: the
/// order asks the child again (at its next claim) and hears then whether
/// the child can still be undone. (Told in the transaction that stopped the
/// child, the stop may already be old: the same transaction may have asked
/// the child since to undo itself, and it did.)
pub(super) fn stopped(draft: &mut Draft<'_>, (step, child): (&str, &str), reason: &str) {
    let Some(index) = draft.steps.iter().position(|s| s.name == step) else {
        return draft.unchanged("the order has no such step");
    };
    if child_order_id(&draft.snapshot.order_id, &draft.steps[index]).as_str() != child {
        return draft.unchanged("the step waits for another child");
    }
    match (draft.steps[index].state, draft.process.state) {
        (StepState::Running, ProcessState::Pending) => {
            let until = draft.steps[index].complete_by.unwrap_or(draft.ctx.now);
            let detail = format!(
                "{reason} (this order waits for it until {until}, then undoes itself and the child)"
            );
            draft.log(HistoryEvent::ChildStopped, Some(step), None, Some(detail));
        }
        _ => draft.unchanged("the step waits for no child to go on"),
    }
}

/// This order's parent is undone (see [`ChildCommand::Undo`]): running (or
/// stopped in error before any undo began), it is cancelled; processed,
/// it is compensated as a whole; already undoing itself, nothing changes.
pub(super) fn undone_for_parent(draft: &mut Draft<'_>, reason: &str) {
    match draft.process.state {
        ProcessState::Processed => {
            let why = format!("undone as a whole: {reason}");
            draft.process.state = ProcessState::Compensating;
            draft.process.failure_count = 0;
            draft.process.last_error = Some(why.clone());
            draft.log(HistoryEvent::UndoneForParent, None, None, Some(why.clone()));
            draft.compensate_later();
            draft.notify(StatusEvent::Compensating, None, Some(&why));
        }
        ProcessState::Compensating | ProcessState::Compensated => {
            draft.unchanged("the order is already undone, or undoing itself");
        }
        ProcessState::Pending | ProcessState::Processing | ProcessState::Error => {
            draft.log(
                HistoryEvent::UndoneForParent,
                None,
                None,
                Some(format!("cancelled: {reason}")),
            );
            super::operator::cancelled(draft, reason);
        }
    }
}

/// The child of step `step` could not be started (an order of its id
/// that no step of this order started, its workflow not registered,
/// children too deep), or could not be reached to be undone (gone, or
/// stopped in error while undoing itself): forward, the step fails as a
/// refused call's would, nothing of it to undo, with an alert, and the
/// order is undone; undoing, its undo is refused and the order stops in
/// `error` with an alert saying what to do.
pub(super) fn refused(draft: &mut Draft<'_>, step: &str, reason: &str) {
    let Some(index) = draft.steps.iter().position(|s| s.name == step) else {
        return draft.unchanged("the order has no such step");
    };
    let order_id = draft.snapshot.order_id.clone();
    match (draft.steps[index].state, draft.process.state) {
        (StepState::Running, ProcessState::Pending) => {
            draft.change_step(index, |s| {
                s.state = StepState::Failed;
                s.maybe_applied = false;
                s.last_error = Some(reason.to_owned());
            });
            draft.alert = Some(NewAlert {
                kind: AlertKind::RequestNotBuilt,
                message: format!("order {order_id}: {reason}; the order is undone"),
            });
            draft.start_compensation(Some(step), None, reason);
            draft.advance();
        }
        (StepState::Compensating, ProcessState::Compensating) => {
            draft.change_step(index, |s| {
                s.undo_refused = true;
                s.last_error = Some(reason.to_owned());
            });
            let message = format!("order {order_id}: {reason}");
            draft.fail(Failure {
                step: Some(step),
                attempt_id: None,
                kind: AlertKind::CompensationFailed,
                detail: reason.to_owned(),
                last_error: reason,
                message: &message,
            });
        }
        _ => draft.unchanged("the step waits for no child now"),
    }
}
