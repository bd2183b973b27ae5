//! The stored form of a step's kind: the `steps` columns `agent`, `action`,
//! `compensation`, `request` and `park`, and the same fields in the plans
//! registered in `workflow_plans` and in the console's API. Steps were
//! stored this way before kinds were a type, and SQL reads some of these
//! columns (an agent's in-flight count, the fast path's "is it a call"),
//! so every kind still fills them:
//!
//! | kind  | agent | action    | compensation | request         | park    |
//! |-------|-------|-----------|--------------|-----------------|---------|
//! | call  | agent | action    | its undo     | its templates   | null    |
//! | wait  | `""`  | the event | null         | null            | `event` |
//! | delay | `""`  | `delay`   | null         | null            | `delay` |
//! | child | `""`  | workflow  | `undo`       | `{"on_failure": "stop"}`, or null for the default | `child` |
//!
//! Nothing outside this file decides what goes in those fields: the
//! columns are read into [`Stored`] and written from [`StoredKind`]
//! (`step_columns.rs`, the intake statements), and a move writes a plan's
//! JSON, which is this form (migration 0016's `sas_replace_steps`).
//! Reading trusts the form: a row with a `park` is its parked kind,
//! whatever its other columns hold.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use super::{CallStep, ChildStep, DelayStep, Kind, WaitStep};
use crate::machine::call::StepCalls;

/// What a child step's `compensation` column holds: the child is undone by
/// its own compensation, as a whole.
pub(super) const CHILD_UNDO: &str = "undo";

/// What a parked step's `park` column holds, tagged by `kind`.
#[derive(Debug, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum Park {
    Event(WaitStep),
    Delay(DelayStep),
    Child(ChildStep),
}

/// [`Park`], borrowed from a [`Kind`], to write.
#[derive(Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub(crate) enum ParkRef<'a> {
    Event(&'a WaitStep),
    Delay(&'a DelayStep),
    Child(&'a ChildStep),
}

/// A step's kind as read from its columns or a registered plan.
#[derive(Debug, Deserialize)]
pub(crate) struct Stored {
    pub(crate) agent: String,
    pub(crate) action: String,
    #[serde(default)]
    pub(crate) compensation: Option<String>,
    #[serde(default)]
    pub(crate) calls: Option<Box<StepCalls>>,
    #[serde(default)]
    pub(crate) park: Option<Park>,
}

/// A step's kind in its stored form, borrowed, to write (the columns, a
/// registered plan, the console's API).
#[derive(Debug, Serialize)]
pub(crate) struct StoredKind<'a> {
    pub(crate) agent: &'a str,
    pub(crate) action: &'a str,
    pub(crate) compensation: Option<&'a str>,
    pub(crate) calls: Option<Cow<'a, StepCalls>>,
    pub(crate) park: Option<ParkRef<'a>>,
}

impl From<Stored> for Kind {
    fn from(stored: Stored) -> Self {
        match stored.park {
            None => Kind::Call(CallStep {
                agent: stored.agent,
                action: stored.action,
                compensation: stored.compensation,
                calls: stored.calls,
            }),
            Some(Park::Event(wait)) => Kind::Wait(wait),
            Some(Park::Delay(delay)) => Kind::Delay(delay),
            Some(Park::Child(child)) => Kind::Child(ChildStep {
                on_failure: stored
                    .calls
                    .map(|calls| calls.on_failure)
                    .unwrap_or_default(),
                ..child
            }),
        }
    }
}

impl Kind {
    /// The kind in its stored form (see the table above).
    pub(crate) fn stored(&self) -> StoredKind<'_> {
        let parked = |action, park| StoredKind {
            agent: "",
            action,
            compensation: None,
            calls: None,
            park: Some(park),
        };
        match self {
            Kind::Call(call) => StoredKind {
                agent: &call.agent,
                action: &call.action,
                compensation: call.compensation.as_deref(),
                calls: call.calls.as_deref().map(Cow::Borrowed),
                park: None,
            },
            Kind::Wait(wait) => parked(&wait.event, ParkRef::Event(wait)),
            Kind::Delay(delay) => parked("delay", ParkRef::Delay(delay)),
            Kind::Child(child) => StoredKind {
                compensation: Some(CHILD_UNDO),
                calls: (!child.on_failure.is_default()).then(|| {
                    Cow::Owned(StepCalls {
                        on_failure: child.on_failure,
                        ..StepCalls::default()
                    })
                }),
                ..parked(&child.workflow, ParkRef::Child(child))
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::call::OnFailure;
    use crate::machine::park::OnTimeout;

    #[test]
    fn every_kind_reads_back_as_it_was_stored() {
        for kind in super::super::tests::kinds() {
            let json = serde_json::to_value(&kind).unwrap();
            let back: Kind = serde_json::from_value(json.clone()).unwrap();
            assert_eq!(back, kind, "{json}");
        }
    }

    #[test]
    fn a_step_stored_before_kinds_were_a_type_reads_as_its_kind_and_writes_back_the_same() {
        // As steps and registered plans hold them (a plan registered again
        // must compare equal, or the schedulers warn that it changed).
        let wait = serde_json::json!({
            "agent": "", "action": "approved", "compensation": null, "calls": null,
            "park": {"kind": "event", "event": "approved", "on_timeout": "fail"}
        });
        let child = serde_json::json!({
            "agent": "", "action": "fulfil", "compensation": "undo",
            "calls": {"on_failure": "stop"},
            "park": {"kind": "child", "workflow": "fulfil", "version": 2}
        });
        let call = serde_json::json!({
            "agent": "inventory", "action": "reserve", "compensation": "release",
            "calls": null, "park": null
        });
        let read = |json: &serde_json::Value| serde_json::from_value::<Kind>(json.clone()).unwrap();
        assert_eq!(
            read(&wait).waits_for("approved").map(|w| w.on_timeout),
            Some(OnTimeout::Fail)
        );
        assert_eq!(read(&child).on_failure(), OnFailure::Stop);
        assert_eq!(read(&call).agent(), Some("inventory"));
        assert_eq!(read(&call).undo_label(), Some("release"));
        for json in [wait, child, call] {
            assert_eq!(serde_json::to_value(read(&json)).unwrap(), json);
        }
        let unknown = serde_json::json!({
            "agent": "", "action": "x",
            "park": {"kind": "event", "event": "x", "on_timeout": "fail", "surprise": 1}
        });
        assert!(
            serde_json::from_value::<Kind>(unknown).is_err(),
            "unknown fields are refused"
        );
    }
}
