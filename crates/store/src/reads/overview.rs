//! What the console's overview shows from the state store: orders by state
//! now, and per minute over the last hour how many were received,
//! processed, retried, compensated, ended in error or resubmitted.

use chrono::{DateTime, Utc};
use serde::Serialize;

use super::Reads;
use crate::model::ProcessState;
use crate::StoreError;

/// The history events counted per minute (those the `history_milestones_v2`
/// index of migration 0011 holds; the query spells them out, and a test
/// holds the three lists together).
pub const MILESTONES: [&str; 7] = [
    "received",
    "processed",
    "retry_scheduled",
    "compensation_started",
    "compensated",
    "error",
    "resubmitted",
];

/// One minute's count of one milestone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, sqlx::FromRow)]
pub struct MinuteCount {
    /// Start of the minute (database clock).
    pub minute: DateTime<Utc>,
    /// The history event (one of [`MILESTONES`]).
    pub event: String,
    /// How many.
    pub count: i64,
}

/// The overview's numbers.
#[derive(Debug, Clone, Serialize)]
pub struct Activity {
    /// Orders in each state now (states with none omitted).
    pub by_state: Vec<(ProcessState, i64)>,
    /// Per minute over the last hour, oldest first.
    pub per_minute: Vec<MinuteCount>,
    /// The database's clock when this was read.
    pub now: DateTime<Utc>,
    /// Open (unresolved) alerts.
    pub open_alerts: i64,
    /// Dead letters nobody has replayed or discarded.
    pub pending_dead_letters: i64,
}

impl Reads<'_> {
    /// The overview's numbers (see [`Activity`]). Counting orders by state
    /// reads every order's process record: callers cache it for a few
    /// seconds rather than ask once per viewer.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn activity(self) -> Result<Activity, StoreError> {
        let by_state = self.count_by_state().await?;
        // The events are written out, not bound: Postgres uses a partial
        // index only when it can prove the query's condition implies the
        // index's, which it cannot for a parameter.
        let per_minute = sqlx::query_as(
            "SELECT date_trunc('minute', at) AS minute, event, count(*) AS count FROM history
              WHERE at > date_trunc('minute', now()) - interval '59 minutes'
                AND event IN ('received', 'processed', 'retry_scheduled',
                              'compensation_started', 'compensated', 'error',
                              'resubmitted')
              GROUP BY 1, 2 ORDER BY 1, 2",
        )
        .fetch_all(self.pool())
        .await?;
        let (now, open_alerts, pending_dead_letters) = sqlx::query_as(
            "SELECT now(),
                    (SELECT count(*) FROM alerts WHERE resolved_at IS NULL),
                    (SELECT count(*) FROM dead_letters WHERE disposition IS NULL)",
        )
        .fetch_one(self.pool())
        .await?;
        Ok(Activity {
            by_state,
            per_minute,
            now,
            open_alerts,
            pending_dead_letters,
        })
    }

    /// The agents this deployment has seen (one admission row each): whose
    /// request queues the console shows.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn known_agents(self) -> Result<Vec<String>, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT agent FROM admission ORDER BY agent")
                .fetch_all(self.pool())
                .await?,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::MILESTONES;

    #[test]
    fn the_milestones_are_those_the_index_and_the_query_name() {
        let migration = include_str!("../../migrations/0011_milestones_with_resubmissions.sql");
        let source = include_str!("overview.rs");
        for event in MILESTONES {
            assert!(
                migration.contains(&format!("'{event}'")),
                "{event} in the index"
            );
            assert!(
                source.contains(&format!("'{event}'")),
                "{event} in the query"
            );
        }
    }
}
