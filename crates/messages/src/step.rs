//! The request/reply pair between the scheduler and an agent.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{AttemptId, OrderId};

/// Whether a request moves the order forward or undoes a completed step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
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
/// `attempt_id`, `reply_to` = [`crate::QueueNames::scheduler_replies`] and
/// the AMQP `priority` property = the order's priority (agents order their
/// waits for a call slot by it).
///
/// Agents refuse unknown fields: a field they do not know may change what
/// the call must do (docs/messages.md, "Upgrades", says what follows).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepRequest {
    /// Must equal [`crate::SCHEMA_VERSION`].
    #[schemars(extend("const" = crate::SCHEMA_VERSION))]
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
    /// Absolute deadline from the database clock. Past it, the agent stops
    /// calling: the supervisor has taken over.
    pub complete_by: DateTime<Utc>,
    /// Last moment to start a call to the remote service (database clock):
    /// `complete_by` less the deployment's start margin, so that no call
    /// starts late enough to land after the supervisor gave up on it and
    /// its undo went out. Absent from older schedulers: the agent then uses
    /// `complete_by` less its own margin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_by: Option<DateTime<Utc>>,
    /// When the request was dispatched (database clock): agents compare it
    /// with their own clock to find out how far behind it runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dispatched_at: Option<DateTime<Utc>>,
    /// The body of the call: by default the order and the results of
    /// earlier steps (`{order, results}`); a step whose workflow shapes its
    /// request gets the body its template built.
    pub payload: serde_json::Value,
    /// The HTTP method of the call, when the workflow names one; `POST`
    /// when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// The path of the call under the service's base URL (`/...`, its
    /// segments already percent-encoded), when the workflow names one;
    /// `/<action>` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// The key the step's concurrency limit counts this attempt under
    /// (`payment:m-17`), when its workflow limits it by key. A 429 with
    /// `Retry-After` for such a request pauses that key, not the agent's
    /// lane: the agent answers `not_started` with the pause at once, and
    /// the scheduler holds the key's other orders until then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit_key: Option<String>,
}

/// What the agent learned from the remote service.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "status", rename_all = "snake_case", deny_unknown_fields)]
pub enum StepOutcome {
    /// The remote service applied (or had already applied) the operation.
    Succeeded {
        /// The service's answer, kept for compensation (e.g. a reservation id).
        result: serde_json::Value,
    },
    /// The operation did not succeed.
    Failed {
        /// The service's reason, recorded on the order.
        error: String,
        /// True when retrying cannot help (declined payment, unknown SKU). A
        /// transient failure reply makes the supervisor retry the step now.
        permanent: bool,
        /// True when the operation may have been applied all the same: some
        /// call of this request may have reached the remote service and its
        /// answer is unknown (a timeout, a reset after sending, a 5xx, a 409
        /// "in progress"). Once set for a step it stays set, and compensation
        /// undoes the step whatever later attempts answer.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        maybe_applied: bool,
    },
    /// No call of this attempt was made: its start-by passed while the
    /// request waited for an agent (in the queue, or for a call slot), so
    /// nothing can have been applied. Waiting is not a failure of the remote
    /// service: the order goes back to the head of its agent's line without
    /// counting a failure. Agents send it only in answer to a request
    /// that carries `start_by`, which only schedulers that know this
    /// answer send.
    NotStarted {
        /// What the agent saw, for the order's history.
        reason: String,
    },
}

/// The agent's answer, published to the request's `reply_to` with the same
/// `correlation_id`.
///
/// Schedulers refuse unknown fields and outcomes: an answer they misread
/// could settle a step wrongly (docs/messages.md, "Upgrades", says what
/// follows).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct StepReply {
    /// Must equal [`crate::SCHEMA_VERSION`].
    #[schemars(extend("const" = crate::SCHEMA_VERSION))]
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
    /// Milliseconds from the request's `dispatched_at` to the agent's first
    /// call for it (or to its answer, when no call was made), on the
    /// database clock as the agent estimates it: the time it queued in the
    /// agent queue and for a call slot. Admission control shrinks the
    /// agent's limit while attempts queue there (docs/design-decisions.md).
    /// Not in the body: it travels in the reply's
    /// [`crate::headers::QUEUED_MS`] header, which a scheduler that does not
    /// know it ignores, and the scheduler sets it from there.
    #[serde(skip)]
    pub queued_ms: Option<u64>,
    /// Of `queued_ms` and the retries after it, the milliseconds the
    /// request waited for one of the agent's call slots (`agent.concurrency`):
    /// while attempts wait for slots, the remote service is what holds them
    /// up, and admission control keeps the backlog in the line. Carried in
    /// the [`crate::headers::SLOT_WAIT_MS`] header, as `queued_ms`.
    #[serde(skip)]
    pub slot_wait_ms: Option<u64>,
    /// Of a `not_started` answer to a request that names a `limit_key`:
    /// the remote answered 429 with `Retry-After`, and the key must rest
    /// this many milliseconds. The scheduler pauses the key, and the order
    /// waits in the key's line at its place. Carried in the
    /// [`crate::headers::RETRY_AFTER_MS`] header, as `queued_ms`.
    #[serde(skip)]
    pub retry_after_ms: Option<u64>,
    /// The milliseconds the attempt's last call took at the remote (queues,
    /// pauses and earlier tries left out): how an adaptive key's limit
    /// learns how loaded its remote is. Carried in the
    /// [`crate::headers::CALL_MS`] header, as `queued_ms`; absent when no
    /// call was made.
    #[serde(skip)]
    pub call_ms: Option<u64>,
}
