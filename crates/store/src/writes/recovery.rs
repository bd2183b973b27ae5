//! The supervisor's transitions: orders whose deadline passed, and dead letters.

use chrono::{DateTime, Utc};
use sas_messages::storable::storable_text;
use sas_messages::OrderId;

use super::apply::{transition, Decided, Slots};
use super::Writes;
pub use crate::machine::RecoveryPolicy;
use crate::machine::{Event, Verdict};
use crate::model::{ProcessState, Progress};
use crate::StoreError;

/// One decision of the supervisor about one order.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    /// The order concerned.
    pub order_id: OrderId,
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

impl Writes<'_> {
    /// Finds up to `limit` held orders whose deadline has passed and has the
    /// state machine decide for each (see [`Event::DeadlineMissed`]): back to
    /// a scheduler after a growing, jittered wait; or, past `max_failures`,
    /// compensation (for a forward step) or error with an operator alert
    /// (for a compensation).
    ///
    /// `FOR UPDATE SKIP LOCKED` shares the work between supervisors: a row is
    /// locked by at most one of them, and once its transaction commits the
    /// order no longer matches (its deadline is cleared), so no two
    /// supervisors ever recover the same step.
    ///
    /// # Errors
    /// When the database fails; nothing was changed then.
    pub async fn recover_expired(
        self,
        actor: &str,
        policy: &RecoveryPolicy,
        limit: i64,
    ) -> Result<Vec<Recovery>, StoreError> {
        self.recover_expired_with(actor, policy, limit, rand::random)
            .await
    }

    /// [`Writes::recover_expired`] with the jitter of each backoff drawn from
    /// `jitter` (a number in [0, 1)), so tests can fix it.
    ///
    /// # Errors
    /// When the database fails; nothing was changed then.
    pub async fn recover_expired_with(
        self,
        actor: &str,
        policy: &RecoveryPolicy,
        limit: i64,
        mut jitter: impl FnMut() -> f64,
    ) -> Result<Vec<Recovery>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let due: Vec<String> = sqlx::query_scalar(
            "SELECT order_id FROM order_process
              WHERE state IN ('processing', 'compensating')
                AND complete_by < now() - make_interval(secs => $2::float8 / 1000)
              ORDER BY complete_by
              LIMIT $1
                FOR UPDATE SKIP LOCKED",
        )
        .bind(limit)
        .bind(policy.grace.as_millis() as f64)
        .fetch_all(&mut *tx)
        .await?;
        if due.is_empty() {
            tx.commit().await?;
            return Ok(Vec::new());
        }
        let due: Vec<&str> = due.iter().map(String::as_str).collect();
        let decided = transition(&mut tx, self.store, &due, actor, Slots::Check, |_| {
            Event::DeadlineMissed {
                policy,
                jitter: jitter(),
            }
        })
        .await?;
        let recoveries = decided
            .into_iter()
            .filter_map(
                |Decided {
                     snapshot,
                     decision,
                     now,
                 }| {
                    let (Verdict::Applied, Some(process)) = (&decision.verdict, &decision.process)
                    else {
                        return None;
                    };
                    Some(Recovery {
                        order_id: snapshot.order_id.clone(),
                        from: snapshot.process.state,
                        to: process.state,
                        failure_count: process.failure_count,
                        not_before: if process.state == ProcessState::Error {
                            now
                        } else {
                            process.not_before
                        },
                        progress: decision.progress,
                    })
                },
            )
            .collect();
        tx.commit().await?;
        Ok(recoveries)
    }

    /// Records a message some queue dead-lettered, so operators can find it
    /// with the order it belongs to, and who published it (`publisher`:
    /// the broker user one of our services vouched for, when it did).
    ///
    /// # Errors
    /// When the database fails.
    pub async fn record_dead_letter(
        self,
        source_queue: Option<&str>,
        reason: &str,
        order_id: Option<&str>,
        (message_id, publisher): (Option<&str>, Option<&str>),
        body: &[u8],
    ) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO dead_letters (source_queue, reason, order_id, message_id, body, publisher)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(source_queue)
        .bind(reason)
        .bind(order_id)
        .bind(message_id)
        // Postgres text cannot hold NUL; the operator's copy in the
        // dead-letter queue keeps the exact bytes.
        .bind(storable_text(&String::from_utf8_lossy(body)))
        .bind(publisher)
        .execute(self.pool())
        .await?;
        Ok(())
    }
}
