//! Retention: what a deployment running for years must forget.
//!
//! Finished orders (with their steps, history and alerts) and dead letters
//! older than an age are deleted in small batches, through two functions of
//! the schema owner (migration 0010): the services' own role may not delete
//! rows, so the policy (finished only, older than the age, nothing with an
//! open alert) lives in the database, not in the caller. So does the
//! youngest age a role other than the schema owner may ask for (migration
//! 0022's `retention_floor`, one hour unless the owner changes it).

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
    /// Decided schedule runs, and schedules deleted long ago, deleted
    /// (`retention.finished_secs`, as the runs' orders).
    pub schedule_runs: u64,
}

impl Retention {
    /// The first age of this policy below `floor`, with the setting that
    /// gave it: a retention the database would refuse on every pass, said
    /// at start instead.
    pub fn below(&self, floor: Duration) -> Option<(&'static str, Duration)> {
        [
            ("retention.finished_secs", self.finished),
            ("retention.dead_letters_secs", self.dead_letters),
        ]
        .into_iter()
        .find_map(|(setting, age)| age.filter(|age| *age < floor).map(|age| (setting, age)))
    }
}

impl Writes<'_> {
    /// The youngest age this session's role may retire
    /// (`sas_retention_floor()`): zero for the schema owner and its
    /// members, the owner's `retention_floor` for everyone else.
    ///
    /// # Errors
    /// When the database fails, or its schema predates migration 0022.
    pub async fn retention_floor(self) -> Result<Duration, StoreError> {
        let secs: f64 =
            sqlx::query_scalar("SELECT EXTRACT(EPOCH FROM sas_retention_floor())::float8")
                .fetch_one(self.pool())
                .await?;
        Ok(Duration::from_secs_f64(secs.max(0.0)))
    }

    /// Deletes at most one batch of finished orders (and one of decided
    /// schedule runs, at the same age) and one of dead letters past their
    /// age. Orders held by someone else are skipped, not waited
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
            retired.schedule_runs = self
                .retire_with(
                    "SELECT sas_retire_schedule_runs(make_interval(secs => $1), $2)",
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_age_below_the_floor_is_named_with_its_setting() {
        let hour = Duration::from_secs(3600);
        let policy = |finished: Option<u64>, dead_letters: Option<u64>| Retention {
            finished: finished.map(Duration::from_secs),
            dead_letters: dead_letters.map(Duration::from_secs),
            batch: 100,
        };
        assert_eq!(policy(Some(3600), None).below(hour), None);
        assert_eq!(policy(None, None).below(hour), None);
        assert_eq!(
            policy(Some(7200), Some(60)).below(hour),
            Some(("retention.dead_letters_secs", Duration::from_secs(60)))
        );
        assert_eq!(
            policy(Some(1), Some(60)).below(hour),
            Some(("retention.finished_secs", Duration::from_secs(1)))
        );
        assert_eq!(policy(Some(1), Some(1)).below(Duration::ZERO), None);
    }
}
