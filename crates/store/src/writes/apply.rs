//! The write kernel: every transition of an order, whatever its cause (a
//! claim, a reply, a missed deadline, a dead letter, an operator's action),
//! goes through [`transition`]: lock the orders, load their snapshots, let
//! the state machine decide each under admission control, write them all. The modules that receive those causes (`progress`, `recovery`,
//! `operator`) only turn their inputs into [`Event`]s and the decisions
//! into their results; intake and a forward step's success take the
//! single-statement paths of `intake` and `fast`, which the property test
//! holds to the same machine.
//!
//! A batch's decisions are written in one statement: the process records,
//! the changed steps (each guarded by the state and attempt id it was
//! decided on), the history lines, the alerts and the admission counters.
//! A guard that does not hold means the rows changed under the lock, which
//! cannot happen without a bug: the statement's counts are checked and the
//! transaction is abandoned.

use std::collections::{BTreeMap, HashMap};

use chrono::{DateTime, Utc};
use sas_messages::{AttemptId, StepKind};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use super::key_room::{learn_keys, pause_keys, KeyRoom};
use super::Writes;
use crate::machine::admission::has_room;
use crate::machine::park::MailboxEvent;
use crate::machine::{decide, Context, Decision, Event, ProcessRow, Snapshot};
use crate::model::StepState;
use crate::step_columns::{step_select, BESIDE_ORDER};
use crate::{Store, StoreError};

/// How many times [`run_again_if_rolled_back`] runs a transaction Postgres
/// rolled back (a deadlock) before it answers with the failure.
const ROLLBACK_TRIES: u32 = 3;

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
    /// Each order was admitted when it was locked (the heads of the agents'
    /// lines: counted against the free slots, or passing a full limit by
    /// its level, [`crate::machine::admission::Levels`]): decided as it
    /// comes.
    Held,
}

/// The write kernel. In the caller's transaction: locks the orders
/// `order_ids` and loads their snapshots ([`load_snapshots`]), decides
/// for each the event `event_for` makes of it (under admission control,
/// as `slots` says), and writes all the decisions in one statement
/// ([`apply_all`]). Orders that do not exist are left out. Every decision
/// of the batch uses the transaction's clock.
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
    let mut decided: Vec<Decided> = Vec::with_capacity(snapshots.len());
    // Each agent's counters, read once for the batch, and the slots and
    // places in line the decisions made so far take (not yet written).
    let mut room = Room {
        read: HashMap::new(),
        taken: HashMap::new(),
        keys: KeyRoom::new(now, store.grace()),
    };
    for snapshot in snapshots {
        let ctx = store.context(now, actor);
        let event = event_for(&snapshot);
        // A held order's slot of the agent it was admitted for is counted;
        // a parallel group's other agents are still checked.
        let admitted = match slots {
            Slots::Held => snapshot.process.waiting_for.as_deref(),
            Slots::Check => None,
        };
        let decision = if slots == Slots::Held && admitted.is_none() {
            decide(&snapshot, &event, &ctx)
        } else {
            decide_admitted(&mut *conn, &snapshot, &event, &ctx, &mut room, admitted).await?
        };
        room.take(&decision);
        decided.push(Decided {
            snapshot,
            decision,
            now,
        });
    }
    apply_all(&mut *conn, &decided, actor).await?;
    mark_used_events(&mut *conn, &decided).await?;
    register_wait_keys(&mut *conn, &decided).await?;
    room.keys.write(&mut *conn).await?;
    pause_keys(&mut *conn, &decided).await?;
    // Last: the keys' rows stay locked only until the commit.
    learn_keys(&mut *conn, &decided, store.grace()).await?;
    super::children::cascade(&mut *conn, store, actor, &mut decided).await?;
    Ok(decided)
}

/// Records the business keys the batch's orders now wait with (see
/// [`crate::machine::park::WaitKey`]), so that events naming a key find
/// them.
///
/// # Errors
/// When the database fails.
async fn register_wait_keys(
    conn: &mut PgConnection,
    decided: &[Decided],
) -> Result<(), StoreError> {
    let (mut orders, mut steps, mut keys) = (Vec::new(), Vec::new(), Vec::new());
    for d in decided {
        if let Some(wait) = &d.decision.wait_key {
            orders.push(d.snapshot.order_id.as_str());
            steps.push(wait.step.as_str());
            keys.push(wait.key.as_str());
        }
    }
    if orders.is_empty() {
        return Ok(());
    }
    sqlx::query(
        "INSERT INTO order_waits (order_id, step, correlation_key)
         SELECT * FROM UNNEST($1::text[], $2::text[], $3::text[])
         ON CONFLICT (order_id, step) DO UPDATE SET correlation_key = EXCLUDED.correlation_key",
    )
    .bind(&orders)
    .bind(&steps)
    .bind(&keys)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Marks the mailbox events the batch's wait steps used, with the step
/// that used each, so that each is used once.
///
/// # Errors
/// When the database fails, or an event was used already (a guard that
/// cannot fail under the order's lock without a bug).
async fn mark_used_events(conn: &mut PgConnection, decided: &[Decided]) -> Result<(), StoreError> {
    let (mut orders, mut events, mut steps) = (Vec::new(), Vec::new(), Vec::new());
    for d in decided {
        if let Some(event_id) = &d.decision.used_event {
            let step = d
                .decision
                .history
                .iter()
                .find(|line| line.event == crate::machine::HistoryEvent::WaitEnded)
                .and_then(|line| line.step.clone());
            orders.push(d.snapshot.order_id.as_str().to_owned());
            events.push(event_id.clone());
            steps.push(step);
        }
    }
    if orders.is_empty() {
        return Ok(());
    }
    let marked = sqlx::query(
        "UPDATE order_events e SET used_at = now(), used_by = u.step
           FROM UNNEST($1::text[], $2::text[], $3::text[]) AS u(order_id, event_id, step)
          WHERE e.order_id = u.order_id AND e.event_id = u.event_id AND e.used_at IS NULL",
    )
    .bind(&orders)
    .bind(&events)
    .bind(&steps)
    .execute(&mut *conn)
    .await?
    .rows_affected();
    if marked != orders.len() as u64 {
        return Err(StoreError::Invariant(format!(
            "{} of {} mailbox events to mark used were not unused",
            orders.len() as u64 - marked,
            orders.len()
        )));
    }
    Ok(())
}

/// What a batch's room checks read: each agent's admission counters (in
/// flight, limit, waiting; `None` for an agent without a row, which has no
/// admission control), read once for the batch, and the attempts in flight
/// and places in line the batch's decisions so far move, not yet written.
#[derive(Debug)]
struct Room {
    read: HashMap<String, Option<(i32, i32, i32)>>,
    taken: HashMap<String, (i32, i32)>,
    /// The key lines', read under their locks (see [`KeyRoom`]).
    keys: KeyRoom,
}

impl Room {
    fn take(&mut self, decision: &Decision) {
        for delta in &decision.admission {
            let taken = self.taken.entry(delta.agent.clone()).or_default();
            taken.0 += delta.in_flight;
            taken.1 += delta.waiting;
        }
        self.keys.take(decision);
    }

    /// Whether `agent` has a slot for one more attempt ([`has_room`]).
    async fn has_room(
        &mut self,
        conn: &mut PgConnection,
        agent: &str,
        first_in_line: bool,
    ) -> Result<bool, StoreError> {
        let counters = match self.read.get(agent) {
            Some(counters) => *counters,
            None => {
                let counters = sqlx::query_as(
                    "SELECT in_flight, admit_limit, waiting FROM admission_now WHERE agent = $1",
                )
                .bind(agent)
                .fetch_optional(&mut *conn)
                .await?;
                self.read.insert(agent.to_owned(), counters);
                counters
            }
        };
        let (more_in_flight, more_waiting) = self.taken.get(agent).copied().unwrap_or_default();
        Ok(counters.is_none_or(|(in_flight, limit, waiting)| {
            has_room(
                in_flight + more_in_flight,
                limit,
                waiting + more_waiting,
                first_in_line,
            )
        }))
    }
}

impl Writes<'_> {
    /// [`transition`] for one order and one event, in a transaction of its
    /// own. `None` when the order does not exist.
    ///
    /// # Errors
    /// When the database fails; nothing changed then.
    pub(crate) async fn transition_one(
        self,
        order_id: &str,
        event: &Event<'_>,
        actor: &str,
    ) -> Result<Option<Decided>, StoreError> {
        run_again_if_rolled_back(order_id, || self.transition_once(order_id, event, actor)).await
    }

    /// One try of [`Writes::transition_one`].
    async fn transition_once(
        self,
        order_id: &str,
        event: &Event<'_>,
        actor: &str,
    ) -> Result<Option<Decided>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let decided = transition(
            &mut tx,
            self.store,
            &[order_id],
            actor,
            Slots::Check,
            |_| *event,
        )
        .await?;
        tx.commit().await?;
        Ok(decided.into_iter().next())
    }
}

/// Runs `once` (a transaction of its own on `order_id`) again when
/// Postgres rolled it back as a deadlock, a few times, before answering
/// that the database failed. A rolled-back transaction wrote nothing; a
/// cascade to a child or a parent can meet another transaction that locked
/// them the other way round (see `children`).
///
/// # Errors
/// The last try's failure.
pub(crate) async fn run_again_if_rolled_back<T, F, Fut>(
    order_id: &str,
    mut once: F,
) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let mut tries = 0;
    loop {
        tries += 1;
        match once().await {
            Err(error) if error.is_rolled_back() && tries < ROLLBACK_TRIES => {
                tracing::debug!(order_id, error = %error, "transaction rolled back; running it again");
            }
            outcome => return outcome,
        }
    }
}

/// Locks the `order_process` rows of `order_ids` (in order id order, as
/// every batch does, so two transactions cannot deadlock) and reads each
/// order's snapshot, with the transaction's `now()`: the clock every
/// decision of this transaction uses. Orders that do not exist are left out.
///
/// The lock is taken by a statement of its own, before the read. In one
/// statement (`… JOIN steps … FOR UPDATE OF p`), a lock that had to wait
/// for another transaction (a claim starting the order's next attempt, a
/// deadline's recovery) returns the order's new process row beside the
/// steps as they were when the statement began (Postgres re-checks only
/// the locked row): a late reply was then decided against the attempt
/// that had just been replaced, its guarded write failed and the reply
/// went back to its queue. Read after the lock is held, by a statement
/// with a snapshot of its own, the steps are what the holder committed.
///
/// # Errors
/// When the database fails.
pub(crate) async fn load_snapshots(
    conn: &mut PgConnection,
    order_ids: &[&str],
) -> Result<(Vec<Snapshot>, DateTime<Utc>), StoreError> {
    sqlx::query(
        "SELECT 1 FROM order_process WHERE order_id = ANY($1) ORDER BY order_id FOR UPDATE",
    )
    .bind(order_ids)
    .execute(&mut *conn)
    .await?;
    let rows = sqlx::query(concat!(
        "SELECT p.order_id, p.state, p.locked_by, p.complete_by, p.failure_count, p.not_before,
                p.last_error, p.reply_to, p.trace_id, p.reply_correlation_id, p.priority, p.waiting_for, p.admit_key,
                p.waiting_key,
                o.body, o.submitted_by, c.parent_order_id, c.step AS parent_step, now() AS now, ",
        step_select!(),
        "
           FROM order_process p
           JOIN orders o ON o.order_id = p.order_id
           JOIN steps s ON s.order_id = p.order_id
           LEFT JOIN order_children c ON c.child_order_id = p.order_id
          WHERE p.order_id = ANY($1)
          ORDER BY p.order_id, s.position"
    ))
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
    let mut waiting: Vec<String> = Vec::new();
    // Rows come ordered by order id, then position.
    for row in &rows {
        let order_id: String = row.try_get("order_id")?;
        let step = BESIDE_ORDER.read(row)?;
        match snapshots.get_mut(&order_id) {
            Some(snapshot) => snapshot.steps.push(step),
            None => {
                let mut snapshot = snapshot_from_row(row)?;
                snapshot.steps.push(step);
                snapshots.insert(order_id, snapshot);
            }
        }
    }
    // Only children read their parent's step (does it still wait for
    // them?): no cost for other orders. Under the children's locks, as
    // every transaction that ends a child holds its lock.
    let children: Vec<&str> = snapshots
        .values()
        .filter(|s| s.parent.is_some())
        .map(|s| s.order_id.as_str())
        .collect();
    if !children.is_empty() {
        let steps: Vec<(String, String, StepState)> = sqlx::query_as(
            "SELECT c.child_order_id, s.idempotency_key, s.state
               FROM order_children c
               JOIN steps s ON s.order_id = c.parent_order_id AND s.name = c.step
              WHERE c.child_order_id = ANY($1)",
        )
        .bind(&children)
        .fetch_all(&mut *conn)
        .await?;
        for (child, key, state) in steps {
            if let Some(link) = snapshots.get_mut(&child).and_then(|s| s.parent.as_mut()) {
                link.waits = crate::machine::child::parent_waits(
                    &link.order_id.as_str().into(),
                    &link.step,
                    &key,
                    state,
                    &child,
                );
            }
        }
    }
    // Only orders with a wait step read their mailbox: no cost for others.
    for snapshot in snapshots.values() {
        if snapshot.steps.iter().any(|step| step.kind.parks()) {
            waiting.push(snapshot.order_id.as_str().to_owned());
        }
    }
    if !waiting.is_empty() {
        let events = sqlx::query(
            "SELECT order_id, event_id, name, data, received_at, principals, sender FROM order_events
              WHERE order_id = ANY($1) AND used_at IS NULL AND expired_at IS NULL
              ORDER BY order_id, received_at, event_id",
        )
        .bind(&waiting)
        .fetch_all(&mut *conn)
        .await?;
        for row in &events {
            let order_id: String = row.try_get("order_id")?;
            if let Some(snapshot) = snapshots.get_mut(&order_id) {
                snapshot.mailbox.push(MailboxEvent {
                    event_id: row.try_get("event_id")?,
                    name: row.try_get("name")?,
                    data: row.try_get("data")?,
                    received_at: row.try_get("received_at")?,
                    principals: row.try_get("principals")?,
                    sender: row.try_get("sender")?,
                });
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
            waiting_key: row.try_get("waiting_key")?,
        },
        steps: Vec::new(),
        mailbox: Vec::new(),
        submitted_by: row.try_get("submitted_by")?,
        parent: match row.try_get::<Option<String>, _>("parent_order_id")? {
            // Whether it waits is read below, for children only.
            Some(order_id) => Some(crate::machine::child::ParentLink {
                order_id,
                step: row.try_get("parent_step")?,
                waits: false,
            }),
            None => None,
        },
    })
}

/// Writes every decision of a batch, decided by `actor`, in one statement:
/// the process records, the changed steps (each guarded by the state and
/// attempt id it was decided on), the history lines, the alerts and the
/// admission counters (summed by agent, in agent order, as every writer
/// locks them).
///
/// # Errors
/// When the database fails, or a guard did not hold ([`StoreError::Invariant`]):
/// the caller's transaction must then be abandoned.
async fn apply_all(
    conn: &mut PgConnection,
    decided: &[Decided],
    actor: &str,
) -> Result<(), StoreError> {
    let writes: Vec<&Decided> = decided.iter().filter(|d| d.decision.writes()).collect();
    if writes.is_empty() {
        return Ok(());
    }
    // A move's new steps replace the old ones first: the statement below
    // changes no step of a moved order (its changes are the new plan).
    for d in &writes {
        if let Some(moved) = &d.decision.moved {
            let steps = serde_json::to_value(&moved.steps)
                .map_err(|e| StoreError::Invariant(format!("steps as JSON: {e}")))?;
            sqlx::query("SELECT sas_replace_steps($1, $2, $3)")
                .bind(d.snapshot.order_id.as_str())
                .bind(moved.version)
                .bind(&steps)
                .execute(&mut *conn)
                .await?;
        }
    }
    let rows = Rows::of(&writes);
    if !rows.admission.agent.is_empty() {
        // The agents' rows are locked before the statement that moves them,
        // so that it reads their shards after any fold it would have waited
        // for: in one statement, a row re-read after the wait beside shards
        // read before it would count the folded shards twice in the peak.
        sqlx::query(
            "SELECT 1 FROM admission WHERE agent = ANY($1) ORDER BY agent FOR NO KEY UPDATE",
        )
        .bind(&rows.admission.agent)
        .execute(&mut *conn)
        .await?;
    }
    let row = sqlx::query(
        "WITH p AS (
             UPDATE order_process o
                SET state = d.state::process_state, locked_by = d.locked_by,
                    complete_by = d.complete_by, failure_count = d.failure_count,
                    not_before = d.not_before, last_error = d.last_error,
                    waiting_for = d.waiting_for, admit_key = d.admit_key,
                    waiting_key = d.waiting_key, updated_at = now()
               FROM UNNEST($1::text[], $2::text[], $3::text[], $4::timestamptz[], $5::int4[],
                           $6::timestamptz[], $7::text[], $8::text[], $9::timestamptz[], $43::text[])
                    AS d(order_id, state, locked_by, complete_by, failure_count, not_before,
                         last_error, waiting_for, admit_key, waiting_key)
              WHERE o.order_id = d.order_id
          RETURNING 1),
         c AS (
             SELECT * FROM UNNEST($10::text[], $11::int4[], $12::text[], $13::int4[], $14::uuid[],
                                  $15::timestamptz[], $16::text[], $17::jsonb[], $18::text[],
                                  $19::text[], $20::uuid[], $21::bool[], $22::int4[], $23::bool[],
                                  $24::jsonb[], $44::text[])
                    AS c(order_id, position, state, attempt, attempt_id, complete_by,
                         idempotency_key, result, last_error, expected_state,
                         expected_attempt_id, maybe_applied, undo_generation, undo_refused,
                         undo_result, limit_key)),
         s AS (
             UPDATE steps st
                SET state = c.state::step_state, attempt = c.attempt, attempt_id = c.attempt_id,
                    complete_by = c.complete_by, idempotency_key = c.idempotency_key,
                    result = c.result, last_error = c.last_error,
                    maybe_applied = c.maybe_applied, undo_generation = c.undo_generation,
                    undo_refused = c.undo_refused, undo_result = c.undo_result,
                    limit_key = c.limit_key, updated_at = now()
               FROM c
              WHERE st.order_id = c.order_id AND st.position = c.position
                AND st.state = c.expected_state::step_state
                AND st.attempt_id IS NOT DISTINCT FROM c.expected_attempt_id
          RETURNING 1),
         h AS (
             INSERT INTO history (order_id, actor, event, step, attempt_id, detail)
             SELECT h.order_id, $25, h.event, h.step, h.attempt_id, h.detail
               FROM UNNEST($26::text[], $27::text[], $28::text[], $29::uuid[], $30::text[])
                    WITH ORDINALITY AS h(order_id, event, step, attempt_id, detail, n)
              ORDER BY h.n),
         a AS (
             INSERT INTO alerts (order_id, kind, message)
             SELECT * FROM UNNEST($31::text[], $32::text[], $33::text[])),
         r AS (
             UPDATE alerts SET resolved_at = now(), resolved_by = $25,
                    resolution_note = 'an operator resubmitted, resumed or cancelled the order'
              WHERE order_id = ANY($34::text[]) AND resolved_at IS NULL),
         -- The rare paths move the agent's row; the peak counts what its
         -- shards hold too (crate::admission::SHARDS).
         q AS (
             UPDATE admission a
                SET in_flight = a.in_flight + d.in_flight, waiting = a.waiting + d.waiting,
                    peak_in_flight = GREATEST(a.peak_in_flight, a.in_flight + d.peak_rise
                        + COALESCE((SELECT sum(x.in_flight) FROM admission_shard x WHERE x.agent = a.agent), 0)),
                    settled = a.settled + d.settled, in_flight_ms = a.in_flight_ms + d.in_flight_ms,
                    queued_ms = a.queued_ms + d.queued_ms, slot_wait_ms = a.slot_wait_ms + d.slot_wait_ms
               FROM (SELECT * FROM UNNEST($35::text[], $36::int4[], $37::int4[], $38::int4[], $39::int8[],
                                          $40::int8[], $41::int8[], $42::int8[])
                              AS d(agent, in_flight, waiting, peak_rise, settled, in_flight_ms,
                                   queued_ms, slot_wait_ms) ORDER BY agent) d
              WHERE a.agent = d.agent)
         SELECT (SELECT count(*) FROM p) AS process, (SELECT count(*) FROM s) AS steps",
    )
    .bind(&rows.process.order_id)
    .bind(&rows.process.state)
    .bind(&rows.process.locked_by)
    .bind(&rows.process.complete_by)
    .bind(&rows.process.failure_count)
    .bind(&rows.process.not_before)
    .bind(&rows.process.last_error)
    .bind(&rows.process.waiting_for)
    .bind(&rows.process.admit_key)
    .bind(&rows.steps.order_id)
    .bind(&rows.steps.position)
    .bind(&rows.steps.state)
    .bind(&rows.steps.attempt)
    .bind(&rows.steps.attempt_id)
    .bind(&rows.steps.complete_by)
    .bind(&rows.steps.idempotency_key)
    .bind(&rows.steps.result)
    .bind(&rows.steps.last_error)
    .bind(&rows.steps.expected_state)
    .bind(&rows.steps.expected_attempt_id)
    .bind(&rows.steps.maybe_applied)
    .bind(&rows.steps.undo_generation)
    .bind(&rows.steps.undo_refused)
    .bind(&rows.steps.undo_result)
    .bind(actor)
    .bind(&rows.history.order_id)
    .bind(&rows.history.event)
    .bind(&rows.history.step)
    .bind(&rows.history.attempt_id)
    .bind(&rows.history.detail)
    .bind(&rows.alerts.0)
    .bind(&rows.alerts.1)
    .bind(&rows.alerts.2)
    .bind(&rows.resolve)
    .bind(&rows.admission.agent)
    .bind(&rows.admission.in_flight)
    .bind(&rows.admission.waiting)
    .bind(&rows.admission.peak_rise)
    .bind(&rows.admission.settled)
    .bind(&rows.admission.in_flight_ms)
    .bind(&rows.admission.queued_ms)
    .bind(&rows.admission.slot_wait_ms)
    .bind(&rows.process.waiting_key)
    .bind(&rows.steps.limit_key)
    .fetch_one(&mut *conn)
    .await?;
    let (changed_process, changed_steps): (i64, i64) =
        (row.try_get("process")?, row.try_get("steps")?);
    let (expected_process, expected_steps) = (
        rows.process.order_id.len() as i64,
        rows.steps.order_id.len() as i64,
    );
    if changed_process != expected_process || changed_steps != expected_steps {
        let orders: Vec<&str> = writes
            .iter()
            .map(|d| d.snapshot.order_id.as_str())
            .collect();
        return Err(StoreError::Invariant(format!(
            "orders {orders:?}: a decision's guards did not hold under the orders' locks \
             ({changed_process} of {expected_process} process rows, {changed_steps} of {expected_steps} steps changed)"
        )));
    }
    Ok(())
}

/// A batch's decisions as the columns of [`apply_all`]'s statement.
#[derive(Default)]
struct Rows<'a> {
    process: ProcessColumns<'a>,
    steps: StepColumns<'a>,
    history: HistoryColumns<'a>,
    /// The new alerts: order, kind, message.
    alerts: (Vec<&'a str>, Vec<&'a str>, Vec<&'a str>),
    /// Orders whose open alerts are resolved.
    resolve: Vec<&'a str>,
    admission: AdmissionColumns,
}

#[derive(Default)]
struct ProcessColumns<'a> {
    order_id: Vec<&'a str>,
    state: Vec<&'a str>,
    locked_by: Vec<Option<&'a str>>,
    complete_by: Vec<Option<DateTime<Utc>>>,
    failure_count: Vec<i32>,
    not_before: Vec<DateTime<Utc>>,
    last_error: Vec<Option<&'a str>>,
    waiting_for: Vec<Option<&'a str>>,
    admit_key: Vec<Option<DateTime<Utc>>>,
    waiting_key: Vec<Option<&'a str>>,
}

#[derive(Default)]
struct StepColumns<'a> {
    order_id: Vec<&'a str>,
    position: Vec<i32>,
    state: Vec<&'a str>,
    attempt: Vec<i32>,
    attempt_id: Vec<Option<Uuid>>,
    complete_by: Vec<Option<DateTime<Utc>>>,
    idempotency_key: Vec<&'a str>,
    result: Vec<Option<serde_json::Value>>,
    last_error: Vec<Option<&'a str>>,
    expected_state: Vec<&'a str>,
    expected_attempt_id: Vec<Option<Uuid>>,
    maybe_applied: Vec<bool>,
    undo_generation: Vec<i32>,
    undo_refused: Vec<bool>,
    undo_result: Vec<Option<serde_json::Value>>,
    limit_key: Vec<Option<&'a str>>,
}

#[derive(Default)]
struct HistoryColumns<'a> {
    order_id: Vec<&'a str>,
    event: Vec<&'a str>,
    step: Vec<Option<&'a str>>,
    attempt_id: Vec<Option<Uuid>>,
    detail: Vec<Option<&'a str>>,
}

/// The batch's admission deltas summed by agent, in agent order: the
/// attempts in flight and places in line it moves, the highest the
/// in-flight count rises along the batch (for the peak), and the attempts
/// it settles (a slot given back by an attempt that started), and the
/// answered attempts' milliseconds in flight, queued, and waiting for call
/// slots.
#[derive(Default)]
struct AdmissionColumns {
    agent: Vec<String>,
    in_flight: Vec<i32>,
    waiting: Vec<i32>,
    peak_rise: Vec<i32>,
    settled: Vec<i64>,
    in_flight_ms: Vec<i64>,
    queued_ms: Vec<i64>,
    slot_wait_ms: Vec<i64>,
}

/// One agent's deltas summed over a batch: see [`AdmissionColumns`].
#[derive(Default)]
struct AgentSum {
    in_flight: i32,
    waiting: i32,
    peak_rise: i32,
    settled: i64,
    in_flight_ms: i64,
    queued_ms: i64,
    slot_wait_ms: i64,
}

impl<'a> Rows<'a> {
    fn of(writes: &[&'a Decided]) -> Self {
        let mut rows = Self::default();
        // The batch's deltas summed by agent, in agent order.
        let mut admission: BTreeMap<&str, AgentSum> = BTreeMap::new();
        for decided in writes {
            let (snapshot, decision) = (&decided.snapshot, &decided.decision);
            let order_id = snapshot.order_id.as_str();
            if let Some(process) = &decision.process {
                let p = &mut rows.process;
                p.order_id.push(order_id);
                p.state.push(process.state.as_str());
                p.locked_by.push(process.locked_by.as_deref());
                p.complete_by.push(process.complete_by);
                p.failure_count.push(process.failure_count);
                p.not_before.push(process.not_before);
                p.last_error.push(process.last_error.as_deref());
                p.waiting_for.push(process.waiting_for.as_deref());
                p.admit_key.push(process.admit_key);
                p.waiting_key.push(process.waiting_key.as_deref());
            }
            for change in &decision.steps {
                let (c, row) = (&mut rows.steps, &change.row);
                c.order_id.push(order_id);
                c.position.push(row.position);
                c.state.push(row.state.as_str());
                c.attempt.push(row.attempt);
                c.attempt_id.push(row.attempt_id.map(AttemptId::as_uuid));
                c.complete_by.push(row.complete_by);
                c.idempotency_key.push(row.idempotency_key.as_str());
                c.result.push(row.result.clone());
                c.last_error.push(row.last_error.as_deref());
                c.expected_state.push(change.expected_state.as_str());
                c.expected_attempt_id
                    .push(change.expected_attempt_id.map(AttemptId::as_uuid));
                c.maybe_applied.push(row.maybe_applied);
                c.undo_generation.push(row.undo_generation);
                c.undo_refused.push(row.undo_refused);
                c.undo_result.push(row.undo_result.clone());
                c.limit_key.push(row.limit_key.as_deref());
            }
            for line in &decision.history {
                let h = &mut rows.history;
                h.order_id.push(order_id);
                h.event.push(line.event.as_str());
                h.step.push(line.step.as_deref());
                h.attempt_id.push(line.attempt_id.map(AttemptId::as_uuid));
                h.detail.push(line.detail.as_deref());
            }
            if let Some(alert) = &decision.alert {
                rows.alerts.0.push(order_id);
                rows.alerts.1.push(alert.kind.as_str());
                rows.alerts.2.push(alert.message.as_str());
            }
            if decision.resolve_alerts {
                rows.resolve.push(order_id);
            }
            for delta in &decision.admission {
                let sum = admission.entry(delta.agent.as_str()).or_default();
                sum.in_flight += delta.in_flight;
                sum.waiting += delta.waiting;
                sum.peak_rise = sum.peak_rise.max(sum.in_flight);
                sum.settled += i64::from((-delta.in_flight - delta.unstarted).max(0));
                sum.in_flight_ms += delta.in_flight_ms;
                sum.queued_ms += delta.queued_ms;
                sum.slot_wait_ms += delta.slot_wait_ms;
            }
        }
        for (agent, sum) in admission {
            let a = &mut rows.admission;
            a.agent.push(agent.to_owned());
            a.in_flight.push(sum.in_flight);
            a.waiting.push(sum.waiting);
            a.peak_rise.push(sum.peak_rise);
            a.settled.push(sum.settled);
            a.in_flight_ms.push(sum.in_flight_ms);
            a.queued_ms.push(sum.queued_ms);
            a.slot_wait_ms.push(sum.slot_wait_ms);
        }
        rows
    }
}

/// Decides `event` for the order of `snapshot` under admission control:
/// when the decision would take a slot of an agent with none free (of any
/// of them, for a parallel group), decides again with that agent closed,
/// and the order waits in its line instead. The slot of `admitted`, the
/// agent whose line the order was admitted from, is not checked again.
///
/// Whether a slot is free is [`has_room`]'s rule, on the counters as
/// [`Room`] holds them for the batch. They are read without locking them,
/// so schedulers deciding at the same moment can overshoot the limit by a
/// few: it bounds queueing, it is not a semaphore.
///
/// # Errors
/// When the database fails.
async fn decide_admitted(
    conn: &mut PgConnection,
    snapshot: &Snapshot,
    event: &Event<'_>,
    ctx: &Context<'_>,
    room: &mut Room,
    admitted: Option<&str>,
) -> Result<Decision, StoreError> {
    let decision = decide(snapshot, event, ctx);
    // An order taken from a line (its agent's or its key's) is first in
    // line for both checks: otherwise, with both lines long, it would go
    // from one to the back of the other for ever.
    let from_a_line =
        snapshot.process.waiting_for.is_some() || snapshot.process.waiting_key.is_some();
    let mut full = None;
    for (agent, kind) in decision.takes_slots() {
        if Some(agent) == admitted {
            continue;
        }
        let first_in_line = kind == StepKind::Compensation || from_a_line;
        if !room.has_room(&mut *conn, agent, first_in_line).await? {
            full = Some(agent.to_owned());
            break;
        }
    }
    if let Some(agent) = full {
        let closed = Context {
            closed: Some(&agent),
            ..*ctx
        };
        return Ok(decide(snapshot, event, &closed));
    }
    // Most decisions start nothing limited by key: no more work for them.
    if decision.takes_keys().is_empty() {
        return Ok(decision);
    }
    let mut full_key = None;
    // Members of one parallel group in one key each need room: the
    // demand so far of this decision counts.
    let mut demand: HashMap<&str, i64> = HashMap::new();
    // A new attempt of a step the key counts in flight (a retry after a
    // transient failure, its call answered) takes the place it held.
    let mut replaced: HashMap<&str, i64> = HashMap::new();
    for change in &decision.steps {
        let Some(before) = snapshot
            .steps
            .iter()
            .find(|s| s.position == change.row.position)
        else {
            continue;
        };
        if let Some(line) = before.limit_key.as_deref() {
            if change.row.attempt_id != change.expected_attempt_id
                && room.keys.counted(&snapshot.process, before)
            {
                *replaced.entry(line).or_default() += 1;
            }
        }
    }
    for (line, limits, kind) in decision.takes_keys() {
        let first_in_line = kind == StepKind::Compensation || from_a_line;
        let wanted = demand.entry(line).or_default();
        *wanted += 1;
        let replaced = replaced.get(line).copied().unwrap_or_default();
        if !room
            .keys
            .has_room(&mut *conn, line, limits, first_in_line, *wanted, replaced)
            .await?
        {
            full_key = Some(line.to_owned());
            break;
        }
    }
    let Some(line) = full_key else {
        return Ok(decision);
    };
    let closed = Context {
        closed_key: Some(&line),
        ..*ctx
    };
    Ok(decide(snapshot, event, &closed))
}
