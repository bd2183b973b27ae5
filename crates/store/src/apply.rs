//! The write kernel: every transition of an order, whatever its cause (a
//! claim, a reply, a missed deadline, a dead letter, an operator's action),
//! goes through [`transition`]: lock the orders, load their snapshots, let
//! the state machine decide each under admission control, write each
//! decision. The modules that receive those causes (`progress`, `recovery`,
//! `operator`) only turn their inputs into [`Event`]s and the decisions
//! into their results; intake and a forward step's success take the
//! single-statement paths of `intake` and `fast`, which the property test
//! holds to the same machine.
//!
//! A decision is written in one statement: the process record, the changed
//! steps (each guarded by the state and attempt id it was decided on), the
//! history lines and the alert. A guard that does not hold means the rows
//! changed under the lock, which cannot happen without a bug: the statement's
//! counts are checked and the transaction is abandoned.

use std::collections::BTreeMap;

use chrono::{DateTime, Utc};
use sas_messages::{AttemptId, StepKind};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use crate::machine::admission::has_room;
use crate::machine::{decide, Context, Decision, Event, ProcessRow, Snapshot, StepRow};
use crate::{Store, StoreError};

/// What one transition decided about one order, with what it decided on.
pub(crate) struct Decided {
    /// The order as it was read under its lock.
    pub(crate) snapshot: Snapshot,
    /// What the state machine decided, now written.
    pub(crate) decision: Decision,
    /// The transaction's clock.
    pub(crate) now: DateTime<Utc>,
}

/// Whether the orders of a batch still need a slot of their agents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slots {
    /// A decision that would start an attempt is checked for a free slot
    /// first ([`decide_admitted`]); without one the order waits in line.
    Check,
    /// Each order was counted against its agent's free slots when it was
    /// locked (the heads of the agents' lines): decided as it comes.
    Held,
}

/// The write kernel. In the caller's transaction: locks the orders
/// `order_ids` and loads their snapshots ([`load_snapshots`]), decides
/// for each the event `event_for` makes of it (under admission control,
/// as `slots` says), and writes each decision ([`apply`]). Orders that do
/// not exist are left out. Every decision of the batch uses the
/// transaction's clock.
///
/// # Errors
/// When the database fails, or a guard did not hold: the caller's
/// transaction must then be abandoned.
pub(crate) async fn transition<'e>(
    conn: &mut PgConnection,
    store: &Store,
    order_ids: &[&str],
    actor: &str,
    slots: Slots,
    mut event_for: impl FnMut(&Snapshot) -> Event<'e>,
) -> Result<Vec<Decided>, StoreError> {
    let (snapshots, now) = load_snapshots(&mut *conn, order_ids).await?;
    let mut decided = Vec::with_capacity(snapshots.len());
    for snapshot in snapshots {
        let ctx = store.context(now, actor);
        let event = event_for(&snapshot);
        let decision = match slots {
            Slots::Held => decide(&snapshot, &event, &ctx),
            Slots::Check => decide_admitted(&mut *conn, &snapshot, &event, &ctx).await?,
        };
        apply(&mut *conn, &snapshot, &decision, actor).await?;
        decided.push(Decided {
            snapshot,
            decision,
            now,
        });
    }
    Ok(decided)
}

impl Store {
    /// [`transition`] for one order and one event, in a transaction of its
    /// own. `None` when the order does not exist.
    ///
    /// # Errors
    /// When the database fails; nothing changed then.
    pub(crate) async fn transition_one(
        &self,
        order_id: &str,
        event: &Event<'_>,
        actor: &str,
    ) -> Result<Option<Decided>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let decided =
            transition(&mut tx, self, &[order_id], actor, Slots::Check, |_| *event).await?;
        tx.commit().await?;
        Ok(decided.into_iter().next())
    }
}

/// Locks the `order_process` rows of `order_ids` (in order id order, as
/// every batch does, so two transactions cannot deadlock) and reads each
/// order's snapshot, with the transaction's `now()`: the clock every
/// decision of this transaction uses. Orders that do not exist are left out.
///
/// # Errors
/// When the database fails.
async fn load_snapshots(
    conn: &mut PgConnection,
    order_ids: &[&str],
) -> Result<(Vec<Snapshot>, DateTime<Utc>), StoreError> {
    let rows = sqlx::query(
        "SELECT p.order_id, p.state, p.locked_by, p.complete_by, p.failure_count, p.not_before,
                p.last_error, p.reply_to, p.trace_id, p.reply_correlation_id, p.priority, p.waiting_for, p.admit_key,
                o.body, now() AS now,
                s.position, s.name, s.agent, s.action, s.compensation, s.timeout_ms,
                s.state AS step_state, s.attempt, s.attempt_id, s.complete_by AS step_complete_by,
                s.idempotency_key, s.result, s.last_error AS step_last_error,
                s.maybe_applied, s.undo_generation, s.undo_refused, s.undo_result
           FROM order_process p
           JOIN orders o ON o.order_id = p.order_id
           JOIN steps s ON s.order_id = p.order_id
          WHERE p.order_id = ANY($1)
          ORDER BY p.order_id, s.position
            FOR UPDATE OF p",
    )
    .bind(order_ids)
    .fetch_all(&mut *conn)
    .await?;
    let now = match rows.first() {
        Some(row) => row.try_get("now")?,
        None => {
            sqlx::query_scalar("SELECT now()")
                .fetch_one(&mut *conn)
                .await?
        }
    };
    let mut snapshots: BTreeMap<String, Snapshot> = BTreeMap::new();
    // Rows come ordered by order id, then position.
    for row in &rows {
        let order_id: String = row.try_get("order_id")?;
        let step = step_from_row(row)?;
        match snapshots.get_mut(&order_id) {
            Some(snapshot) => snapshot.steps.push(step),
            None => {
                let mut snapshot = snapshot_from_row(row)?;
                snapshot.steps.push(step);
                snapshots.insert(order_id, snapshot);
            }
        }
    }
    Ok((snapshots.into_values().collect(), now))
}

fn snapshot_from_row(row: &PgRow) -> Result<Snapshot, StoreError> {
    Ok(Snapshot {
        order_id: row.try_get::<String, _>("order_id")?.into(),
        body: row.try_get("body")?,
        reply_to: row.try_get("reply_to")?,
        trace_id: row.try_get("trace_id")?,
        reply_correlation_id: row.try_get("reply_correlation_id")?,
        priority: row.try_get("priority")?,
        process: ProcessRow {
            state: row.try_get("state")?,
            locked_by: row.try_get("locked_by")?,
            complete_by: row.try_get("complete_by")?,
            failure_count: row.try_get("failure_count")?,
            not_before: row.try_get("not_before")?,
            last_error: row.try_get("last_error")?,
            waiting_for: row.try_get("waiting_for")?,
            admit_key: row.try_get("admit_key")?,
        },
        steps: Vec::new(),
    })
}

fn step_from_row(row: &PgRow) -> Result<StepRow, StoreError> {
    Ok(StepRow {
        position: row.try_get("position")?,
        name: row.try_get("name")?,
        agent: row.try_get("agent")?,
        action: row.try_get("action")?,
        compensation: row.try_get("compensation")?,
        timeout_ms: row.try_get("timeout_ms")?,
        state: row.try_get("step_state")?,
        attempt: row.try_get("attempt")?,
        attempt_id: row
            .try_get::<Option<Uuid>, _>("attempt_id")?
            .map(AttemptId::from),
        complete_by: row.try_get("step_complete_by")?,
        idempotency_key: row.try_get("idempotency_key")?,
        result: row.try_get("result")?,
        last_error: row.try_get("step_last_error")?,
        maybe_applied: row.try_get("maybe_applied")?,
        undo_generation: row.try_get("undo_generation")?,
        undo_refused: row.try_get("undo_refused")?,
        undo_result: row.try_get("undo_result")?,
    })
}

/// Writes `decision` about the order of `snapshot`, decided by `actor`, in
/// one statement.
///
/// # Errors
/// When the database fails, or a guard did not hold ([`StoreError::Invariant`]):
/// the caller's transaction must then be abandoned.
async fn apply(
    conn: &mut PgConnection,
    snapshot: &Snapshot,
    decision: &Decision,
    actor: &str,
) -> Result<(), StoreError> {
    if !decision.writes() {
        return Ok(());
    }
    let process = decision.process.as_ref().unwrap_or(&snapshot.process);
    let steps = &decision.steps;
    let history = &decision.history;
    let row = sqlx::query(
        "WITH p AS (
             UPDATE order_process
                SET state = $2, locked_by = $3, complete_by = $4, failure_count = $5,
                    not_before = $6, last_error = $7, waiting_for = $31, admit_key = $32,
                    updated_at = now()
              WHERE order_id = $1 AND $8
          RETURNING 1),
         c AS (
             SELECT * FROM UNNEST($9::int4[], $10::text[], $11::int4[], $12::uuid[], $13::timestamptz[],
                                  $14::text[], $15::jsonb[], $16::text[], $17::text[], $18::uuid[],
                                  $27::bool[], $28::int4[], $29::bool[], $30::jsonb[])
                    AS c(position, state, attempt, attempt_id, complete_by, idempotency_key, result,
                         last_error, expected_state, expected_attempt_id,
                         maybe_applied, undo_generation, undo_refused, undo_result)),
         s AS (
             UPDATE steps st
                SET state = c.state::step_state, attempt = c.attempt, attempt_id = c.attempt_id,
                    complete_by = c.complete_by, idempotency_key = c.idempotency_key,
                    result = c.result, last_error = c.last_error,
                    maybe_applied = c.maybe_applied, undo_generation = c.undo_generation,
                    undo_refused = c.undo_refused, undo_result = c.undo_result, updated_at = now()
               FROM c
              WHERE st.order_id = $1 AND st.position = c.position
                AND st.state = c.expected_state::step_state
                AND st.attempt_id IS NOT DISTINCT FROM c.expected_attempt_id
          RETURNING 1),
         h AS (
             INSERT INTO history (order_id, actor, event, step, attempt_id, detail)
             SELECT $1, $19, h.event, h.step, h.attempt_id, h.detail
               FROM UNNEST($20::text[], $21::text[], $22::uuid[], $23::text[]) WITH ORDINALITY
                    AS h(event, step, attempt_id, detail, n)
              ORDER BY h.n),
         a AS (
             INSERT INTO alerts (order_id, kind, message)
             SELECT $1, $24, $25 WHERE $24::text IS NOT NULL),
         r AS (
             UPDATE alerts SET resolved_at = now(), resolved_by = $19,
                    resolution_note = 'the order was resubmitted'
              WHERE order_id = $1 AND resolved_at IS NULL AND $26),
         q AS (
             UPDATE admission a
                SET in_flight = a.in_flight + d.in_flight, waiting = a.waiting + d.waiting,
                    peak_in_flight = GREATEST(a.peak_in_flight, a.in_flight + d.in_flight),
                    settled = a.settled + GREATEST(-d.in_flight - d.unstarted, 0)
               FROM (SELECT * FROM UNNEST($33::text[], $34::int4[], $35::int4[], $36::int4[])
                              AS d(agent, in_flight, waiting, unstarted) ORDER BY agent) d
              WHERE a.agent = d.agent)
         SELECT (SELECT count(*) FROM p) AS process, (SELECT count(*) FROM s) AS steps",
    )
    .bind(snapshot.order_id.as_str())
    .bind(process.state)
    .bind(&process.locked_by)
    .bind(process.complete_by)
    .bind(process.failure_count)
    .bind(process.not_before)
    .bind(&process.last_error)
    .bind(decision.process.is_some())
    .bind(steps.iter().map(|c| c.row.position).collect::<Vec<_>>())
    .bind(steps.iter().map(|c| c.row.state.as_str()).collect::<Vec<_>>())
    .bind(steps.iter().map(|c| c.row.attempt).collect::<Vec<_>>())
    .bind(steps.iter().map(|c| c.row.attempt_id.map(AttemptId::as_uuid)).collect::<Vec<_>>())
    .bind(steps.iter().map(|c| c.row.complete_by).collect::<Vec<_>>())
    .bind(steps.iter().map(|c| c.row.idempotency_key.as_str()).collect::<Vec<_>>())
    .bind(steps.iter().map(|c| c.row.result.clone()).collect::<Vec<_>>())
    .bind(steps.iter().map(|c| c.row.last_error.as_deref()).collect::<Vec<_>>())
    .bind(steps.iter().map(|c| c.expected_state.as_str()).collect::<Vec<_>>())
    .bind(steps.iter().map(|c| c.expected_attempt_id.map(AttemptId::as_uuid)).collect::<Vec<_>>())
    .bind(actor)
    .bind(history.iter().map(|h| h.event.as_str()).collect::<Vec<_>>())
    .bind(history.iter().map(|h| h.step.as_deref()).collect::<Vec<_>>())
    .bind(history.iter().map(|h| h.attempt_id.map(AttemptId::as_uuid)).collect::<Vec<_>>())
    .bind(history.iter().map(|h| h.detail.as_deref()).collect::<Vec<_>>())
    .bind(decision.alert.as_ref().map(|a| a.kind.as_str()))
    .bind(decision.alert.as_ref().map(|a| a.message.as_str()))
    .bind(decision.resolve_alerts)
    .bind(steps.iter().map(|c| c.row.maybe_applied).collect::<Vec<_>>())
    .bind(steps.iter().map(|c| c.row.undo_generation).collect::<Vec<_>>())
    .bind(steps.iter().map(|c| c.row.undo_refused).collect::<Vec<_>>())
    .bind(steps.iter().map(|c| c.row.undo_result.clone()).collect::<Vec<_>>())
    .bind(&process.waiting_for)
    .bind(process.admit_key)
    .bind(decision.admission.iter().map(|d| d.agent.as_str()).collect::<Vec<_>>())
    .bind(decision.admission.iter().map(|d| d.in_flight).collect::<Vec<_>>())
    .bind(decision.admission.iter().map(|d| d.waiting).collect::<Vec<_>>())
    .bind(decision.admission.iter().map(|d| d.unstarted).collect::<Vec<_>>())
    .fetch_one(&mut *conn)
    .await?;
    let (changed_process, changed_steps): (i64, i64) =
        (row.try_get("process")?, row.try_get("steps")?);
    let expected_process = i64::from(decision.process.is_some());
    if changed_process != expected_process || changed_steps != steps.len() as i64 {
        return Err(StoreError::Invariant(format!(
            "order {}: a decision's guards did not hold under the order's lock \
             ({changed_process} of {expected_process} process rows, {changed_steps} of {} steps changed)",
            snapshot.order_id,
            steps.len()
        )));
    }
    Ok(())
}

/// Decides `event` for the order of `snapshot` under admission control:
/// when the decision would take a slot of an agent with none free, decides
/// again with that agent closed, and the order waits in its line instead.
///
/// Whether a slot is free is [`has_room`]'s rule. The check
/// reads the counters without locking them, so schedulers deciding at the
/// same moment can overshoot the limit by a few: it bounds queueing, it is
/// not a semaphore.
///
/// # Errors
/// When the database fails.
async fn decide_admitted(
    conn: &mut PgConnection,
    snapshot: &Snapshot,
    event: &Event<'_>,
    ctx: &Context<'_>,
) -> Result<Decision, StoreError> {
    let decision = decide(snapshot, event, ctx);
    let Some((agent, kind)) = decision.takes_slot() else {
        return Ok(decision);
    };
    let first_in_line = kind == StepKind::Compensation || snapshot.process.waiting_for.is_some();
    let counters: Option<(i32, i32, i32)> =
        sqlx::query_as("SELECT in_flight, admit_limit, waiting FROM admission WHERE agent = $1")
            .bind(agent)
            .fetch_optional(&mut *conn)
            .await?;
    // An agent without a row has no admission control.
    let room = counters.is_none_or(|(in_flight, limit, waiting)| {
        has_room(in_flight, limit, waiting, first_in_line)
    });
    if room {
        return Ok(decision);
    }
    let agent = agent.to_owned();
    let closed = Context {
        closed: Some(&agent),
        ..*ctx
    };
    Ok(decide(snapshot, event, &closed))
}
