//! Starting an attempt: the one place that says what a step request holds
//! (its idempotency key, payload, deadline) and how its history line reads.
//!
//! The intake and reply statements of the hot path compute the same key and
//! detail in SQL; the property test holds them to these functions.

use sas_messages::StepKind;

use super::call::{Rendered, Unrendered};
use super::StepRow;
use crate::model::Dispatch;

/// What a step request holds beside its payload and its strings: field
/// names, times, ids, numbers. Generous: the size check must never let a
/// request the broker or an agent would refuse pass.
const ENVELOPE_BYTES: usize = 512;

/// The room a request keeps for its envelope and its strings (order id,
/// step, action, key, method, path), for a check that sees only its
/// payload: the fast reply path's ([`payload_budget`]).
const ENVELOPE_AND_STRINGS_BYTES: usize = 2048;

/// Why a step's request could not be built. Nothing is sent: a request
/// with a hole in it, or one the broker or its agent would refuse for its
/// size, is refused here, where it is built, with the reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unbuilt {
    /// Its template found no value for a placeholder.
    #[error("its template cannot render: {0}")]
    Template(#[from] Unrendered),
    /// It would be larger than a message may be.
    #[error(
        "it would be {size} bytes, over the {limit}-byte limit of a message (amqp.max_message_bytes): \
         have its template send less, keep the answers it carries smaller, or raise the limit"
    )]
    TooLarge {
        /// Its size, about.
        size: usize,
        /// `amqp.max_message_bytes`.
        limit: usize,
    },
}

/// The most bytes a default payload (`{order, results}`) may have for its
/// request to fit in a message of `max_request_bytes`, with room for the
/// envelope and the longest strings a request carries beside it.
pub fn payload_budget(max_request_bytes: usize) -> usize {
    max_request_bytes.saturating_sub(ENVELOPE_AND_STRINGS_BYTES)
}

/// The length of `value` as compact JSON, without building the text.
fn json_len(value: &serde_json::Value) -> usize {
    struct Counter(usize);
    impl std::io::Write for Counter {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0 += bytes.len();
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut counter = Counter(0);
    match serde_json::to_writer(&mut counter, value) {
        Ok(()) => counter.0,
        Err(_) => usize::MAX,
    }
}

/// The default body of an undo: the order and the result of the step it
/// undoes (what the undo needs: the charge id it refunds), not every
/// step's. An undo stays small however many answers the order gathered.
fn undo_payload(payload: serde_json::Value, step: &str) -> serde_json::Value {
    let serde_json::Value::Object(mut fields) = payload else {
        return payload;
    };
    if let Some(serde_json::Value::Object(results)) = fields.get_mut("results") {
        results.retain(|name, _| name == step);
    }
    serde_json::Value::Object(fields)
}

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
        StepKind::Action => step.kind.label(),
        StepKind::Compensation => step.kind.undo_label().unwrap_or_default(),
    }
}

impl Dispatch {
    /// The request of the attempt just started on `step` (its attempt
    /// number, id and deadline already set), with `payload` (`{order,
    /// results}`), or what the step's template builds from it (an undo's
    /// default body keeps only its own step's result, [`undo_payload`]);
    /// its calls must start `start_margin` before the deadline. `priority`
    /// is the order's; `max_request_bytes` the largest message allowed
    /// (`amqp.max_message_bytes`).
    ///
    /// # Errors
    /// [`Unbuilt`]: a template that finds no value, or a request over
    /// `max_request_bytes`. Nothing may be sent then.
    pub fn for_step(
        order_id: &str,
        step: &StepRow,
        kind: StepKind,
        payload: serde_json::Value,
        start_margin: std::time::Duration,
        priority: i16,
        max_request_bytes: usize,
    ) -> Result<Self, Unbuilt> {
        let complete_by = step.complete_by.unwrap_or_default();
        let dispatched_at = step.started_at().unwrap_or(complete_by);
        let margin = chrono::Duration::from_std(start_margin).unwrap_or_default();
        let start_by = (complete_by - margin).max(dispatched_at);
        let idempotency_key = match kind {
            StepKind::Action => step.idempotency_key.clone(),
            StepKind::Compensation => compensation_key(&step.idempotency_key, step.undo_generation),
        };
        let template = step.kind.calls().and_then(|calls| calls.of(kind));
        let mut call = match template {
            Some(template) => template.render(payload)?,
            None => Rendered {
                body: payload,
                method: None,
                path: None,
            },
        };
        if kind == StepKind::Compensation && template.is_none_or(|t| t.body.is_none()) {
            call.body = undo_payload(call.body, &step.name);
        }
        let action = operation(step, kind).to_owned();
        let size = ENVELOPE_BYTES
            + json_len(&call.body)
            + 2 * order_id.len()
            + step.name.len()
            + action.len()
            + idempotency_key.len()
            + call.method.as_ref().map_or(0, String::len)
            + call.path.as_ref().map_or(0, String::len);
        if size > max_request_bytes {
            return Err(Unbuilt::TooLarge {
                size,
                limit: max_request_bytes,
            });
        }
        Ok(Self {
            order_id: order_id.into(),
            step: step.name.clone(),
            agent: step.kind.agent().unwrap_or_default().to_owned(),
            kind,
            action,
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
            limit_key: step.limit_key.clone(),
        })
    }
}
