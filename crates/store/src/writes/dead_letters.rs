//! What operators do with recorded dead letters: replay one to the queue it
//! came from, or discard it. The record keeps what was done, when and by
//! whom, and the order's history says it too.
//!
//! The store only records the disposition; publishing the replayed message
//! is the caller's (it holds the broker connection). A replay is recorded
//! only after the broker confirmed the message, so a record never says
//! "replayed" for a message that was not.

use super::Writes;
use crate::machine::HistoryEvent;
use crate::StoreError;

/// What an operator did with a dead letter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Published again to its source queue.
    Replayed,
    /// Dropped: nothing will be done with it.
    Discarded,
}

impl Disposition {
    /// The name stored in `dead_letters.disposition`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Replayed => "replayed",
            Self::Discarded => "discarded",
        }
    }
}

impl Writes<'_> {
    /// Records that `actor` replayed or discarded dead letter `id`, unless
    /// something was done with it already; returns whether this call
    /// recorded it. The order's history says it too.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn dispose_dead_letter(
        self,
        id: i64,
        disposition: Disposition,
        actor: &str,
    ) -> Result<bool, StoreError> {
        let mut tx = self.pool().begin().await?;
        let updated: Option<(Option<String>, Option<String>)> = sqlx::query_as(
            "UPDATE dead_letters SET disposition = $2, disposed_at = now(), disposed_by = $3
              WHERE id = $1 AND disposition IS NULL RETURNING order_id, source_queue",
        )
        .bind(id)
        .bind(disposition.as_str())
        .bind(actor)
        .fetch_optional(&mut *tx)
        .await?;
        let Some((order_id, source)) = updated else {
            tx.commit().await?;
            return Ok(false);
        };
        if let Some(order_id) = order_id {
            let event = match disposition {
                Disposition::Replayed => HistoryEvent::DeadLetterReplayed,
                Disposition::Discarded => HistoryEvent::DeadLetterDiscarded,
            };
            sqlx::query(
                "INSERT INTO history (order_id, actor, event, detail) VALUES ($1, $2, $3, $4)",
            )
            .bind(order_id)
            .bind(actor)
            .bind(event.as_str())
            .bind(format!(
                "dead letter #{id} from {}",
                source.as_deref().unwrap_or("an unknown queue")
            ))
            .execute(&mut *tx)
            .await?;
        }
        tx.commit().await?;
        Ok(true)
    }
}
