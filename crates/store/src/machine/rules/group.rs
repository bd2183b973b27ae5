//! Parallel groups: consecutive steps that share a group name start
//! together, each with its own attempt, deadline and agent slot, and the
//! order moves on when all of them completed.
//!
//! - A member's success while others are in flight only completes it.
//! - A member refused for good starts the compensation, but no undo of a
//!   member still in flight is sent before its deadline plus the grace
//!   period ([`crate::machine::undo`]): the order waits, held by nobody (as
//!   after a cancel), so an undo never reaches a remote service before the
//!   action it undoes. A member's answer that comes meanwhile is kept.
//! - A member whose attempt never started, or failed for now, leaves the
//!   others running; the members not completed start again together.
//! - The order's deadline is its latest member's: the supervisor acts when
//!   every attempt in flight is past its own.

use std::ops::Range;

use chrono::{DateTime, Utc};
use sas_messages::{AttemptId, StepKind};
use uuid::Uuid;

use super::Draft;
use crate::machine::StepRow;
use crate::model::StepState;

/// The positions of the group step `index` belongs to: the run of
/// consecutive steps with its group name (only `index` for a step alone).
pub(super) fn members(steps: &[StepRow], index: usize) -> Range<usize> {
    let Some(group) = steps[index].group.as_deref() else {
        return index..index + 1;
    };
    let other = |s: &StepRow| s.group.as_deref() != Some(group);
    let start = steps[..index].iter().rposition(other).map_or(0, |i| i + 1);
    let end = steps[index..]
        .iter()
        .position(other)
        .map_or(steps.len(), |i| index + i);
    start..end
}

/// The attempt id of the `k`-th member started by one decision: the
/// decision's own id for the first, and for the others that id with its
/// last bits changed, so every member's attempt has an id of its own and
/// the decision stays a pure function of its context.
pub(super) fn member_attempt_id(first: AttemptId, k: usize) -> AttemptId {
    let k = u128::try_from(k).unwrap_or(u128::MAX);
    AttemptId::from(Uuid::from_u128(first.as_uuid().as_u128() ^ k))
}

/// Starts every member of step `index`'s group that has not completed, or
/// puts the order in the line of the first of their agents that has no
/// free slot: a group starts whole or waits.
pub(super) fn start(draft: &mut Draft<'_>, index: usize) {
    let starting: Vec<usize> = members(&draft.steps, index)
        .filter(|&i| draft.steps[i].state != StepState::Completed)
        .collect();
    let closed = starting.iter().find(|&&i| draft.agent_closed(i));
    if let Some(&waits) = closed {
        return draft.wait_for_slot(waits, StepKind::Action);
    }
    let closed_key = starting
        .iter()
        .find_map(|&i| Some((i, draft.closed_key_line(i)?)));
    if let Some((waits, line)) = closed_key {
        return draft.wait_for_key(waits, StepKind::Action, line);
    }
    // Every member's request is built before any starts: one that cannot
    // be is refused, and the group does not start.
    let mut calls = Vec::with_capacity(starting.len());
    for (k, &i) in starting.iter().enumerate() {
        let attempt_id = member_attempt_id(draft.ctx.next_attempt_id, k);
        match draft.prepare_call(i, StepKind::Action, attempt_id) {
            Ok(call) => calls.push((i, call)),
            Err(unbuilt) => return draft.refuse_unbuilt(i, StepKind::Action, &unbuilt),
        }
    }
    for (i, (started, dispatch)) in calls {
        draft.start_call(i, StepKind::Action, started, dispatch);
    }
    draft.process.complete_by = in_flight_until(draft);
}

/// Whether a member of step `index`'s group other than it has a forward
/// attempt in flight (the order is held, and that member is running).
pub(super) fn others_in_flight(draft: &Draft<'_>, index: usize) -> bool {
    draft.process.locked_by.is_some()
        && members(&draft.steps, index)
            .any(|i| i != index && draft.steps[i].state == StepState::Running)
}

/// The latest deadline of the forward attempts in flight: the group's.
fn in_flight_until(draft: &Draft<'_>) -> Option<DateTime<Utc>> {
    draft
        .steps
        .iter()
        .filter(|s| s.state == StepState::Running)
        .filter_map(|s| s.complete_by)
        .max()
}
