//! Admission control's shared state: one row per agent (`admission`), read
//! by every scheduler and adapted by the supervisors.
//!
//! The limit of attempts in flight per agent follows what the agent's
//! replicas measurably finish: every adaptation window, the completions
//! counted (`settled`; an attempt that never started is not one) give a
//! rate, and `rate × deadline × share` is the number of attempts that can
//! wait and run within `share` of a step's deadline. The limit grows to that
//! target at once (a fast agent must not be held back), and while orders
//! wait in the agent's line it shrinks towards it, at most halving per
//! window. Only a limit in use is trusted (as TCP's congestion window
//! validation): it never exceeds twice the most attempts in flight during
//! the window, or the initial limit, so a limit learnt while the remote
//! service was fast and busy decays while it is quiet instead of admitting
//! the next burst at once. The ceiling caps it, and it never drops below one.

use std::time::Duration;

use serde::Serialize;

use crate::{Store, StoreError};

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
    /// The highest the limit may go.
    pub ceiling: i32,
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

impl Store {
    /// Makes sure every agent in `agents` (name, shortest step deadline) has
    /// an admission row, starting at `initial` under `ceiling`; an existing
    /// row takes the new ceiling and deadline and keeps its counters.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn register_agents(
        &self,
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
        Ok(())
    }

    /// Adapts the limit of every agent whose window has run its length (see
    /// the module documentation), and returns every agent's counters.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn adapt_admission(
        &self,
        adaptation: &Adaptation,
    ) -> Result<Vec<AgentAdmission>, StoreError> {
        let rows = sqlx::query_as(
            "WITH due AS (
                 SELECT agent,
                        CEIL((settled - window_settled) / GREATEST(EXTRACT(EPOCH FROM now() - window_started), 0.001)
                             * deadline_ms / 1000.0 * $2)::int8 AS target
                   FROM admission
                  WHERE now() - window_started >= make_interval(secs => $1::float8 / 1000)
                  ORDER BY agent
                    FOR UPDATE SKIP LOCKED),
             adapted AS (
                 UPDATE admission a
                    SET admit_limit = LEAST(a.ceiling,
                            GREATEST(a.initial_limit, 2 * a.peak_in_flight::int8),
                            GREATEST(1,
                                CASE WHEN a.waiting > 0
                                     THEN GREATEST(due.target, a.admit_limit / 2)
                                     ELSE GREATEST(due.target, a.admit_limit)
                                END))::int4,
                        window_settled = a.settled, window_started = now(),
                        peak_in_flight = a.in_flight
                   FROM due WHERE a.agent = due.agent
              RETURNING a.agent, a.in_flight, a.waiting, a.admit_limit, a.ceiling)
             -- The statement's own snapshot predates its update: the adapted
             -- rows come from RETURNING.
             SELECT * FROM adapted
             UNION ALL
             SELECT agent, in_flight, waiting, admit_limit, ceiling FROM admission
              WHERE agent NOT IN (SELECT agent FROM adapted)
             ORDER BY agent",
        )
        .bind(adaptation.window.as_millis() as f64)
        .bind(adaptation.deadline_share)
        .fetch_all(self.pool())
        .await?;
        Ok(rows)
    }
}
