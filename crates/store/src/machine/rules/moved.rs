//! An operator's move of a parked order to another version of its
//! workflow: [`crate::machine::moves::plan_move`] says what its steps
//! become, or why it may not move; the order leaves its agent's line (a
//! claim finds it again at once), and its history says what changed.

use std::collections::BTreeMap;

use super::Draft;
use crate::machine::moves::plan_move;
use crate::machine::{HistoryEvent, Verdict};
use crate::model::NewStep;

/// The order moves to the plan `plan` (version `versions.1`), or the
/// verdict says why not.
pub(super) fn moved(
    draft: &mut Draft<'_>,
    plan: &[NewStep],
    mapping: &BTreeMap<String, String>,
    versions: (i32, i32),
) {
    let moved = match plan_move(draft.snapshot, plan, mapping, versions) {
        Ok(moved) => moved,
        Err(unsafe_move) => {
            draft.verdict = Verdict::NotMovable(unsafe_move.0);
            return;
        }
    };
    draft.steps = moved.steps;
    draft.moved = Some(versions.1);
    if draft.process.waiting_for.is_some() || draft.process.waiting_key.is_some() {
        // Out of its line: its place there was for a step of the old plan.
        draft.process.waiting_for = None;
        draft.process.waiting_key = None;
        draft.process.admit_key = None;
        draft.process.not_before = draft.ctx.now;
    }
    draft.log(HistoryEvent::Moved, None, None, Some(moved.detail));
}
