//! The workflow versions schedulers registered (`workflow_plans`), with how
//! many orders have each: what an operator looks at before moving waiting
//! orders from one version to another (see [`crate::writes::moves`]).

use chrono::{DateTime, Utc};
use serde::Serialize;
use sqlx::types::Json;

use super::Reads;
use crate::model::NewStep;
use crate::StoreError;

/// One version of a workflow: its plan as a scheduler registered it, and
/// how many orders have that version, by state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkflowVersion {
    /// The workflow's name.
    pub name: String,
    /// The version.
    pub version: i32,
    /// Its steps, in order; `None` when no scheduler registered this
    /// version (orders of it exist, from before plans were registered, or
    /// from a file no running scheduler reads).
    pub steps: Option<Vec<NewStep>>,
    /// When a scheduler first registered it.
    pub registered_at: Option<DateTime<Utc>>,
    /// Orders of this version that wait (`pending`: in a line, in backoff
    /// or at a wait step): the ones a move may take.
    pub waiting: i64,
    /// Orders of this version a scheduler holds (`processing`,
    /// `compensating`).
    pub running: i64,
    /// Orders of this version that ended (`processed`, `error`,
    /// `compensated`).
    pub ended: i64,
}

/// A row of [`Reads::workflow_versions`]'s query.
type Row = (
    String,
    i32,
    Option<Json<Vec<NewStep>>>,
    Option<DateTime<Utc>>,
    i64,
    i64,
    i64,
);

impl Reads<'_> {
    /// Every registered workflow version, and every version some order has
    /// though none registered it, by name and version, with its orders
    /// counted by state. It reads every order's process record: for a page
    /// an operator opens, not for gauges.
    ///
    /// # Errors
    /// When the database fails, or a registered plan is not steps.
    pub async fn workflow_versions(self) -> Result<Vec<WorkflowVersion>, StoreError> {
        let rows: Vec<Row> = sqlx::query_as(
            "SELECT coalesce(p.name, c.workflow), coalesce(p.version, c.workflow_version),
                    p.steps, p.registered_at,
                    coalesce(c.waiting, 0), coalesce(c.running, 0), coalesce(c.ended, 0)
               FROM workflow_plans p
               FULL JOIN (SELECT workflow, workflow_version,
                                 count(*) FILTER (WHERE state = 'pending') AS waiting,
                                 count(*) FILTER (WHERE state IN ('processing', 'compensating')) AS running,
                                 count(*) FILTER (WHERE state IN ('processed', 'error', 'compensated')) AS ended
                            FROM order_process GROUP BY workflow, workflow_version) c
                 ON c.workflow = p.name AND c.workflow_version = p.version
              ORDER BY 1, 2",
        )
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(
                |(name, version, steps, registered_at, waiting, running, ended)| WorkflowVersion {
                    name,
                    version,
                    steps: steps.map(|Json(steps)| steps),
                    registered_at,
                    waiting,
                    running,
                    ended,
                },
            )
            .collect())
    }
}

/// The newest registered version of one workflow, as the gateway checks a
/// submission against it.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkflowSchema {
    /// The workflow's name.
    pub name: String,
    /// Its newest registered version.
    pub version: i32,
    /// What its orders' attributes must match, if anything.
    pub attributes_schema: Option<serde_json::Value>,
}

impl Reads<'_> {
    /// Every registered workflow at its newest version, with the JSON
    /// Schema of its attributes: what the gateway refuses a submission
    /// against before publishing it.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn workflow_schemas(self) -> Result<Vec<WorkflowSchema>, StoreError> {
        let rows: Vec<(String, i32, Option<serde_json::Value>)> = sqlx::query_as(
            "SELECT DISTINCT ON (name) name, version, attributes_schema
               FROM workflow_plans ORDER BY name, version DESC",
        )
        .fetch_all(self.pool())
        .await?;
        Ok(rows
            .into_iter()
            .map(|(name, version, attributes_schema)| WorkflowSchema {
                name,
                version,
                attributes_schema,
            })
            .collect())
    }
}
