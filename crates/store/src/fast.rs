//! The hot path of a reply: a step of an order running forward succeeded.
//!
//! That is nearly every reply, so it gets one statement instead of a
//! transaction of several: lock the order, complete the step (guarded by
//! attempt id and state), start the next step or finish the order, and record
//! the history. When anything is unusual (the order is not processing, the
//! attempt is not current, the steps are not in the plain forward shape), the
//! statement changes nothing and the caller takes the general path, which
//! handles every case.

use chrono::{DateTime, Utc};
use sas_messages::{StatusEvent, StepKind, StepReply};
use sqlx::Row;
use uuid::Uuid;

use crate::model::{Dispatch, Progress};
use crate::progress::status;
use crate::{Store, StoreError};

/// What the fast path did.
pub(crate) struct Completed {
    /// Statuses and the next request to publish.
    pub progress: Progress,
    /// The completed step.
    pub step: String,
    /// Seconds from the attempt's dispatch to this reply.
    pub latency_secs: f64,
}

impl Store {
    /// Applies a successful reply to a forward step in one statement, or
    /// returns `None` having changed nothing.
    pub(crate) async fn complete_step_fast(
        &self,
        reply: &StepReply,
        result: &serde_json::Value,
        actor: &str,
    ) -> Result<Option<Completed>, StoreError> {
        let next_attempt_id = Uuid::now_v7();
        let by = format!("by {}", reply.agent_id);
        // The guards in `done` keep this to the plain forward shape: every
        // earlier step completed, no later one completed.
        let row = sqlx::query(
            "WITH p AS (
                 SELECT order_id, reply_to, trace_id FROM order_process
                  WHERE order_id = $1 AND state = 'processing'
                    FOR UPDATE),
             done AS (
                 UPDATE steps d
                    SET state = 'completed', result = $3, last_error = NULL, updated_at = now()
                  WHERE d.order_id = $1 AND d.attempt_id = $2 AND d.state = 'running'
                    AND EXISTS (SELECT 1 FROM p)
                    AND NOT EXISTS (SELECT 1 FROM steps e WHERE e.order_id = $1 AND e.position < d.position AND e.state <> 'completed')
                    AND NOT EXISTS (SELECT 1 FROM steps e WHERE e.order_id = $1 AND e.position > d.position AND e.state = 'completed')
              RETURNING d.position, d.name, d.updated_at,
                        EXTRACT(EPOCH FROM now() - (d.complete_by - make_interval(secs => d.timeout_ms::float8 / 1000)))::float8 AS latency),
             next AS (
                 UPDATE steps
                    SET state = 'running', attempt = attempt + 1, attempt_id = $4,
                        complete_by = now() + make_interval(secs => timeout_ms::float8 / 1000),
                        updated_at = now()
                  WHERE order_id = $1 AND position = (SELECT position + 1 FROM done)
              RETURNING name, agent, action, attempt, complete_by, idempotency_key),
             process AS (
                 UPDATE order_process
                    SET state = CASE WHEN EXISTS (SELECT 1 FROM next) THEN 'processing' ELSE 'processed' END::process_state,
                        complete_by = (SELECT complete_by FROM next),
                        locked_by = CASE WHEN EXISTS (SELECT 1 FROM next) THEN $5 END,
                        updated_at = now()
                  WHERE order_id = $1 AND EXISTS (SELECT 1 FROM done)
              RETURNING updated_at),
             h AS (
                 INSERT INTO history (order_id, actor, event, step, attempt_id, detail)
                 SELECT $1, $5, 'step_completed', name, $2, $6 FROM done
                 UNION ALL
                 SELECT $1, $5, 'dispatched', name, $4, 'attempt ' || attempt || ': ' || agent || '.' || action FROM next
                 UNION ALL
                 SELECT $1, $5, 'processed', NULL, NULL, NULL FROM done WHERE NOT EXISTS (SELECT 1 FROM next))
             SELECT done.name AS step, done.updated_at AS at, done.latency,
                    p.reply_to, p.trace_id,
                    (SELECT updated_at FROM process) AS finished_at,
                    next.name AS next_step, next.agent AS next_agent, next.action AS next_action,
                    next.attempt AS next_attempt, next.complete_by AS next_complete_by,
                    next.idempotency_key AS next_key,
                    (SELECT body FROM orders WHERE order_id = $1) AS body,
                    COALESCE((SELECT jsonb_object_agg(name, result) FROM steps
                               WHERE order_id = $1 AND result IS NOT NULL), '{}'::jsonb)
                      || jsonb_build_object(done.name, $3::jsonb) AS results
               FROM done CROSS JOIN p LEFT JOIN next ON true",
        )
        .bind(&reply.order_id)
        .bind(reply.attempt_id)
        .bind(result)
        .bind(next_attempt_id)
        .bind(actor)
        .bind(&by)
        .fetch_optional(self.pool())
        .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let order_id = reply.order_id.as_str();
        let step: String = row.try_get("step")?;
        let at: DateTime<Utc> = row.try_get("at")?;
        let mut progress = Progress {
            reply_to: row.try_get("reply_to")?,
            trace_id: row.try_get("trace_id")?,
            ..Progress::default()
        };
        progress.statuses.push(status(
            order_id,
            StatusEvent::StepCompleted,
            Some(&step),
            None,
            at,
        ));
        match row.try_get::<Option<String>, _>("next_step")? {
            Some(next_step) => {
                let body: serde_json::Value = row.try_get("body")?;
                let results: serde_json::Value = row.try_get("results")?;
                progress.dispatch = Some(Box::new(Dispatch {
                    order_id: order_id.to_owned(),
                    step: next_step,
                    agent: row.try_get("next_agent")?,
                    kind: StepKind::Action,
                    action: row.try_get("next_action")?,
                    attempt: row.try_get("next_attempt")?,
                    attempt_id: next_attempt_id,
                    idempotency_key: row.try_get("next_key")?,
                    complete_by: row.try_get("next_complete_by")?,
                    payload: serde_json::json!({ "order": body, "results": results }),
                }));
            }
            None => {
                let finished_at: DateTime<Utc> = row.try_get("finished_at")?;
                progress.statuses.push(status(
                    order_id,
                    StatusEvent::Processed,
                    None,
                    None,
                    finished_at,
                ));
            }
        }
        Ok(Some(Completed {
            progress,
            step,
            latency_secs: row.try_get("latency")?,
        }))
    }
}
