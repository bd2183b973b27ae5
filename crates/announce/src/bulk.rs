//! A bulk action on the orders a filter selects (resubmit, resume or
//! cancel each):
//! the other use case the console and `sasctl` both offer, written once.
//!
//! The operator first sees how many orders match (the preview); the action
//! then goes through at most that many, oldest first, each in its own
//! transaction. When more orders match than the operator confirmed, nothing
//! is done: they would be acting on orders they did not see.

use futures_util::StreamExt as _;
use sas_broker::Publisher;
use sas_store::reads::search::OrderFilter;
use sas_store::writes::operator::{Cancel, OrderAction, Resubmit, Resume};
use sas_store::{Store, StoreError};
use serde::Serialize;

use crate::Announcer;

/// Orders changed at once by a bulk action (each in its own transaction).
const CONCURRENCY: usize = 4;

/// A bulk action an operator confirmed.
#[derive(Debug, Clone, Copy)]
pub struct Bulk<'a> {
    /// What to do with each order.
    pub action: OrderAction,
    /// Which orders.
    pub filter: &'a OrderFilter,
    /// How many orders the operator saw in the preview and confirmed.
    pub confirmed: i64,
    /// The most orders one action goes through (the oldest first).
    pub limit: i64,
    /// Why (a cancellation's or resume's reason, recorded in each order's
    /// history).
    pub reason: &'a str,
    /// Who, as recorded in each order's history (`console:<user>`, `sasctl:<user>`).
    pub actor: &'a str,
}

/// What a bulk action did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BulkOutcome {
    /// Orders the action was applied to, sorted.
    pub applied: Vec<String>,
    /// Orders it no longer applied to when their turn came (they moved on
    /// meanwhile, or are gone), with why.
    pub skipped: Vec<(String, String)>,
    /// Cancelled orders whose messages the broker did not take: their
    /// compensation starts when the supervisor finds the deadline passed.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub unannounced: Vec<String>,
}

/// Why a bulk action did nothing.
#[derive(Debug, thiserror::Error)]
pub enum BulkError {
    /// More orders match now than the operator saw and confirmed.
    #[error("{now} orders match now, {confirmed} were previewed and confirmed: nothing done; preview again")]
    Unconfirmed {
        /// Orders matching now.
        now: i64,
        /// Orders the operator confirmed.
        confirmed: i64,
    },
    /// The store failed; orders done before it stay done.
    #[error(transparent)]
    Store(#[from] StoreError),
}

/// How many orders `action` would go through among those `filter` selects:
/// the preview an operator confirms.
///
/// # Errors
/// When the store fails.
pub async fn preview(
    store: &Store,
    action: OrderAction,
    filter: &OrderFilter,
) -> Result<i64, StoreError> {
    store.reads().count_orders(filter, action.eligible()).await
}

/// Applies `bulk` to the orders it selects, once the count still matches
/// what the operator confirmed; a cancelled order's compensation is
/// announced (`publisher`: the connection that is up, if any; without one
/// the supervisor sends it after its deadline).
///
/// # Errors
/// See [`BulkError`].
pub async fn run_bulk(
    store: &Store,
    announcer: &Announcer,
    publisher: Option<&Publisher>,
    bulk: Bulk<'_>,
) -> Result<BulkOutcome, BulkError> {
    let now = preview(store, bulk.action, bulk.filter).await?;
    if now > bulk.confirmed {
        return Err(BulkError::Unconfirmed {
            now,
            confirmed: bulk.confirmed,
        });
    }
    let ids = store
        .reads()
        .select_order_ids(
            bulk.filter,
            bulk.action.eligible(),
            bulk.confirmed.min(bulk.limit),
        )
        .await?;
    let results: Vec<(String, Result<Applied, StoreError>)> = futures_util::stream::iter(ids)
        .map(|order_id| async move {
            let result = apply(store, announcer, publisher, &bulk, &order_id).await;
            (order_id, result)
        })
        .buffer_unordered(CONCURRENCY)
        .collect()
        .await;
    let mut outcome = BulkOutcome::default();
    for (order_id, result) in results {
        match result? {
            Applied::Done => outcome.applied.push(order_id),
            Applied::Unannounced => {
                outcome.unannounced.push(order_id.clone());
                outcome.applied.push(order_id);
            }
            Applied::Skipped(why) => outcome.skipped.push((order_id, why)),
        }
    }
    outcome.applied.sort();
    outcome.skipped.sort();
    outcome.unannounced.sort();
    Ok(outcome)
}

/// What the action did to one order.
enum Applied {
    /// Done (and announced, for a cancellation).
    Done,
    /// Cancelled, but its messages were not sent.
    Unannounced,
    /// It no longer applies, with why.
    Skipped(String),
}

/// The action on one order.
async fn apply(
    store: &Store,
    announcer: &Announcer,
    publisher: Option<&Publisher>,
    bulk: &Bulk<'_>,
    order_id: &str,
) -> Result<Applied, StoreError> {
    let writes = store.writes();
    Ok(match bulk.action {
        OrderAction::Resubmit => match writes.resubmit(order_id, bulk.actor).await? {
            Resubmit::Resubmitted { .. } => Applied::Done,
            Resubmit::NotFound => Applied::Skipped("gone".to_owned()),
            Resubmit::NotFailed(state) => Applied::Skipped(format!("now {state}")),
            Resubmit::NotResubmittable(why) => Applied::Skipped(why),
        },
        OrderAction::Resume => match writes.resume(order_id, bulk.reason, bulk.actor).await? {
            Resume::Resumed { .. } => Applied::Done,
            Resume::NotFound => Applied::Skipped("gone".to_owned()),
            Resume::NotStopped(state) => Applied::Skipped(format!("now {state}")),
            Resume::NotResumable(why) => Applied::Skipped(why),
        },
        OrderAction::Cancel => match writes.cancel(order_id, bulk.reason, bulk.actor).await? {
            Cancel::Cancelled(progress) => match announcer.announce(publisher, &progress).await {
                Ok(()) => Applied::Done,
                Err(error) => {
                    tracing::warn!(order_id, error = %error, "a cancelled order's messages were not sent: the supervisor sends its compensation after the deadline");
                    Applied::Unannounced
                }
            },
            Cancel::NotFound => Applied::Skipped("gone".to_owned()),
            Cancel::NotRunning(state) => Applied::Skipped(format!("now {state}")),
        },
    })
}
