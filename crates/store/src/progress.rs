//! The scheduler's transitions: claiming ready orders, starting the next
//! attempt, and applying an agent's reply.
//!
//! Each public function runs one transaction that locks the order's
//! `order_process` row before touching its steps, so two schedulers never
//! change the same order at once, and returns a [`Progress`] that the caller
//! publishes only after the commit.

use chrono::{DateTime, Utc};
use sas_messages::{OrderStatus, StatusEvent, StepKind, StepOutcome, StepReply, SCHEMA_VERSION};
use sqlx::{PgConnection, Row};
use uuid::Uuid;

use crate::model::{Dispatch, ProcessState, Progress, StepState};
use crate::{Store, StoreError};

/// Suffix of the idempotency key of a step's compensation.
const COMPENSATION_KEY_SUFFIX: &str = ":undo";

/// One step as the transitions need it.
#[derive(Debug, Clone, sqlx::FromRow)]
pub(crate) struct StepRow {
    pub(crate) position: i32,
    pub(crate) name: String,
    pub(crate) agent: String,
    pub(crate) action: String,
    pub(crate) compensation: Option<String>,
    pub(crate) timeout_ms: i32,
    pub(crate) state: StepState,
    pub(crate) idempotency_key: String,
    pub(crate) result: Option<serde_json::Value>,
}

/// Appends one row to the order's history.
pub(crate) async fn record_history(
    conn: &mut PgConnection,
    order_id: &str,
    actor: &str,
    event: &str,
    step: Option<&str>,
    attempt_id: Option<Uuid>,
    detail: Option<&str>,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO history (order_id, actor, event, step, attempt_id, detail)
         VALUES ($1, $2, $3, $4, $5, $6)",
    )
    .bind(order_id)
    .bind(actor)
    .bind(event)
    .bind(step)
    .bind(attempt_id)
    .bind(detail)
    .execute(conn)
    .await?;
    Ok(())
}

/// Raises an operator alert.
pub(crate) async fn raise_alert(
    conn: &mut PgConnection,
    order_id: Option<&str>,
    kind: &str,
    message: &str,
) -> Result<(), StoreError> {
    sqlx::query("INSERT INTO alerts (order_id, kind, message) VALUES ($1, $2, $3)")
        .bind(order_id)
        .bind(kind)
        .bind(message)
        .execute(conn)
        .await?;
    Ok(())
}

/// A status message for `order_id` stamped with the database clock.
pub(crate) fn status(
    order_id: &str,
    event: StatusEvent,
    step: Option<&str>,
    detail: Option<&str>,
    at: DateTime<Utc>,
) -> OrderStatus {
    OrderStatus {
        schema_version: SCHEMA_VERSION,
        order_id: order_id.to_owned(),
        event,
        step: step.map(str::to_owned),
        detail: detail.map(str::to_owned),
        at,
    }
}

/// Moves the order to a terminal (or held) state and records why.
pub(crate) async fn set_process_state(
    conn: &mut PgConnection,
    order_id: &str,
    state: ProcessState,
    last_error: Option<&str>,
) -> Result<DateTime<Utc>, StoreError> {
    let at: DateTime<Utc> = sqlx::query_scalar(
        "UPDATE order_process
            SET state = $2, locked_by = NULL, complete_by = NULL,
                last_error = COALESCE($3, last_error), updated_at = now()
          WHERE order_id = $1
      RETURNING updated_at",
    )
    .bind(order_id)
    .bind(state)
    .bind(last_error)
    .fetch_one(conn)
    .await?;
    Ok(at)
}

/// Decides and starts the next thing the order needs, with its
/// `order_process` row already locked by the caller: the first step not yet
/// completed (forward), or the last step that may have had an effect
/// (compensating); or finishes the order when nothing is left.
///
/// `known` are the order's steps when the caller has just read them under
/// the order's lock (saving a round trip); `None` reads them.
pub(crate) async fn advance(
    conn: &mut PgConnection,
    order_id: &str,
    state: ProcessState,
    actor: &str,
    progress: &mut Progress,
    known: Option<Vec<StepRow>>,
) -> Result<(), StoreError> {
    let steps: Vec<StepRow> = match known {
        Some(steps) => steps,
        None => {
            sqlx::query_as(
                "SELECT position, name, agent, action, compensation, timeout_ms, state,
                        idempotency_key, result
                   FROM steps WHERE order_id = $1 ORDER BY position",
            )
            .bind(order_id)
            .fetch_all(&mut *conn)
            .await?
        }
    };

    let (next, kind) = match state {
        ProcessState::Processing => (
            steps.iter().find(|s| s.state != StepState::Completed),
            StepKind::Action,
        ),
        // Undo every step that had, or may have had, an effect: completed, or
        // in flight when it timed out. A step that failed permanently applied
        // nothing.
        ProcessState::Compensating => (
            steps.iter().rev().find(|s| {
                s.compensation.is_some()
                    && matches!(
                        s.state,
                        StepState::Completed | StepState::Running | StepState::Compensating
                    )
            }),
            StepKind::Compensation,
        ),
        other => {
            return Err(StoreError::Invariant(format!(
                "order {order_id} cannot advance from state {other}"
            )))
        }
    };

    let Some(step) = next else {
        let done = if state == ProcessState::Processing {
            ProcessState::Processed
        } else {
            ProcessState::Compensated
        };
        let at: DateTime<Utc> = sqlx::query_scalar(
            "WITH p AS (
                 UPDATE order_process
                    SET state = $2, locked_by = NULL, complete_by = NULL, updated_at = now()
                  WHERE order_id = $1
              RETURNING updated_at),
             h AS (
                 INSERT INTO history (order_id, actor, event) SELECT $1, $3, $4 FROM p)
             SELECT updated_at FROM p",
        )
        .bind(order_id)
        .bind(done)
        .bind(actor)
        .bind(done.as_str())
        .fetch_one(&mut *conn)
        .await?;
        let event = if done == ProcessState::Processed {
            StatusEvent::Processed
        } else {
            StatusEvent::Compensated
        };
        progress
            .statuses
            .push(status(order_id, event, None, None, at));
        return Ok(());
    };

    let (step_state, action, key) = match kind {
        StepKind::Action => (
            StepState::Running,
            step.action.clone(),
            step.idempotency_key.clone(),
        ),
        StepKind::Compensation => (
            StepState::Compensating,
            step.compensation.clone().unwrap_or_default(),
            format!("{}{COMPENSATION_KEY_SUFFIX}", step.idempotency_key),
        ),
    };
    let attempt_id = Uuid::now_v7();
    let event = match kind {
        StepKind::Action => "dispatched",
        StepKind::Compensation => "compensation_dispatched",
    };
    // Start the attempt, move the order's deadline, and record it, in one
    // statement: this is the hot path of every order.
    let row = sqlx::query(
        "WITH s AS (
             UPDATE steps
                SET state = $3, attempt = attempt + 1, attempt_id = $4,
                    complete_by = now() + make_interval(secs => $5::float8 / 1000),
                    updated_at = now()
              WHERE order_id = $1 AND position = $2
          RETURNING name, attempt, complete_by),
         p AS (
             UPDATE order_process
                SET complete_by = (SELECT complete_by FROM s), locked_by = $6, updated_at = now()
              WHERE order_id = $1),
         h AS (
             INSERT INTO history (order_id, actor, event, step, attempt_id, detail)
             SELECT $1, $6, $7, s.name, $4, 'attempt ' || s.attempt || ': ' || $8 FROM s)
         SELECT s.attempt, s.complete_by, (SELECT body FROM orders WHERE order_id = $1) AS body FROM s",
    )
    .bind(order_id)
    .bind(step.position)
    .bind(step_state)
    .bind(attempt_id)
    .bind(f64::from(step.timeout_ms))
    .bind(actor)
    .bind(event)
    .bind(format!("{}.{action}", step.agent))
    .fetch_one(&mut *conn)
    .await?;
    let attempt: i32 = row.try_get("attempt")?;
    let complete_by: DateTime<Utc> = row.try_get("complete_by")?;
    let body: serde_json::Value = row.try_get("body")?;
    let results: serde_json::Map<String, serde_json::Value> = steps
        .iter()
        .filter_map(|s| s.result.clone().map(|r| (s.name.clone(), r)))
        .collect();

    progress.dispatch = Some(Box::new(Dispatch {
        order_id: order_id.to_owned(),
        step: step.name.clone(),
        agent: step.agent.clone(),
        kind,
        action,
        attempt,
        attempt_id,
        idempotency_key: key,
        complete_by,
        payload: serde_json::json!({ "order": body, "results": results }),
    }));
    Ok(())
}

/// The rows of a reply's guarded update: every step of the order, and the
/// step the update changed.
#[derive(sqlx::FromRow)]
struct UpdatedSteps {
    #[sqlx(flatten)]
    step: StepRow,
    updated_name: String,
    updated_at: DateTime<Utc>,
    latency: f64,
}

/// What became of an agent's reply.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplyOutcome {
    /// The reply answered an attempt that is no longer current: nothing changed.
    Stale {
        /// Why it was not applied, for logs.
        reason: String,
    },
    /// The reply was applied; publish what it asks.
    Applied {
        /// What to publish.
        progress: Progress,
        /// The step answered.
        step: String,
        /// Seconds from the attempt's dispatch to this reply (database clock).
        latency_secs: f64,
    },
}

impl Store {
    /// Claims up to `limit` orders that are ready to run (pending and past
    /// their backoff, or compensating and held by nobody) for `actor`, and
    /// starts each one's next attempt, all in one transaction.
    ///
    /// `FOR UPDATE SKIP LOCKED` makes the claim atomic: two schedulers never
    /// claim the same order.
    ///
    /// # Errors
    /// When the database fails; nothing is claimed then.
    pub async fn claim_ready(&self, actor: &str, limit: i64) -> Result<Vec<Progress>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let claimed: Vec<(String, ProcessState, Option<String>, Option<String>)> = sqlx::query_as(
            "WITH ready AS (
                 SELECT order_id FROM order_process
                  WHERE (state = 'pending' OR (state = 'compensating' AND locked_by IS NULL))
                    AND not_before <= now()
                  ORDER BY not_before
                  LIMIT $2
                    FOR UPDATE SKIP LOCKED)
             UPDATE order_process p
                SET state = CASE WHEN p.state = 'pending' THEN 'processing'::process_state
                                 ELSE p.state END,
                    locked_by = $1, updated_at = now()
               FROM ready WHERE p.order_id = ready.order_id
           RETURNING p.order_id, p.state, p.reply_to, p.trace_id",
        )
        .bind(actor)
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;

        let mut out = Vec::with_capacity(claimed.len());
        for (order_id, state, reply_to, trace_id) in claimed {
            record_history(&mut tx, &order_id, actor, "claimed", None, None, None).await?;
            let mut progress = Progress {
                reply_to,
                trace_id,
                ..Progress::default()
            };
            advance(&mut tx, &order_id, state, actor, &mut progress, None).await?;
            out.push(progress);
        }
        tx.commit().await?;
        Ok(out)
    }

    /// Applies each agent's reply if it answers the step's current attempt
    /// of an order that is still waiting for it; otherwise changes nothing
    /// and says why (fencing by attempt id). Returns one outcome per reply,
    /// in order; an error means the reply should be redelivered.
    ///
    /// A success completes the step and starts the next one (or finishes the
    /// order). A permanent failure of an action starts compensation; of a
    /// compensation, ends the order in error with an operator alert. A
    /// transient failure pulls the deadline to now, so the supervisor decides
    /// on its next scan whether to retry or undo.
    ///
    /// Successes of forward steps, the bulk of the traffic, are applied
    /// together in one statement (at most one reply per order in it); every
    /// other reply, and any the statement left alone, takes the general
    /// path, a transaction of its own.
    pub async fn record_replies(
        &self,
        replies: &[StepReply],
        actor: &str,
    ) -> Vec<Result<ReplyOutcome, StoreError>> {
        let mut orders = std::collections::HashSet::new();
        let in_fast: Vec<bool> = replies
            .iter()
            .map(|reply| {
                matches!(reply.outcome, StepOutcome::Succeeded { .. })
                    && orders.insert(reply.order_id.as_str())
            })
            .collect();
        let fast: Vec<(&StepReply, &serde_json::Value)> = replies
            .iter()
            .zip(&in_fast)
            .filter_map(|(reply, &fast)| match &reply.outcome {
                StepOutcome::Succeeded { result } if fast => Some((reply, result)),
                _ => None,
            })
            .collect();
        let mut applied = if fast.is_empty() {
            std::collections::HashMap::new()
        } else {
            match self.complete_steps_fast(&fast, actor).await {
                Ok(applied) => applied,
                // The database is away: every caller gets the error and
                // retries on its own, as intake does, rather than each
                // trying the general path against it at once.
                Err(error) if error.is_transient() => {
                    let shared = std::sync::Arc::new(error);
                    return replies
                        .iter()
                        .map(|_| Err(StoreError::Shared(shared.clone())))
                        .collect();
                }
                // Nothing changed: every reply takes the general path.
                Err(error) => {
                    tracing::warn!(error = %error, "the batched reply statement failed; replies take the general path");
                    std::collections::HashMap::new()
                }
            }
        };
        let mut outcomes = Vec::with_capacity(replies.len());
        for (reply, fast) in replies.iter().zip(in_fast) {
            let done = if fast {
                applied.remove(&reply.order_id)
            } else {
                None
            };
            outcomes.push(async move {
                match done {
                    Some(done) => Ok(ReplyOutcome::Applied {
                        progress: done.progress,
                        step: done.step,
                        latency_secs: done.latency_secs,
                    }),
                    None => self.record_reply_general(reply, actor).await,
                }
            });
        }
        futures_util::future::join_all(outcomes).await
    }

    /// The general path of a reply: one transaction that locks the order and
    /// handles every case.
    async fn record_reply_general(
        &self,
        reply: &StepReply,
        actor: &str,
    ) -> Result<ReplyOutcome, StoreError> {
        let mut tx = self.pool().begin().await?;
        let order_id = reply.order_id.clone();
        let locked: Option<(ProcessState, Option<String>, Option<String>)> = sqlx::query_as(
            "SELECT state, reply_to, trace_id FROM order_process WHERE order_id = $1 FOR UPDATE",
        )
        .bind(&order_id)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((state, reply_to, trace_id)) = locked else {
            return Ok(ReplyOutcome::Stale {
                reason: "no such order".into(),
            });
        };
        let expected = match state {
            ProcessState::Processing => StepState::Running,
            ProcessState::Compensating => StepState::Compensating,
            other => {
                let reason = format!("order is {other}, no attempt is awaited");
                record_history(
                    &mut tx,
                    &order_id,
                    actor,
                    "stale_reply",
                    Some(&reply.step),
                    Some(reply.attempt_id),
                    Some(&reason),
                )
                .await?;
                tx.commit().await?;
                return Ok(ReplyOutcome::Stale { reason });
            }
        };

        let mut progress = Progress {
            reply_to,
            trace_id,
            ..Progress::default()
        };
        let (new_state, result, error) = match &reply.outcome {
            StepOutcome::Succeeded { result } => (
                if expected == StepState::Running {
                    StepState::Completed
                } else {
                    StepState::Compensated
                },
                Some(result),
                None,
            ),
            StepOutcome::Failed {
                error,
                permanent: true,
            } if expected == StepState::Running => (StepState::Failed, None, Some(error.as_str())),
            // A compensation that failed permanently, or any transient
            // failure, leaves the step as it is: only its error is recorded.
            StepOutcome::Failed { error, .. } => (expected, None, Some(error.as_str())),
        };
        // A success is recorded in the history by the same statement (one
        // round trip on the hot path); failures are recorded below.
        let by = format!("by {}", reply.agent_id);
        let success_event = match (&reply.outcome, expected) {
            (StepOutcome::Succeeded { .. }, StepState::Running) => Some("step_completed"),
            (StepOutcome::Succeeded { .. }, _) => Some("step_compensated"),
            _ => None,
        };
        // The guarded update, its history row, and every step of the order
        // as they were before it (patched below), in one round trip. No row
        // at all means the attempt is not current.
        let rows: Vec<UpdatedSteps> = sqlx::query_as(
            "WITH s AS (
                 UPDATE steps
                    SET state = $3, result = COALESCE($4, result), last_error = $5, updated_at = now()
                  WHERE order_id = $1 AND attempt_id = $2 AND state = $6
              RETURNING name, updated_at,
                        EXTRACT(EPOCH FROM now() - (complete_by - make_interval(secs => timeout_ms::float8 / 1000)))::float8 AS latency),
             h AS (
                 INSERT INTO history (order_id, actor, event, step, attempt_id, detail)
                 SELECT $1, $7, $8, s.name, $2, $9 FROM s WHERE $8::text IS NOT NULL)
             SELECT st.position, st.name, st.agent, st.action, st.compensation, st.timeout_ms, st.state,
                    st.idempotency_key, st.result,
                    s.name AS updated_name, s.updated_at AS updated_at, s.latency AS latency
               FROM steps st CROSS JOIN s
              WHERE st.order_id = $1
              ORDER BY st.position",
        )
        .bind(&order_id)
        .bind(reply.attempt_id)
        .bind(new_state)
        .bind(result)
        .bind(error)
        .bind(expected)
        .bind(actor)
        .bind(success_event)
                .bind(&by)
        .fetch_all(&mut *tx)
        .await?;
        let Some((step, at, latency_secs)) = rows
            .first()
            .map(|row| (row.updated_name.clone(), row.updated_at, row.latency))
        else {
            let reason = format!(
                "attempt {} is not the step's current attempt (order {state})",
                reply.attempt_id
            );
            record_history(
                &mut tx,
                &order_id,
                actor,
                "stale_reply",
                Some(&reply.step),
                Some(reply.attempt_id),
                Some(&reason),
            )
            .await?;
            tx.commit().await?;
            return Ok(ReplyOutcome::Stale { reason });
        };

        let steps: Vec<StepRow> = rows
            .into_iter()
            .map(|row| {
                let mut step = row.step;
                if step.name == row.updated_name {
                    step.state = new_state;
                    if let Some(result) = result {
                        step.result = Some(result.clone());
                    }
                }
                step
            })
            .collect();
        match (&reply.outcome, expected) {
            (StepOutcome::Succeeded { .. }, StepState::Running) => {
                progress.statuses.push(status(
                    &order_id,
                    StatusEvent::StepCompleted,
                    Some(&step),
                    None,
                    at,
                ));
                advance(&mut tx, &order_id, state, actor, &mut progress, Some(steps)).await?;
            }
            (StepOutcome::Succeeded { .. }, _) => {
                advance(&mut tx, &order_id, state, actor, &mut progress, Some(steps)).await?;
            }
            (
                StepOutcome::Failed {
                    error,
                    permanent: true,
                },
                StepState::Running,
            ) => {
                let reason = format!("step {step} failed: {error}");
                sqlx::query(
                    "UPDATE order_process
                        SET state = 'compensating', failure_count = 0, last_error = $2, updated_at = now()
                      WHERE order_id = $1",
                )
                .bind(&order_id)
                .bind(&reason)
                .execute(&mut *tx)
                .await?;
                record_history(
                    &mut tx,
                    &order_id,
                    actor,
                    "compensation_started",
                    Some(&step),
                    Some(reply.attempt_id),
                    Some(&reason),
                )
                .await?;
                progress.statuses.push(status(
                    &order_id,
                    StatusEvent::Compensating,
                    Some(&step),
                    Some(&reason),
                    at,
                ));
                advance(
                    &mut tx,
                    &order_id,
                    ProcessState::Compensating,
                    actor,
                    &mut progress,
                    Some(steps),
                )
                .await?;
            }
            (
                StepOutcome::Failed {
                    error,
                    permanent: true,
                },
                _,
            ) => {
                let reason = format!("compensation of step {step} failed permanently: {error}");
                set_process_state(&mut tx, &order_id, ProcessState::Error, Some(&reason)).await?;
                record_history(
                    &mut tx,
                    &order_id,
                    actor,
                    "error",
                    Some(&step),
                    Some(reply.attempt_id),
                    Some(&reason),
                )
                .await?;
                raise_alert(&mut tx, Some(&order_id), "compensation_failed", &reason).await?;
                progress.statuses.push(status(
                    &order_id,
                    StatusEvent::Failed,
                    Some(&step),
                    Some(&reason),
                    at,
                ));
            }
            (
                StepOutcome::Failed {
                    error,
                    permanent: false,
                },
                _,
            ) => {
                sqlx::query("UPDATE order_process SET complete_by = now(), updated_at = now() WHERE order_id = $1")
                    .bind(&order_id)
                    .execute(&mut *tx)
                    .await?;
                record_history(
                    &mut tx,
                    &order_id,
                    actor,
                    "transient_failure",
                    Some(&step),
                    Some(reply.attempt_id),
                    Some(error),
                )
                .await?;
            }
        }
        tx.commit().await?;
        Ok(ReplyOutcome::Applied {
            progress,
            step,
            latency_secs,
        })
    }
}
