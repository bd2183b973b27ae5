//! Moving a parked order to another version of its workflow: an operator's
//! explicit, recorded operation (orders keep the plan they started with
//! otherwise).
//!
//! [`plan_move`] decides, without a database, what the order's steps become
//! under the new plan, or why the move is unsafe. A step of the old plan
//! goes to the step of the new one that the mapping names (by default, the
//! step of the same name) and keeps what it did: its state, attempts, keys
//! and results; it takes the new plan's definition (agent, action,
//! compensation, timeout, request template, what it waits for). A new step
//! nothing maps to starts not started.

use std::collections::{BTreeMap, BTreeSet};

use super::kind::{ChildStep, Kind};
use super::{Snapshot, StepRow};
use crate::model::{NewStep, ProcessState, StepState};

/// What a move does to one order.
#[derive(Debug, Clone, PartialEq)]
pub struct Moved {
    /// The order's steps under the new plan, by position.
    pub steps: Vec<StepRow>,
    /// The history line's detail: the versions and what changed.
    pub detail: String,
}

/// Why an order cannot move: it is running, or the move would lose what it
/// did.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Unsafe(pub String);

/// The steps of the order `snapshot` (of plan version `from`) under the
/// plan `steps` (version `to`), old step names mapped to new ones by
/// `mapping` (a step absent from it keeps its name).
///
/// # Errors
/// [`Unsafe`] when the order is not parked (`pending`: in a line, in
/// backoff, or at a wait); when the mapping names a step neither plan has,
/// or two old steps map to one new step; when a step that did, or may have
/// done, something would be dropped without its undo; when the wait the
/// order is parked at has no place in the new plan, or changes its kind;
/// or when a new step would come before a step that completed (it would
/// never run).
pub fn plan_move(
    snapshot: &Snapshot,
    steps: &[NewStep],
    mapping: &BTreeMap<String, String>,
    (from, to): (i32, i32),
) -> Result<Moved, Unsafe> {
    if snapshot.process.state != ProcessState::Pending {
        return Err(Unsafe(format!(
            "it is {}: only an order that waits (in a line, in backoff or at a wait step) moves",
            snapshot.process.state
        )));
    }
    let new_names: BTreeSet<&str> = steps.iter().map(|s| s.name.as_str()).collect();
    for (old, new) in mapping {
        if !snapshot.steps.iter().any(|s| &s.name == old) {
            return Err(Unsafe(format!(
                "the mapping names {old:?}, which version {from} does not have"
            )));
        }
        if !new_names.contains(new.as_str()) {
            return Err(Unsafe(format!(
                "the mapping names {new:?}, which version {to} does not have"
            )));
        }
    }
    let mut carried: BTreeMap<&str, &StepRow> = BTreeMap::new();
    let mut dropped = Vec::new();
    for old in &snapshot.steps {
        let name = mapping
            .get(&old.name)
            .map_or(old.name.as_str(), String::as_str);
        match new_names.contains(name).then_some(name) {
            Some(new) => {
                if carried.insert(new, old).is_some() {
                    return Err(Unsafe(format!(
                        "two steps of version {from} map to {new:?}"
                    )));
                }
            }
            None if old.needs_undo()
                || (old.state == StepState::Completed && old.kind.undoable()) =>
            {
                return Err(Unsafe(format!(
                    "step {:?} did (or may have done) its action and has no place in version {to}: it would be dropped without its undo",
                    old.name
                )));
            }
            None if old.state == StepState::Running => {
                return Err(Unsafe(format!(
                    "the order waits at step {:?}, which has no place in version {to}",
                    old.name
                )));
            }
            None => dropped.push(old.name.as_str()),
        }
    }
    let mut rows = Vec::with_capacity(steps.len());
    let mut added = Vec::new();
    for (position, definition) in (0..).zip(steps) {
        let mut row = StepRow::new(&snapshot.order_id, position, definition);
        if let Some(old) = carried.get(definition.name.as_str()) {
            if old.state == StepState::Running && !old.kind.carries_running_to(&definition.kind) {
                return Err(Unsafe(format!(
                    "the order waits at step {:?}, which is no wait step in version {to}",
                    old.name
                )));
            }
            keeps_its_undo(old, definition, to)?;
            row.state = old.state;
            row.attempt = old.attempt;
            row.attempt_id = old.attempt_id;
            row.complete_by = old.complete_by;
            row.idempotency_key.clone_from(&old.idempotency_key);
            row.result.clone_from(&old.result);
            row.last_error.clone_from(&old.last_error);
            row.maybe_applied = old.maybe_applied;
            row.undo_generation = old.undo_generation;
            row.undo_refused = old.undo_refused;
            row.undo_result.clone_from(&old.undo_result);
        } else {
            added.push(definition.name.as_str());
        }
        rows.push(row);
    }
    if let Some(last_done) = rows.iter().rposition(|s| s.state == StepState::Completed) {
        // Members of one parallel group run side by side: any of them may
        // have completed before the others.
        let beside = |s: &StepRow| s.group.is_some() && s.group == rows[last_done].group;
        if let Some(skipped) = rows[..last_done]
            .iter()
            .find(|s| s.state != StepState::Completed && !beside(s))
        {
            return Err(Unsafe(format!(
                "step {:?} of version {to} would come before step {:?}, which completed: it would never run",
                skipped.name, rows[last_done].name
            )));
        }
    }
    let renamed: Vec<String> = mapping
        .iter()
        .filter(|(old, new)| old != new)
        .map(|(old, new)| format!("{old} as {new}"))
        .collect();
    let mut detail = format!("from version {from} to {to}");
    for (what, names) in [
        ("added", added.join(", ")),
        ("dropped", dropped.join(", ")),
        ("renamed", renamed.join(", ")),
    ] {
        if !names.is_empty() {
            detail.push_str(&format!("; {what} {names}"));
        }
    }
    Ok(Moved {
        steps: rows,
        detail,
    })
}

/// Whether step `old` did, or may have done, its action at the remote: it
/// completed, its undo is under way, a call of it may be in flight or land
/// late (a call step running, or in backoff), or it failed after a call
/// whose outcome is unknown.
fn may_have_acted(old: &StepRow) -> bool {
    match old.state {
        StepState::Completed | StepState::Compensating => true,
        StepState::Running => old.kind.may_act_while_running(),
        // A step resumed by an operator keeps "maybe applied" until its
        // new attempt settles it.
        StepState::Failed | StepState::NotStarted => old.maybe_applied,
        StepState::Compensated => false,
    }
}

/// A step that did or may have done its action keeps the undo it owes
/// under its new definition `new` (of version `to`): a compensation if it
/// had one, and the same agent, whose service holds the effect to undo.
///
/// # Errors
/// [`Unsafe`] naming the step and what it would lose.
fn keeps_its_undo(old: &StepRow, new: &NewStep, to: i32) -> Result<(), Unsafe> {
    if !may_have_acted(old) {
        return Ok(());
    }
    if let Kind::Child(ChildStep { workflow, .. }) = &old.kind {
        let kept = new.name == old.name
            && matches!(&new.kind, Kind::Child(child) if &child.workflow == workflow);
        if !kept {
            return Err(Unsafe(format!(
                "step {:?} started a child order of {workflow}: version {to} must keep it as a child step of {workflow} under the same name, or its child could not be undone",
                old.name
            )));
        }
    }
    if old.kind.undoable() && !new.kind.undoable() {
        return Err(Unsafe(format!(
            "step {:?} did (or may have done) its action and has no compensation in version {to}: it would lose its undo",
            old.name
        )));
    }
    if old.kind.agent() != new.kind.agent() {
        return Err(Unsafe(format!(
            "step {:?} did (or may have done) its action at {}, and version {to} gives it to {}: its effect could not be undone (nor a late call of it known)",
            old.name,
            old.kind.agent().unwrap_or("no agent"),
            new.kind.agent().unwrap_or("no agent")
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::machine::kind::{CallStep, WaitStep};
    use crate::machine::park::OnTimeout;

    fn step(name: &str, kind: Kind) -> NewStep {
        NewStep {
            name: name.into(),
            kind,
            timeout: Duration::from_secs(5),
            group: None,
        }
    }

    fn call(name: &str, agent: &str, compensation: Option<&str>) -> NewStep {
        step(name, Kind::Call(CallStep::new(agent, name, compensation)))
    }

    fn approval() -> Kind {
        Kind::Wait(WaitStep {
            event: "approved".into(),
            on_timeout: OnTimeout::Compensate,
            correlation_key: None,
            senders: Vec::new(),
        })
    }

    /// Version 1: reserve, approval, charge; the order parked at approval.
    fn parked() -> Snapshot {
        let v1 = [
            call("reserve", "inventory", Some("release")),
            step("approval", approval()),
            call("charge", "payment", Some("refund")),
        ];
        let now = chrono::Utc::now();
        let mut snapshot =
            Snapshot::new_order("o-1", serde_json::json!({}), None, None, 5, &v1, now);
        snapshot.steps[0].state = StepState::Completed;
        snapshot.steps[0].attempt = 1;
        snapshot.steps[0].result = Some(serde_json::json!({"id": "r-1"}));
        snapshot.steps[1].state = StepState::Running;
        snapshot.steps[1].attempt = 1;
        snapshot
    }

    #[test]
    fn a_parked_order_gains_a_step_and_keeps_what_it_did() {
        let v2 = [
            call("reserve", "inventory", Some("release")),
            step("approval", approval()),
            call("fraud_check", "payment", None),
            call("charge", "payment", Some("refund")),
        ];
        let moved = plan_move(&parked(), &v2, &BTreeMap::new(), (1, 2)).unwrap();
        let states: Vec<StepState> = moved.steps.iter().map(|s| s.state).collect();
        use StepState::*;
        assert_eq!(states, [Completed, Running, NotStarted, NotStarted]);
        assert_eq!(
            moved.steps[0].result,
            Some(serde_json::json!({"id": "r-1"}))
        );
        assert_eq!(moved.steps[0].idempotency_key, "o-1:reserve");
        assert_eq!(moved.steps[2].idempotency_key, "o-1:fraud_check");
        assert_eq!(moved.detail, "from version 1 to 2; added fraud_check");
    }

    #[test]
    fn a_rename_follows_the_mapping() {
        let v2 = [
            call("reserve_stock", "inventory", Some("release")),
            step("approval", approval()),
            call("charge", "payment", Some("refund")),
        ];
        let mapping = BTreeMap::from([("reserve".to_owned(), "reserve_stock".to_owned())]);
        let moved = plan_move(&parked(), &v2, &mapping, (1, 2)).unwrap();
        assert_eq!(moved.steps[0].state, StepState::Completed);
        assert!(
            moved.detail.contains("renamed reserve as reserve_stock"),
            "{}",
            moved.detail
        );
    }

    #[test]
    fn unsafe_moves_are_refused_with_the_reason() {
        let without_reserve = [
            step("approval", approval()),
            call("charge", "payment", Some("refund")),
        ];
        let error = plan_move(&parked(), &without_reserve, &BTreeMap::new(), (1, 3)).unwrap_err();
        assert!(error.0.contains("without its undo"), "{error}");
        let without_wait = [
            call("reserve", "inventory", Some("release")),
            call("charge", "payment", Some("refund")),
        ];
        let error = plan_move(&parked(), &without_wait, &BTreeMap::new(), (1, 3)).unwrap_err();
        assert!(error.0.contains("waits at step \"approval\""), "{error}");
        let new_first = [
            call("kyc", "payment", None),
            call("reserve", "inventory", Some("release")),
            step("approval", approval()),
            call("charge", "payment", Some("refund")),
        ];
        let error = plan_move(&parked(), &new_first, &BTreeMap::new(), (1, 3)).unwrap_err();
        assert!(error.0.contains("would never run"), "{error}");
        let mapping = BTreeMap::from([("charge".to_owned(), "reserve".to_owned())]);
        let v1 = [
            call("reserve", "inventory", Some("release")),
            step("approval", approval()),
            call("charge", "payment", Some("refund")),
        ];
        let error = plan_move(&parked(), &v1, &mapping, (1, 3)).unwrap_err();
        assert!(error.0.contains("two steps"), "{error}");
        // The reservation completed: its undo is owed where it happened.
        let undo_dropped = [
            call("reserve", "inventory", None),
            step("approval", approval()),
            call("charge", "payment", Some("refund")),
        ];
        let error = plan_move(&parked(), &undo_dropped, &BTreeMap::new(), (1, 3)).unwrap_err();
        assert!(error.0.contains("would lose its undo"), "{error}");
        let elsewhere = [
            call("reserve", "warehouse", Some("release")),
            step("approval", approval()),
            call("charge", "payment", Some("refund")),
        ];
        let error = plan_move(&parked(), &elsewhere, &BTreeMap::new(), (1, 3)).unwrap_err();
        assert!(error.0.contains("gives it to warehouse"), "{error}");
        // A charge in backoff (its call may still land) keeps its agent too,
        // while a step never started may go anywhere.
        let mut backoff = parked();
        backoff.steps[1].state = StepState::Completed;
        backoff.steps[2].state = StepState::Running;
        backoff.steps[2].attempt = 1;
        let to_other_psp = [
            call("reserve", "inventory", Some("release")),
            step("approval", approval()),
            call("charge", "payments-v2", Some("refund")),
        ];
        let error = plan_move(&backoff, &to_other_psp, &BTreeMap::new(), (1, 3)).unwrap_err();
        assert!(error.0.contains("step \"charge\""), "{error}");
        plan_move(&parked(), &to_other_psp, &BTreeMap::new(), (1, 3)).unwrap();
        let mut running = parked();
        running.process.state = ProcessState::Processing;
        let error = plan_move(&running, &v1, &BTreeMap::new(), (1, 3)).unwrap_err();
        assert!(error.0.contains("it is processing"), "{error}");
    }

    #[test]
    fn a_started_child_step_keeps_its_name_and_workflow_and_a_wait_never_becomes_one() {
        let child = |workflow: &str| {
            Kind::Child(ChildStep {
                workflow: workflow.into(),
                version: 1,
                attributes: None,
                on_failure: crate::OnFailure::Compensate,
            })
        };
        let v1 = [
            call("reserve", "inventory", Some("release")),
            step("fulfil", child("fulfil")),
            call("charge", "payment", Some("refund")),
        ];
        let now = chrono::Utc::now();
        let mut waiting =
            Snapshot::new_order("o-1", serde_json::json!({}), None, None, 5, &v1, now);
        waiting.steps[0].state = StepState::Completed;
        waiting.steps[0].attempt = 1;
        waiting.steps[1].state = StepState::Running;
        waiting.steps[1].attempt = 1;
        let renamed = [
            call("reserve", "inventory", Some("release")),
            step("fulfil_v2", child("fulfil")),
            call("charge", "payment", Some("refund")),
        ];
        let mapping = BTreeMap::from([("fulfil".to_owned(), "fulfil_v2".to_owned())]);
        let error = plan_move(&waiting, &renamed, &mapping, (1, 2)).unwrap_err();
        assert!(error.0.contains("must keep it as a child step"), "{error}");
        let other = [
            call("reserve", "inventory", Some("release")),
            step("fulfil", child("ship_only")),
            call("charge", "payment", Some("refund")),
        ];
        let error = plan_move(&waiting, &other, &BTreeMap::new(), (1, 2)).unwrap_err();
        assert!(error.0.contains("child order of fulfil"), "{error}");
        // The same child step moves; a parked wait never becomes a child.
        assert!(plan_move(&waiting, &v1, &BTreeMap::new(), (1, 2)).is_ok());
        let waits_as_child = [
            call("reserve", "inventory", Some("release")),
            step("approval", child("fulfil")),
            call("charge", "payment", Some("refund")),
        ];
        let error = plan_move(&parked(), &waits_as_child, &BTreeMap::new(), (1, 2)).unwrap_err();
        assert!(error.0.contains("waits at step \"approval\""), "{error}");
    }
}
