//! Transitions that come from outside the workflow: a message the broker
//! dead-lettered, and an operator resubmitting, resuming or cancelling an
//! order.

use sas_messages::AttemptId;
use serde::Serialize;

use sqlx::PgConnection;

use super::apply::{run_again_if_rolled_back, transition, Decided, Slots};
use super::Writes;
use crate::machine::{Event, ResubmitAction, Verdict};
use crate::model::{ProcessState, Progress};
use crate::StoreError;

/// An operator's action on orders one by one, as the console and `sasctl`
/// both offer it (on one order, or in bulk by filter).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OrderAction {
    /// Put an order that ended `error` or `compensated` back into the
    /// workflow ([`Writes::resubmit`]).
    Resubmit,
    /// Start an order stopped in `error` again from its failed step
    /// ([`Writes::resume`]).
    Resume,
    /// Undo what a pending or processing order did, by compensating now
    /// ([`Writes::cancel`]).
    Cancel,
}

impl OrderAction {
    /// Its name in URLs and on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Resubmit => "resubmit",
            Self::Resume => "resume",
            Self::Cancel => "cancel",
        }
    }

    /// The states of the orders it applies to: a bulk action selects only
    /// those, and the state machine refuses it on any other.
    pub fn eligible(self) -> &'static [ProcessState] {
        match self {
            Self::Resubmit => &[ProcessState::Error, ProcessState::Compensated],
            Self::Resume => &[ProcessState::Error],
            Self::Cancel => &[ProcessState::Pending, ProcessState::Processing],
        }
    }
}

/// A name that is no [`OrderAction`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown action {0:?}: expected resubmit, resume or cancel")]
pub struct UnknownAction(pub String);

impl std::str::FromStr for OrderAction {
    type Err = UnknownAction;

    fn from_str(text: &str) -> Result<Self, UnknownAction> {
        match text {
            "resubmit" => Ok(Self::Resubmit),
            "resume" => Ok(Self::Resume),
            "cancel" => Ok(Self::Cancel),
            other => Err(UnknownAction(other.to_owned())),
        }
    }
}

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
    /// A child order its parent no longer waits for: why, and what to do
    /// instead (see [`crate::machine::child`]).
    NotResubmittable(String),
}

/// What became of an operator's resume (see [`Writes::resume`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resume {
    /// Back in the workflow from step `from`; a scheduler will claim it.
    Resumed {
        /// The step it starts again from.
        from: String,
        /// The step's action keeps its idempotency key (an earlier
        /// attempt's outcome is unknown); otherwise it has a fresh one.
        key_kept: bool,
    },
    /// No such order.
    NotFound,
    /// Only orders stopped in `error` can be resumed.
    NotStopped(ProcessState),
    /// The order's steps do not allow it: why, and what to do instead.
    NotResumable(String),
}

/// What became of an operator's cancellation.
#[derive(Debug, Clone, PartialEq)]
pub enum Cancel {
    /// The order is compensating; publish the status messages.
    Cancelled(Progress),
    /// No such order.
    NotFound,
    /// Only pending or processing orders, or orders stopped in error before
    /// any undo began, can be cancelled.
    NotRunning(ProcessState),
}

impl Writes<'_> {
    /// Settles the order a dead-lettered step request or reply belonged to
    /// (see [`Event::DeadLettered`]): a message that kept failing its
    /// consumer will fail again, so a forward run is compensated and a
    /// compensation ends in error with an operator alert. `no_call` says
    /// the message is a request its agent dead-lettered unread (no call was
    /// made for it). A dead letter for an attempt that is no longer current
    /// changes nothing. Returns the status messages to send, if anything
    /// changed.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn settle_dead_letter(
        self,
        order_id: &str,
        attempt_id: AttemptId,
        reason: &str,
        no_call: bool,
        actor: &str,
    ) -> Result<Option<Progress>, StoreError> {
        let event = Event::DeadLettered {
            attempt_id,
            reason,
            no_call,
        };
        let decided = self.transition_one(order_id, &event, actor).await?;
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
    pub async fn resubmit(self, order_id: &str, actor: &str) -> Result<Resubmit, StoreError> {
        let decided = self
            .put_back(order_id, actor, |earlier| Event::Resubmitted { earlier })
            .await?;
        Ok(match decided {
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
                Verdict::NotPutBack(why) => Resubmit::NotResubmittable(why),
                other => {
                    return Err(StoreError::Invariant(format!(
                        "a resubmission was decided as {other:?}"
                    )))
                }
            },
        })
    }

    /// Puts `order_id` back into its workflow (the event `event` makes of
    /// how many times an operator did before) in one transaction, run
    /// again if Postgres rolled it back as a deadlock; `None`: no such
    /// order. The count is read under the order's lock, and so is the
    /// snapshot the machine decides on, whose parent link says whether a
    /// child's parent still waits for it
    /// ([`crate::machine::child::put_back_refusal`]): every transaction
    /// that ends a child holds the child's lock.
    ///
    /// # Errors
    /// When the database fails.
    async fn put_back<'e>(
        self,
        order_id: &str,
        actor: &str,
        event: impl Fn(i64) -> Event<'e>,
    ) -> Result<Option<Decided>, StoreError> {
        run_again_if_rolled_back(order_id, || async {
            let mut tx = self.pool().begin().await?;
            sqlx::query("SELECT 1 FROM order_process WHERE order_id = $1 FOR UPDATE")
                .bind(order_id)
                .execute(&mut *tx)
                .await?;
            let earlier = put_back_before(&mut tx, order_id).await?;
            let event = event(earlier);
            let decided = transition(
                &mut tx,
                self.store,
                &[order_id],
                actor,
                Slots::Check,
                |_| event,
            )
            .await?;
            tx.commit().await?;
            Ok(decided.into_iter().next())
        })
        .await
    }

    /// Resumes an order stopped in `error` from the step that failed, once
    /// an operator fixed the cause, and resolves its alerts (see
    /// [`Event::Resumed`]); the history records `actor` and `reason`.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn resume(
        self,
        order_id: &str,
        reason: &str,
        actor: &str,
    ) -> Result<Resume, StoreError> {
        let decided = self
            .put_back(order_id, actor, |earlier| Event::Resumed {
                reason,
                earlier,
            })
            .await?;
        Ok(match decided {
            None => Resume::NotFound,
            Some(Decided { decision, .. }) => match decision.verdict {
                Verdict::Resumed { from, key_kept } => Resume::Resumed { from, key_kept },
                Verdict::Refused(state) => Resume::NotStopped(state),
                Verdict::NotResumable(why) | Verdict::NotPutBack(why) => Resume::NotResumable(why),
                other => {
                    return Err(StoreError::Invariant(format!(
                        "a resume was decided as {other:?}"
                    )))
                }
            },
        })
    }

    /// Cancels a pending or processing order: what was done is undone (see
    /// [`Event::Cancelled`]); the history records `actor` and `reason`.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn cancel(
        self,
        order_id: &str,
        reason: &str,
        actor: &str,
    ) -> Result<Cancel, StoreError> {
        let event = Event::Cancelled { reason };
        Ok(match self.transition_one(order_id, &event, actor).await? {
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
        })
    }
}

/// How many times an operator put the order back before (resubmitted or
/// resumed): a fresh key of the next generation is one never sent. Read
/// under the order's lock, so two operators never count the same.
async fn put_back_before(conn: &mut PgConnection, order_id: &str) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT count(*) FROM history WHERE order_id = $1 AND event IN ('resubmitted', 'resumed')",
    )
    .bind(order_id)
    .fetch_one(&mut *conn)
    .await?)
}
