//! Moving waiting orders to another version of their workflow, as an
//! operator asks: the plans every scheduler registers, and the move itself,
//! decided for each order by the state machine ([`Event::Moved`]) and
//! recorded in its history.

use std::collections::BTreeMap;

use sqlx::types::Json;

use super::apply::load_snapshots;
use super::Writes;
use crate::machine::moves::Moved;
use crate::machine::{decide, Event, HistoryEvent, Verdict};
use crate::model::{NewStep, Plan};
use crate::StoreError;

/// A move an operator asks for.
#[derive(Debug, Clone)]
pub struct MoveRequest<'a> {
    /// The workflow.
    pub workflow: &'a str,
    /// The version the orders have.
    pub from: i32,
    /// The version they move to (registered by a scheduler that runs it).
    pub to: i32,
    /// Old step names to new ones; a step absent keeps its name.
    pub mapping: &'a BTreeMap<String, String>,
    /// At most this many orders, by order id.
    pub limit: i64,
    /// False: only say what would happen (nothing changes).
    pub apply: bool,
    /// When applying: the most orders the operator confirmed; a move that
    /// would take more changes nothing.
    pub confirmed: Option<usize>,
}

/// What a move did, or would do.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MoveReport {
    /// Orders moved (or movable), each with what changed.
    pub moved: Vec<(String, String)>,
    /// Orders left as they are, each with why the move is unsafe for it.
    pub refused: Vec<(String, String)>,
    /// Orders of that version that do not wait now (running, or ended),
    /// which no move touches.
    pub not_waiting: i64,
}

/// Why a move could not be made at all.
#[derive(Debug, thiserror::Error)]
pub enum MoveError {
    /// No scheduler registered the target version.
    #[error("version {version} of workflow {workflow:?} is unknown: a scheduler registers the versions of its workflows when it starts; start one with the new file first")]
    UnknownPlan {
        /// The workflow.
        workflow: String,
        /// The version asked for.
        version: i32,
    },
    /// More orders would move now than the operator confirmed.
    #[error("{found} orders would move now, more than the {confirmed} confirmed: look again")]
    MoreThanConfirmed {
        /// How many would move.
        found: usize,
        /// How many were confirmed.
        confirmed: usize,
    },
    /// The store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}

impl From<sqlx::Error> for MoveError {
    fn from(error: sqlx::Error) -> Self {
        Self::Store(error.into())
    }
}

impl Writes<'_> {
    /// Registers `plans` (name, version, steps), so that a move can read
    /// them; a version registered before keeps its first steps (a changed
    /// file under the same version is logged, not taken).
    ///
    /// # Errors
    /// When the database fails.
    pub async fn register_plans(self, plans: &[Plan<'_>]) -> Result<(), StoreError> {
        for plan in plans {
            let steps = serde_json::to_value(plan.steps)
                .map_err(|e| StoreError::Invariant(format!("a plan as JSON: {e}")))?;
            let stored: serde_json::Value = sqlx::query_scalar(
                "INSERT INTO workflow_plans (name, version, steps, attributes_schema)
                 VALUES ($1, $2, $3, $4)
                 ON CONFLICT (name, version) DO UPDATE SET attributes_schema = EXCLUDED.attributes_schema
                 RETURNING steps",
            )
            .bind(plan.name)
            .bind(plan.version)
            .bind(&steps)
            .bind(plan.attributes_schema)
            .fetch_one(self.pool())
            .await?;
            if stored != steps {
                tracing::warn!(workflow = plan.name, version = plan.version, "this version of the workflow was registered before with other steps; moves use the first: give a changed workflow a new version");
            }
        }
        Ok(())
    }

    /// Moves the orders of `request.workflow` at version `request.from`
    /// that wait (in a line, in backoff or at a wait step) to version
    /// `request.to`, each as the state machine decides ([`Event::Moved`]),
    /// in one transaction: its
    /// steps replaced, taken out of any agent's line (a claim puts it back
    /// in the right one), and a `moved` line in its history by `actor`.
    /// An order the move is unsafe for is left as it is, with the reason.
    ///
    /// # Errors
    /// An unknown target version, or a database failure (nothing moved).
    pub async fn move_orders(
        self,
        request: &MoveRequest<'_>,
        actor: &str,
    ) -> Result<MoveReport, MoveError> {
        let steps: Option<Json<Vec<NewStep>>> =
            sqlx::query_scalar("SELECT steps FROM workflow_plans WHERE name = $1 AND version = $2")
                .bind(request.workflow)
                .bind(request.to)
                .fetch_optional(self.pool())
                .await?;
        let Some(Json(steps)) = steps else {
            return Err(MoveError::UnknownPlan {
                workflow: request.workflow.to_owned(),
                version: request.to,
            });
        };
        let mut tx = self.pool().begin().await?;
        let ids: Vec<String> = sqlx::query_scalar(
            "SELECT order_id FROM order_process
              WHERE workflow = $1 AND workflow_version = $2 AND state = 'pending'
              ORDER BY order_id LIMIT $3
                FOR UPDATE SKIP LOCKED",
        )
        .bind(request.workflow)
        .bind(request.from)
        .bind(request.limit)
        .fetch_all(&mut *tx)
        .await?;
        let not_waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM order_process
              WHERE workflow = $1 AND workflow_version = $2 AND state <> 'pending'",
        )
        .bind(request.workflow)
        .bind(request.from)
        .fetch_one(&mut *tx)
        .await?;
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        let (snapshots, now) = load_snapshots(&mut tx, &ids).await?;
        let mut report = MoveReport {
            not_waiting,
            ..MoveReport::default()
        };
        let ctx = self.store.context(now, actor);
        let event = Event::Moved {
            plan: &steps,
            mapping: request.mapping,
            from: request.from,
            to: request.to,
        };
        let mut planned = Vec::new();
        for snapshot in &snapshots {
            let order_id = snapshot.order_id.as_str().to_owned();
            let decision = decide(snapshot, &event, &ctx);
            match (decision.verdict, decision.moved_steps) {
                (Verdict::Applied, Some(steps)) => {
                    let detail = decision
                        .history
                        .into_iter()
                        .find(|line| line.event == HistoryEvent::Moved)
                        .and_then(|line| line.detail)
                        .unwrap_or_default();
                    planned.push((snapshot, Moved { steps, detail }));
                }
                (Verdict::NotMovable(why), _) => report.refused.push((order_id, why)),
                (other, _) => {
                    return Err(
                        StoreError::Invariant(format!("a move was decided as {other:?}")).into(),
                    )
                }
            }
        }
        if let (true, Some(confirmed)) = (request.apply, request.confirmed) {
            if planned.len() > confirmed {
                tx.rollback().await?;
                return Err(MoveError::MoreThanConfirmed {
                    found: planned.len(),
                    confirmed,
                });
            }
        }
        for (snapshot, moved) in planned {
            if request.apply {
                replace(&mut tx, snapshot, &moved, request.to, actor).await?;
            }
            report
                .moved
                .push((snapshot.order_id.as_str().to_owned(), moved.detail));
        }
        if request.apply {
            tx.commit().await?;
        } else {
            tx.rollback().await?;
        }
        Ok(report)
    }
}

/// Writes one move: the new steps, the order out of its line, the history.
async fn replace(
    tx: &mut sqlx::PgConnection,
    snapshot: &crate::machine::Snapshot,
    moved: &Moved,
    version: i32,
    actor: &str,
) -> Result<(), StoreError> {
    let order_id = snapshot.order_id.as_str();
    let steps = serde_json::to_value(&moved.steps)
        .map_err(|e| StoreError::Invariant(format!("steps as JSON: {e}")))?;
    sqlx::query("SELECT sas_replace_steps($1, $2, $3)")
        .bind(order_id)
        .bind(version)
        .bind(&steps)
        .execute(&mut *tx)
        .await?;
    if let Some(agent) = &snapshot.process.waiting_for {
        sqlx::query("UPDATE admission SET waiting = GREATEST(waiting - 1, 0) WHERE agent = $1")
            .bind(agent)
            .execute(&mut *tx)
            .await?;
    }
    // Out of its line (an agent's or a key's): its place there was for a
    // step of the old plan.
    if snapshot.process.waiting_for.is_some() || snapshot.process.waiting_key.is_some() {
        sqlx::query(
            "UPDATE order_process SET waiting_for = NULL, waiting_key = NULL, admit_key = NULL,
                                      not_before = now()
              WHERE order_id = $1",
        )
        .bind(order_id)
        .execute(&mut *tx)
        .await?;
    }
    sqlx::query("INSERT INTO history (order_id, actor, event, detail) VALUES ($1, $2, $3, $4)")
        .bind(order_id)
        .bind(actor)
        .bind(HistoryEvent::Moved.as_str())
        .bind(&moved.detail)
        .execute(&mut *tx)
        .await?;
    Ok(())
}
