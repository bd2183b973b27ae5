//! The request/reply pair between the scheduler and an agent.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::{AttemptId, OrderId};

/// Whether a request moves the order forward or undoes a completed step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StepKind {
    /// The step's action (reserve, charge, ship).
    Action,
    /// The step's compensation (release, refund, cancel).
    Compensation,
}

/// One call an agent must make to its remote service.
///
/// Published to [`crate::QueueNames::agent_requests`] with `correlation_id` =
/// `attempt_id` and `reply_to` = [`crate::QueueNames::scheduler_replies`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepRequest {
    /// Must equal [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Order the step belongs to.
    pub order_id: OrderId,
    /// Step name from the workflow definition (e.g. `reserve_stock`).
    pub step: String,
    /// Action or compensation.
    pub kind: StepKind,
    /// Remote operation to invoke (e.g. `reserve` or `release`).
    pub action: String,
    /// Id of this attempt; the reply must carry it (fencing).
    pub attempt_id: AttemptId,
    /// 1 for the first attempt of this step, then 2, 3, ...
    pub attempt: u32,
    /// Stable across every attempt of the same step and kind: the remote service
    /// applies a key at most once.
    pub idempotency_key: String,
    /// Absolute deadline from the database clock. Past it, the agent stops and
    /// sends nothing: the supervisor has taken over.
    pub complete_by: DateTime<Utc>,
    /// What the remote service needs: the order, and results of earlier steps.
    pub payload: serde_json::Value,
}

/// What the agent learned from the remote service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case", deny_unknown_fields)]
pub enum StepOutcome {
    /// The remote service applied (or had already applied) the operation.
    Succeeded {
        /// The service's answer, kept for compensation (e.g. a reservation id).
        result: serde_json::Value,
    },
    /// The remote service refused the operation.
    Failed {
        /// The service's reason, recorded on the order.
        error: String,
        /// True when retrying cannot help (declined payment, unknown SKU). A
        /// transient failure reply makes the supervisor retry the step now.
        permanent: bool,
    },
}

/// The agent's answer, published to the request's `reply_to` with the same
/// `correlation_id`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StepReply {
    /// Must equal [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// Order the step belongs to.
    pub order_id: OrderId,
    /// Step name, for logs.
    pub step: String,
    /// The attempt being answered; a reply for another attempt is stale.
    pub attempt_id: AttemptId,
    /// Which agent replica answered, for logs and tests.
    pub agent_id: String,
    /// What happened.
    pub outcome: StepOutcome,
}
