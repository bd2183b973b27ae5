//! What operators do, for the pages and the JSON API alike: resubmit and
//! cancel orders (one, or every order a filter selects), acknowledge and
//! resolve alerts, replay and discard dead letters. Orders change only
//! through the state store's transitions, the ones `sasctl` uses, and every
//! action is recorded in the order's history as `console:<user>`.

pub use sas_announce::bulk::BulkOutcome;
use sas_announce::bulk::{run_bulk, Bulk, BulkError};
use sas_announce::replay::{replay_dead_letter, ReplayError};
use sas_store::reads::dead_letters::NotReplayable;
use sas_store::reads::search::OrderFilter;
use sas_store::writes::dead_letters::Disposition;
use sas_store::writes::operator::{Cancel, Resubmit};
use sas_store::Progress;
use serde::Serialize;

use crate::auth::Principal;
use crate::error::Failure;
use crate::Console;

pub use sas_store::writes::operator::OrderAction;

impl From<sas_store::writes::operator::UnknownAction> for Failure {
    fn from(error: sas_store::writes::operator::UnknownAction) -> Self {
        Failure::bad_request(error.to_string())
    }
}

/// What a bulk action would do.
#[derive(Debug, Clone, Serialize)]
pub struct Preview {
    /// The action.
    pub action: OrderAction,
    /// Orders the filter selects among those the action applies to.
    pub count: i64,
    /// Most orders one bulk action goes through (the oldest first).
    pub limit: i64,
}

/// The outcome of one action, said for the operator.
#[derive(Debug, Clone, Serialize)]
pub struct Done {
    /// What happened.
    pub message: String,
}

impl Console {
    /// Sends what a committed transition asks for; a failure is logged, as
    /// the transition stands either way (status messages are notifications,
    /// and a request never sent is retried after its deadline).
    async fn announce(&self, progress: &Progress) {
        let publisher = self.session.publisher().get().ok();
        if let Err(error) = self.announcer.announce(publisher.as_ref(), progress).await {
            tracing::warn!(error = %error, "the status messages of an operator's action were not sent");
        }
    }

    /// Resubmits one order.
    ///
    /// # Errors
    /// 404 for no such order, 409 when it has not failed, 503 when the store fails.
    pub async fn resubmit(&self, order_id: &str, who: &Principal) -> Result<Done, Failure> {
        let outcome = self.store.writes().resubmit(order_id, &who.actor()).await?;
        metrics::counter!("sas_console_actions_total", "action" => "resubmit").increment(1);
        match outcome {
            Resubmit::Resubmitted { what, fresh_keys } => {
                tracing::info!(order_id, user = %who.name, %what, "order resubmitted");
                let keys = if fresh_keys.is_empty() {
                    String::new()
                } else {
                    format!("; fresh keys for {}", fresh_keys.join(", "))
                };
                Ok(Done {
                    message: format!("order {order_id} resubmitted: {what}{keys}"),
                })
            }
            Resubmit::NotFound => Err(Failure::not_found(format!("order {order_id}"))),
            Resubmit::NotFailed(state) => Err(Failure::conflict(format!(
                "order {order_id} is {state}: only orders that ended error or compensated can be resubmitted"
            ))),
        }
    }

    /// Cancels one order: what it did is undone, by compensating now.
    ///
    /// # Errors
    /// 404 for no such order, 409 when it is not running, 503 when the store fails.
    pub async fn cancel(
        &self,
        order_id: &str,
        reason: &str,
        who: &Principal,
    ) -> Result<Done, Failure> {
        let reason = if reason.trim().is_empty() {
            format!("cancelled by {} in the console", who.name)
        } else {
            reason.trim().chars().take(500).collect()
        };
        let outcome = self
            .store
            .writes()
            .cancel(order_id, &reason, &who.actor())
            .await?;
        metrics::counter!("sas_console_actions_total", "action" => "cancel").increment(1);
        match outcome {
            Cancel::Cancelled(progress) => {
                tracing::info!(order_id, user = %who.name, "order cancelled");
                self.announce(&progress).await;
                Ok(Done {
                    message: format!("order {order_id} cancelled: what it did is being undone"),
                })
            }
            Cancel::NotFound => Err(Failure::not_found(format!("order {order_id}"))),
            Cancel::NotRunning(state) => Err(Failure::conflict(format!(
                "order {order_id} is {state}: only pending or processing orders can be cancelled"
            ))),
        }
    }

    /// How many orders a bulk action would go through.
    ///
    /// # Errors
    /// 503 when the store fails.
    pub async fn preview(
        &self,
        action: OrderAction,
        filter: &OrderFilter,
    ) -> Result<Preview, Failure> {
        Ok(Preview {
            action,
            count: sas_announce::bulk::preview(&self.store, action, filter).await?,
            limit: self.settings.console.bulk_limit,
        })
    }

    /// Applies `action` to every order `filter` selects among those it
    /// applies to (at most `console.bulk_limit`, oldest first), once the
    /// operator confirmed the previewed count (see [`sas_announce::bulk`]).
    ///
    /// # Errors
    /// 409 when more orders match than were confirmed, 503 when the store fails.
    pub async fn bulk(
        &self,
        action: OrderAction,
        filter: &OrderFilter,
        confirmed: i64,
        who: &Principal,
    ) -> Result<BulkOutcome, Failure> {
        let query = filter
            .to_pairs()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("&");
        let reason = format!("bulk cancel by {} (filter: {query})", who.name);
        let publisher = self.session.publisher().get().ok();
        let bulk = Bulk {
            action,
            filter,
            confirmed,
            limit: self.settings.console.bulk_limit,
            reason: &reason,
            actor: &who.actor(),
        };
        let outcome = match run_bulk(&self.store, &self.announcer, publisher.as_ref(), bulk).await {
            Ok(outcome) => outcome,
            Err(refused @ BulkError::Unconfirmed { .. }) => {
                return Err(Failure::conflict(refused.to_string()))
            }
            Err(BulkError::Store(error)) => return Err(error.into()),
        };
        let done = outcome.applied.len() + outcome.skipped.len();
        metrics::counter!("sas_console_actions_total", "action" => action.as_str())
            .increment(done as u64);
        tracing::info!(user = %who.name, action = action.as_str(), applied = outcome.applied.len(), skipped = outcome.skipped.len(), filter = %query, "bulk action");
        Ok(outcome)
    }

    /// Acknowledges an alert.
    ///
    /// # Errors
    /// 404, 409 when it is resolved, 503.
    pub async fn acknowledge_alert(&self, id: i64, who: &Principal) -> Result<Done, Failure> {
        use sas_store::writes::alerts::AlertAction;
        match self
            .store
            .writes()
            .acknowledge_alert(id, &who.actor())
            .await?
        {
            AlertAction::Done => Ok(Done {
                message: format!("alert #{id} acknowledged by {}", who.name),
            }),
            AlertAction::NotFound => Err(Failure::not_found(format!("alert #{id}"))),
            AlertAction::AlreadyResolved => Err(Failure::conflict(format!(
                "alert #{id} is already resolved"
            ))),
        }
    }

    /// Resolves an alert with a note (required: what was found or done).
    ///
    /// # Errors
    /// 400 without a note, 404, 409 when it is resolved, 503.
    pub async fn resolve_alert(
        &self,
        id: i64,
        note: &str,
        who: &Principal,
    ) -> Result<Done, Failure> {
        use sas_store::writes::alerts::AlertAction;
        let note = note.trim();
        if note.is_empty() || note.chars().count() > 2000 {
            return Err(Failure::bad_request(
                "a resolution needs a note of 1 to 2000 characters: what was found or done",
            ));
        }
        match self
            .store
            .writes()
            .resolve_alert(id, note, &who.actor())
            .await?
        {
            AlertAction::Done => Ok(Done {
                message: format!("alert #{id} resolved by {}", who.name),
            }),
            AlertAction::NotFound => Err(Failure::not_found(format!("alert #{id}"))),
            AlertAction::AlreadyResolved => Err(Failure::conflict(format!(
                "alert #{id} is already resolved"
            ))),
        }
    }

    /// Replays a dead letter (see [`sas_announce::replay::replay_dead_letter`]).
    ///
    /// # Errors
    /// 404; 409 when it was already dealt with, its source queue is not
    /// known to be one of this deployment's, or only part of it was
    /// recorded; 503 when the broker or the store fails.
    pub async fn replay_dead_letter(&self, id: i64, who: &Principal) -> Result<Done, Failure> {
        let publisher = self.session.publisher().get().map_err(|_| {
            Failure::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "not connected to RabbitMQ: nothing was replayed; try again once /readyz answers 200",
            )
        })?;
        let replayed =
            replay_dead_letter(&self.store, &self.names, &publisher, id, &who.actor()).await;
        let source = match replayed {
            Ok(source) => source,
            Err(ReplayError::Refused(NotReplayable::NotFound(_))) => {
                return Err(Failure::not_found(format!("dead letter #{id}")))
            }
            Err(ReplayError::Refused(refusal)) => {
                return Err(Failure::conflict(refusal.to_string()))
            }
            Err(error @ ReplayError::NotTaken { .. }) => {
                return Err(Failure::new(
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    error.to_string(),
                ))
            }
            Err(ReplayError::Store(error)) => return Err(error.into()),
        };
        metrics::counter!("sas_console_actions_total", "action" => "replay").increment(1);
        tracing::info!(dead_letter = id, queue = %source, user = %who.name, "dead letter replayed");
        Ok(Done {
            message: format!("dead letter #{id} replayed to {source}"),
        })
    }

    /// Marks a dead letter discarded.
    ///
    /// # Errors
    /// 404, 409 when it was already dealt with, 503.
    pub async fn discard_dead_letter(&self, id: i64, who: &Principal) -> Result<Done, Failure> {
        let letter = self
            .store
            .reads()
            .dead_letter(id)
            .await?
            .ok_or_else(|| Failure::not_found(format!("dead letter #{id}")))?;
        if !self
            .store
            .writes()
            .dispose_dead_letter(id, Disposition::Discarded, &who.actor())
            .await?
        {
            return Err(Failure::conflict(format!(
                "dead letter #{id} was already {}",
                letter.disposition.as_deref().unwrap_or("dealt with")
            )));
        }
        metrics::counter!("sas_console_actions_total", "action" => "discard").increment(1);
        Ok(Done {
            message: format!("dead letter #{id} discarded"),
        })
    }
}
