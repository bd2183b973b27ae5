//! Storing a submitted order.

use sas_messages::{StatusEvent, SubmitOrder};

use crate::model::{NewStep, ProcessState, Progress};
use crate::model::StepState;
use crate::progress::{advance, status, StepRow};
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
    /// Stores `order` (of trace `trace_id`) with its process record and its steps, and starts its
    /// first step held by `actor`, in one transaction; idempotent on the
    /// order id.
    ///
    /// The intake scheduler holds the new order straight away rather than
    /// leaving it pending for a claim, so a new order costs no polling delay.
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
        let mut tx = self.pool().begin().await?;
        // The order, its process record, its steps and the first history
        // row in one statement; none of them when the id is already taken.
        let inserted: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
            "WITH o AS (
                 INSERT INTO orders (order_id, body) VALUES ($1, $2)
                 ON CONFLICT (order_id) DO NOTHING
              RETURNING order_id, received_at),
             p AS (
                 INSERT INTO order_process (order_id, workflow, state, locked_by, reply_to, trace_id)
                 SELECT order_id, $3, 'processing', $4, $5, $6 FROM o),
             s AS (
                 INSERT INTO steps (order_id, position, name, agent, action, compensation, timeout_ms, idempotency_key)
                 SELECT o.order_id, t.position, t.name, t.agent, t.action, t.compensation, t.timeout_ms,
                        o.order_id || ':' || t.name
                   FROM o, UNNEST($7::int4[], $8::text[], $9::text[], $10::text[], $11::text[], $12::int4[])
                        AS t(position, name, agent, action, compensation, timeout_ms)),
             h AS (
                 INSERT INTO history (order_id, actor, event) SELECT order_id, $4, 'received' FROM o)
             SELECT received_at FROM o",
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
        .fetch_optional(&mut *tx)
        .await?;
        let Some(received_at) = inserted else {
            let same: bool = sqlx::query_scalar("SELECT body = $2 FROM orders WHERE order_id = $1")
                .bind(&order.order_id)
                .bind(&body)
                .fetch_one(&mut *tx)
                .await?;
            return Ok(if same {
                Intake::Duplicate
            } else {
                Intake::Conflict
            });
        };
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
                // The steps were just written: no need to read them back.
        let known = steps
            .iter()
            .zip(0..)
            .map(|(step, position)| StepRow {
                position,
                name: step.name.clone(),
                agent: step.agent.clone(),
                action: step.action.clone(),
                compensation: step.compensation.clone(),
                timeout_ms: i32::try_from(step.timeout.as_millis()).unwrap_or(i32::MAX),
                state: StepState::NotStarted,
                idempotency_key: format!("{}:{}", order.order_id, step.name),
                result: None,
            })
            .collect();
        advance(
            &mut tx,
            &order.order_id,
            ProcessState::Processing,
            actor,
            &mut progress,
            Some(known),
        )
        .await?;
        tx.commit().await?;
        Ok(Intake::Accepted(progress))
    }
}
