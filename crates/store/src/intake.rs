//! Storing a submitted order.

use chrono::{DateTime, Utc};
use sas_messages::{StatusEvent, StepKind, SubmitOrder};
use sqlx::Row;
use uuid::Uuid;

use crate::model::{Dispatch, NewStep, Progress};
use crate::progress::status;
use crate::{Store, StoreError};

/// What became of a submitted order.
#[derive(Debug, Clone, PartialEq)]
pub enum Intake {
    /// Stored, and its first step started: publish what the progress asks.
    Accepted(Progress),
    /// The same order was already stored (a redelivery or a resubmission): nothing changed.
    Duplicate,
    /// An order with this id but other content was already stored: nothing
    /// changed, and the submission should be rejected.
    Conflict,
}

impl Store {
    /// Stores `order` (of trace `trace_id`) with its process record and its
    /// steps, and starts its first step held by `actor`; idempotent on the
    /// order id.
    ///
    /// It is one statement, so it is atomic without a transaction and costs
    /// one round trip: the order, its process record (`processing`, held by
    /// `actor`, complete-by of the first step), its steps (the first one
    /// `running` with its first attempt) and two history rows. The intake
    /// scheduler holds the new order straight away rather than leaving it
    /// pending for a claim, so a new order costs no polling delay.
    ///
    /// # Errors
    /// When the database fails; the submission should then be redelivered.
    pub async fn insert_order(
        &self,
        order: &SubmitOrder,
        workflow: &str,
        steps: &[NewStep],
        trace_id: &str,
        actor: &str,
    ) -> Result<Intake, StoreError> {
        let first = steps
            .first()
            .ok_or_else(|| StoreError::Invariant("a workflow needs at least one step".into()))?;
        let body = serde_json::to_value(order).map_err(|e| StoreError::Invariant(e.to_string()))?;
        let positions: Vec<i32> = (0..).take(steps.len()).collect();
        let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
        let agents: Vec<&str> = steps.iter().map(|s| s.agent.as_str()).collect();
        let actions: Vec<&str> = steps.iter().map(|s| s.action.as_str()).collect();
        let compensations: Vec<Option<&str>> =
            steps.iter().map(|s| s.compensation.as_deref()).collect();
        let timeouts: Vec<i32> = steps
            .iter()
            .map(|s| i32::try_from(s.timeout.as_millis()).unwrap_or(i32::MAX))
            .collect();
        let attempt_id = Uuid::now_v7();
        let inserted = sqlx::query(
            "WITH o AS (
                 INSERT INTO orders (order_id, body) VALUES ($1, $2)
                 ON CONFLICT (order_id) DO NOTHING
              RETURNING order_id, received_at),
             t AS (
                 SELECT * FROM UNNEST($7::int4[], $8::text[], $9::text[], $10::text[], $11::text[], $12::int4[])
                        AS t(position, name, agent, action, compensation, timeout_ms)),
             first AS (
                 SELECT t.*, now() + make_interval(secs => t.timeout_ms::float8 / 1000) AS complete_by
                   FROM t WHERE t.position = 0),
             p AS (
                 INSERT INTO order_process (order_id, workflow, state, locked_by, reply_to, trace_id, complete_by)
                 SELECT o.order_id, $3, 'processing', $4, $5, $6, first.complete_by FROM o, first),
             s AS (
                 INSERT INTO steps (order_id, position, name, agent, action, compensation, timeout_ms,
                                    idempotency_key, state, attempt, attempt_id, complete_by)
                 SELECT o.order_id, t.position, t.name, t.agent, t.action, t.compensation, t.timeout_ms,
                        o.order_id || ':' || t.name,
                        CASE WHEN t.position = 0 THEN 'running' ELSE 'not_started' END::step_state,
                        CASE WHEN t.position = 0 THEN 1 ELSE 0 END,
                        CASE WHEN t.position = 0 THEN $13::uuid END,
                        CASE WHEN t.position = 0 THEN first.complete_by END
                   FROM o, t, first),
             h AS (
                 INSERT INTO history (order_id, actor, event, step, attempt_id, detail)
                 SELECT o.order_id, $4, 'received', NULL, NULL, NULL FROM o
                 UNION ALL
                 SELECT o.order_id, $4, 'dispatched', first.name, $13::uuid,
                        'attempt 1: ' || first.agent || '.' || first.action
                   FROM o, first)
             SELECT o.received_at, first.complete_by FROM o, first",
        )
        .bind(&order.order_id)
        .bind(&body)
        .bind(workflow)
        .bind(actor)
        .bind(&order.reply_to)
        .bind(trace_id)
        .bind(&positions)
        .bind(&names)
        .bind(&agents)
        .bind(&actions)
        .bind(&compensations)
        .bind(&timeouts)
        .bind(attempt_id)
        .fetch_optional(self.pool())
        .await?;
        let Some(row) = inserted else {
            let same: bool = sqlx::query_scalar("SELECT body = $2 FROM orders WHERE order_id = $1")
                .bind(&order.order_id)
                .bind(&body)
                .fetch_one(self.pool())
                .await?;
            return Ok(if same {
                Intake::Duplicate
            } else {
                Intake::Conflict
            });
        };
        let received_at: DateTime<Utc> = row.try_get("received_at")?;
        let complete_by: DateTime<Utc> = row.try_get("complete_by")?;
        let mut progress = Progress {
            reply_to: order.reply_to.clone(),
            trace_id: Some(trace_id.to_owned()),
            ..Progress::default()
        };
        progress.statuses.push(status(
            &order.order_id,
            StatusEvent::Received,
            None,
            None,
            received_at,
        ));
        progress.dispatch = Some(Box::new(Dispatch {
            order_id: order.order_id.clone(),
            step: first.name.clone(),
            agent: first.agent.clone(),
            kind: StepKind::Action,
            action: first.action.clone(),
            attempt: 1,
            attempt_id,
            idempotency_key: format!("{}:{}", order.order_id, first.name),
            complete_by,
            payload: serde_json::json!({ "order": body, "results": {} }),
        }));
        Ok(Intake::Accepted(progress))
    }
}
