//! What operators do with alerts: acknowledge one (someone is on it), then
//! resolve it with a note. Each is recorded in the order's history with who
//! did it, beside the transitions the state machine decides. And the one
//! alert about no order in particular a service raises itself: orders it
//! acknowledged that the database lost ([`Writes::alert_orders_lost`]).

use super::Writes;
use crate::machine::{AlertKind, HistoryEvent};
use crate::StoreError;

/// What became of an operator's action on an alert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AlertAction {
    /// Done (and recorded in the order's history when the alert names one).
    Done,
    /// No such alert.
    NotFound,
    /// The alert was already resolved: nothing changed.
    AlreadyResolved,
}

impl Writes<'_> {
    /// Raises an [`AlertKind::OrdersLost`] alert, about no one order (they
    /// are not in the database), with `message`: which orders, acknowledged
    /// when, and what to do.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn alert_orders_lost(self, message: &str) -> Result<(), StoreError> {
        sqlx::query("INSERT INTO alerts (order_id, kind, message) VALUES (NULL, $1, $2)")
            .bind(AlertKind::OrdersLost.as_str())
            .bind(message)
            .execute(self.pool())
            .await?;
        Ok(())
    }

    /// Marks an open alert acknowledged by `actor`. Acknowledging it again
    /// keeps the first acknowledgement.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn acknowledge_alert(self, id: i64, actor: &str) -> Result<AlertAction, StoreError> {
        self.act_on_alert(
            id,
            actor,
            "UPDATE alerts SET acknowledged_at = coalesce(acknowledged_at, now()),
                    acknowledged_by = coalesce(acknowledged_by, $2)
              WHERE id = $1 AND resolved_at IS NULL RETURNING order_id",
            None,
            HistoryEvent::AlertAcknowledged,
        )
        .await
    }

    /// Resolves an open alert with `note` (what was found or done), by `actor`.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn resolve_alert(
        self,
        id: i64,
        note: &str,
        actor: &str,
    ) -> Result<AlertAction, StoreError> {
        self.act_on_alert(
            id,
            actor,
            "UPDATE alerts SET resolved_at = now(), resolved_by = $2, resolution_note = $3
              WHERE id = $1 AND resolved_at IS NULL RETURNING order_id",
            Some(note),
            HistoryEvent::AlertResolved,
        )
        .await
    }

    async fn act_on_alert(
        self,
        id: i64,
        actor: &str,
        statement: &'static str,
        note: Option<&str>,
        event: HistoryEvent,
    ) -> Result<AlertAction, StoreError> {
        let mut tx = self.pool().begin().await?;
        let updated: Option<Option<String>> = sqlx::query_scalar(statement)
            .bind(id)
            .bind(actor)
            .bind(note)
            .fetch_optional(&mut *tx)
            .await?;
        let Some(order_id) = updated else {
            let exists: bool =
                sqlx::query_scalar("SELECT EXISTS (SELECT 1 FROM alerts WHERE id = $1)")
                    .bind(id)
                    .fetch_one(&mut *tx)
                    .await?;
            tx.commit().await?;
            return Ok(if exists {
                AlertAction::AlreadyResolved
            } else {
                AlertAction::NotFound
            });
        };
        if let Some(order_id) = order_id {
            let detail = match note {
                Some(note) => format!("alert #{id}: {note}"),
                None => format!("alert #{id}"),
            };
            sqlx::query(
                "INSERT INTO history (order_id, actor, event, detail) VALUES ($1, $2, $3, $4)",
            )
            .bind(order_id)
            .bind(actor)
            .bind(event.as_str())
            .bind(detail)
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(AlertAction::Done)
    }
}
