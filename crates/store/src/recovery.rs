//! The supervisor's transitions: orders whose deadline passed, and dead letters.

use std::time::Duration;

use chrono::{DateTime, Utc};
use sas_messages::StatusEvent;

use crate::model::{ProcessState, Progress};
use crate::progress::{raise_alert, record_history, set_process_state, status};
use crate::{Store, StoreError};

/// How the supervisor treats an order whose step missed its deadline.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RecoveryPolicy {
    /// Failures tolerated before giving up: the next one starts compensation
    /// (or, for a compensation, ends the order in error).
    pub max_failures: i32,
    /// Wait before the first retry; doubled at each failure.
    pub backoff_base: Duration,
    /// Longest wait before a retry.
    pub backoff_max: Duration,
}

impl RecoveryPolicy {
    /// The wait before retry number `failures` (1-based), before jitter:
    /// `base * 2^(failures-1)`, capped at `backoff_max`.
    pub fn backoff(&self, failures: i32) -> Duration {
        let exponent = u32::try_from(failures.saturating_sub(1))
            .unwrap_or(0)
            .min(20);
        self.backoff_base
            .saturating_mul(1u32 << exponent)
            .min(self.backoff_max)
    }
}

/// One decision of the supervisor about one order.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    /// The order concerned.
    pub order_id: String,
    /// State it was in (processing or compensating).
    pub from: ProcessState,
    /// State it was put in.
    pub to: ProcessState,
    /// Its failure count after this decision.
    pub failure_count: i32,
    /// When a scheduler may claim it again, for a retry.
    pub not_before: DateTime<Utc>,
    /// Status messages for the client.
    pub progress: Progress,
}

/// An expired order as the scan reads it: id, state, failures so far,
/// reply queue, trace id.
type ExpiredRow = (String, ProcessState, i32, Option<String>, Option<String>);

impl Store {
    /// Finds up to `limit` held orders whose deadline has passed and decides
    /// for each: back to a scheduler after a growing, jittered wait; or, past
    /// `max_failures`, compensation (for a forward step) or error with an
    /// operator alert (for a compensation). Every decision is recorded in the
    /// order's history.
    ///
    /// `FOR UPDATE SKIP LOCKED` shares the work between supervisors: a row is
    /// locked by at most one of them, and once its transaction commits the
    /// order no longer matches (its deadline is cleared), so no two
    /// supervisors ever recover the same step.
    ///
    /// # Errors
    /// When the database fails; nothing was changed then.
    pub async fn recover_expired(
        &self,
        actor: &str,
        policy: &RecoveryPolicy,
        limit: i64,
    ) -> Result<Vec<Recovery>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let due: Vec<ExpiredRow> = sqlx::query_as(
            "SELECT order_id, state, failure_count, reply_to, trace_id FROM order_process
              WHERE state IN ('processing', 'compensating') AND complete_by < now()
              ORDER BY complete_by
              LIMIT $1
                FOR UPDATE SKIP LOCKED",
        )
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;

        let mut decisions = Vec::with_capacity(due.len());
        for (order_id, from, failures_before, reply_to, trace_id) in due {
            let failures = failures_before + 1;
            let step: Option<(String, i32)> = sqlx::query_as(
                "UPDATE steps
                    SET last_error = 'attempt ' || attempt || ' missed its deadline ' || complete_by,
                        updated_at = now()
                  WHERE order_id = $1 AND state IN ('running', 'compensating')
              RETURNING name, attempt",
            )
            .bind(&order_id)
            .fetch_optional(&mut *tx)
            .await?;
            let step_name = step.as_ref().map(|(name, _)| name.as_str());
            let what = match &step {
                Some((name, attempt)) => format!("step {name} attempt {attempt} timed out"),
                None => "held order made no progress before its deadline".to_owned(),
            };
            let give_up = failures > policy.max_failures;
            let (to, count, wait) = match (from, give_up) {
                (ProcessState::Processing, false) => {
                    (ProcessState::Pending, failures, policy.backoff(failures))
                }
                (ProcessState::Processing, true) => (ProcessState::Compensating, 0, Duration::ZERO),
                (_, false) => (
                    ProcessState::Compensating,
                    failures,
                    policy.backoff(failures),
                ),
                (_, true) => (ProcessState::Error, failures, Duration::ZERO),
            };
            let reason = format!(
                "{what}; failure {failures} of {} allowed",
                policy.max_failures
            );
            let mut progress = Progress {
                reply_to,
                trace_id,
                ..Progress::default()
            };

            let (not_before, at) = if to == ProcessState::Error {
                let at = set_process_state(&mut tx, &order_id, to, Some(&reason)).await?;
                let message = format!("compensation could not complete: {reason}");
                raise_alert(&mut tx, Some(&order_id), "compensation_exhausted", &message).await?;
                progress.statuses.push(status(
                    &order_id,
                    StatusEvent::Failed,
                    step_name,
                    Some(&message),
                    at,
                ));
                (at, at)
            } else {
                // Equal jitter: half the wait is fixed, half random, so that
                // orders failing together do not all come back together.
                sqlx::query_as(
                    "UPDATE order_process
                        SET state = $2, failure_count = $3, locked_by = NULL, complete_by = NULL,
                            not_before = now() + make_interval(secs => $4::float8 / 1000 * (0.5 + random() / 2)),
                            last_error = $5, updated_at = now()
                      WHERE order_id = $1
                  RETURNING not_before, updated_at",
                )
                .bind(&order_id)
                .bind(to)
                .bind(count)
                .bind(wait.as_millis() as f64)
                .bind(&reason)
                .fetch_one(&mut *tx)
                .await?
            };
            let event = match (from, to) {
                (_, ProcessState::Pending) => "retry_scheduled",
                (ProcessState::Processing, _) => "compensation_started",
                (_, ProcessState::Error) => "error",
                _ => "compensation_retry_scheduled",
            };
            let detail = format!("{reason}; next attempt not before {not_before}");
            record_history(
                &mut tx,
                &order_id,
                actor,
                event,
                step_name,
                None,
                Some(&detail),
            )
            .await?;
            if event == "compensation_started" {
                progress.statuses.push(status(
                    &order_id,
                    StatusEvent::Compensating,
                    step_name,
                    Some(&reason),
                    at,
                ));
            }
            decisions.push(Recovery {
                order_id,
                from,
                to,
                failure_count: count,
                not_before,
                progress,
            });
        }
        tx.commit().await?;
        Ok(decisions)
    }

    /// Records a message some queue dead-lettered, so operators can find it
    /// with the order it belongs to.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn record_dead_letter(
        &self,
        source_queue: Option<&str>,
        reason: &str,
        order_id: Option<&str>,
        message_id: Option<&str>,
        body: &[u8],
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO dead_letters (source_queue, reason, order_id, message_id, body)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(source_queue)
        .bind(reason)
        .bind(order_id)
        .bind(message_id)
        // Postgres text cannot hold NUL; the operator's copy in the
        // dead-letter queue keeps the exact bytes.
        .bind(String::from_utf8_lossy(body).replace('\0', "\u{fffd}"))
        .execute(self.pool())
        .await?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_and_is_capped() {
        let policy = RecoveryPolicy {
            max_failures: 5,
            backoff_base: Duration::from_millis(100),
            backoff_max: Duration::from_millis(500),
        };
        assert_eq!(policy.backoff(1), Duration::from_millis(100));
        assert_eq!(policy.backoff(2), Duration::from_millis(200));
        assert_eq!(policy.backoff(3), Duration::from_millis(400));
        assert_eq!(policy.backoff(4), Duration::from_millis(500));
        assert_eq!(policy.backoff(60), Duration::from_millis(500));
    }
}
