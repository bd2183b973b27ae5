//! Delay steps: the order parks until a time, its delay after the step
//! starts or an instant its order names, whichever is later (see
//! [`crate::machine::kind::DelayStep`]). What every parked kind shares is
//! in [`super::park`].

use super::park::{end_wait, park};
use super::Draft;
use crate::machine::kind::DelayStep;

/// The order reaches delay step `index` (`delay`): a delay already over ends at once;
/// otherwise the order parks until it is.
pub(super) fn start(draft: &mut Draft<'_>, index: usize, delay: &DelayStep) {
    let now = draft.ctx.now;
    let until = crate::machine::to_micros(delay.end(&draft.snapshot.body, now));
    if until <= now {
        let result = serde_json::json!({ "waited_until": until });
        return end_wait(draft, index, result, None, "the delay was already over");
    }
    park(draft, index, until, &format!("waiting until {until}"));
}

/// A claim of an order parked at delay step `index`, due: the delay is
/// over, and the order runs on.
pub(super) fn over(draft: &mut Draft<'_>, index: usize) {
    let until = draft.steps[index].complete_by.unwrap_or(draft.ctx.now);
    let result = serde_json::json!({ "waited_until": until });
    end_wait(draft, index, result, None, "the delay is over");
}
