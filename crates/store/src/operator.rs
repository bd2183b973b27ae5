//! Transitions that come from outside the workflow: a message the broker
//! dead-lettered, and an operator resubmitting or cancelling an order.

use sas_messages::AttemptId;

use crate::apply::{apply, decide_admitted, load_snapshot};
use crate::machine::{Decision, Event, ResubmitAction, Snapshot, Verdict};
use crate::model::{ProcessState, Progress};
use crate::{Store, StoreError};

/// What became of an operator's resubmission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resubmit {
    /// Back in the workflow; a scheduler will claim it.
    Resubmitted {
        /// What will happen.
        what: ResubmitAction,
        /// The steps that get fresh idempotency keys: for the action when the
        /// workflow restarts, for the undo when a compensation the remote
        /// refused for good resumes (the old keys are decided at the remote).
        fresh_keys: Vec<String>,
    },
    /// No such order.
    NotFound,
    /// Only orders that ended `error` or `compensated` can be resubmitted.
    NotFailed(ProcessState),
}

/// What became of an operator's cancellation.
#[derive(Debug, Clone, PartialEq)]
pub enum Cancel {
    /// The order is compensating; publish the status messages.
    Cancelled(Progress),
    /// No such order.
    NotFound,
    /// Only pending or processing orders can be cancelled.
    NotRunning(ProcessState),
}

/// What one transaction decided about one order, with what it decided on.
pub(crate) struct Decided {
    /// The order as it was read under its lock.
    pub(crate) snapshot: Snapshot,
    /// What the state machine decided, now written.
    pub(crate) decision: Decision,
    /// The transaction's clock.
    pub(crate) now: chrono::DateTime<chrono::Utc>,
}

impl Store {
    /// Settles the order a dead-lettered step request or reply belonged to
    /// (see [`Event::DeadLettered`]): a message that kept failing its
    /// consumer will fail again, so a forward run is compensated and a
    /// compensation ends in error with an operator alert. A dead letter for
    /// an attempt that is no longer current changes nothing. Returns the
    /// status messages to send, if anything changed.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn settle_dead_letter(
        &self,
        order_id: &str,
        attempt_id: AttemptId,
        reason: &str,
        actor: &str,
    ) -> Result<Option<Progress>, StoreError> {
        let event = Event::DeadLettered { attempt_id, reason };
        let decided = self.decide_and_apply(order_id, &event, actor).await?;
        Ok(decided
            .map(|d| d.decision)
            .filter(|d| d.verdict == Verdict::Applied)
            .map(|d| d.progress))
    }

    /// Puts an order that ended `error` or `compensated` back into the
    /// workflow, once an operator has fixed the cause, and resolves its
    /// alerts (see [`Event::Resubmitted`]).
    ///
    /// # Errors
    /// When the database fails.
    pub async fn resubmit(&self, order_id: &str, actor: &str) -> Result<Resubmit, StoreError> {
        let earlier: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM history WHERE order_id = $1 AND event = 'resubmitted'",
        )
        .bind(order_id)
        .fetch_one(self.pool())
        .await?;
        let event = Event::Resubmitted { earlier };
        Ok(
            match self.decide_and_apply(order_id, &event, actor).await? {
                None => Resubmit::NotFound,
                Some(Decided { decision, .. }) => match decision.verdict {
                    Verdict::Resubmitted(what) => Resubmit::Resubmitted {
                        what,
                        fresh_keys: decision
                            .steps
                            .iter()
                            .map(|change| change.row.name.clone())
                            .collect(),
                    },
                    Verdict::Refused(state) => Resubmit::NotFailed(state),
                    other => {
                        return Err(StoreError::Invariant(format!(
                            "a resubmission was decided as {other:?}"
                        )))
                    }
                },
            },
        )
    }

    /// Cancels a pending or processing order: what was done is undone (see
    /// [`Event::Cancelled`]); the history records `actor` and `reason`.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn cancel(
        &self,
        order_id: &str,
        reason: &str,
        actor: &str,
    ) -> Result<Cancel, StoreError> {
        let event = Event::Cancelled { reason };
        Ok(
            match self.decide_and_apply(order_id, &event, actor).await? {
                None => Cancel::NotFound,
                Some(Decided { decision, .. }) => match decision.verdict {
                    Verdict::Applied => Cancel::Cancelled(decision.progress),
                    Verdict::Refused(state) => Cancel::NotRunning(state),
                    other => {
                        return Err(StoreError::Invariant(format!(
                            "a cancellation was decided as {other:?}"
                        )))
                    }
                },
            },
        )
    }

    /// One order, one event, one transaction: lock and read the order, let
    /// the state machine decide (under admission control), write the
    /// decision. `None` when the order does not exist.
    pub(crate) async fn decide_and_apply(
        &self,
        order_id: &str,
        event: &Event<'_>,
        actor: &str,
    ) -> Result<Option<Decided>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let (snapshot, now) = load_snapshot(&mut tx, order_id).await?;
        let Some(snapshot) = snapshot else {
            tx.commit().await?;
            return Ok(None);
        };
        let ctx = self.context(now, actor);
        let decision = decide_admitted(&mut tx, &snapshot, event, &ctx).await?;
        apply(&mut tx, &snapshot, &decision, actor).await?;
        tx.commit().await?;
        Ok(Some(Decided {
            snapshot,
            decision,
            now,
        }))
    }
}
