//! Moving waiting orders to another version of their workflow, as an
//! operator asks: the plans every scheduler registers, and the move itself,
//! decided for each order by the state machine ([`Event::Moved`]) and
//! recorded in its history.

use std::collections::BTreeMap;

use sqlx::types::Json;

use super::apply::{transition, Slots};
use super::Writes;
use crate::machine::{Event, HistoryEvent, Verdict};
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
        let mut report = MoveReport {
            not_waiting,
            ..MoveReport::default()
        };
        let event = Event::Moved {
            plan: &steps,
            mapping: request.mapping,
            from: request.from,
            to: request.to,
        };
        // Decided and written by the write kernel as any event (the new
        // steps, the order out of its line, the history); what a preview or
        // an unconfirmed count must not keep is rolled back.
        let decided = transition(&mut tx, self.store, &ids, actor, Slots::Check, |_| event).await?;
        for d in decided {
            let order_id = d.snapshot.order_id.as_str().to_owned();
            match (d.decision.verdict, d.decision.moved) {
                (Verdict::Applied, Some(_)) => {
                    let detail = d
                        .decision
                        .history
                        .into_iter()
                        .find(|line| line.event == HistoryEvent::Moved)
                        .and_then(|line| line.detail)
                        .unwrap_or_default();
                    report.moved.push((order_id, detail));
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
            if report.moved.len() > confirmed {
                tx.rollback().await?;
                return Err(MoveError::MoreThanConfirmed {
                    found: report.moved.len(),
                    confirmed,
                });
            }
        }
        if request.apply {
            tx.commit().await?;
        } else {
            tx.rollback().await?;
        }
        Ok(report)
    }
}
