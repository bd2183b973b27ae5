//! `GET /v1/schedules`: the caller's tenant's durable schedules, with their
//! next runs and latest runs (see docs/schedules.md). Read only: the
//! gateway's database role reads, so schedules are managed by operators
//! (sasctl, the console).

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::Serialize;

use crate::orders::store_unavailable;
use crate::{Caller, Gateway};

/// How many next runs, and latest runs, each schedule shows.
const RUNS: usize = 5;

/// One schedule of the caller's tenant.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct ScheduleView {
    /// Its name.
    pub name: String,
    /// The workflow its runs follow.
    pub workflow: String,
    /// The cron expression (5 or 6 fields).
    pub cron: String,
    /// The IANA time zone it is read in.
    pub time_zone: String,
    /// `skip`, `buffer_one` or `allow`.
    pub overlap: String,
    /// Paused: no run starts but one asked by hand.
    pub paused: bool,
    /// Its next runs (none while paused).
    pub next_runs: Vec<DateTime<Utc>>,
    /// Its latest decided occurrences, newest first.
    pub latest_runs: Vec<RunView>,
}

/// One decided occurrence.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct RunView {
    /// When it was due (or asked for).
    pub occurrence: DateTime<Utc>,
    /// `started`, `skipped` or `missed`.
    pub outcome: String,
    /// Started: its order, by the id this client reads it with (`GET /v1/orders/{order_id}`).
    pub order_id: Option<String>,
    /// What became of it beyond its outcome (why skipped, how many missed, a refusal).
    pub detail: String,
}

/// `GET /v1/schedules`.
pub async fn list(
    State(gateway): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
) -> Response {
    let tenant = match gateway.tenant_of(&caller) {
        Ok(tenant) => tenant,
        Err(refused) => return *refused,
    };
    let schedules = gateway.store.schedules();
    let rows = match schedules.list(Some(&tenant)).await {
        Ok(rows) => rows,
        Err(error) => return store_unavailable(&error),
    };
    let mut views = Vec::with_capacity(rows.len());
    for row in rows {
        let runs = match schedules.runs(&tenant, &row.name, RUNS as i64).await {
            Ok(runs) => runs,
            Err(error) => return store_unavailable(&error),
        };
        // A stored definition that no longer parses (the schedulers pause
        // it): shown without next runs.
        let next_runs = row.next_runs(RUNS).unwrap_or_default();
        views.push(ScheduleView {
            latest_runs: runs
                .iter()
                .map(|run| RunView {
                    occurrence: run.occurrence,
                    outcome: run.outcome.clone(),
                    order_id: run
                        .order_id
                        .as_deref()
                        .map(|id| sas_messages::ids::client_id(id).to_owned()),
                    detail: run.detail(),
                })
                .collect(),
            name: row.name,
            workflow: row.workflow,
            cron: row.cron,
            time_zone: row.time_zone,
            overlap: row.overlap,
            paused: row.paused,
            next_runs,
        });
    }
    Json(views).into_response()
}
