//! Admission control's shared state: one row per agent (`admission`), read
//! by every scheduler and adapted by the supervisors, and the agent's
//! shards (`admission_shard`), where the hot paths add their deltas so that
//! they do not wait for each other's commits on one row. Readers use the
//! `admission_now` view, the row plus its shards. What the counters mean
//! and how the limit adapts (the control law) is decided in
//! [`crate::machine::admission`]; this module reads and writes the rows.

use std::time::Duration;

use serde::Serialize;

use sqlx::AssertSqlSafe;

use crate::machine::admission::{adapted_cap, adapted_limit, Window};
use crate::{Store, StoreError};

/// How many shards each agent's counters have. The intake and fast reply
/// statements each add to one, picked at random: with two or three
/// statements in flight per scheduler, eight make a meeting on one row
/// rare. [`Admission::register`] and the supervisors' folds make them; a
/// statement that picks one not there yet (a row made by hand, or by an
/// older scheduler, before the next fold) makes it. Readers sum whatever
/// shards exist, so changing the number loses nothing.
pub(crate) const SHARDS: i16 = 8;

/// The agents' admission rows of a [`Store`] (see [`Store::admission`]):
/// registered by schedulers, read by every scheduler's claim through the
/// write kernel, adapted and reconciled by the supervisors.
#[derive(Debug, Clone, Copy)]
pub struct Admission<'a> {
    store: &'a Store,
}

impl<'a> Admission<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    fn pool(&self) -> &'a sqlx::PgPool {
        self.store.pool()
    }
}

/// An agent's row whose window is due, as the control law reads it.
#[derive(sqlx::FromRow)]
struct DueWindow {
    agent: String,
    admit_limit: i32,
    initial_limit: i32,
    ceiling: i32,
    waiting: i32,
    peak_in_flight: i32,
    settled: i64,
    seconds: f64,
    deadline_ms: i32,
    in_flight_ms: i64,
    queued_ms: i64,
    slot_wait_ms: i64,
}

impl DueWindow {
    fn window(&self) -> Window {
        Window {
            limit: self.admit_limit,
            initial: self.initial_limit,
            ceiling: self.ceiling,
            waiting: self.waiting,
            peak_in_flight: self.peak_in_flight,
            settled: self.settled,
            seconds: self.seconds,
            deadline_ms: self.deadline_ms,
            in_flight_ms: self.in_flight_ms,
            queued_ms: self.queued_ms,
            slot_wait_ms: self.slot_wait_ms,
        }
    }
}

/// One agent's admission counters, for gauges and operators.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct AgentAdmission {
    /// The agent.
    pub agent: String,
    /// Attempts dispatched and not settled.
    pub in_flight: i32,
    /// Orders in its line.
    pub waiting: i32,
    /// Attempts allowed in flight now.
    pub admit_limit: i32,
    /// The most attempts in flight when urgent work passes a full limit
    /// ([`crate::machine::admission::Levels`]).
    pub admit_cap: i32,
    /// The highest the limit may go.
    pub ceiling: i32,
}

/// One agent's line for operators: its counters and the oldest wait.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct AdmissionLine {
    /// The agent.
    pub agent: String,
    /// Attempts dispatched and not settled.
    pub in_flight: i32,
    /// Orders in its line.
    pub waiting: i32,
    /// Attempts allowed in flight now.
    pub admit_limit: i32,
    /// The most in flight when urgent orders pass a full limit
    /// ([`crate::machine::admission::Levels`]): in flight may exceed the
    /// limit up to it.
    pub admit_cap: i32,
    /// The highest the limit may go.
    pub ceiling: i32,
    /// Seconds the longest-waiting order of the line has waited (none when
    /// nobody waits).
    pub oldest_wait_secs: Option<f64>,
}

/// How the supervisors adapt the limits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Adaptation {
    /// Length of a measuring window.
    pub window: Duration,
    /// Share of a step's deadline the attempts admitted may spend queued and
    /// running (0.5: half of it, the rest is margin).
    pub deadline_share: f64,
}

impl Admission<'_> {
    /// Makes sure every agent in `agents` (name, shortest step deadline) has
    /// an admission row and its [`SHARDS`] shards, starting at `initial`
    /// under `ceiling`; an existing row takes the new ceiling and deadline
    /// and keeps its counters.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn register(
        self,
        agents: &[(String, Duration)],
        initial: i32,
        ceiling: i32,
    ) -> Result<(), StoreError> {
        let names: Vec<&str> = agents.iter().map(|(name, _)| name.as_str()).collect();
        let deadlines: Vec<i32> = agents
            .iter()
            .map(|(_, deadline)| i32::try_from(deadline.as_millis()).unwrap_or(i32::MAX))
            .collect();
        sqlx::query(
            "INSERT INTO admission (agent, admit_limit, initial_limit, ceiling, deadline_ms)
             SELECT agent, LEAST($3, $4), LEAST($3, $4), $4, deadline_ms
               FROM UNNEST($1::text[], $2::int4[]) AS a(agent, deadline_ms)
              ORDER BY agent
             ON CONFLICT (agent) DO UPDATE
                SET ceiling = EXCLUDED.ceiling, deadline_ms = EXCLUDED.deadline_ms,
                    initial_limit = EXCLUDED.initial_limit,
                    admit_limit = LEAST(admission.admit_limit, EXCLUDED.ceiling)",
        )
        .bind(&names)
        .bind(&deadlines)
        .bind(initial)
        .bind(ceiling)
        .execute(self.pool())
        .await?;
        // Made here rather than on a hot statement's first use, whose
        // foreign-key check would wait for a row a supervisor holds.
        make_shards(self.pool(), &names).await
    }

    /// Adapts the limit and the cap of every agent whose window has run its
    /// length, by [`crate::machine::admission::adapted_limit`] (the control
    /// law, in Rust) and [`crate::machine::admission::adapted_cap`], and
    /// returns every agent's counters. The rows adapted stay
    /// locked from their read to their write, their shards folded into them
    /// first (so the window starts with shards at zero and the peak is
    /// exact); a row another supervisor is adapting is skipped.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn adapt(self, adaptation: &Adaptation) -> Result<Vec<AgentAdmission>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let due: Vec<String> = sqlx::query_scalar(
            "SELECT agent FROM admission
              WHERE now() - window_started >= make_interval(secs => $1::float8 / 1000)
              ORDER BY agent
                FOR UPDATE SKIP LOCKED",
        )
        .bind(adaptation.window.as_millis() as f64)
        .fetch_all(&mut *tx)
        .await?;
        fold(&mut tx, &due).await?;
        let due: Vec<DueWindow> = sqlx::query_as(
            "SELECT agent, admit_limit, initial_limit, ceiling, waiting, peak_in_flight,
                    settled - window_settled AS settled,
                    GREATEST(EXTRACT(EPOCH FROM now() - window_started), 0)::float8 AS seconds,
                    deadline_ms, in_flight_ms - window_in_flight_ms AS in_flight_ms,
                    queued_ms - window_queued_ms AS queued_ms,
                    slot_wait_ms - window_slot_wait_ms AS slot_wait_ms
               FROM admission
              WHERE agent = ANY($1)
              ORDER BY agent",
        )
        .bind(&due)
        .fetch_all(&mut *tx)
        .await?;
        let limits: Vec<i32> = due
            .iter()
            .map(|row| adapted_limit(&row.window(), adaptation.deadline_share))
            .collect();
        let caps: Vec<i32> = due
            .iter()
            .map(|row| adapted_cap(&row.window(), adaptation.deadline_share))
            .collect();
        let agents: Vec<&str> = due.iter().map(|row| row.agent.as_str()).collect();
        let rows = sqlx::query_as(
            "WITH adapted AS (
                 UPDATE admission a
                    SET admit_limit = d.admit_limit, admit_cap = d.admit_cap,
                        window_settled = a.settled,
                        window_in_flight_ms = a.in_flight_ms, window_queued_ms = a.queued_ms,
                        window_slot_wait_ms = a.slot_wait_ms,
                        window_started = now(), peak_in_flight = a.in_flight
                   FROM UNNEST($1::text[], $2::int4[], $3::int4[]) AS d(agent, admit_limit, admit_cap)
                  WHERE a.agent = d.agent
              RETURNING a.agent, a.in_flight, a.waiting, a.admit_limit, a.admit_cap, a.ceiling)
             -- The statement's own snapshot predates its update: the adapted
             -- rows come from RETURNING (exact: their shards are folded and
             -- locked).
             SELECT * FROM adapted
             UNION ALL
             SELECT agent, in_flight, waiting, admit_limit, admit_cap, ceiling FROM admission_now
              WHERE agent <> ALL($1::text[])
             ORDER BY agent",
        )
        .bind(&agents)
        .bind(&limits)
        .bind(&caps)
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(rows)
    }

    /// Every agent's line as operators read it: its counters, and how long
    /// the order that has waited longest in it has waited (its `admit_key`
    /// less the head start its priority, or its undo, gave it; see
    /// [`crate::machine::admit_key`]). Read-only: the real backlog, which
    /// the agent queues do not show.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn lines(self) -> Result<Vec<AdmissionLine>, StoreError> {
        let rows = sqlx::query_as(
            "SELECT a.agent, a.in_flight, a.waiting, a.admit_limit, a.admit_cap, a.ceiling,
                    (SELECT EXTRACT(EPOCH FROM now() - min(p.admit_key
                                + (p.priority * $1::int8
                                   + CASE WHEN p.state = 'compensating' THEN $2::int8 ELSE 0 END)
                                  * interval '1 microsecond'))::float8
                       FROM order_process p
                      WHERE p.waiting_for = a.agent) AS oldest_wait_secs
               FROM admission_now a
              ORDER BY a.agent",
        )
        .bind(crate::machine::PRIORITY_STEP.num_microseconds())
        .bind(crate::machine::UNDO_HEAD_START.num_microseconds())
        .fetch_all(self.pool())
        .await?;
        Ok(rows)
    }

    /// Every agent's counters as its orders say they are (agent, in flight,
    /// waiting; see [`recount`]), read only: what
    /// [`Store::reconcile_admission`] corrects the counters to.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn recount(self) -> Result<Vec<(String, i32, i32)>, StoreError> {
        Ok(
            sqlx::query_as(AssertSqlSafe(format!("{} ORDER BY agent", recount())))
                .fetch_all(self.pool())
                .await?,
        )
    }

    /// Recounts every agent's `in_flight` and `waiting` from the orders
    /// themselves and corrects counters that drifted (a row deleted or
    /// edited by hand, a bug): a lost slot would otherwise be lost for
    /// good. Returns the corrections made.
    ///
    /// Safe beside live traffic: the admission rows and then their shards
    /// are locked first (the shards folded into the rows), and every
    /// transition moves one or the other in the same statement as its
    /// orders, so the count (taken after the locks, in a statement of its
    /// own) sees exactly the transitions whose deltas are already applied.
    /// Those waiting for the locks apply theirs after the correction.
    ///
    /// # Errors
    /// When the database fails, or the rows stay locked for 200 ms.
    pub async fn reconcile(self) -> Result<Vec<Correction>, StoreError> {
        let mut tx = self.pool().begin().await?;
        // Never a long wait for live traffic, nor a deadlock: a supervisor
        // that cannot lock every row at once tries again later.
        sqlx::query("SET LOCAL lock_timeout = '200ms'")
            .execute(&mut *tx)
            .await?;
        let agents: Vec<String> =
            sqlx::query_scalar("SELECT agent FROM admission ORDER BY agent FOR UPDATE")
                .fetch_all(&mut *tx)
                .await?;
        fold(&mut tx, &agents).await?;
        let corrections = sqlx::query_as(AssertSqlSafe(format!(
            "WITH recount AS ({}),
             counted AS (
                 SELECT a.agent, a.in_flight AS was_in_flight, a.waiting AS was_waiting,
                        coalesce(r.in_flight, 0) AS in_flight, coalesce(r.waiting, 0) AS waiting
                   FROM admission a
                   LEFT JOIN recount r ON r.agent = a.agent)
             UPDATE admission a
                SET in_flight = c.in_flight, waiting = c.waiting
               FROM counted c
              WHERE a.agent = c.agent
                AND (c.was_in_flight, c.was_waiting) IS DISTINCT FROM (c.in_flight, c.waiting)
          RETURNING a.agent, c.was_in_flight, c.was_waiting, c.in_flight, c.waiting",
            recount()
        )))
        .fetch_all(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(corrections)
    }
}

/// Makes the [`SHARDS`] shards of each of `agents` that are missing.
async fn make_shards<'e>(db: impl sqlx::PgExecutor<'e>, agents: &[&str]) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO admission_shard (agent, shard)
         SELECT agent, shard
           FROM UNNEST($1::text[]) AS a(agent)
          CROSS JOIN generate_series(0, $2::int2 - 1) AS s(shard)
          ORDER BY agent, shard
         ON CONFLICT (agent, shard) DO NOTHING",
    )
    .bind(agents)
    .bind(SHARDS)
    .execute(db)
    .await?;
    Ok(())
}

/// Adds the shards of `agents` (whose admission rows `tx` holds) into their
/// rows and sets them to zero, holding them until `tx` ends: the rows are
/// then exact, and no hot statement moves them meanwhile (one that would
/// make a missing shard waits for the row, through its foreign key). The
/// rows are locked before the shards, the order the hot statements keep
/// once every shard exists, which is why the fold makes any missing first:
/// under the row locks it holds, that cannot wait for anyone but a hot
/// statement making the same shard.
async fn fold(tx: &mut sqlx::PgConnection, agents: &[String]) -> Result<(), StoreError> {
    if agents.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = agents.iter().map(String::as_str).collect();
    make_shards(&mut *tx, &names).await?;
    sqlx::query(
        "SELECT 1 FROM admission_shard WHERE agent = ANY($1) ORDER BY agent, shard FOR UPDATE",
    )
    .bind(agents)
    .execute(&mut *tx)
    .await?;
    // Each statement reads what is committed when it starts: with the shards
    // locked above, the sums added here are exactly what is zeroed below.
    sqlx::query(
        "UPDATE admission a
            SET in_flight = a.in_flight + s.in_flight,
                peak_in_flight = GREATEST(a.peak_in_flight, s.peak_in_flight),
                settled = a.settled + s.settled, in_flight_ms = a.in_flight_ms + s.in_flight_ms,
                queued_ms = a.queued_ms + s.queued_ms, slot_wait_ms = a.slot_wait_ms + s.slot_wait_ms
           FROM (SELECT agent, sum(in_flight)::int4 AS in_flight,
                        max(peak_in_flight) AS peak_in_flight, sum(settled)::int8 AS settled,
                        sum(in_flight_ms)::int8 AS in_flight_ms, sum(queued_ms)::int8 AS queued_ms,
                        sum(slot_wait_ms)::int8 AS slot_wait_ms
                   FROM admission_shard WHERE agent = ANY($1) GROUP BY agent) s
          WHERE a.agent = s.agent",
    )
    .bind(agents)
    .execute(&mut *tx)
    .await?;
    sqlx::query(
        "UPDATE admission_shard
            SET in_flight = 0, peak_in_flight = 0, settled = 0, in_flight_ms = 0, queued_ms = 0,
                slot_wait_ms = 0
          WHERE agent = ANY($1)",
    )
    .bind(agents)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Every agent's counters as its orders say they are: an attempt in
/// flight for each order held with a deadline whose current step (running
/// forward, or compensating) is the agent's (the machine's
/// [`crate::machine::slots_held`]), a place in line for each order waiting
/// for it. Agents with neither are left out. Pinned to the machine by the
/// property test (`tests/tests/e2e/state_machine.rs`).
fn recount() -> String {
    format!(
        "SELECT agent, sum(in_flight)::int4 AS in_flight, sum(waiting)::int4 AS waiting
           FROM (SELECT s.agent, 1 AS in_flight, 0 AS waiting {IN_FLIGHT}
                 UNION ALL
                 SELECT waiting_for, 0, 1 FROM order_process WHERE waiting_for IS NOT NULL) c
          GROUP BY agent"
    )
}

/// The attempts in flight, one row per attempt (`s.agent`, and `op` its
/// order), as [`crate::machine::admission::slots_held`] counts them: the
/// FROM and WHERE clauses of a statement that counts them.
pub(crate) const IN_FLIGHT: &str = "
      FROM order_process op
      JOIN steps s ON s.order_id = op.order_id
       AND s.state = CASE op.state WHEN 'processing' THEN 'running'::step_state
                                   ELSE 'compensating'::step_state END
     WHERE op.state IN ('processing', 'compensating')
       AND op.locked_by IS NOT NULL AND op.complete_by IS NOT NULL";

/// An agent's counters that did not match its orders, and what they became.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Correction {
    /// The agent.
    pub agent: String,
    /// Attempts in flight, as counted before.
    pub was_in_flight: i32,
    /// Orders in line, as counted before.
    pub was_waiting: i32,
    /// Attempts in flight, recounted.
    pub in_flight: i32,
    /// Orders in line, recounted.
    pub waiting: i32,
}
