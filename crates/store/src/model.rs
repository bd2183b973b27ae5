//! Types of the state store: states, step definitions, and what a transition
//! asks the caller to do next.

use std::fmt;
use std::time::Duration;

use chrono::{DateTime, Utc};
use sas_messages::{AttemptId, OrderId, OrderStatus, StepKind};
use serde::Serialize;

/// The pattern's ProcessState of an order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, sqlx::Type)]
#[sqlx(type_name = "process_state", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum ProcessState {
    /// Waiting for a scheduler to claim it (new, or sent back by the supervisor).
    Pending,
    /// Held by a scheduler (`locked_by`), a step in flight until `complete_by`.
    Processing,
    /// Every step succeeded. Terminal.
    Processed,
    /// Could neither finish nor be undone; an alert was raised. Terminal until resubmitted.
    Error,
    /// Undoing completed steps in reverse order.
    Compensating,
    /// Every completed step was undone. Terminal.
    Compensated,
}

impl ProcessState {
    /// Every state, in lifecycle order (for metrics and listings).
    pub const ALL: [Self; 6] = [
        Self::Pending,
        Self::Processing,
        Self::Processed,
        Self::Error,
        Self::Compensating,
        Self::Compensated,
    ];

    /// The name used in the database and on the wire.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Pending => "pending",
            Self::Processing => "processing",
            Self::Processed => "processed",
            Self::Error => "error",
            Self::Compensating => "compensating",
            Self::Compensated => "compensated",
        }
    }

    /// True for states no scheduler or supervisor will move an order out of.
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Processed | Self::Error | Self::Compensated)
    }

    /// True for orders done with for good (an order in `error` still waits
    /// for the operator): the ones the open-orders index (`order_process_open`)
    /// and the `sas_orders` gauges leave out.
    pub fn is_finished(self) -> bool {
        matches!(self, Self::Processed | Self::Compensated)
    }
}

impl fmt::Display for ProcessState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for ProcessState {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|state| state.as_str() == text)
            .ok_or_else(|| {
                format!("unknown state {text:?}: expected one of pending, processing, processed, error, compensating, compensated")
            })
    }
}

/// The state of one step of an order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, sqlx::Type)]
#[sqlx(type_name = "step_state", rename_all = "snake_case")]
#[serde(rename_all = "snake_case")]
pub enum StepState {
    /// Not yet attempted.
    NotStarted,
    /// An attempt of the action is in flight (its outcome may be unknown).
    Running,
    /// The action succeeded; `result` holds what compensation needs.
    Completed,
    /// The action failed permanently: nothing was applied.
    Failed,
    /// An attempt of the compensation is in flight.
    Compensating,
    /// The compensation succeeded.
    Compensated,
}

impl StepState {
    /// The name used in the database.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotStarted => "not_started",
            Self::Running => "running",
            Self::Completed => "completed",
            Self::Failed => "failed",
            Self::Compensating => "compensating",
            Self::Compensated => "compensated",
        }
    }
}

impl fmt::Display for StepState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One step of a workflow definition, copied onto each order at intake
/// (and registered with its plan's version, as JSON, for moves).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct NewStep {
    /// Step name, unique in the workflow (`reserve_stock`).
    pub name: String,
    /// What the step does: call an agent, wait for an event or a time, or
    /// start a child order (see [`crate::machine::kind`]). Its fields are
    /// this struct's in the JSON (the stored form, see
    /// `machine::kind::stored`).
    #[serde(flatten)]
    pub kind: crate::machine::kind::Kind,
    /// How long one attempt may take before the supervisor steps in.
    pub timeout: Duration,
    /// The parallel group the step belongs to, if any: consecutive steps
    /// of one group start together, and the order moves on when all of
    /// them completed. Left out of the JSON when `None`, so that a plan
    /// registered before groups existed reads as the same plan.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
}

/// The plan an order starts with: its workflow's name and version, and the
/// steps copied onto the order at intake.
#[derive(Debug, Clone, Copy)]
pub struct Plan<'a> {
    /// The workflow's name (`order`).
    pub name: &'a str,
    /// The workflow's version, recorded with the order.
    pub version: i32,
    /// The steps, in order.
    pub steps: &'a [NewStep],
    /// What its orders' attributes must match (a JSON Schema), if the
    /// workflow says: registered with the plan for the gateway.
    pub attributes_schema: Option<&'a serde_json::Value>,
}

impl<'a> Plan<'a> {
    /// The plan of workflow `name` at `version`, with `steps`.
    pub const fn new(name: &'a str, version: i32, steps: &'a [NewStep]) -> Self {
        Self {
            name,
            version,
            steps,
            attributes_schema: None,
        }
    }

    /// The plan with the JSON Schema its orders' attributes must match.
    #[must_use]
    pub const fn with_schema(mut self, schema: Option<&'a serde_json::Value>) -> Self {
        self.attributes_schema = schema;
        self
    }
}

/// A step request the caller must publish after the transaction committed.
#[derive(Debug, Clone, PartialEq)]
pub struct Dispatch {
    /// Order the step belongs to.
    pub order_id: OrderId,
    /// Step name.
    pub step: String,
    /// Agent whose queue receives the request.
    pub agent: String,
    /// Action or compensation.
    pub kind: StepKind,
    /// Remote operation.
    pub action: String,
    /// Attempt number of this step (1-based, action and compensation attempts together).
    pub attempt: i32,
    /// Correlation id of the request, and the fence for its reply.
    pub attempt_id: AttemptId,
    /// Stable key the remote service deduplicates on.
    pub idempotency_key: String,
    /// Deadline, from the database clock.
    pub complete_by: DateTime<Utc>,
    /// Last moment an agent may start a call (the deadline less the start margin).
    pub start_by: DateTime<Utc>,
    /// When the attempt was started (database clock).
    pub dispatched_at: DateTime<Utc>,
    /// The request's body: the order and the results of earlier steps, or
    /// what the step's template built from them.
    pub payload: serde_json::Value,
    /// The call's method, when the step's template names one.
    pub method: Option<String>,
    /// The call's path, when the step's template names one.
    pub path: Option<String>,
    /// The order's priority (0 to 9): the request carries it, so that an
    /// agent starts the most urgent of the requests waiting for its call
    /// slots first.
    pub priority: i16,
    /// The key the step's concurrency limit counts the attempt under, if
    /// its workflow limits it by key (see [`crate::machine::concurrency`]).
    pub limit_key: Option<String>,
}

/// What a committed transition asks the caller to publish: the step
/// requests it started (one, or each member of a parallel group), and
/// status messages for the client.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Progress {
    /// The client's status queue, if the order named one.
    pub reply_to: Option<String>,
    /// The client's `correlation_id`, set on every message to `reply_to`.
    pub correlation_id: Option<String>,
    /// The order's W3C trace id, for the `traceparent` header of every message.
    pub trace_id: Option<String>,
    /// Status messages, in order.
    pub statuses: Vec<OrderStatus>,
    /// The step requests to send: none, one, or one per member of a
    /// parallel group started together.
    pub dispatches: Vec<Dispatch>,
    /// What the other orders this transition moved publish (a child order
    /// started or undone, a parent told its child ended; see
    /// [`crate::machine::child`]), each to its own client.
    pub others: Vec<Progress>,
}
