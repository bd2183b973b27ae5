//! Alerts: open ones first; acknowledge, or resolve with a note.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{Html, Response};
use axum::{Extension, Form};
use maud::html;
use serde::Deserialize;

use crate::auth::Principal;
use crate::error::PageFailure;
use crate::Console;

/// Query of the alerts page.
#[derive(Debug, Deserialize)]
pub struct AlertsQuery {
    /// Show resolved alerts too.
    #[serde(default)]
    pub all: bool,
    /// What the last action did.
    pub notice: Option<String>,
}

/// `GET /alerts`.
pub async fn page(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Query(query): Query<AlertsQuery>,
) -> Result<Html<String>, PageFailure> {
    let alerts = console.store.reads().alerts(query.all, 500).await?;
    let act = super::may_act(&who);
    Ok(super::layout(
        "Alerts",
        "/alerts",
        &who,
        html! {
            h1 { "Alerts" }
            (super::notice(query.notice.as_deref()))
            p { @if query.all { a href="/alerts" { "Open ones only" } } @else { a href="/alerts?all=true" { "Resolved ones too" } } }
            @if alerts.is_empty() { p.muted #no-alerts { "No alerts." } }
            table #alerts {
                tr { th { "#" } th { "raised" } th { "kind" } th { "order" } th { "message" } th { "acknowledged" } th { "resolved" } }
                @for alert in &alerts {
                    tr data-alert=(alert.id) {
                        td { (alert.id) }
                        td { (super::when(alert.raised_at)) }
                        td { (alert.kind) }
                        td { @if let Some(order) = &alert.order_id { a href={ "/orders/" (order) } { (order) } } }
                        td { (alert.message) }
                        td {
                            @if let Some(at) = alert.acknowledged_at {
                                (super::when(at)) " by " (alert.acknowledged_by.as_deref().unwrap_or("?"))
                            } @else if act && alert.resolved_at.is_none() {
                                form.inline method="post" action={ "/alerts/" (alert.id) "/acknowledge" } {
                                    (super::csrf_field(&console, &who))
                                    button type="submit" { "Acknowledge" }
                                }
                            }
                        }
                        td {
                            @if let Some(at) = alert.resolved_at {
                                (super::when(at)) " by " (alert.resolved_by.as_deref().unwrap_or("?"))
                                @if let Some(note) = &alert.resolution_note { ": " (note) }
                            } @else if act {
                                form.inline method="post" action={ "/alerts/" (alert.id) "/resolve" } {
                                    (super::csrf_field(&console, &who))
                                    input type="text" name="note" required placeholder="what was found or done" size="30";
                                    " " button type="submit" { "Resolve" }
                                }
                            }
                        }
                    }
                }
            }
        },
    ))
}

/// `POST /alerts/{id}/acknowledge`.
pub async fn acknowledge(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<i64>,
) -> Result<Response, PageFailure> {
    let done = console.acknowledge_alert(id, &who).await?;
    Ok(super::redirect_with_notice("/alerts", &done.message))
}

/// The resolve form.
#[derive(Debug, Deserialize)]
pub struct ResolveForm {
    /// What was found or done.
    #[serde(default)]
    pub note: String,
}

/// `POST /alerts/{id}/resolve`.
pub async fn resolve(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<i64>,
    Form(form): Form<ResolveForm>,
) -> Result<Response, PageFailure> {
    let done = console.resolve_alert(id, &form.note, &who).await?;
    Ok(super::redirect_with_notice("/alerts", &done.message))
}
