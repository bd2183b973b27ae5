//! Starting an attempt: the one place that says what a step request holds
//! (its idempotency key, payload, deadline) and how its history line reads.
//!
//! The intake and reply statements of the hot path compute the same key and
//! detail in SQL; the property test holds them to these functions.

use sas_messages::StepKind;

use super::call::Rendered;
use super::StepRow;
use crate::model::Dispatch;

/// Suffix of the idempotency key of a step's compensation.
const COMPENSATION_KEY_SUFFIX: &str = ":undo";

/// The key of a step's action on its first run: the same on every attempt,
/// so the remote service applies it at most once.
pub fn idempotency_key(order_id: &str, step: &str) -> String {
    format!("{order_id}:{step}")
}

/// The key of a step's action after an operator restarted the workflow for
/// the `generation`-th time: the old key is already decided at the remote.
pub fn resubmitted_key(order_id: &str, step: &str, generation: i64) -> String {
    format!("{order_id}:{step}:r{generation}")
}

/// The key of the compensation of the action keyed `action_key`, in its
/// `generation`: 0 at first, one more each time an operator resumes a
/// compensation the remote service refused for good (that key is decided).
pub fn compensation_key(action_key: &str, generation: i32) -> String {
    match generation {
        0 => format!("{action_key}{COMPENSATION_KEY_SUFFIX}"),
        n => format!("{action_key}{COMPENSATION_KEY_SUFFIX}:r{n}"),
    }
}

/// The history detail of a dispatched attempt: `attempt 2: payment.charge`.
pub fn attempt_detail(attempt: i32, agent: &str, operation: &str) -> String {
    format!("attempt {attempt}: {agent}.{operation}")
}

/// What every request carries for the remote service: the order, and the
/// results of the steps that have one, by step name.
pub fn payload<'a>(
    body: &serde_json::Value,
    results: impl IntoIterator<Item = (&'a str, &'a serde_json::Value)>,
) -> serde_json::Value {
    let results: serde_json::Map<String, serde_json::Value> = results
        .into_iter()
        .map(|(name, result)| (name.to_owned(), result.clone()))
        .collect();
    serde_json::json!({ "order": body, "results": results })
}

/// The remote operation an attempt of `kind` calls on `step`.
pub fn operation(step: &StepRow, kind: StepKind) -> &str {
    match kind {
        StepKind::Action => &step.action,
        StepKind::Compensation => step.compensation.as_deref().unwrap_or_default(),
    }
}

impl Dispatch {
    /// The request of the attempt just started on `step` (its attempt
    /// number, id and deadline already set), with `payload` (`{order,
    /// results}`), or what the step's template builds from it; its calls
    /// must start `start_margin` before the deadline. `priority` is the
    /// order's.
    pub fn for_step(
        order_id: &str,
        step: &StepRow,
        kind: StepKind,
        payload: serde_json::Value,
        start_margin: std::time::Duration,
        priority: i16,
    ) -> Self {
        let complete_by = step.complete_by.unwrap_or_default();
        let dispatched_at = step.started_at().unwrap_or(complete_by);
        let margin = chrono::Duration::from_std(start_margin).unwrap_or_default();
        let start_by = (complete_by - margin).max(dispatched_at);
        let idempotency_key = match kind {
            StepKind::Action => step.idempotency_key.clone(),
            StepKind::Compensation => compensation_key(&step.idempotency_key, step.undo_generation),
        };
        let call = match step.calls.as_ref().and_then(|calls| calls.of(kind)) {
            Some(template) => template.render(payload),
            None => Rendered {
                body: payload,
                method: None,
                path: None,
            },
        };
        Self {
            order_id: order_id.into(),
            step: step.name.clone(),
            agent: step.agent.clone(),
            kind,
            action: operation(step, kind).to_owned(),
            attempt: step.attempt,
            attempt_id: step.attempt_id.unwrap_or_default(),
            idempotency_key,
            complete_by,
            start_by,
            dispatched_at,
            payload: call.body,
            method: call.method,
            path: call.path,
            priority,
        }
    }
}
