//! Storing a submitted order.

use sas_messages::{StatusEvent, SubmitOrder};

use crate::model::{NewStep, ProcessState, Progress};
use crate::progress::{advance, record_history, status};
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
        let mut tx = self.pool().begin().await?;
        let inserted: Option<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
            "INSERT INTO orders (order_id, body) VALUES ($1, $2)
             ON CONFLICT (order_id) DO NOTHING
             RETURNING received_at",
        )
        .bind(&order.order_id)
        .bind(&body)
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

        sqlx::query(
            "INSERT INTO order_process (order_id, workflow, state, locked_by, reply_to, trace_id)
             VALUES ($1, $2, 'processing', $3, $4, $5)",
        )
        .bind(&order.order_id)
        .bind(workflow)
        .bind(actor)
        .bind(&order.reply_to)
        .bind(trace_id)
        .execute(&mut *tx)
        .await?;

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
        sqlx::query(
            "INSERT INTO steps (order_id, position, name, agent, action, compensation, timeout_ms, idempotency_key)
             SELECT $1, position, name, agent, action, compensation, timeout_ms, $1 || ':' || name
               FROM UNNEST($2::int4[], $3::text[], $4::text[], $5::text[], $6::text[], $7::int4[])
                    AS t(position, name, agent, action, compensation, timeout_ms)",
        )
        .bind(&order.order_id)
        .bind(&positions)
        .bind(&names)
        .bind(&agents)
        .bind(&actions)
        .bind(&compensations)
        .bind(&timeouts)
        .execute(&mut *tx)
        .await?;

        record_history(
            &mut tx,
            &order.order_id,
            actor,
            "received",
            None,
            None,
            None,
        )
        .await?;
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
        advance(
            &mut tx,
            &order.order_id,
            ProcessState::Processing,
            actor,
            &mut progress,
        )
        .await?;
        tx.commit().await?;
        Ok(Intake::Accepted(progress))
    }
}
