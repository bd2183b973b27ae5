//! Read models: what operators and clients are shown of one order, of
//! alerts and dead letters, and what metrics count.

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::AssertSqlSafe;
use uuid::Uuid;

use super::Reads;
use crate::machine::wait::EventAdmission;
use crate::machine::{AlertKind, HistoryEvent, StepRow};
use crate::model::ProcessState;
use crate::step_columns::{step_select, BESIDE_ORDER};
use crate::StoreError;

/// An order's process record, as its detail shows it.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct OrderSummary {
    /// The client's order id.
    pub order_id: String,
    /// ProcessState.
    pub state: ProcessState,
    /// The workflow the order follows.
    pub workflow: String,
    /// The version of that workflow it started with (its plan).
    pub workflow_version: i32,
    /// Scheduler holding it, if any.
    pub locked_by: Option<String>,
    /// Deadline of the step in flight.
    pub complete_by: Option<DateTime<Utc>>,
    /// Failures so far (reset when compensation starts).
    pub failure_count: i32,
    /// Earliest time a scheduler may claim it.
    pub not_before: DateTime<Utc>,
    /// Why it failed, if it did.
    pub last_error: Option<String>,
    /// Submission time.
    pub created_at: DateTime<Utc>,
    /// Last change.
    pub updated_at: DateTime<Utc>,
}

/// One history row.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct HistoryEntry {
    /// When (database clock).
    pub at: DateTime<Utc>,
    /// Which service instance decided.
    pub actor: String,
    /// What happened.
    #[sqlx(try_from = "String")]
    pub event: HistoryEvent,
    /// Step concerned.
    pub step: Option<String>,
    /// Attempt concerned.
    pub attempt_id: Option<Uuid>,
    /// Reason or detail.
    pub detail: Option<String>,
}

/// Where the status messages of an order go, besides `sas.status`.
#[derive(Debug, Clone, Default, sqlx::FromRow, serde::Serialize)]
pub struct Delivery {
    /// The client's status queue, if it named one.
    pub reply_to: Option<String>,
    /// The client's correlation id on those messages.
    pub reply_correlation_id: Option<String>,
    /// Priority, 0 to 9.
    pub priority: i16,
    /// The agent whose line the order waits in, if it waits.
    pub waiting_for: Option<String>,
    /// The key whose line the order waits in (its step's limit by key),
    /// if it waits there.
    pub waiting_key: Option<String>,
}

/// Everything known about one order.
#[derive(Debug, Clone, Serialize)]
pub struct OrderDetail {
    /// Process record.
    pub summary: OrderSummary,
    /// The order as submitted.
    pub body: serde_json::Value,
    /// Its steps.
    pub steps: Vec<StepRow>,
    /// Its history, oldest first.
    pub history: Vec<HistoryEntry>,
    /// The order whose child step started it, if one did.
    pub parent: Option<ChildLink>,
    /// The orders its child steps started, oldest first.
    pub children: Vec<ChildLink>,
}

/// One end of a parent's link to a child order (see
/// [`crate::machine::child`]): the other order and the parent's step.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct ChildLink {
    /// The parent's id (in [`OrderDetail::parent`]) or the child's (in
    /// [`OrderDetail::children`]).
    pub order_id: String,
    /// The parent's step that started the child.
    pub step: String,
}

impl ChildLink {
    /// The child step `step` started last, of a parent's `children` (oldest
    /// first, as [`Reads::children_of`] reads them): a parent put back
    /// starts a new child at the same step.
    pub fn latest<'c>(children: &'c [ChildLink], step: &str) -> Option<&'c ChildLink> {
        children.iter().rev().find(|child| child.step == step)
    }
}

/// An operator alert.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct Alert {
    /// Alert id.
    pub id: i64,
    /// Order concerned, if any.
    pub order_id: Option<String>,
    /// When it was raised.
    pub raised_at: DateTime<Utc>,
    /// Why it was raised.
    #[sqlx(try_from = "String")]
    pub kind: AlertKind,
    /// What happened and what to do.
    pub message: String,
    /// When an operator resolved it.
    pub resolved_at: Option<DateTime<Utc>>,
    /// When an operator acknowledged it (someone is on it).
    pub acknowledged_at: Option<DateTime<Utc>>,
    /// Who acknowledged it.
    pub acknowledged_by: Option<String>,
    /// Who resolved it (a resubmission resolves its order's alerts).
    pub resolved_by: Option<String>,
    /// What the operator who resolved it found or did.
    pub resolution_note: Option<String>,
}

/// A recorded dead letter.
#[derive(Debug, Clone, Serialize, sqlx::FromRow)]
pub struct DeadLetter {
    /// Row id.
    pub id: i64,
    /// When it was recorded.
    pub at: DateTime<Utc>,
    /// Queue it came from.
    pub source_queue: Option<String>,
    /// Why it was rejected.
    pub reason: String,
    /// Order it belongs to, if known.
    pub order_id: Option<String>,
    /// Body, as text.
    pub body: String,
    /// What an operator did with it: `replayed` or `discarded`.
    pub disposition: Option<String>,
    /// When.
    pub disposed_at: Option<DateTime<Utc>>,
    /// Who.
    pub disposed_by: Option<String>,
}

const SUMMARY_COLUMNS: &str = "order_id, state, workflow, workflow_version, locked_by, complete_by, failure_count, not_before, last_error, created_at, updated_at";

impl Reads<'_> {
    /// Everything about one order, or `None` if no such order exists.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn order_detail(self, order_id: &str) -> Result<Option<OrderDetail>, StoreError> {
        let Some((summary, steps)) = self.order_status(order_id).await? else {
            return Ok(None);
        };
        let body = self.order_body(order_id).await?.unwrap_or_default();
        let history = self.history(order_id).await?;
        let parent = self.parent_of(order_id).await?;
        let children = self.children_of(order_id).await?;
        Ok(Some(OrderDetail {
            summary,
            body,
            steps,
            history,
            parent,
            children,
        }))
    }

    /// The order whose child step started `order_id`, and the step, if one
    /// did (see [`crate::machine::child`]).
    ///
    /// # Errors
    /// When the database fails.
    pub async fn parent_of(self, order_id: &str) -> Result<Option<ChildLink>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT parent_order_id AS order_id, step FROM order_children WHERE child_order_id = $1",
        )
        .bind(order_id)
        .fetch_optional(self.pool())
        .await?)
    }

    /// The orders the child steps of `order_id` started, oldest first: the
    /// stored links, so a start that was refused (no child stored) or a
    /// client's own order with a child's id is never named a child.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn children_of(self, order_id: &str) -> Result<Vec<ChildLink>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT child_order_id AS order_id, step FROM order_children
              WHERE parent_order_id = $1 ORDER BY created_at, child_order_id",
        )
        .bind(order_id)
        .fetch_all(self.pool())
        .await?)
    }

    /// An order's process record and steps (what a client's status shows),
    /// without its body or history; `None` if no such order exists.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn order_status(
        self,
        order_id: &str,
    ) -> Result<Option<(OrderSummary, Vec<StepRow>)>, StoreError> {
        let mut conn = self.pool().acquire().await?;
        status_of(&mut conn, order_id).await
    }

    /// What event `event` with id `event_id`, from a sender known by
    /// `principals`, would become
    /// in order `order_id` (its stored id) as it stands: what every front
    /// end checks before it sends one (see [`crate::machine::wait`]).
    ///
    /// Read in one snapshot: a webhook retried while the scheduler uses its
    /// first delivery sees either the wait still ahead or the event kept,
    /// never the wait passed without the event (which would refuse the
    /// retry with 409 as if it were another event).
    ///
    /// # Errors
    /// When the database fails.
    pub async fn event_admission(
        self,
        order_id: &str,
        event: &str,
        event_id: &str,
        principals: &[String],
    ) -> Result<EventAdmission, StoreError> {
        let mut tx = self.pool().begin().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *tx)
            .await?;
        let seen: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM order_events WHERE order_id = $1 AND event_id = $2)",
        )
        .bind(order_id)
        .bind(event_id)
        .fetch_one(&mut *tx)
        .await?;
        let status = if seen {
            None
        } else {
            status_of(&mut tx, order_id).await?
        };
        tx.commit().await?;
        if seen {
            return Ok(EventAdmission::Duplicate);
        }
        let Some((summary, steps)) = status else {
            return Ok(EventAdmission::NoOrderYet);
        };
        Ok(crate::machine::wait::admission(
            summary.state,
            &steps,
            event,
            principals,
            sas_messages::ids::tenant_of(order_id),
        ))
    }

    /// Where an order's status messages go, besides `sas.status`, and the
    /// line it waits in; `None` if no such order exists.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn order_delivery(self, order_id: &str) -> Result<Option<Delivery>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT reply_to, reply_correlation_id, priority, waiting_for, waiting_key
               FROM order_process WHERE order_id = $1",
        )
        .bind(order_id)
        .fetch_optional(self.pool())
        .await?)
    }

    /// The order as submitted, if the store holds it (one read: the HTTP
    /// gateway compares a submission with it).
    ///
    /// # Errors
    /// When the database fails.
    pub async fn order_body(self, order_id: &str) -> Result<Option<serde_json::Value>, StoreError> {
        Ok(
            sqlx::query_scalar("SELECT body FROM orders WHERE order_id = $1")
                .bind(order_id)
                .fetch_optional(self.pool())
                .await?,
        )
    }

    /// An order's history, oldest first.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn history(self, order_id: &str) -> Result<Vec<HistoryEntry>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT at, actor, event, step, attempt_id, detail
               FROM history WHERE order_id = $1 ORDER BY id",
        )
        .bind(order_id)
        .fetch_all(self.pool())
        .await?)
    }

    /// Which of `order_ids` the database does not hold, in their order:
    /// orders acknowledged to their clients that a failover lost.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn missing_orders(self, order_ids: &[&str]) -> Result<Vec<String>, StoreError> {
        Ok(sqlx::query_scalar(
            "SELECT ids.order_id FROM UNNEST($1::text[]) WITH ORDINALITY AS ids(order_id, n)
              WHERE NOT EXISTS (SELECT 1 FROM orders o WHERE o.order_id = ids.order_id)
              ORDER BY ids.n",
        )
        .bind(order_ids)
        .fetch_all(self.pool())
        .await?)
    }

    /// Operator alerts, newest first; resolved ones only when asked.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn alerts(
        self,
        include_resolved: bool,
        limit: i64,
    ) -> Result<Vec<Alert>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT id, order_id, raised_at, kind, message, resolved_at, acknowledged_at,
                    acknowledged_by, resolved_by, resolution_note FROM alerts
              WHERE $1 OR resolved_at IS NULL ORDER BY id DESC LIMIT $2",
        )
        .bind(include_resolved)
        .bind(limit)
        .fetch_all(self.pool())
        .await?)
    }

    /// Recorded dead letters, newest first.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn dead_letters(self, limit: i64) -> Result<Vec<DeadLetter>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT id, at, source_queue, reason, order_id, body, disposition, disposed_at,
                    disposed_by FROM dead_letters
              ORDER BY id DESC LIMIT $1",
        )
        .bind(limit)
        .fetch_all(self.pool())
        .await?)
    }

    /// How many orders are in each open state (not processed or compensated;
    /// states with none are omitted). It reads a partial index of open
    /// orders only, so it costs the same however many orders have finished:
    /// cheap enough for gauges refreshed every few seconds.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn count_open_by_state(self) -> Result<Vec<(ProcessState, i64)>, StoreError> {
        Ok(sqlx::query_as(
            "SELECT state, count(*) FROM order_process
              WHERE state NOT IN ('processed', 'compensated') GROUP BY state",
        )
        .fetch_all(self.pool())
        .await?)
    }

    /// What operators are alerted on: held orders (processing or
    /// compensating) whose complete-by passed more than `overdue_after` ago,
    /// and operator alerts not yet resolved. The first reads the partial
    /// index the supervisor's scan reads (`order_process_deadline`), the
    /// second the alerts table, which stays small.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn count_overdue_and_open_alerts(
        self,
        overdue_after: std::time::Duration,
    ) -> Result<(i64, i64), StoreError> {
        Ok(sqlx::query_as(
            "SELECT (SELECT count(*) FROM order_process
                      WHERE state IN ('processing', 'compensating')
                        AND complete_by < now() - make_interval(secs => $1::float8 / 1000)),
                    (SELECT count(*) FROM alerts WHERE resolved_at IS NULL)",
        )
        .bind(overdue_after.as_millis() as f64)
        .fetch_one(self.pool())
        .await?)
    }

    /// How many orders are in each state (states with none are omitted). It
    /// reads every order: for tests and one-off checks, not for gauges.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn count_by_state(self) -> Result<Vec<(ProcessState, i64)>, StoreError> {
        Ok(
            sqlx::query_as("SELECT state, count(*) FROM order_process GROUP BY state")
                .fetch_all(self.pool())
                .await?,
        )
    }
}

/// An order's process record and steps, read on `conn` (in its snapshot,
/// when it is a transaction's); `None` if no such order exists.
async fn status_of(
    conn: &mut sqlx::PgConnection,
    order_id: &str,
) -> Result<Option<(OrderSummary, Vec<StepRow>)>, StoreError> {
    let summary: Option<OrderSummary> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT {SUMMARY_COLUMNS} FROM order_process WHERE order_id = $1"
    )))
    .bind(order_id)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(summary) = summary else {
        return Ok(None);
    };
    let steps = sqlx::query(concat!(
        "SELECT ",
        step_select!(),
        " FROM steps s WHERE s.order_id = $1 ORDER BY s.position"
    ))
    .bind(order_id)
    .fetch_all(&mut *conn)
    .await?
    .iter()
    .map(|row| BESIDE_ORDER.read(row))
    .collect::<Result<_, _>>()?;
    Ok(Some((summary, steps)))
}
