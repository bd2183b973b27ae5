//! Recorded dead letters as operators see them, and whether one may be
//! replayed (to where, and what). Recording what was done with one is a
//! write: [`crate::writes::dead_letters`].

use sas_messages::QueueNames;

use super::Reads;
use crate::StoreError;

/// Why a dead letter cannot be replayed: what to tell the operator.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NotReplayable {
    /// No such dead letter.
    #[error("no dead letter #{0}")]
    NotFound(i64),
    /// Replayed or discarded already.
    #[error("dead letter #{0} was already {1}")]
    AlreadyDone(i64, String),
    /// Its source queue is unknown or was not trusted.
    #[error("dead letter #{0} has no trusted source queue: discard it, or publish a corrected message yourself")]
    NoSource(i64),
    /// It came from a queue that is not a work queue of this deployment.
    #[error("dead letter #{0} came from {1}, which is not a work queue of this deployment: it cannot be replayed")]
    ForeignQueue(i64, String),
    /// It is an agent's reply: schedulers take replies only from agents, so
    /// a replay by an operator would be refused as forged.
    #[error("dead letter #{0} is an agent's reply: schedulers accept replies only from agents, so a replay would be refused as forged; discard it (the supervisor retries the step once its deadline passes)")]
    AgentReply(i64),
    /// Only the first bytes of its body were recorded.
    #[error("only part of dead letter #{0} was recorded: replaying it would send a broken message; discard it")]
    Truncated(i64),
    /// It is a step request: when it was dead-lettered the supervisor took
    /// its step over (retried it or undid the order), so a replay is stale
    /// at best, and at worst makes a call that was never made land after
    /// the order's undo.
    #[error("dead letter #{0} is a step request: its order moved on when it was dead-lettered (the supervisor retried the step or undid the order), and a replay could make the call after the undo; discard it, and resubmit the order if it must run again")]
    StepRequest(i64),
}

/// A dead letter that may be replayed: where to, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replay {
    /// Its id.
    pub id: i64,
    /// The work queue it came from.
    pub queue: String,
    /// The recorded body.
    pub body: String,
}

/// A dead letter an operator may act on: what a replay needs.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct DeadLetterRecord {
    /// Row id.
    pub id: i64,
    /// Queue it came from, when known and trusted.
    pub source_queue: Option<String>,
    /// Why it was rejected.
    pub reason: String,
    /// The order it belongs to, if known.
    pub order_id: Option<String>,
    /// The body as recorded (text).
    pub body: String,
    /// What was done with it already, if anything.
    pub disposition: Option<String>,
}

/// Why intake refused an order: the latest dead letter its id has from the
/// orders queue, recorded from a trusted service (an untrusted one names no
/// source queue).
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
pub struct Refusal {
    /// When it was recorded.
    pub at: chrono::DateTime<chrono::Utc>,
    /// Why intake refused it.
    pub reason: String,
}

impl Reads<'_> {
    /// Why intake refused order `order_id`, if it did: for a client asking
    /// after an order that is not stored, so that it hears `rejected` and
    /// the reason instead of "not stored yet" for ever. With `publisher`,
    /// only a refusal of a message that broker user published (the
    /// gateway's own): another client's refused message under the same id
    /// says nothing of this client's order.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn order_refusal(
        self,
        order_id: &str,
        names: &QueueNames,
        publisher: Option<&str>,
    ) -> Result<Option<Refusal>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT at, reason FROM dead_letters
              WHERE order_id = $1 AND source_queue = $2
                AND ($3::text IS NULL OR publisher = $3)
              ORDER BY id DESC LIMIT 1",
        )
        .bind(order_id)
        .bind(names.orders())
        .bind(publisher)
        .fetch_optional(self.pool())
        .await?)
    }

    /// One recorded dead letter, or `None`.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn dead_letter(self, id: i64) -> Result<Option<DeadLetterRecord>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT id, source_queue, reason, order_id, body, disposition
               FROM dead_letters WHERE id = $1",
        )
        .bind(id)
        .fetch_optional(self.pool())
        .await?)
    }

    /// Whether dead letter `id` may be replayed, and where to: only once,
    /// only to a work queue of this deployment that takes messages from
    /// operators (`names`: orders, an agent's requests; not the replies,
    /// which only agents may send), and only when the whole body was recorded.
    ///
    /// # Errors
    /// [`NotReplayable`] saying why not (the outer error when the database fails).
    pub async fn replay_of(
        self,
        id: i64,
        names: &QueueNames,
    ) -> Result<Result<Replay, NotReplayable>, StoreError> {
        let Some(letter) = self.dead_letter(id).await? else {
            return Ok(Err(NotReplayable::NotFound(id)));
        };
        if let Some(done) = letter.disposition {
            return Ok(Err(NotReplayable::AlreadyDone(id, done)));
        }
        let Some(queue) = letter.source_queue else {
            return Ok(Err(NotReplayable::NoSource(id)));
        };
        if queue == names.scheduler_replies() {
            return Ok(Err(NotReplayable::AgentReply(id)));
        }
        if queue.starts_with(&names.agent_requests("")) {
            return Ok(Err(NotReplayable::StepRequest(id)));
        }
        if queue != names.orders() {
            return Ok(Err(NotReplayable::ForeignQueue(id, queue)));
        }
        // The supervisor's note on a body over the size limit (see its dead_letters module).
        if letter.reason.contains(" bytes; the first ") {
            return Ok(Err(NotReplayable::Truncated(id)));
        }
        Ok(Ok(Replay {
            id,
            queue,
            body: letter.body,
        }))
    }
}
