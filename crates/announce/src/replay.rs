//! Replaying a dead letter: the one use case the console and `sasctl` both
//! offer, written once.

use sas_broker::{BrokerError, Publisher};
use sas_messages::QueueNames;
use sas_store::reads::dead_letters::NotReplayable;
use sas_store::writes::dead_letters::Disposition;
use sas_store::{Store, StoreError};

/// Why a dead letter was not replayed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The store says it cannot be replayed (none, dealt with already, not
    /// from a work queue, only partly recorded): the text says what to do.
    #[error(transparent)]
    Refused(#[from] NotReplayable),
    /// The broker did not confirm the publish: nothing was recorded.
    #[error("RabbitMQ did not take the replay of dead letter #{id} to {queue} ({source}): nothing is recorded; try again")]
    NotTaken {
        /// The dead letter.
        id: i64,
        /// Its source queue.
        queue: String,
        /// What the broker said.
        source: BrokerError,
    },
    /// The store failed (before the publish, or when recording it).
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// Publishes dead letter `id`'s recorded body again to its source queue,
/// waits for the broker's confirm, then records the replay by `actor`.
/// Returns the queue it went to.
///
/// A replay is at least once: two operators replaying the same letter at
/// the same moment may both publish it, which intake absorbs (it is
/// idempotent on the order id). Only orders are replayed: see
/// [`NotReplayable`] for the rest.
///
/// # Errors
/// See [`ReplayError`].
pub async fn replay_dead_letter(
    store: &Store,
    names: &QueueNames,
    publisher: &Publisher,
    id: i64,
    actor: &str,
) -> Result<String, ReplayError> {
    let replay = store.reads().replay_of(id, names).await??;
    let properties = sas_broker::publish::json_properties(&format!(
        "replay-{id}-{}",
        uuid::Uuid::new_v4().simple()
    ));
    if let Err(source) = publisher
        .publish("", &replay.queue, replay.body.as_bytes(), properties, true)
        .await
    {
        return Err(ReplayError::NotTaken {
            id,
            queue: replay.queue,
            source,
        });
    }
    store
        .writes()
        .dispose_dead_letter(id, Disposition::Replayed, actor)
        .await?;
    Ok(replay.queue)
}
