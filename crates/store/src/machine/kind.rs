//! What a step does: the closed set of step kinds, as the state machine
//! sees them. Every rule that depends on a step's kind matches on
//! [`Kind`] (or asks one of its questions below, each one exhaustive
//! match), never on "has a park or not": a new kind is a new variant here,
//! and the compiler lists every place that must decide what it does.
//!
//! Steps are stored as they always were (an agent and action for a call,
//! [`Park`] for a wait or a delay); [`Kind`] is the view the rules read.

use super::park::{OnTimeout, Park};
use super::StepRow;
use crate::model::NewStep;

/// What one step does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind<'a> {
    /// Calls its agent's remote service: the action forward, its
    /// compensation when undone.
    Call,
    /// Waits for an event from the outside world, for at most its timeout.
    Wait {
        /// The event's name.
        event: &'a str,
        /// What a timeout means.
        on_timeout: OnTimeout,
    },
    /// Waits for a time.
    Delay,
    /// Starts an order of another workflow and waits for it to end (see
    /// [`crate::machine::child`]); undone by undoing that order as a whole.
    Child {
        /// The child's workflow.
        workflow: &'a str,
    },
}

impl Kind<'_> {
    /// The kind a step's stored wait or delay (`None`: a call) makes.
    pub fn of(park: Option<&Park>) -> Kind<'_> {
        match park {
            None => Kind::Call,
            Some(Park::Event {
                event, on_timeout, ..
            }) => Kind::Wait {
                event,
                on_timeout: *on_timeout,
            },
            Some(Park::Delay { .. }) => Kind::Delay,
            Some(Park::Child { workflow, .. }) => Kind::Child { workflow },
        }
    }

    /// Whether a step of this kind, running, may have a call of its own in
    /// flight that can land after its deadline (and so its undo waits the
    /// grace period): a call may; a wait or a delay calls nobody, and a
    /// child's undo is the child's own compensation, which waits for its
    /// own calls.
    pub fn calls_out(self) -> bool {
        match self {
            Kind::Call => true,
            Kind::Wait { .. } | Kind::Delay | Kind::Child { .. } => false,
        }
    }

    /// Whether a step of this kind, running, may already have had effects
    /// somewhere (so that it must be undone, and may not be replaced by a
    /// move): a call may have reached its remote, a child may have run
    /// steps; a wait or a delay did nothing.
    pub fn may_act_while_running(self) -> bool {
        match self {
            Kind::Call | Kind::Child { .. } => true,
            Kind::Wait { .. } | Kind::Delay => false,
        }
    }

    /// Whether reaching a step of this kind parks its order (pending, held
    /// by nobody, until an event, a time, or its child's end): waits,
    /// delays and children do.
    pub fn parks(self) -> bool {
        match self {
            Kind::Call => false,
            Kind::Wait { .. } | Kind::Delay | Kind::Child { .. } => true,
        }
    }

    /// Whether a running step of this kind may be carried by a move to a
    /// step of kind `to` under the same name (see [`crate::machine::moves`]):
    /// a call only to a call, a parked step only to one that parks the same
    /// way (a wait or a delay to a wait or a delay, a child to a child), so
    /// that what it waits for still ends it.
    pub fn carries_running_to(self, to: Kind<'_>) -> bool {
        match (self, to) {
            (Kind::Call, to) => match to {
                Kind::Call => true,
                Kind::Wait { .. } | Kind::Delay | Kind::Child { .. } => false,
            },
            (Kind::Wait { .. } | Kind::Delay, to) => match to {
                Kind::Wait { .. } | Kind::Delay => true,
                Kind::Call | Kind::Child { .. } => false,
            },
            (Kind::Child { .. }, to) => match to {
                Kind::Child { .. } => true,
                Kind::Call | Kind::Wait { .. } | Kind::Delay => false,
            },
        }
    }

    /// Whether a cancel ends a running step of this kind where it is (a
    /// wait or a delay, which did nothing), rather than undoing it (a
    /// call's action, a child's run).
    pub fn ends_on_cancel(self) -> bool {
        match self {
            Kind::Wait { .. } | Kind::Delay => true,
            Kind::Call | Kind::Child { .. } => false,
        }
    }
}

impl StepRow {
    /// What this step does (see [`Kind`]).
    pub fn kind(&self) -> Kind<'_> {
        Kind::of(self.park.as_ref())
    }
}

impl NewStep {
    /// What this step does (see [`Kind`]).
    pub fn kind(&self) -> Kind<'_> {
        Kind::of(self.park.as_ref())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_call_calls_out_and_a_wait_or_delay_parks() {
        let wait = Park::Event {
            event: "approved".into(),
            on_timeout: OnTimeout::Fail,
            correlation_key: None,
            senders: Vec::new(),
        };
        let delay = Park::Delay {
            delay_ms: 5,
            not_before: None,
        };
        assert_eq!(
            Kind::of(Some(&wait)),
            Kind::Wait {
                event: "approved",
                on_timeout: OnTimeout::Fail
            }
        );
        let child = Park::Child {
            workflow: "fulfil".into(),
            version: 3,
            attributes: None,
        };
        assert_eq!(Kind::of(Some(&child)), Kind::Child { workflow: "fulfil" });
        for (kind, calls_out, parks, acts, ends_on_cancel) in [
            (Kind::of(None), true, false, true, false),
            (Kind::of(Some(&wait)), false, true, false, true),
            (Kind::of(Some(&delay)), false, true, false, true),
            (Kind::of(Some(&child)), false, true, true, false),
        ] {
            assert_eq!(
                (
                    kind.calls_out(),
                    kind.parks(),
                    kind.may_act_while_running(),
                    kind.ends_on_cancel()
                ),
                (calls_out, parks, acts, ends_on_cancel),
                "{kind:?}"
            );
        }
        // A running step moves only to a step that ends the same way.
        let (call, wait, delay, child) = (
            Kind::of(None),
            Kind::of(Some(&wait)),
            Kind::of(Some(&delay)),
            Kind::of(Some(&child)),
        );
        let kinds = [call, wait, delay, child];
        let carried: Vec<(usize, usize)> = (0..4)
            .flat_map(|from| (0..4).map(move |to| (from, to)))
            .filter(|&(from, to)| kinds[from].carries_running_to(kinds[to]))
            .collect();
        assert_eq!(carried, [(0, 0), (1, 1), (1, 2), (2, 1), (2, 2), (3, 3)]);
    }
}
