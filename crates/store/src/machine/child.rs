//! Child steps: a step that starts an order of another workflow, waits for
//! it to end and takes its results (`kind = "child"`, [`super::kind::ChildStep`]).
//!
//! The child is an ordinary order of its parent's tenant, with an id
//! derived from the parent's and the step's ([`child_order_id`]): the
//! transaction that starts the step inserts it (the write kernel applies
//! [`ChildCommand::Start`]), so a parent committed without its child, or
//! a retried start making two, cannot happen. While it runs the parent is
//! parked at the step. Its end (processed or compensated) is decided, in
//! the transaction that ends it, as [`super::Event::ChildEnded`] of the
//! parent. A parent undoing the step (its compensation, a cancel, the
//! step's timeout) asks the child to undo itself as a whole
//! ([`ChildCommand::Undo`]: a running child is cancelled, a processed one
//! compensated) and waits for it to end compensated.

use sas_messages::OrderId;

use super::{Decision, Event, Snapshot, StepRow, Verdict};
use crate::model::{ProcessState, StepState};

/// The deepest a chain of children may go (a parent's child's child ...):
/// the catalog refuses a workflow that would start deeper, and one that
/// starts itself (directly or through others).
pub const MAX_DEPTH: usize = 5;

/// The most child steps one workflow may have.
pub const MAX_CHILDREN: usize = 20;

/// The most orders one tree may hold (its root and every order started
/// under it, at any depth, in every generation): [`MAX_CHILDREN`] and
/// [`MAX_DEPTH`] alone allow 20^5, and each operator put-back starts a
/// new generation of children. A start past it refuses its parent's step.
pub const MAX_TREE_ORDERS: usize = 1000;

/// The parent an order was started by (see [`child_order_id`]), read
/// with its snapshot: whom its end is told to, and whether the parent
/// still waits for it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ParentLink {
    /// The parent's id.
    pub order_id: String,
    /// The parent's step that started it.
    pub step: String,
    /// The parent's step still waits for this order ([`parent_waits`]):
    /// read under this order's lock, as every transaction that ends a child
    /// (and so may tell its parent to stop waiting) holds it.
    pub waits: bool,
}

/// Whether parent `parent`'s step `step`, with idempotency key `key` and in
/// state `state`, still waits for order `child`: `child` is the child its
/// current key starts, and the step runs (forward) or undoes it. A parent
/// that took the child's end and went on, or started another child, does
/// not: running `child` again would leave effects nobody undoes.
pub fn parent_waits(
    parent: &OrderId,
    step: &str,
    key: &str,
    state: StepState,
    child: &str,
) -> bool {
    child_of_key(parent, step, key).as_str() == child
        && matches!(state, StepState::Running | StepState::Compensating)
}

/// Why an operator may not put `child` back (resubmit or resume it): its
/// parent no longer waits for it. `None` for an order no step started, or
/// one its parent still waits for.
pub fn put_back_refusal(child: &OrderId, parent: Option<&ParentLink>) -> Option<String> {
    let parent = parent.filter(|link| !link.waits)?;
    Some(format!(
        "order {child} was started by step {} of order {}, which no longer waits for it: run again, it would leave effects nobody undoes; resubmit or resume {} instead, which starts a new child",
        parent.step, parent.order_id, parent.order_id
    ))
}

/// What a decision asks of another order, applied by the write kernel in
/// the same transaction.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildCommand {
    /// Insert the child order and take it in.
    Start {
        /// The child's id ([`child_order_id`]).
        child: OrderId,
        /// The parent's step that starts it.
        step: String,
        /// The child's workflow and version.
        workflow: String,
        /// The version the parent pinned.
        version: i32,
        /// The child's order as submitted (the parent's, with its own id,
        /// workflow and attributes).
        body: serde_json::Value,
    },
    /// The child must undo itself as a whole: cancelled while it runs,
    /// compensated once processed.
    Undo {
        /// The child's id.
        child: OrderId,
        /// The parent's step that started it.
        step: String,
        /// Why, for the child's history.
        reason: String,
    },
}

/// The id of the order a child step of `parent` starts, from the step's
/// idempotency key (`<parent>:<step>`, `<parent>:<step>:r2` once an
/// operator restarted the workflow): the parent's client id and what the
/// key adds to the parent's id (`ord-1:fulfil`, `ord-1:fulfil:r2`), in the
/// parent's tenant. A restarted step so starts a new child, and its first
/// child, which ended, is never taken for it. One too long for an order id
/// keeps its start and ends with a hash of the whole, so two steps never
/// share a child.
pub fn child_order_id(parent: &OrderId, step: &StepRow) -> OrderId {
    child_of_key(parent, &step.name, &step.idempotency_key)
}

/// [`child_order_id`] from the step's name and idempotency key, as they are
/// stored.
pub fn child_of_key(parent: &OrderId, step: &str, key: &str) -> OrderId {
    let prefix = format!("{parent}:");
    derived_id(parent, key.strip_prefix(&prefix).unwrap_or(step))
}

/// `parent`'s client id and `suffix`, fitted to an order id (see
/// [`child_order_id`]), in the parent's tenant.
fn derived_id(parent: &OrderId, suffix: &str) -> OrderId {
    const HASH: crc::Crc<u64> = crc::Crc::<u64>::new(&crc::CRC_64_ECMA_182);
    let whole = format!("{}:{suffix}", parent.client_id());
    let max = sas_messages::order::MAX_ID_LEN;
    let client = if whole.len() <= max {
        whole
    } else {
        let hash = format!("{:016x}", HASH.checksum(whole.as_bytes()));
        let keep = max - hash.len() - 1;
        let mut cut = keep;
        while !whole.is_char_boundary(cut) {
            cut -= 1;
        }
        format!("{}:{hash}", &whole[..cut])
    };
    OrderId::from(client).qualified(parent.tenant())
}

/// The child's order as submitted: the parent's body with the child's id
/// and workflow, its attributes `attributes` (the parent's when `None`),
/// and no `reply_to` (the parent's client hears of its own order; the
/// child's statuses go to the status exchange only).
pub fn child_body(
    parent_body: &serde_json::Value,
    child: &OrderId,
    workflow: &str,
    attributes: Option<serde_json::Value>,
) -> serde_json::Value {
    let mut body = parent_body.clone();
    if let Some(object) = body.as_object_mut() {
        object.insert("order_id".into(), child.client_id().into());
        object.insert("workflow".into(), workflow.into());
        object.remove("reply_to");
        if let Some(attributes) = attributes {
            object.insert("attributes".into(), attributes);
        }
    }
    body
}

/// What a parent hears of its child: its end, decided where the child
/// ended; or that it could not be started or reached, decided where the
/// parent tried. The write kernel, in the same transaction, turns it into
/// the parent's event with [`ToParent::event`]. Decided here, not by the
/// kernel, so that the property test's model of several orders hears the
/// same.
#[derive(Debug, Clone, PartialEq)]
pub enum ToParent {
    /// The child ended (processed or compensated) with its steps' results
    /// by name: [`Event::ChildEnded`].
    Ended {
        /// Processed or compensated.
        state: ProcessState,
        /// Its steps' results, by step name.
        results: serde_json::Value,
    },
    /// The child could not be started, or reached to be undone, for this
    /// reason (saying what to do): [`Event::ChildRefused`].
    Refused(String),
    /// The child stopped in `error`: why, and what an operator can do
    /// ([`Event::ChildStopped`]).
    Stopped(String),
}

impl ToParent {
    /// The parent's event for what it hears of `child`, started by its
    /// step `step`.
    pub fn event<'a>(&'a self, step: &'a str, child: &'a str) -> Event<'a> {
        match self {
            Self::Ended { state, results } => Event::ChildEnded {
                step,
                child,
                state: *state,
                results,
            },
            Self::Refused(reason) => Event::ChildRefused { step, reason },
            Self::Stopped(reason) => Event::ChildStopped {
                step,
                child,
                reason,
            },
        }
    }

    /// Why the undo of `child`, the child of step `step`, is refused when
    /// the child stopped in `error` while undoing itself, and what to do.
    pub fn stopped_while_undoing(child: &str, step: &str) -> String {
        format!(
            "child order {child} of step {step} stopped in error while undoing itself: fix its cause and resubmit it (its compensation resumes), then resubmit this order to finish undoing it"
        )
    }

    /// A child of workflow `workflow` version `version` whose plan was never
    /// registered cannot start.
    pub fn not_registered(child: &str, workflow: &str, version: i32) -> Self {
        Self::Refused(format!(
            "child order {child} could not start: workflow {workflow} version {version} is not registered (a scheduler registers the workflows it runs as it starts)"
        ))
    }

    /// A child whose parent is `depth` children deep cannot start when it
    /// would be deeper than [`MAX_DEPTH`].
    pub fn too_deep(child: &str, depth: usize) -> Option<Self> {
        (depth >= MAX_DEPTH).then(|| {
            Self::Refused(format!(
                "child order {child} could not start: it would be {} children deep, and at most {MAX_DEPTH} are allowed",
                depth + 1
            ))
        })
    }

    /// A child cannot start when the tree of `root` holds `size` orders,
    /// [`MAX_TREE_ORDERS`] or more, already.
    pub fn tree_full(child: &str, root: &str, size: usize) -> Option<Self> {
        (size >= MAX_TREE_ORDERS).then(|| {
            Self::Refused(format!(
                "child order {child} could not start: the tree of order {root} holds {size} orders, and at most {MAX_TREE_ORDERS} are allowed (resubmitting a parent starts its children anew: see each child's history)"
            ))
        })
    }

    /// A child whose attributes (built from its parent's templates) do not
    /// match its workflow's `attributes_schema` cannot start, as a client's
    /// order with them would be refused at intake. A schema that does not
    /// compile checks nothing (the scheduler that registered it refused to
    /// start with it).
    pub fn attributes_refused(
        child: &str,
        (workflow, version): (&str, i32),
        schema: &serde_json::Value,
        body: &serde_json::Value,
    ) -> Option<Self> {
        let validator = jsonschema::validator_for(schema).ok()?;
        let empty = serde_json::Value::Object(serde_json::Map::new());
        let attributes = body.get("attributes").unwrap_or(&empty);
        let why = sas_messages::attributes::refusal(&validator, workflow, version, attributes)?;
        Some(Self::Refused(format!(
            "child order {child} could not start: its {why}"
        )))
    }

    /// A child cannot start when an order with its id exists that the step
    /// did not start.
    pub fn squatted(child: &str) -> Self {
        Self::Refused(format!(
            "child order {child} could not start: an order with its id exists, which this step did not start (a client's own order?); rename the step or that order's id"
        ))
    }
}

/// The end `decision` brings the order of `before` to, told to the parent
/// that started it: processed or compensated, with its steps' results as
/// the decision left them; or its stop, in `error`, with why. `None` for
/// an order no parent started, or one the decision neither ends nor
/// stops.
pub fn end_told<'a>(
    before: &'a Snapshot,
    decision: &Decision,
) -> Option<(&'a ParentLink, ToParent)> {
    let parent = before.parent.as_ref()?;
    let process = decision.process.as_ref()?;
    let state = process.state;
    if state == ProcessState::Error && before.process.state != ProcessState::Error {
        let child = &before.order_id;
        let why = process
            .last_error
            .as_deref()
            .unwrap_or("no reason recorded");
        let reason = if before.process.state == ProcessState::Compensating {
            format!(
                "child order {child} stopped in error while undoing itself: {why}; resubmit it once its cause is fixed (its undo resumes), and this order is undone when it ends"
            )
        } else {
            format!(
                "child order {child} stopped in error: {why}; resume or resubmit it once its cause is fixed, and this order goes on when it ends; or cancel this order, which undoes both"
            )
        };
        return Some((parent, ToParent::Stopped(reason)));
    }
    if !matches!(state, ProcessState::Processed | ProcessState::Compensated) {
        return None;
    }
    let mut after = before.clone();
    after.apply(decision);
    let results: serde_json::Map<String, serde_json::Value> = after
        .steps
        .into_iter()
        .filter_map(|step| Some((step.name, step.result?)))
        .collect();
    let results = serde_json::Value::Object(results);
    Some((parent, ToParent::Ended { state, results }))
}

/// What the parent whose step `step` asked `child` to undo itself hears at
/// once, given the child as it was and what it decided (`None`: gone,
/// retired or never stored): the child's undo refused when it is gone or
/// stopped in error while undoing itself, its end when it had undone
/// itself already (it ended compensated while its parent could not take
/// that end: stopped, or undoing an earlier step); nothing while it undoes
/// itself (its end is told when it comes, see [`end_told`]).
pub fn undo_answer(
    child: &str,
    step: &str,
    undone: Option<(&Snapshot, &Decision)>,
) -> Option<ToParent> {
    match undone {
        None => Some(ToParent::Refused(format!(
            "child order {child} of step {step} is gone (retired, or never stored): what it did cannot be undone from here; undo it by hand, then resolve this alert"
        ))),
        Some((_, decision)) if matches!(decision.verdict, Verdict::Refused(ProcessState::Error)) => {
            Some(ToParent::Refused(ToParent::stopped_while_undoing(
                child, step,
            )))
        }
        Some((before, decision))
            if before.process.state == ProcessState::Compensated && decision.process.is_none() =>
        {
            Some(ToParent::Ended {
                state: ProcessState::Compensated,
                results: serde_json::Value::Object(serde_json::Map::new()),
            })
        }
        Some(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::kind::{ChildStep, Kind};

    #[test]
    fn a_child_s_id_is_the_parent_s_and_the_step_s_in_the_parent_s_tenant() {
        let parent = OrderId::from("ord-1".to_owned()).qualified("shop");
        let step = |key: &str| {
            let definition = crate::model::NewStep {
                name: "fulfil".into(),
                kind: Kind::Child(ChildStep {
                    workflow: "fulfil".into(),
                    version: 1,
                    attributes: None,
                    on_failure: crate::OnFailure::Compensate,
                }),
                timeout: std::time::Duration::from_secs(1),
                group: None,
            };
            let mut row = StepRow::new(&parent, 1, &definition);
            if !key.is_empty() {
                row.idempotency_key = key.to_owned();
            }
            row
        };
        let child = child_order_id(&parent, &step(""));
        assert_eq!(child.as_str(), "ord-1:fulfil@shop");
        assert_eq!(child.tenant(), "shop");
        assert_eq!(
            child_order_id(&parent, &step("")),
            child,
            "derived, not drawn"
        );
        let again = child_order_id(&parent, &step("ord-1@shop:fulfil:r2"));
        assert_eq!(
            again.as_str(),
            "ord-1:fulfil:r2@shop",
            "a restarted step, a new child"
        );
        let long = OrderId::from("x".repeat(60));
        let (a, b) = (derived_id(&long, "first"), derived_id(&long, "second"));
        assert!(a.len() <= sas_messages::order::MAX_ID_LEN, "{a}");
        assert_ne!(a, b, "two steps, two children");
    }

    #[test]
    fn a_child_s_body_is_the_parent_s_with_its_own_id_workflow_and_attributes() {
        let parent = serde_json::json!({"order_id": "ord-1", "workflow": "big", "reply_to": "q",
            "amount_cents": 5, "attributes": {"a": 1}});
        let child = OrderId::from("ord-1:fulfil".to_owned());
        let body = child_body(&parent, &child, "order", None);
        assert_eq!(body["order_id"], "ord-1:fulfil");
        assert_eq!(body["workflow"], "order");
        assert_eq!(body["attributes"], serde_json::json!({"a": 1}));
        assert!(body.get("reply_to").is_none());
        let body = child_body(&parent, &child, "order", Some(serde_json::json!({"b": 2})));
        assert_eq!(body["attributes"], serde_json::json!({"b": 2}));
    }
}
