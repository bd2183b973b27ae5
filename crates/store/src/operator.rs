//! Transitions that come from outside the workflow: a message the broker
//! dead-lettered, and an operator putting a failed order back.

use sas_messages::StatusEvent;
use uuid::Uuid;

use crate::model::{ProcessState, Progress};
use crate::progress::{raise_alert, record_history, set_process_state, status};
use crate::{Store, StoreError};

/// Why an order could not be resubmitted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resubmit {
    /// Back in the workflow; a scheduler will claim it.
    Resubmitted {
        /// What will happen: `compensation resumed` or `workflow restarted`.
        what: String,
    },
    /// No such order.
    NotFound,
    /// Only orders that ended `error` or `compensated` can be resubmitted.
    NotFailed(ProcessState),
}

impl Store {
    /// Settles the order a dead-lettered step request or reply belonged to.
    ///
    /// A message that kept failing its consumer will fail again, so the
    /// order is not retried: if it was running forward it is compensated
    /// (a scheduler claims the compensation), and if it was already
    /// compensating it ends in error with an operator alert. A dead letter
    /// for an attempt that is no longer current changes nothing. Returns the
    /// status messages to send, if anything changed.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn settle_dead_letter(
        &self,
        order_id: &str,
        attempt_id: Uuid,
        reason: &str,
        actor: &str,
    ) -> Result<Option<Progress>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let locked: Option<(ProcessState, Option<String>, Option<String>)> = sqlx::query_as(
            "SELECT state, reply_to, trace_id FROM order_process WHERE order_id = $1 FOR UPDATE",
        )
        .bind(order_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((state, reply_to, trace_id)) = locked else {
            return Ok(None);
        };
        let step: Option<String> = sqlx::query_scalar(
            "SELECT name FROM steps
              WHERE order_id = $1 AND attempt_id = $2
                AND state = CASE WHEN $3 = 'compensating'::process_state
                                 THEN 'compensating' ELSE 'running' END::step_state",
        )
        .bind(order_id)
        .bind(attempt_id)
        .bind(state)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(step) = step else {
            return Ok(None);
        };
        let mut progress = Progress {
            reply_to,
            trace_id,
            ..Progress::default()
        };
        let why = format!("a message of step {step} was dead-lettered: {reason}");
        match state {
            ProcessState::Processing | ProcessState::Pending => {
                let at: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
                    "UPDATE order_process
                        SET state = 'compensating', locked_by = NULL, complete_by = NULL,
                            failure_count = 0, not_before = now(), last_error = $2, updated_at = now()
                      WHERE order_id = $1
                  RETURNING updated_at",
                )
                .bind(order_id)
                .bind(&why)
                .fetch_one(&mut *tx)
                .await?;
                record_history(
                    &mut tx,
                    order_id,
                    actor,
                    "compensation_started",
                    Some(&step),
                    Some(attempt_id),
                    Some(&why),
                )
                .await?;
                progress.statuses.push(status(
                    order_id,
                    StatusEvent::Compensating,
                    Some(&step),
                    Some(&why),
                    at,
                ));
            }
            ProcessState::Compensating => {
                let at =
                    set_process_state(&mut tx, order_id, ProcessState::Error, Some(&why)).await?;
                record_history(
                    &mut tx,
                    order_id,
                    actor,
                    "error",
                    Some(&step),
                    Some(attempt_id),
                    Some(&why),
                )
                .await?;
                raise_alert(&mut tx, Some(order_id), "compensation_dead_lettered", &why).await?;
                progress.statuses.push(status(
                    order_id,
                    StatusEvent::Failed,
                    Some(&step),
                    Some(&why),
                    at,
                ));
            }
            _ => return Ok(None),
        }
        tx.commit().await?;
        Ok(Some(progress))
    }

    /// Puts an order that ended `error` or `compensated` back into the
    /// workflow, once an operator has fixed the cause, and resolves its alerts.
    ///
    /// An order whose compensation failed resumes its compensation. Any
    /// other restarts its workflow: every step not completed is reset, with
    /// a fresh idempotency key (`<order>:<step>:r<n>`), because the old key
    /// is already decided (refused, or applied and undone) at the remote
    /// service.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn resubmit(&self, order_id: &str, actor: &str) -> Result<Resubmit, StoreError> {
        let mut tx = self.pool().begin().await?;
        let state: Option<ProcessState> =
            sqlx::query_scalar("SELECT state FROM order_process WHERE order_id = $1 FOR UPDATE")
                .bind(order_id)
                .fetch_optional(&mut *tx)
                .await?;
        let state = match state {
            None => return Ok(Resubmit::NotFound),
            Some(state @ (ProcessState::Error | ProcessState::Compensated)) => state,
            Some(other) => return Ok(Resubmit::NotFailed(other)),
        };
        let compensation_underway: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM steps WHERE order_id = $1 AND state = 'compensating')",
        )
        .bind(order_id)
        .fetch_one(&mut *tx)
        .await?;
        let (reopened, what) = if state == ProcessState::Error && compensation_underway {
            (ProcessState::Compensating, "compensation resumed")
        } else {
            let generation: i64 = sqlx::query_scalar(
                "SELECT count(*) + 1 FROM history WHERE order_id = $1 AND event = 'resubmitted'",
            )
            .bind(order_id)
            .fetch_one(&mut *tx)
            .await?;
            sqlx::query(
                "UPDATE steps
                    SET state = 'not_started', attempt_id = NULL, complete_by = NULL, result = NULL,
                        last_error = NULL, idempotency_key = order_id || ':' || name || ':r' || $2::text,
                        updated_at = now()
                  WHERE order_id = $1 AND state <> 'completed'",
            )
            .bind(order_id)
                        .bind(generation.to_string())
            .execute(&mut *tx)
            .await?;
            (ProcessState::Pending, "workflow restarted")
        };
        // Held by nobody and due now: a scheduler claims it at its next claim.
        sqlx::query(
            "UPDATE order_process
                SET state = $2, locked_by = NULL, complete_by = NULL,
                    failure_count = 0, not_before = now(), updated_at = now()
              WHERE order_id = $1",
        )
        .bind(order_id)
        .bind(reopened)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE alerts SET resolved_at = now() WHERE order_id = $1 AND resolved_at IS NULL",
        )
        .bind(order_id)
        .execute(&mut *tx)
        .await?;
        record_history(
            &mut tx,
            order_id,
            actor,
            "resubmitted",
            None,
            None,
            Some(what),
        )
        .await?;
        tx.commit().await?;
        Ok(Resubmit::Resubmitted {
            what: what.to_owned(),
        })
    }
}
