//! Retention: what a deployment running for years must forget.
//!
//! Finished orders (with their steps, history and alerts) and dead letters
//! older than an age are deleted in small batches, through two functions of
//! the schema owner (migration 0010): the services' own role may not delete
//! rows, so the policy (finished only, older than the age, nothing with an
//! open alert) lives in the database, not in the caller.

use std::time::Duration;

use super::Writes;
use crate::StoreError;

/// What one retention pass may delete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Finished orders older than this go; `None` keeps them for ever.
    pub finished: Option<Duration>,
    /// Dead letters older than this go; `None` keeps them for ever.
    pub dead_letters: Option<Duration>,
    /// Most rows (orders, or dead letters) deleted in one transaction.
    pub batch: i32,
}

/// How many rows one pass deleted.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Retired {
    /// Orders deleted, each with its steps, history and alerts.
    pub orders: u64,
    /// Dead letters deleted.
    pub dead_letters: u64,
}

impl Writes<'_> {
    /// Deletes at most one batch of finished orders and one of dead letters
    /// past their age. Orders held by someone else are skipped, not waited
    /// for, so several supervisors share the work and live traffic is not
    /// slowed.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn retire(self, retention: &Retention) -> Result<Retired, StoreError> {
        let mut retired = Retired::default();
        if let Some(age) = retention.finished {
            retired.orders = self
                .retire_with(
                    "SELECT sas_retire_finished(make_interval(secs => $1), $2)",
                    age,
                    retention.batch,
                )
                .await?;
        }
        if let Some(age) = retention.dead_letters {
            retired.dead_letters = self
                .retire_with(
                    "SELECT sas_retire_dead_letters(make_interval(secs => $1), $2)",
                    age,
                    retention.batch,
                )
                .await?;
        }
        Ok(retired)
    }

    async fn retire_with(
        self,
        sql: &'static str,
        age: Duration,
        batch: i32,
    ) -> Result<u64, StoreError> {
        let n: i32 = sqlx::query_scalar(sql)
            .bind(age.as_secs_f64())
            .bind(batch)
            .fetch_one(self.pool())
            .await?;
        Ok(u64::try_from(n).unwrap_or(0))
    }
}
