//! What an event sent to an order becomes there, decided once: by the
//! scheduler that receives it (whether the order's waits refuse its sender)
//! and by every front end before it sends one (the console, `sasctl
//! signal`, the gateway), so that the three answer alike and say at once
//! what the scheduler would only write in the order's history.
//!
//! What a wait step does on each event of the state machine is in the
//! rules (`rules/wait.rs`); what every parked kind shares is in
//! [`super::park`].

use crate::machine::kind::{Kind, WaitStep};
use crate::machine::park::parked_at;
use crate::machine::StepRow;
use crate::model::{ProcessState, StepState};

/// The wait steps an order's waits for `event` refuse a sender at, when
/// every one of them does: the first such step and whom it accepts. `None`
/// when one of them accepts the sender, or when the order has no wait for
/// `event` (the event changes nothing there, and the mailbox may keep it).
///
/// `waits` are the order's wait steps for `event` (name and spec), in any
/// state; `principals` what the sender is known by (see
/// [`WaitStep::accepts`]); `tenant` the order's tenant.
pub fn refusal<'a>(
    waits: impl IntoIterator<Item = (&'a str, &'a WaitStep)>,
    principals: &[String],
    tenant: &str,
) -> Option<(&'a str, &'a [String])> {
    let mut first = None;
    for (step, wait) in waits {
        if wait.accepts(principals, tenant) {
            return None;
        }
        first.get_or_insert((step, wait.senders.as_slice()));
    }
    first
}

/// What an event named `event` would become in an order, as the order
/// stands: the one rule the console, `sasctl signal` and the gateway
/// follow before they send one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventAdmission {
    /// No order has this id (yet): the scheduler keeps the event for one
    /// (`scheduler.event_ttl_secs`), then dead-letters it.
    NoOrderYet,
    /// An event with this id came for the order before: sending it again
    /// changes nothing (safe, as a retried webhook is).
    Duplicate,
    /// The order is parked at wait step `step` for it: it runs on when the
    /// event comes.
    Used {
        /// The wait step.
        step: String,
    },
    /// Wait step `step` for it is still ahead: the order's mailbox keeps
    /// the event, and the step uses it when the order gets there (an order
    /// stopped in error before any undo: once an operator resumes or
    /// resubmits it).
    Kept {
        /// The wait step.
        step: String,
    },
    /// Every wait for it refuses the sender: the scheduler would refuse it.
    Refused {
        /// The first such wait step.
        step: String,
        /// Whom it accepts the event from.
        senders: Vec<String>,
    },
    /// Nothing in the order will use it: the order ended, or none of its
    /// steps still to come waits for it.
    Unused {
        /// Why, said of the order ("is processed and waits for no event").
        why: String,
    },
}

impl EventAdmission {
    /// Whether the event is worth sending: the order takes or keeps it, or
    /// may come yet, or has it already (sending again is safe).
    pub fn sendable(&self) -> bool {
        match self {
            Self::NoOrderYet | Self::Duplicate | Self::Used { .. } | Self::Kept { .. } => true,
            Self::Refused { .. } | Self::Unused { .. } => false,
        }
    }

    /// What it means for event `event` of `sender`, in words for the
    /// sender (order `order_id`).
    pub fn describe(&self, order_id: &str, event: &str, sender: &str) -> String {
        match self {
            Self::NoOrderYet => format!(
                "no order {order_id} yet: the event is kept for it for scheduler.event_ttl_secs"
            ),
            Self::Duplicate => {
                format!("order {order_id} has had this event before: nothing changes")
            }
            Self::Used { step } => format!("order {order_id} waits for {event} at step {step}"),
            Self::Kept { step } => format!(
                "order {order_id} has its wait for {event} ahead (step {step}): its mailbox keeps the event until that step uses it"
            ),
            Self::Refused { step, senders } => format!(
                "the wait at step {step} of order {order_id} accepts {event} only from {}, and {sender} is none of these: nothing was sent; send it as one of them (the tenancy file gives roles and tenants)",
                senders.join(", ")
            ),
            Self::Unused { why } => format!("order {order_id} {why}: nothing was sent"),
        }
    }
}

/// What event `event`, from a sender known by `principals`, would become
/// in an order of tenant `tenant` in `state` with `steps`. The two cases a read decides
/// (no such order, an event id seen before) are the store's
/// ([`crate::reads::Reads::event_admission`]).
pub fn admission(
    state: ProcessState,
    steps: &[StepRow],
    event: &str,
    principals: &[String],
    tenant: &str,
) -> EventAdmission {
    let waits: Vec<(usize, &WaitStep)> = steps
        .iter()
        .enumerate()
        .filter_map(|(index, step)| Some((index, step.kind.waits_for(event)?)))
        .collect();
    // The step states still to come: an order stopped in error before any
    // undo began may be resumed or resubmitted, which starts its failed
    // step (a wait that timed out with `on_timeout = "fail"`) again.
    let undoing = steps.iter().any(StepRow::undo_began);
    let ahead = |step: &StepRow| match state {
        ProcessState::Pending | ProcessState::Processing => {
            matches!(step.state, StepState::NotStarted | StepState::Running)
        }
        // Not reached once an undo began (the return below).
        ProcessState::Error => matches!(
            step.state,
            StepState::NotStarted | StepState::Running | StepState::Failed
        ),
        ProcessState::Processed | ProcessState::Compensating | ProcessState::Compensated => false,
    };
    if state == ProcessState::Error && undoing {
        return EventAdmission::Unused {
            why: "stopped in error while undoing itself: no wait of it will run again".into(),
        };
    }
    if !steps.iter().any(ahead) {
        return EventAdmission::Unused {
            why: format!("is {state} and waits for no event"),
        };
    }
    if waits.is_empty() {
        let mut others: Vec<&str> = Vec::new();
        for step in steps.iter().filter(|step| ahead(step)) {
            match &step.kind {
                Kind::Wait(WaitStep { event, .. }) if !others.contains(&event.as_str()) => {
                    others.push(event);
                }
                Kind::Wait(_) | Kind::Delay(_) | Kind::Child(_) | Kind::Call(_) => {}
            }
        }
        return EventAdmission::Unused {
            why: if others.is_empty() {
                format!("has no wait for {event} ahead")
            } else {
                format!("waits for {}, not for {event}", others.join(", "))
            },
        };
    }
    let named = waits
        .iter()
        .map(|(index, park)| (steps[*index].name.as_str(), *park));
    if let Some((step, senders)) = refusal(named, principals, tenant) {
        return EventAdmission::Refused {
            step: step.to_owned(),
            senders: senders.to_vec(),
        };
    }
    // The first wait ahead that takes it from this sender: the one it is
    // used at (now, when the order is parked there, or when it gets there).
    let parked = parked_at(state, steps);
    match waits
        .iter()
        .find(|(index, wait)| ahead(&steps[*index]) && wait.accepts(principals, tenant))
    {
        Some((index, _)) if Some(*index) == parked => EventAdmission::Used {
            step: steps[*index].name.clone(),
        },
        Some((index, _)) => EventAdmission::Kept {
            step: steps[*index].name.clone(),
        },
        None => EventAdmission::Unused {
            why: format!(
                "is past its wait for {event} (step {})",
                steps[waits[0].0].name
            ),
        },
    }
}
