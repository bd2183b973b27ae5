//! The order state machine: every transition of an order is decided here,
//! and only here.
//!
//! [`decide`] takes what is known of an order (a [`Snapshot`], read under
//! the order's lock), one [`Event`] and a [`Context`] (the database clock's
//! `now`, who acts, the id for a new attempt), and returns a [`Decision`]:
//! the rows to change (each step change guarded by the state and attempt id
//! it was decided on), the history lines, an optional alert, the status
//! messages and the step request to publish after the commit. It has no
//! database, no broker and no clock of its own, so every rule can be tested
//! without Postgres, and [`Snapshot::apply`] replays a decision in memory.
//!
//! The store loads snapshots and applies decisions
//! (`crate::writes::apply`). Two hot paths, the intake and a forward step's
//! success, are single SQL statements for speed; the property test in
//! `tests/tests/e2e/state_machine.rs` holds them to what this module decides.
//!
//! - [`names`]: history events and alert kinds.
//! - [`dispatch`]: the one constructor of a step request, with its key,
//!   payload, deadline and history detail.
//! - [`kind`]: what a step does (a call, a wait, a delay): the closed set
//!   the rules match on.
//! - [`wait`]: what an event sent to an order becomes there, the one rule
//!   the scheduler and every front end that sends one follow.
//! - [`undo`]: when a step may be undone, the one rule every road to
//!   compensation follows.
//! - `rules`: the decisions, one function per event.

pub mod admission;
pub mod call;
pub mod child;
pub mod concurrency;
pub mod dispatch;
pub mod key_learning;
pub mod kind;
pub mod moves;
pub mod names;
pub mod park;
mod rules;
#[cfg(test)]
mod tests;
pub mod undo;
pub mod wait;

use std::time::Duration;

use chrono::{DateTime, Utc};
use sas_messages::{AttemptId, OrderId, OrderStatus, StatusEvent, StepReply, SCHEMA_VERSION};
use sas_runtime::Backoff;
use serde::Serialize;

use crate::model::{NewStep, ProcessState, Progress, StepState};
pub use admission::{
    admission_delta, admit_key, slots_held, AdmissionDelta, PRIORITY_STEP, UNDO_HEAD_START,
};
pub use names::{AlertKind, HistoryEvent, ResubmitAction};
pub use rules::decide;
pub use sas_messages::storable::{storable, storable_text};

/// The process record of an order: the fields transitions change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ProcessRow {
    /// The pattern's ProcessState.
    pub state: ProcessState,
    /// The scheduler holding the order, if any.
    pub locked_by: Option<String>,
    /// Deadline of the attempt in flight.
    pub complete_by: Option<DateTime<Utc>>,
    /// Deadlines missed so far (reset when compensation starts).
    pub failure_count: i32,
    /// Earliest time a scheduler may claim the order.
    pub not_before: DateTime<Utc>,
    /// Why the order last failed, if it did.
    pub last_error: Option<String>,
    /// The agent whose slot the order waits for (admission), if any.
    pub waiting_for: Option<String>,
    /// The order's place in that agent's line (see [`admit_key`]), or in
    /// its key's.
    pub admit_key: Option<DateTime<Utc>>,
    /// The key whose line the order waits in, its step's concurrency limit
    /// full (see [`concurrency`]), if any.
    pub waiting_key: Option<String>,
}

/// One step of an order: its definition (copied at intake) and its state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StepRow {
    /// Position in the workflow, from 0.
    pub position: i32,
    /// Step name.
    pub name: String,
    /// What the step does (see [`kind`]), from its definition.
    #[serde(flatten)]
    pub kind: kind::Kind,
    /// How long one attempt may take.
    pub timeout_ms: i32,
    /// Step state.
    pub state: StepState,
    /// Attempts started so far, actions and compensations together.
    pub attempt: i32,
    /// The current attempt: the only one whose reply counts.
    pub attempt_id: Option<AttemptId>,
    /// Deadline of the current attempt.
    pub complete_by: Option<DateTime<Utc>>,
    /// Key the remote service deduplicates the action on.
    pub idempotency_key: String,
    /// What the remote service answered (what compensation needs).
    pub result: Option<serde_json::Value>,
    /// Last error seen.
    pub last_error: Option<String>,
    /// Some attempt of the action may have reached the remote service without
    /// a known outcome; once true it stays true, and compensation undoes the
    /// step whatever later attempts answered.
    pub maybe_applied: bool,
    /// Which undo key the compensation uses (see [`dispatch::compensation_key`]).
    pub undo_generation: i32,
    /// The current undo key was refused for good by the remote service.
    pub undo_refused: bool,
    /// What the remote service answered to the undo.
    pub undo_result: Option<serde_json::Value>,
    /// The parallel group it starts with, if any (see
    /// [`crate::NewStep::group`]).
    pub group: Option<String>,
    /// The key line of its current attempt, or of the attempt waiting for
    /// room, when its workflow limits it by key (see [`concurrency`]).
    pub limit_key: Option<String>,
}

impl StepRow {
    /// The step as it is before its first attempt, from the workflow definition.
    pub fn new(order_id: &str, position: i32, step: &NewStep) -> Self {
        Self {
            position,
            name: step.name.clone(),
            kind: step.kind.clone(),
            timeout_ms: i32::try_from(step.timeout.as_millis()).unwrap_or(i32::MAX),
            state: StepState::NotStarted,
            attempt: 0,
            attempt_id: None,
            complete_by: None,
            idempotency_key: dispatch::idempotency_key(order_id, &step.name),
            result: None,
            last_error: None,
            maybe_applied: false,
            undo_generation: 0,
            undo_refused: false,
            undo_result: None,
            group: step.group.clone(),
            limit_key: None,
        }
    }

    /// Whether compensation must undo this step: it had, or may have had, an
    /// effect (completed; in flight when the order was given up; its undo
    /// under way; or failed, or resumed by an operator, after an attempt
    /// whose outcome is unknown). A step refused without any such attempt
    /// applied nothing.
    pub fn needs_undo(&self) -> bool {
        self.kind.undoable()
            && match self.state {
                StepState::Completed | StepState::Running | StepState::Compensating => true,
                StepState::Failed | StepState::NotStarted => self.maybe_applied,
                StepState::Compensated => false,
            }
    }

    /// Whether its undo began: sent, done, or refused. An order stopped in
    /// error with no such step may be resumed (its failed step starts
    /// again) or cancelled; one with such a step may not.
    pub fn undo_began(&self) -> bool {
        matches!(self.state, StepState::Compensating | StepState::Compensated) || self.undo_refused
    }

    /// Whether its workflow says to stop the order in `error` when this step
    /// fails for good, instead of undoing it (see [`call::OnFailure`]).
    pub fn stops_on_failure(&self) -> bool {
        self.kind.on_failure() == call::OnFailure::Stop
    }

    /// When its current attempt was started: its deadline less its timeout.
    pub fn started_at(&self) -> Option<DateTime<Utc>> {
        self.complete_by
            .map(|by| by - chrono::Duration::milliseconds(i64::from(self.timeout_ms)))
    }
}

/// Everything a decision needs to know about one order, read under its lock.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Snapshot {
    /// The client's order id.
    pub order_id: OrderId,
    /// The order as submitted: part of every step request's payload.
    pub body: serde_json::Value,
    /// The client's status queue, if it named one.
    pub reply_to: Option<String>,
    /// The order's W3C trace id.
    pub trace_id: Option<String>,
    /// The client's AMQP `correlation_id`, carried back on its status messages.
    pub reply_correlation_id: Option<String>,
    /// 0 (lowest) to 9: its place when it has to wait for a slot.
    pub priority: i16,
    /// The process record.
    pub process: ProcessRow,
    /// The steps, by position.
    pub steps: Vec<StepRow>,
    /// Events kept in the order's mailbox, not used yet, oldest first.
    pub mailbox: Vec<park::MailboxEvent>,
    /// Who submitted it (`amqp:<user>`, `gateway:<client>`), when known.
    pub submitted_by: Option<String>,
    /// The order whose child step started it, if one did (see [`child`]).
    pub parent: Option<child::ParentLink>,
}

impl Snapshot {
    /// An order as it is the moment before intake stores it: pending, held
    /// by nobody, every step not started.
    pub fn new_order(
        order_id: &str,
        body: serde_json::Value,
        reply_to: Option<String>,
        trace_id: Option<String>,
        priority: i16,
        steps: &[NewStep],
        now: DateTime<Utc>,
    ) -> Self {
        Self {
            order_id: order_id.into(),
            body,
            reply_to,
            trace_id,
            reply_correlation_id: None,
            priority,
            process: ProcessRow {
                state: ProcessState::Pending,
                locked_by: None,
                complete_by: None,
                failure_count: 0,
                not_before: now,
                last_error: None,
                waiting_for: None,
                admit_key: None,
                waiting_key: None,
            },
            steps: (0..)
                .zip(steps)
                .map(|(position, step)| StepRow::new(order_id, position, step))
                .collect(),
            mailbox: Vec::new(),
            submitted_by: None,
            parent: None,
        }
    }

    /// The step whose attempt `attempt_id` is current, if any.
    pub fn step_of_attempt(&self, attempt_id: AttemptId) -> Option<&StepRow> {
        self.steps
            .iter()
            .find(|step| step.attempt_id == Some(attempt_id))
    }

    /// Replays a decision in memory: what the store's apply does to the rows.
    /// The property test uses it as the model the SQL paths must match.
    pub fn apply(&mut self, decision: &Decision) {
        if let Some(process) = &decision.process {
            self.process = process.clone();
        }
        if let Some(moved) = &decision.moved {
            self.steps.clone_from(&moved.steps);
        }
        for change in &decision.steps {
            if let Some(step) = self
                .steps
                .iter_mut()
                .find(|step| step.position == change.row.position)
            {
                *step = change.row.clone();
            }
        }
        // A used event leaves the mailbox (the store marks it used).
        if let Some(used) = &decision.used_event {
            self.mailbox.retain(|event| &event.event_id != used);
        }
    }
}

/// How the supervisor treats an order whose step missed its deadline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RecoveryPolicy {
    /// Failures tolerated before giving up: the next one starts compensation
    /// (or, for a compensation, ends the order in error).
    pub max_failures: i32,
    /// The wait before each retry, by the failure count (equal jitter).
    pub backoff: Backoff,
    /// How long after a deadline the supervisor waits before acting, so that
    /// a call started just in time has landed before any undo is sent.
    pub grace: Duration,
}

/// What happened to an order.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Event<'a> {
    /// A client submitted it; intake stores it and starts its first step.
    Submitted,
    /// A scheduler claimed it (pending and due, or a compensation nobody holds).
    Claimed,
    /// An agent answered an attempt.
    Reply(&'a StepReply),
    /// The supervisor found its deadline passed.
    DeadlineMissed {
        /// Retries and backoff.
        policy: &'a RecoveryPolicy,
        /// A number in [0, 1): the random half of the backoff ("equal
        /// jitter"), so orders that failed together do not return together.
        jitter: f64,
    },
    /// A request or reply of an attempt was dead-lettered.
    DeadLettered {
        /// The attempt the message belonged to (its correlation id).
        attempt_id: AttemptId,
        /// Why it was dead-lettered.
        reason: &'a str,
        /// The message was a request its agent dead-lettered unread: no
        /// call was made for the attempt. False for RabbitMQ's delivery
        /// limit (an agent may have died mid-call) and for replies.
        no_call: bool,
    },
    /// An operator put a failed or compensated order back.
    Resubmitted {
        /// How many times it was resubmitted before: fresh keys get a new generation.
        earlier: i64,
    },
    /// An operator resumed an order stopped in `error` from the step that
    /// failed (refused, with the reason, where its compensation began).
    Resumed {
        /// The operator's reason, for the history.
        reason: &'a str,
        /// How many times it was resubmitted or resumed before: a fresh key
        /// gets a new generation.
        earlier: i64,
    },
    /// An operator cancelled a running order: undo what was done.
    Cancelled {
        /// The operator's reason.
        reason: &'a str,
    },
    /// An event arrived in the order's mailbox (already in the snapshot's
    /// `mailbox`): a wait step waiting for it uses it.
    EventArrived,
    /// An operator moves the order from version `from` of its workflow to
    /// version `to`, whose steps are `plan`, old step names mapped to new
    /// ones by `mapping` (see [`moves::plan_move`]).
    Moved {
        /// The new version's steps.
        plan: &'a [NewStep],
        /// Old step names to new ones (a step absent keeps its name).
        mapping: &'a std::collections::BTreeMap<String, String>,
        /// The order's version now.
        from: i32,
        /// The version it moves to.
        to: i32,
    },
    /// The child order a child step started ended (see [`child`]): decided
    /// in the transaction that ended it.
    ChildEnded {
        /// The parent's step that started it.
        step: &'a str,
        /// The child's id (a step restarted by an operator starts another).
        child: &'a str,
        /// How it ended: processed or compensated.
        state: ProcessState,
        /// Its steps' results, by step name.
        results: &'a serde_json::Value,
    },
    /// A child step's child could not be started, or reached to be undone
    /// (see [`child`]): the step fails as a refused call's would, or, while
    /// undoing, its undo is refused and the order stops in `error`.
    ChildRefused {
        /// The parent's step.
        step: &'a str,
        /// What went wrong, and what to do.
        reason: &'a str,
    },
    /// A child step's child stopped in `error` (see [`child`]): waiting for
    /// it forward, the order records why and what an operator can do, and
    /// waits on until the step's timeout; waiting for its undo, nothing
    /// changes (the order's next ask hears whether it can still be undone).
    ChildStopped {
        /// The parent's step that started it.
        step: &'a str,
        /// The child's id.
        child: &'a str,
        /// Why the child stopped.
        reason: &'a str,
    },
    /// The order's parent is undone, and this order (its child) with it:
    /// cancelled while it runs, compensated once processed.
    UndoneForParent {
        /// Why, for the history.
        reason: &'a str,
    },
}

/// The inputs of a decision that come from outside the order.
#[derive(Debug, Clone, Copy)]
pub struct Context<'a> {
    /// The database clock (`now()` of the transaction), never a local clock.
    pub now: DateTime<Utc>,
    /// The service instance deciding (recorded in the history).
    pub actor: &'a str,
    /// The id a new attempt gets, if the decision starts one.
    pub next_attempt_id: AttemptId,
    /// How long before its deadline a new attempt's calls must have started
    /// (see [`crate::timing`]).
    pub start_margin: Duration,
    /// How long after an attempt's deadline a call of it may still land
    /// (`deadlines.grace_ms`): no undo of an action whose outcome is
    /// unknown is sent before (see [`undo::undo_not_before`]).
    pub grace: Duration,
    /// The largest message the broker and the agents take
    /// (`amqp.max_message_bytes`): a request that would be larger is not
    /// built (see [`dispatch::Unbuilt`]).
    pub max_request_bytes: usize,
    /// An agent with no slot free for this decision: an attempt for it is
    /// not started, the order waits in that agent's line instead.
    pub closed: Option<&'a str>,
    /// A key line with no room for this decision (see [`concurrency`]): an
    /// attempt in it is not started, the order waits in its line instead.
    pub closed_key: Option<&'a str>,
}

/// Whether an event changed the order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The decision's changes are to be applied.
    Applied,
    /// An operator's resubmission was accepted; this is what it does.
    Resubmitted(ResubmitAction),
    /// A reply for an attempt that is not current: recorded, nothing else.
    Stale(String),
    /// The event does not apply to the order as it is: nothing changes.
    Unchanged(String),
    /// An operator action the order's state does not allow.
    Refused(ProcessState),
    /// An operator's resume was accepted: the order starts again at step
    /// `from`, with its key kept (`key_kept`, its last outcome unknown) or
    /// a fresh one (its remote refused the old one).
    Resumed {
        /// The step it starts again from.
        from: String,
        /// The step's action keeps its idempotency key.
        key_kept: bool,
    },
    /// An operator's resume the order's steps do not allow, and why.
    NotResumable(String),
    /// An operator's resubmission or resume of a child order its parent no
    /// longer waits for ([`child::put_back_refusal`]), and why.
    NotPutBack(String),
    /// An operator's move the order does not allow (it is running, or the
    /// move would lose what it did), and why.
    NotMovable(String),
}

/// A step's new row, guarded by what it was decided on.
#[derive(Debug, Clone, PartialEq)]
pub struct StepChange {
    /// The state the step must still be in.
    pub expected_state: StepState,
    /// The attempt id the step must still have.
    pub expected_attempt_id: Option<AttemptId>,
    /// The step after the change.
    pub row: StepRow,
}

/// One history line (its time and actor come from the context).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct HistoryLine {
    /// What was decided.
    pub event: HistoryEvent,
    /// The step concerned.
    pub step: Option<String>,
    /// The attempt concerned.
    pub attempt_id: Option<AttemptId>,
    /// Reason or detail.
    pub detail: Option<String>,
}

/// An alert for the operator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NewAlert {
    /// Why.
    pub kind: AlertKind,
    /// What happened and what to do.
    pub message: String,
}

/// Everything one event does to one order.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    /// Whether anything changes.
    pub verdict: Verdict,
    /// The process record after the decision, when it changes.
    pub process: Option<ProcessRow>,
    /// The steps that change.
    pub steps: Vec<StepChange>,
    /// History lines, in order.
    pub history: Vec<HistoryLine>,
    /// An alert to raise.
    pub alert: Option<NewAlert>,
    /// Resolve the order's open alerts (an operator took it back).
    pub resolve_alerts: bool,
    /// What to publish once committed: status messages and at most one step request.
    pub progress: Progress,
    /// How the agents' admission counters move.
    pub admission: Vec<AdmissionDelta>,
    /// The mailbox event a wait step used (by `event_id`): marked used with
    /// the decision, so it is used once.
    pub used_event: Option<String>,
    /// The business key the order waits with from now on (its wait step
    /// reads one): events naming it go to the order.
    pub wait_key: Option<park::WaitKey>,
    /// The order's new plan, when a move replaced its steps (positions and
    /// names may change, so they are not [`StepChange`]s).
    pub moved: Option<MovedPlan>,
    /// A key the remote asked to rest (see [`concurrency::KeyPause`]).
    pub key_pause: Option<concurrency::KeyPause>,
    /// What the reply said of an adaptive key's remote (see
    /// [`key_learning`]).
    pub key_sample: Option<key_learning::KeySample>,
    /// What the decision asks of a child order (see [`child`]), applied by
    /// the write kernel in the same transaction.
    pub child: Option<child::ChildCommand>,
}

impl Decision {
    /// The agents this decision takes new slots of (one, or those of a
    /// parallel group's members), and for what kind of attempt: the store
    /// checks each has room before applying.
    pub fn takes_slots(&self) -> Vec<(&str, sas_messages::StepKind)> {
        let Some(kind) = self.progress.dispatches.first().map(|d| d.kind) else {
            return Vec::new();
        };
        self.admission
            .iter()
            .filter(|delta| delta.in_flight > 0)
            .map(|delta| (delta.agent.as_str(), kind))
            .collect()
    }
}

impl Decision {
    /// The key lines this decision starts attempts in, each with its
    /// limit and whether the attempt is an undo: the store checks each has
    /// room before applying (see [`concurrency`]).
    pub fn takes_keys(&self) -> Vec<(&str, concurrency::KeyLimits<'_>, sas_messages::StepKind)> {
        self.steps
            .iter()
            .filter(|change| change.row.attempt_id != change.expected_attempt_id)
            .filter_map(|change| {
                let kind = match change.row.state {
                    StepState::Running => sas_messages::StepKind::Action,
                    StepState::Compensating => sas_messages::StepKind::Compensation,
                    _ => return None,
                };
                let (limits, _, _) = change.row.kind.calls()?.key_limits()?;
                Some((change.row.limit_key.as_deref()?, limits, kind))
            })
            .collect()
    }

    /// True when the store has rows to write.
    pub fn writes(&self) -> bool {
        self.process.is_some()
            || self.used_event.is_some()
            || !self.steps.is_empty()
            || !self.history.is_empty()
            || self.alert.is_some()
            || self.resolve_alerts
            || self.moved.is_some()
    }
}

/// What a move makes of an order (see [`Event::Moved`]): the version it
/// now runs and every one of its steps, written by the write kernel in
/// place of the old ones.
#[derive(Debug, Clone, PartialEq)]
pub struct MovedPlan {
    /// The workflow version the order moved to.
    pub version: i32,
    /// Its steps under that version, with what the carried ones did.
    pub steps: Vec<StepRow>,
}

/// A status message for `order_id` stamped with the database clock.
pub fn status(
    order_id: &str,
    event: StatusEvent,
    step: Option<&str>,
    detail: Option<&str>,
    at: DateTime<Utc>,
) -> OrderStatus {
    OrderStatus {
        schema_version: SCHEMA_VERSION,
        order_id: order_id.into(),
        event,
        step: step.map(str::to_owned),
        detail: detail.map(str::to_owned),
        at,
    }
}

/// `at` cut to whole microseconds, the precision Postgres keeps, so that a
/// time decided here equals the one read back.
pub fn to_micros(at: DateTime<Utc>) -> DateTime<Utc> {
    DateTime::from_timestamp_micros(at.timestamp_micros()).unwrap_or(at)
}
