//! Schedules: every durable schedule with its next runs; one schedule's
//! latest runs; create, pause, resume, trigger and delete
//! (see [`crate::schedules`]).

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{Html, Response};
use axum::{Extension, Form};
use maud::html;
use sas_store::schedules::{RunRow, ScheduleAsk, ScheduleRow};
use serde::{Deserialize, Serialize};

use crate::auth::Principal;
use crate::error::{Failure, PageFailure};
use crate::Console;

/// How many next runs the list shows per schedule.
const NEXT_RUNS: usize = 3;

/// A schedule as the list shows it: its row and its next runs.
#[derive(Debug, Serialize)]
pub struct Listed {
    /// The schedule.
    #[serde(flatten)]
    pub schedule: ScheduleRow,
    /// Its next runs (none while paused).
    pub next_runs: Vec<chrono::DateTime<chrono::Utc>>,
}

/// Every schedule with its next runs, for the page and the API.
///
/// # Errors
/// When the store fails.
pub async fn load(console: &Console) -> Result<Vec<Listed>, Failure> {
    let rows = console.store.schedules().list(None).await?;
    rows.into_iter()
        .map(|schedule| {
            let next_runs = schedule.next_runs(NEXT_RUNS)?;
            Ok(Listed {
                schedule,
                next_runs,
            })
        })
        .collect()
}

/// One schedule and its latest runs, for the page and the API.
///
/// # Errors
/// 404 for no such schedule; when the store fails.
pub async fn load_one(
    console: &Console,
    tenant: &str,
    name: &str,
) -> Result<(ScheduleRow, Vec<RunRow>), Failure> {
    let schedules = console.store.schedules();
    let Some(schedule) = schedules.get(tenant, name).await? else {
        return Err(Failure::not_found(format!("schedule {tenant}/{name}")));
    };
    let runs = schedules.runs(tenant, name, 100).await?;
    Ok((schedule, runs))
}

/// Query of the schedules pages.
#[derive(Debug, Deserialize)]
pub struct NoticeQuery {
    /// What the last action did.
    pub notice: Option<String>,
}

/// `GET /schedules`.
pub async fn page(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Query(query): Query<NoticeQuery>,
) -> Result<Html<String>, PageFailure> {
    let listed = load(&console).await?;
    let act = super::may_act(&who);
    Ok(super::layout(
        "Schedules",
        "/schedules",
        &who,
        html! {
            h1 { "Schedules" }
            (super::notice(query.notice.as_deref()))
            @if listed.is_empty() { p.muted #no-schedules { "No schedules." } }
            table #schedules {
                tr { th { "tenant" } th { "name" } th { "workflow" } th { "cron" } th { "zone" } th { "overlap" } th { "state" } th { "next runs" } th { "" } }
                @for Listed { schedule: s, next_runs } in &listed {
                    @let path = format!("/schedules/{}/{}", s.tenant, s.name);
                    tr data-schedule=(s.name) {
                        td { (s.tenant) }
                        td { a href=(path) { (s.name) } }
                        td { (s.workflow) }
                        td { code { (s.cron) } }
                        td { (s.time_zone) }
                        td { (s.overlap) }
                        td { @if s.paused { "paused" } @else { "active" } }
                        td { @for at in next_runs { (super::when(*at)) br; } }
                        td {
                            @if act {
                                @let pause = if s.paused { "resume" } else { "pause" };
                                @for action in [pause, "trigger", "delete"] {
                                    form.inline method="post" action={ (path) "/" (action) } {
                                        (super::csrf_field(&console, &who))
                                        button type="submit" data-action=(action) { (action) }
                                    }
                                    " "
                                }
                            }
                        }
                    }
                }
            }
            @if act {
                h2 { "New schedule" }
                form method="post" action="/schedules" #new-schedule {
                    (super::csrf_field(&console, &who))
                    p {
                        label { "tenant " input type="text" name="tenant" value="default" size="12"; } " "
                        label { "name " input type="text" name="name" required size="20" placeholder="nightly"; } " "
                        label { "cron " input type="text" name="cron" required size="16" placeholder="0 2 * * *"; } " "
                        label { "time zone " input type="text" name="time_zone" value="UTC" size="16"; }
                    }
                    p {
                        label { "overlap "
                            select name="overlap" {
                                option value="skip" selected { "skip" }
                                option value="buffer_one" { "buffer_one" }
                                option value="allow" { "allow" }
                            }
                        } " "
                        label { "catch-up (s) " input type="number" name="catch_up_secs" value="3600" min="0"; } " "
                        label { input type="checkbox" name="paused" value="true"; " paused" }
                    }
                    p { label { "order (JSON, without order_id)" br; textarea name="order" rows="4" cols="80" required {} } }
                    button type="submit" { "Create" }
                }
            }
        },
    ))
}

/// `GET /schedules/{tenant}/{name}`.
pub async fn show(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path((tenant, name)): Path<(String, String)>,
    Query(query): Query<NoticeQuery>,
) -> Result<Html<String>, PageFailure> {
    let (s, runs) = load_one(&console, &tenant, &name).await?;
    let order_link = |id: &str| format!("/orders/{id}");
    Ok(super::layout(
        &format!("Schedule {name}"),
        "/schedules",
        &who,
        html! {
            h1 { "Schedule " (s.tenant) "/" (s.name) }
            (super::notice(query.notice.as_deref()))
            table #definition {
                tr { th { "workflow" } td { (s.workflow) } }
                tr { th { "cron" } td { code { (s.cron) } " (" (s.time_zone) ")" } }
                tr { th { "overlap" } td { (s.overlap) } }
                tr { th { "catch-up" } td { (s.catch_up_ms / 1000) " s" } }
                tr { th { "state" } td { @if s.paused { "paused" } @else { "active" } } }
                tr { th { "next run" } td { (super::when_opt(s.next_run)) } }
                tr { th { "buffered" } td { (super::when_opt(s.buffered)) } }
                tr { th { "order" } td { code { (s.order_template.0) } } }
                tr { th { "changed" } td { (super::when(s.updated_at)) " by " (s.updated_by) } }
            }
            h2 { "Runs" }
            @if runs.is_empty() { p.muted #no-runs { "No run yet." } }
            table #runs {
                tr { th { "occurrence" } th { "outcome" } th { "order" } th { "detail" } th { "decided by" } }
                @for run in &runs {
                    tr data-outcome=(run.outcome) {
                        td { (super::when(run.occurrence)) }
                        td { (run.outcome) }
                        td { @if let Some(id) = &run.order_id { a href=(order_link(id)) { (id) } } }
                        td { (run.detail()) }
                        td { (run.recorded_by) }
                    }
                }
            }
        },
    ))
}

/// The new-schedule form.
#[derive(Debug, Deserialize)]
pub struct CreateForm {
    /// The tenant.
    #[serde(default)]
    pub tenant: String,
    /// The name.
    #[serde(default)]
    pub name: String,
    /// The cron expression.
    #[serde(default)]
    pub cron: String,
    /// The time zone.
    #[serde(default)]
    pub time_zone: String,
    /// The overlap policy.
    #[serde(default)]
    pub overlap: String,
    /// The catch-up window, in seconds.
    #[serde(default)]
    pub catch_up_secs: String,
    /// The order, as JSON text.
    #[serde(default)]
    pub order: String,
    /// `true` when the box was ticked.
    pub paused: Option<String>,
}

impl CreateForm {
    /// The schedule the form asks for.
    fn ask(self) -> Result<ScheduleAsk, Failure> {
        let order = serde_json::from_str(&self.order)
            .map_err(|error| Failure::bad_request(format!("the order is not JSON: {error}")))?;
        let catch_up_secs = match self.catch_up_secs.trim() {
            "" => None,
            secs => Some(secs.parse().map_err(|_| {
                Failure::bad_request(format!(
                    "the catch-up window is a whole number of seconds (got {secs:?})"
                ))
            })?),
        };
        Ok(ScheduleAsk {
            tenant: self.tenant,
            name: self.name,
            cron: self.cron,
            time_zone: self.time_zone,
            order,
            overlap: self.overlap,
            catch_up_secs,
            paused: self.paused.is_some(),
        })
    }
}

/// `POST /schedules`.
pub async fn create(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Form(form): Form<CreateForm>,
) -> Result<Response, PageFailure> {
    let done = console.create_schedule(&form.ask()?, &who).await?;
    Ok(super::redirect_with_notice("/schedules", &done.message))
}

/// `POST /schedules/{tenant}/{name}/{action}`.
pub async fn act(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path((tenant, name, action)): Path<(String, String, String)>,
) -> Result<Response, PageFailure> {
    let done = console
        .act_on_schedule(&tenant, &name, &action, &who)
        .await?;
    Ok(super::redirect_with_notice("/schedules", &done.message))
}
