//! Reading a `steps` row out of a query's result: the one mapping from
//! columns to [`StepRow`] that every query returning steps uses (the write
//! kernel's snapshot, the fast path's next step, an order's status), so
//! that a new column is read everywhere or nowhere.

use sas_messages::AttemptId;
use sqlx::postgres::PgRow;
use sqlx::types::Json;
use sqlx::Row;
use uuid::Uuid;

use crate::machine::call::StepCalls;
use crate::machine::kind::{Kind, Park, Stored};
use crate::machine::StepRow;
use crate::StoreError;

/// The names a query gives a step's columns (a query joining `steps` with
/// `order_process` must alias the columns both tables have).
pub(crate) struct StepColumns {
    position: &'static str,
    name: &'static str,
    agent: &'static str,
    action: &'static str,
    compensation: &'static str,
    timeout_ms: &'static str,
    state: &'static str,
    attempt: &'static str,
    attempt_id: &'static str,
    complete_by: &'static str,
    idempotency_key: &'static str,
    result: &'static str,
    last_error: &'static str,
    maybe_applied: &'static str,
    undo_generation: &'static str,
    undo_refused: &'static str,
    undo_result: &'static str,
    calls: &'static str,
    park: &'static str,
    group: &'static str,
    limit_key: &'static str,
}

/// A step's columns beside its order's: `state`, `complete_by` and
/// `last_error` as `step_state`, `step_complete_by` and `step_last_error`
/// (see `step_select!`).
pub(crate) const BESIDE_ORDER: StepColumns = StepColumns {
    position: "position",
    name: "name",
    agent: "agent",
    action: "action",
    compensation: "compensation",
    timeout_ms: "timeout_ms",
    state: "step_state",
    attempt: "attempt",
    attempt_id: "attempt_id",
    complete_by: "step_complete_by",
    idempotency_key: "idempotency_key",
    result: "result",
    last_error: "step_last_error",
    maybe_applied: "maybe_applied",
    undo_generation: "undo_generation",
    undo_refused: "undo_refused",
    undo_result: "undo_result",
    calls: "request",
    park: "park",
    group: "step_group",
    limit_key: "limit_key",
};

/// The next step the fast path started, its columns prefixed `next_`.
pub(crate) const NEXT: StepColumns = StepColumns {
    position: "next_position",
    name: "next_step",
    agent: "next_agent",
    action: "next_action",
    compensation: "next_compensation",
    timeout_ms: "next_timeout_ms",
    state: "next_state",
    attempt: "next_attempt",
    attempt_id: "next_attempt_id",
    complete_by: "next_complete_by",
    idempotency_key: "next_key",
    result: "next_result",
    last_error: "next_last_error",
    maybe_applied: "next_maybe_applied",
    undo_generation: "next_undo_generation",
    undo_refused: "next_undo_refused",
    undo_result: "next_undo_result",
    calls: "next_request",
    park: "next_park",
    group: "next_group",
    limit_key: "next_limit_key",
};

/// The select list of [`BESIDE_ORDER`], for a query on `steps s`.
macro_rules! step_select {
    () => {
        "s.position, s.name, s.agent, s.action, s.compensation, s.timeout_ms,
         s.state AS step_state, s.attempt, s.attempt_id, s.complete_by AS step_complete_by,
         s.idempotency_key, s.result, s.last_error AS step_last_error,
         s.maybe_applied, s.undo_generation, s.undo_refused, s.undo_result, s.request, s.park, s.step_group,
         s.limit_key"
    };
}
pub(crate) use step_select;

impl StepColumns {
    /// The step in `row`, read under these names.
    pub(crate) fn read(&self, row: &PgRow) -> Result<StepRow, StoreError> {
        Ok(StepRow {
            position: row.try_get(self.position)?,
            name: row.try_get(self.name)?,
            kind: Kind::from(Stored {
                agent: row.try_get(self.agent)?,
                action: row.try_get(self.action)?,
                compensation: row.try_get(self.compensation)?,
                calls: row
                    .try_get::<Option<Json<Box<StepCalls>>>, _>(self.calls)?
                    .map(|calls| calls.0),
                park: row
                    .try_get::<Option<Json<Park>>, _>(self.park)?
                    .map(|park| park.0),
            }),
            timeout_ms: row.try_get(self.timeout_ms)?,
            state: row.try_get(self.state)?,
            attempt: row.try_get(self.attempt)?,
            attempt_id: row
                .try_get::<Option<Uuid>, _>(self.attempt_id)?
                .map(AttemptId::from),
            complete_by: row.try_get(self.complete_by)?,
            idempotency_key: row.try_get(self.idempotency_key)?,
            result: row.try_get(self.result)?,
            last_error: row.try_get(self.last_error)?,
            maybe_applied: row.try_get(self.maybe_applied)?,
            undo_generation: row.try_get(self.undo_generation)?,
            undo_refused: row.try_get(self.undo_refused)?,
            undo_result: row.try_get(self.undo_result)?,
            group: row.try_get(self.group)?,
            limit_key: row.try_get(self.limit_key)?,
        })
    }
}
