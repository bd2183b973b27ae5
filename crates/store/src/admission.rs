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
use crate::writes::key_room::KEY_IN_FLIGHT;
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

    pub(crate) fn pool(&self) -> &'a sqlx::PgPool {
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
    /// When the window began: the new limit is written only if it still
    /// did (another supervisor may have adapted the row meanwhile).
    window_started: chrono::DateTime<chrono::Utc>,
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

/// One key's line (see [`crate::machine::concurrency`]) for operators:
/// its attempts in flight, its orders waiting, its limit, the oldest wait.
#[derive(Debug, Clone, PartialEq, Serialize, sqlx::FromRow)]
pub struct KeyLine {
    /// The key line (`payment:m-17`, or a fixed name).
    pub key: String,
    /// Attempts in flight under the key.
    pub in_flight: i64,
    /// Orders waiting in its line.
    pub waiting: i64,
    /// The most in flight at once, as its steps declare it (for an
    /// adaptive key, the most it may learn).
    pub limit: Option<i32>,
    /// The limit an adaptive key lets in flight now (within `limit`): what
    /// it learnt, or 1 before its remote's first answer (see
    /// [`crate::machine::key_learning`]).
    pub learnt_limit: Option<i32>,
    /// The starts a second its steps allow, when they declare a rate.
    pub per_second: Option<i32>,
    /// Seconds the longest-waiting order of the line has waited (none when
    /// nobody waits).
    pub oldest_wait_secs: Option<f64>,
    /// Until when the remote asked the key to rest (a 429 with
    /// `Retry-After`), while it does.
    pub paused_until: Option<chrono::DateTime<chrono::Utc>>,
}

impl KeyLine {
    /// The limit as operators read it: `20`, or `7/20` for a key that
    /// learnt 7 under a ceiling of 20; `-` without one.
    pub fn limit_shown(&self) -> String {
        match (self.learnt_limit, self.limit) {
            (Some(learnt), Some(ceiling)) => format!("{learnt}/{ceiling}"),
            (None, Some(limit)) => limit.to_string(),
            (_, None) => "-".to_owned(),
        }
    }
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

    /// Records each tenant's weight in the agents' lines (`tenant_share`,
    /// migration 0027): from then on, orders joining a line take turns by
    /// tenant. A tenant left out keeps the weight it had; none given (open
    /// tenancy) writes nothing.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn register_tenants(self, weights: &[(String, u16)]) -> Result<(), StoreError> {
        if weights.is_empty() {
            return Ok(());
        }
        let tenants: Vec<&str> = weights.iter().map(|(tenant, _)| tenant.as_str()).collect();
        let shares: Vec<f32> = weights
            .iter()
            .map(|(_, weight)| f32::from(*weight))
            .collect();
        sqlx::query(
            "INSERT INTO tenant_share (tenant, weight)
             SELECT * FROM UNNEST($1::text[], $2::real[]) ORDER BY 1
             ON CONFLICT (tenant) DO UPDATE SET weight = EXCLUDED.weight",
        )
        .bind(&tenants)
        .bind(&shares)
        .execute(self.pool())
        .await?;
        Ok(())
    }

    /// Adapts the limit and the cap of every agent whose window has run its
    /// length, by [`crate::machine::admission::adapted_limit`] (the control
    /// law, in Rust) and [`crate::machine::admission::adapted_cap`], and
    /// returns every agent's counters.
    ///
    /// Two statements, and no lock held between them (migration 0021): the
    /// first (`sas_admission_fold_due`) locks the due rows, skipping one
    /// another supervisor holds, folds their shards and returns their
    /// windows; the second writes each new limit and starts the next window,
    /// only where the window it was computed for is still the row's. A
    /// supervisor stopped between the two holds nothing; what the hot
    /// paths add to the shards meanwhile counts in the next window.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn adapt(self, adaptation: &Adaptation) -> Result<Vec<AgentAdmission>, StoreError> {
        let due: Vec<DueWindow> =
            sqlx::query_as("SELECT * FROM sas_admission_fold_due($1::float8, $2)")
                .bind(adaptation.window.as_millis() as f64)
                .bind(SHARDS)
                .fetch_all(self.pool())
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
        let started: Vec<chrono::DateTime<chrono::Utc>> =
            due.iter().map(|row| row.window_started).collect();
        let rows = sqlx::query_as(
            "WITH adapted AS (
                 UPDATE admission a
                    SET admit_limit = d.admit_limit, admit_cap = d.admit_cap,
                        window_settled = a.settled,
                        window_in_flight_ms = a.in_flight_ms, window_queued_ms = a.queued_ms,
                        window_slot_wait_ms = a.slot_wait_ms,
                        window_started = now(), peak_in_flight = a.in_flight
                   FROM UNNEST($1::text[], $2::int4[], $3::int4[], $4::timestamptz[])
                        AS d(agent, admit_limit, admit_cap, window_started)
                  WHERE a.agent = d.agent AND a.window_started = d.window_started
              RETURNING a.agent, a.admit_limit, a.admit_cap)
             -- The statement's own snapshot predates its update: the new
             -- limits come from RETURNING.
             SELECT n.agent, n.in_flight, n.waiting,
                    COALESCE(d.admit_limit, n.admit_limit) AS admit_limit,
                    COALESCE(d.admit_cap, n.admit_cap) AS admit_cap, n.ceiling
               FROM admission_now n
               LEFT JOIN adapted d ON d.agent = n.agent
              ORDER BY n.agent",
        )
        .bind(&agents)
        .bind(&limits)
        .bind(&caps)
        .bind(&started)
        .fetch_all(self.pool())
        .await?;
        Ok(rows)
    }

    /// Every agent's line as operators read it: its counters, and how long
    /// the order that has waited longest in it has waited (since it joined
    /// the line: its `not_before`; its place, `admit_key`, is a turn
    /// where tenants take turns, migration 0027). Read-only: the real
    /// backlog, which the agent queues do not show.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn lines(self) -> Result<Vec<AdmissionLine>, StoreError> {
        let rows = sqlx::query_as(
            "SELECT a.agent, a.in_flight, a.waiting, a.admit_limit, a.admit_cap, a.ceiling,
                    (SELECT EXTRACT(EPOCH FROM now() - min(p.not_before))::float8
                       FROM order_process p
                      WHERE p.waiting_for = a.agent) AS oldest_wait_secs
               FROM admission_now a
              ORDER BY a.agent",
        )
        .fetch_all(self.pool())
        .await?;
        Ok(rows)
    }

    /// The busiest key lines (see [`crate::machine::concurrency`]), at most
    /// `limit`: those with orders waiting first (most waiting first), then
    /// those with attempts in flight. Keys with neither have no state and
    /// are not listed. Read from the steps and the lines themselves (the
    /// counts the claims use), so it costs the attempts in flight and the
    /// orders waiting under a key, never a scan of idle keys.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn key_lines(self, limit: i64) -> Result<Vec<KeyLine>, StoreError> {
        self.key_lines_named(None, limit).await
    }

    /// [`Admission::key_lines`] of the keys whose names start with one of
    /// `prefixes` only (a key name is its own prefix).
    ///
    /// # Errors
    /// When the database fails.
    pub async fn key_lines_starting(
        self,
        prefixes: &[String],
        limit: i64,
    ) -> Result<Vec<KeyLine>, StoreError> {
        self.key_lines_named(Some(prefixes), limit).await
    }

    async fn key_lines_named(
        self,
        prefixes: Option<&[String]>,
        limit: i64,
    ) -> Result<Vec<KeyLine>, StoreError> {
        Ok(sqlx::query_as(AssertSqlSafe(format!(
            "SELECT key, sum(in_flight)::int8 AS in_flight, sum(waiting)::int8 AS waiting,
                    max(key_limit) AS limit,
                    CASE WHEN bool_or(adaptive) THEN
                         LEAST(max(key_limit), COALESCE((SELECT floor(l.learnt_limit)::int4
                                                           FROM key_learnt l WHERE l.key = k.key), 1))
                    END AS learnt_limit,
                    max(per_second) AS per_second,
                    EXTRACT(EPOCH FROM now() - min(since))::float8 AS oldest_wait_secs,
                    (SELECT until FROM key_pauses x WHERE x.key = k.key AND until > now())
                        AS paused_until
               FROM (SELECT s.limit_key AS key, 1 AS in_flight, 0 AS waiting,
                            (s.request->'concurrency'->>'limit')::int4 AS key_limit,
                            (s.request->'concurrency'->'adaptive') = 'true'::jsonb AS adaptive,
                            (s.request->'rate'->>'per_second')::int4 AS per_second,
                            NULL::timestamptz AS since
                       {KEY_IN_FLIGHT} AND s.limit_key IS NOT NULL
                     UNION ALL
                     SELECT p.waiting_key, 0, 1, w.key_limit, w.adaptive, w.per_second,
                            p.not_before
                       FROM order_process p
                       -- The waiting step's limits, read once per order.
                       CROSS JOIN LATERAL (
                            SELECT max((s.request->'concurrency'->>'limit')::int4) AS key_limit,
                                   bool_or((s.request->'concurrency'->'adaptive') = 'true'::jsonb)
                                       AS adaptive,
                                   max((s.request->'rate'->>'per_second')::int4) AS per_second
                              FROM steps s
                             WHERE s.order_id = p.order_id AND s.limit_key = p.waiting_key) w
                      WHERE p.waiting_key IS NOT NULL) k
              WHERE $3::text[] IS NULL
                 OR EXISTS (SELECT 1 FROM unnest($3::text[]) AS x(prefix)
                             WHERE starts_with(k.key, x.prefix))
              GROUP BY key
              ORDER BY sum(waiting) DESC, sum(in_flight) DESC, key
              LIMIT $1"
        )))
        .bind(limit)
        .bind(self.store.grace().as_secs_f64())
        .bind(prefixes)
        .fetch_all(self.pool())
        .await?)
    }

    /// Forgets up to `batch` ended key pauses and rates of keys quiet for
    /// a minute (`sas_forget_quiet_keys`, migration 0030), in a
    /// transaction of its own that never waits for the schedulers. Returns
    /// how many it forgot.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn forget_quiet_keys(self, batch: i32) -> Result<i32, StoreError> {
        Ok(sqlx::query_scalar("SELECT sas_forget_quiet_keys($1)")
            .bind(batch)
            .fetch_one(self.pool())
            .await?)
    }

    /// Orders waiting in key lines, and keys their remotes asked to rest
    /// now: the totals exported without a label.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn key_totals(self) -> Result<(i64, i64), StoreError> {
        Ok(sqlx::query_as(
            "SELECT (SELECT count(*) FROM order_process WHERE waiting_key IS NOT NULL),
                    (SELECT count(*) FROM key_pauses WHERE until > now())",
        )
        .fetch_one(self.pool())
        .await?)
    }

    /// Every agent's counters as its orders say they are (agent, in flight,
    /// waiting; the `admission_recount` view of migration 0021, the
    /// machine's [`crate::machine::slots_held`], pinned to it by the
    /// property test), read only: what [`Admission::reconcile`] corrects the
    /// counters to.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn recount(self) -> Result<Vec<(String, i32, i32)>, StoreError> {
        Ok(
            sqlx::query_as(
                "SELECT agent, in_flight, waiting FROM admission_recount ORDER BY agent",
            )
            .fetch_all(self.pool())
            .await?,
        )
    }

    /// Recounts every agent's `in_flight` and `waiting` from the orders
    /// themselves and corrects counters that drifted (a row deleted or
    /// edited by hand, a bug): a lost slot would otherwise be lost for
    /// good. Returns the corrections made.
    ///
    /// One call (`sas_admission_reconcile`, migration 0021), safe beside
    /// live traffic: the admission rows and then their shards are locked
    /// first (the shards folded into the rows), and every transition moves
    /// one or the other in the same statement as its orders, so the count
    /// (taken after the locks, in a statement of its own) sees exactly the
    /// transitions whose deltas are already applied. Those waiting for the
    /// locks apply theirs after the correction. Being one statement, it
    /// holds no lock past its own end, whatever happens to the supervisor.
    ///
    /// # Errors
    /// When the database fails, or the rows stay locked for 200 ms.
    pub async fn reconcile(self) -> Result<Vec<Correction>, StoreError> {
        Ok(
            sqlx::query_as("SELECT * FROM sas_admission_reconcile($1) ORDER BY agent")
                .bind(SHARDS)
                .fetch_all(self.pool())
                .await?,
        )
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
