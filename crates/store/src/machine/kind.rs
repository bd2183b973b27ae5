//! What a step does: the closed set of step kinds, owned by the state
//! machine and stored as such on every step ([`StepRow::kind`],
//! [`NewStep::kind`]). Every rule that depends on a step's kind matches on
//! [`Kind`] (or asks one of its questions below, each one exhaustive
//! match): a new kind is a new variant here and a file under
//! `machine/rules/`, and the compiler lists every other place that must
//! decide what it does.
//!
//! The columns and the registered plans' JSON keep the form steps had
//! before kinds existed (an agent, an action, an undo, call templates, and
//! a `park` for the rest); [`stored`] is the one translation between the
//! two.
//!
//! [`StepRow::kind`]: super::StepRow::kind
//! [`NewStep::kind`]: crate::model::NewStep::kind

mod stored;

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::call::{OnFailure, StepCalls};
use super::park::OnTimeout;

pub(crate) use stored::{Park, ParkRef, Stored, StoredKind};

/// What one step does.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "stored::Stored")]
pub enum Kind {
    /// Calls its agent's remote service: the action forward, its
    /// compensation when undone.
    Call(CallStep),
    /// Waits for an event from the outside world, for at most its timeout.
    Wait(WaitStep),
    /// Waits for a time.
    Delay(DelayStep),
    /// Starts an order of another workflow and waits for it to end (see
    /// [`crate::machine::child`]); undone by undoing that order as a whole.
    Child(ChildStep),
}

/// A step that calls an agent: what it calls, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallStep {
    /// Agent whose queue receives its requests (`inventory`).
    pub agent: String,
    /// Remote operation of the step (`reserve`).
    pub action: String,
    /// Remote operation that undoes it (`release`), if it can be undone.
    pub compensation: Option<String>,
    /// How its requests are shaped and limited, when its workflow says (see
    /// [`crate::machine::call`]); `None` sends the default call. Boxed: most
    /// steps have none, and every other kind is a fraction of its size.
    pub calls: Option<Box<StepCalls>>,
}

/// A wait for an event from the outside world (see
/// [`crate::machine::wait`]), for at most the step's timeout.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WaitStep {
    /// The event's name.
    pub event: String,
    /// What a timeout means.
    pub on_timeout: OnTimeout,
    /// A JSON pointer into `{order, attributes, results}` giving the
    /// business key that events may name instead of the order id
    /// (`/results/charge_payment/payment_id`), read when the order
    /// reaches the wait.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correlation_key: Option<String>,
    /// Who may send the event (see [`WaitStep::accepts`]); empty: whoever
    /// may address the order (its tenant's clients and operators).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub senders: Vec<String>,
}

/// A wait for a time: `delay_ms` after the previous step, and not before
/// the time the order holds at `not_before` (a JSON pointer into the order,
/// such as `/attributes/ship_after`), whichever is later.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DelayStep {
    /// Milliseconds after the previous step.
    #[serde(default)]
    pub delay_ms: u64,
    /// A pointer to an RFC 3339 time in the order; a missing or unreadable
    /// value is no constraint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub not_before: Option<String>,
}

/// An order of another workflow, started by the step (see
/// [`crate::machine::child`]): the step waits for it to end, for at most
/// the step's timeout, and takes its results. Serialized alone, it is the
/// `park` column's form, without `on_failure` (stored with the call
/// settings): serialize the [`Kind`] to keep it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ChildStep {
    /// The child's workflow.
    pub workflow: String,
    /// Its version, pinned when the parent was taken in (the plan the
    /// schedulers registered, `workflow_plans`).
    pub version: i32,
    /// The child's attributes: a template over `{order, attributes,
    /// results}` as a call's body is (absent: the parent's attributes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attributes: Option<serde_json::Value>,
    /// What the child's failure does to the parent: undo it (the default),
    /// or stop it in `error`. Stored with the call settings, not here.
    #[serde(skip)]
    pub on_failure: OnFailure,
}

impl CallStep {
    /// A call of `action` at `agent`, undone by `compensation` if any, sent
    /// as by default (no templates, no limits).
    pub fn new(agent: &str, action: &str, compensation: Option<&str>) -> Self {
        Self {
            agent: agent.to_owned(),
            action: action.to_owned(),
            compensation: compensation.map(str::to_owned),
            calls: None,
        }
    }
}

impl Kind {
    /// The agent a call step calls; `None` for a step that calls nobody.
    pub fn agent(&self) -> Option<&str> {
        self.call().map(|call| call.agent.as_str())
    }

    /// The step's call, if it is a call step.
    pub fn call(&self) -> Option<&CallStep> {
        match self {
            Kind::Call(call) => Some(call),
            Kind::Wait(_) | Kind::Delay(_) | Kind::Child(_) => None,
        }
    }

    /// How a call step's requests are shaped and limited, when its
    /// workflow says.
    pub fn calls(&self) -> Option<&StepCalls> {
        self.call().and_then(|call| call.calls.as_deref())
    }

    /// What the step does, in a word, for the history and the screens: a
    /// call's action, the event a wait waits for, `delay`, a child's
    /// workflow.
    pub fn label(&self) -> &str {
        match self {
            Kind::Call(call) => &call.action,
            Kind::Wait(wait) => &wait.event,
            Kind::Delay(_) => "delay",
            Kind::Child(child) => &child.workflow,
        }
    }

    /// What undoes the step, in a word, if anything does: a call's
    /// compensation, `undo` for a child (its own compensation as a whole);
    /// a wait or a delay did nothing to undo.
    pub fn undo_label(&self) -> Option<&str> {
        match self {
            Kind::Call(call) => call.compensation.as_deref(),
            Kind::Child(_) => Some(stored::CHILD_UNDO),
            Kind::Wait(_) | Kind::Delay(_) => None,
        }
    }

    /// Whether the step can be undone once it had an effect.
    pub fn undoable(&self) -> bool {
        self.undo_label().is_some()
    }

    /// What the step's failure for good does to its order (see
    /// [`OnFailure`]): a call's and a child's as their workflow says; a
    /// wait's timeout has its own `on_timeout`, and a delay never fails.
    pub fn on_failure(&self) -> OnFailure {
        match self {
            Kind::Call(call) => call
                .calls
                .as_ref()
                .map(|calls| calls.on_failure)
                .unwrap_or_default(),
            Kind::Child(child) => child.on_failure,
            Kind::Wait(_) | Kind::Delay(_) => OnFailure::default(),
        }
    }

    /// Whether a step of this kind, running, may have a call of its own in
    /// flight that can land after its deadline (and so its undo waits the
    /// grace period): a call may; a wait or a delay calls nobody, and a
    /// child's undo is the child's own compensation, which waits for its
    /// own calls.
    pub fn calls_out(&self) -> bool {
        match self {
            Kind::Call(_) => true,
            Kind::Wait(_) | Kind::Delay(_) | Kind::Child(_) => false,
        }
    }

    /// Whether a step of this kind, running, may already have had effects
    /// somewhere (so that it must be undone, and may not be replaced by a
    /// move): a call may have reached its remote, a child may have run
    /// steps; a wait or a delay did nothing.
    pub fn may_act_while_running(&self) -> bool {
        match self {
            Kind::Call(_) | Kind::Child(_) => true,
            Kind::Wait(_) | Kind::Delay(_) => false,
        }
    }

    /// Whether reaching a step of this kind parks its order (pending, held
    /// by nobody, until an event, a time, or its child's end): waits,
    /// delays and children do.
    pub fn parks(&self) -> bool {
        match self {
            Kind::Call(_) => false,
            Kind::Wait(_) | Kind::Delay(_) | Kind::Child(_) => true,
        }
    }

    /// Whether a running step of this kind may be carried by a move to a
    /// step of kind `to` under the same name (see [`crate::machine::moves`]):
    /// a call only to a call, a parked step only to one that parks the same
    /// way (a wait or a delay to a wait or a delay, a child to a child), so
    /// that what it waits for still ends it.
    pub fn carries_running_to(&self, to: &Kind) -> bool {
        match (self, to) {
            (Kind::Call(_), to) => match to {
                Kind::Call(_) => true,
                Kind::Wait(_) | Kind::Delay(_) | Kind::Child(_) => false,
            },
            (Kind::Wait(_) | Kind::Delay(_), to) => match to {
                Kind::Wait(_) | Kind::Delay(_) => true,
                Kind::Call(_) | Kind::Child(_) => false,
            },
            (Kind::Child(_), to) => match to {
                Kind::Child(_) => true,
                Kind::Call(_) | Kind::Wait(_) | Kind::Delay(_) => false,
            },
        }
    }

    /// Whether a cancel ends a running step of this kind where it is (a
    /// wait or a delay, which did nothing), rather than undoing it (a
    /// call's action, a child's run).
    pub fn ends_on_cancel(&self) -> bool {
        match self {
            Kind::Wait(_) | Kind::Delay(_) => true,
            Kind::Call(_) | Kind::Child(_) => false,
        }
    }

    /// The wait for event `event`, if this step is one.
    pub fn waits_for(&self, event: &str) -> Option<&WaitStep> {
        match self {
            Kind::Wait(wait) if wait.event == event => Some(wait),
            Kind::Wait(_) | Kind::Call(_) | Kind::Delay(_) | Kind::Child(_) => None,
        }
    }
}

impl Serialize for Kind {
    /// In the stored form (see [`stored`]): the console's API and the
    /// registered plans read steps as they always did.
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.stored().serialize(serializer)
    }
}

impl WaitStep {
    /// Whether the wait accepts its event from a sender named by
    /// `principals`, for an order of tenant `order_tenant`: yes when the
    /// wait names no senders, else when one of its `senders` is one of the
    /// principals. `"tenant"` stands for the order's own tenant
    /// (`tenant:<order_tenant>`); `"role:approver"`, `"gateway:manager"`,
    /// `"tenant:ops"` name themselves. A sender whose principals hold `*`
    /// (every sender, when tenancy is open) is accepted by every wait.
    pub fn accepts(&self, principals: &[String], order_tenant: &str) -> bool {
        self.senders.is_empty()
            || principals.iter().any(|p| p == "*")
            || self.senders.iter().any(|sender| {
                if sender == "tenant" {
                    let own = format!("tenant:{order_tenant}");
                    principals.contains(&own)
                } else {
                    principals.iter().any(|p| p == sender)
                }
            })
    }
}

impl DelayStep {
    /// When the delay, started at `now`, ends for an order whose body is
    /// `body`.
    pub fn end(&self, body: &serde_json::Value, now: DateTime<Utc>) -> DateTime<Utc> {
        let after = now
            + chrono::Duration::milliseconds(i64::try_from(self.delay_ms).unwrap_or(i64::MAX / 2));
        let at = self
            .not_before
            .as_deref()
            .and_then(|pointer| body.pointer(pointer))
            .and_then(serde_json::Value::as_str)
            .and_then(|text| DateTime::parse_from_rfc3339(text).ok())
            .map(|at| at.with_timezone(&Utc));
        at.map_or(after, |at| at.max(after))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;

    fn wait(senders: &[&str]) -> WaitStep {
        WaitStep {
            event: "approved".into(),
            on_timeout: OnTimeout::Fail,
            correlation_key: None,
            senders: senders.iter().map(|s| (*s).to_owned()).collect(),
        }
    }

    /// One step of each kind, each with every field it may hold set.
    pub(super) fn kinds() -> [Kind; 4] {
        [
            Kind::Call(CallStep {
                calls: Some(Box::new(StepCalls {
                    action: Some(crate::CallTemplate {
                        method: Some("PUT".into()),
                        ..crate::CallTemplate::default()
                    }),
                    ..StepCalls::default()
                })),
                ..CallStep::new("payment", "charge", Some("refund"))
            }),
            Kind::Wait(WaitStep {
                correlation_key: Some("/attributes/ref".into()),
                ..wait(&["role:approver"])
            }),
            Kind::Delay(DelayStep {
                delay_ms: 5,
                not_before: Some("/attributes/ship_after".into()),
            }),
            Kind::Child(ChildStep {
                workflow: "fulfil".into(),
                version: 3,
                attributes: Some(serde_json::json!({"sku": "${/order/sku}"})),
                on_failure: OnFailure::Stop,
            }),
        ]
    }

    #[test]
    fn a_call_calls_out_and_a_wait_or_delay_parks() {
        let [call, wait, delay, child] = kinds();
        for (kind, calls_out, parks, acts, ends_on_cancel, undoable) in [
            (&call, true, false, true, false, true),
            (&wait, false, true, false, true, false),
            (&delay, false, true, false, true, false),
            (&child, false, true, true, false, true),
        ] {
            assert_eq!(
                (
                    kind.calls_out(),
                    kind.parks(),
                    kind.may_act_while_running(),
                    kind.ends_on_cancel(),
                    kind.undoable(),
                ),
                (calls_out, parks, acts, ends_on_cancel, undoable),
                "{kind:?}"
            );
        }
        assert_eq!(
            [&call, &wait, &delay, &child].map(Kind::label),
            ["charge", "approved", "delay", "fulfil"]
        );
        assert_eq!(call.agent(), Some("payment"));
        assert_eq!(child.agent(), None);
        assert_eq!(child.on_failure(), OnFailure::Stop);
        assert_eq!(call.on_failure(), OnFailure::Compensate);
        assert!(wait.waits_for("approved").is_some());
        assert!(wait.waits_for("paid").is_none() && call.waits_for("approved").is_none());
        // A running step moves only to a step that ends the same way.
        let kinds = [call, wait, delay, child];
        let carried: Vec<(usize, usize)> = (0..4)
            .flat_map(|from| (0..4).map(move |to| (from, to)))
            .filter(|&(from, to)| kinds[from].carries_running_to(&kinds[to]))
            .collect();
        assert_eq!(carried, [(0, 0), (1, 1), (1, 2), (2, 1), (2, 2), (3, 3)]);
    }

    #[test]
    fn a_wait_accepts_its_event_only_from_the_senders_it_names() {
        let shop = ["gateway:shop".to_owned(), "tenant:shop".to_owned()];
        let manager = ["gateway:manager".to_owned(), "role:approver".to_owned()];
        assert!(wait(&[]).accepts(&shop, "shop"), "no senders: anyone");
        assert!(wait(&[]).accepts(&[], "shop"));
        let approvers = wait(&["role:approver"]);
        assert!(!approvers.accepts(&shop, "shop"), "the customer itself");
        assert!(approvers.accepts(&manager, "shop"));
        let own = wait(&["tenant"]);
        assert!(own.accepts(&shop, "shop"));
        assert!(!own.accepts(&shop, "rival"), "another tenant's order");
        assert!(wait(&["gateway:manager"]).accepts(&manager, "shop"));
        assert!(approvers.accepts(&["amqp:x".to_owned(), "*".to_owned()], "default"));
    }

    #[test]
    fn a_delay_ends_at_the_later_of_its_delay_and_the_order_s_time() {
        let now = DateTime::parse_from_rfc3339("2026-11-26T10:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let body = serde_json::json!({"attributes": {"ship_after": "2026-11-27T00:00:00Z", "bad": "soon"}});
        let delay = |ms, pointer: Option<&str>| DelayStep {
            delay_ms: ms,
            not_before: pointer.map(str::to_owned),
        };
        assert_eq!(
            delay(1000, None).end(&body, now),
            now + chrono::Duration::seconds(1)
        );
        assert_eq!(
            delay(1000, Some("/attributes/ship_after"))
                .end(&body, now)
                .to_rfc3339(),
            "2026-11-27T00:00:00+00:00"
        );
        assert_eq!(delay(0, Some("/attributes/bad")).end(&body, now), now);
    }
}
