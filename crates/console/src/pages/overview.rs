//! The overview: orders by state now and per minute over the last hour,
//! throughput, failures and compensations, the agents' lines, queues, open
//! alerts.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::extract::State;
use axum::response::Html;
use axum::Extension;
use chrono::{DateTime, Duration, DurationRound, Utc};
use maud::{html, Markup};

use crate::auth::Principal;
use crate::error::PageFailure;
use crate::overview::Overview;
use crate::Console;

/// `GET /`.
pub async fn page(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
) -> Result<Html<String>, PageFailure> {
    let overview = console.overview().await?;
    Ok(super::layout(
        "Overview",
        "/",
        &who,
        html! {
            h1 { "Overview" }
            div #live { (fragment(&overview)) }
            (super::live_script("/live/overview"))
        },
    ))
}

/// Counts of one milestone per minute of the last hour, oldest first (60 values).
fn series(overview: &Overview, event: &str) -> Vec<i64> {
    let now = overview.activity.now;
    let start = now.duration_trunc(Duration::minutes(1)).unwrap_or(now) - Duration::minutes(59);
    let mut by_minute: BTreeMap<DateTime<Utc>, i64> = BTreeMap::new();
    for row in overview
        .activity
        .per_minute
        .iter()
        .filter(|r| r.event == event)
    {
        by_minute.insert(row.minute, row.count);
    }
    (0..60)
        .map(|i| *by_minute.get(&(start + Duration::minutes(i))).unwrap_or(&0))
        .collect()
}

/// 60 bars, one per minute, scaled to the largest.
fn sparkline(values: &[i64], bad: bool) -> Markup {
    let max = values.iter().copied().max().unwrap_or(0).max(1) as f64;
    html! {
        svg class={ "spark" @if bad { " bad" } } width="240" height="40" viewBox="0 0 240 40" role="img" {
            @for (i, value) in values.iter().enumerate() {
                @let height = (*value as f64 / max * 38.0).round();
                rect x=(i * 4) y=(40.0 - height) width="3" height=(height) { title { (value) } }
            }
        }
    }
}

/// The part of the overview that the live stream replaces.
pub fn fragment(overview: &Overview) -> Markup {
    let activity = &overview.activity;
    let total: i64 = activity.by_state.iter().map(|(_, n)| n).sum();
    let rows = [
        ("received", "Received", false),
        ("processed", "Processed (throughput)", false),
        ("retry_scheduled", "Retries (missed deadlines)", true),
        ("compensation_started", "Compensations started", true),
        ("compensated", "Compensated", true),
        ("error", "Ended in error", true),
    ];
    html! {
        p.muted { "As of " (super::when(activity.now)) " (database clock)." }
        div.grid {
            section {
                h2 { "Orders by state" }
                table #by-state {
                    tr { th { "state" } th { "orders" } }
                    @for state in sas_store::ProcessState::ALL {
                        @let n = activity.by_state.iter().find(|(s, _)| *s == state).map_or(0, |(_, n)| *n);
                        tr {
                            td { a href={ "/orders?state=" (state.as_str()) } { (super::state_badge(state.as_str())) } }
                            td.num data-state=(state.as_str()) { (n) }
                        }
                    }
                    tr { th { "total" } td.num { (total) } }
                }
            }
            section {
                h2 { "Last hour, per minute" }
                table #per-minute {
                    tr { th { "" } th { "last minute" } th { "last hour" } th { "per minute" } }
                    @for (event, label, bad) in rows {
                        @let values = series(overview, event);
                        tr {
                            td { (label) }
                            td.num { (values.last().copied().unwrap_or(0)) }
                            td.num data-event=(event) { (values.iter().sum::<i64>()) }
                            td { (sparkline(&values, bad)) }
                        }
                    }
                }
            }
            section {
                h2 { "Agents' lines" }
                p.muted { "Orders wait here, in Postgres, for an agent's free slot; its queue holds only what was admitted." }
                table #admission {
                    tr { th { "agent" } th { "waiting" } th { "in flight" } th { "limit" } th { "oldest wait" } }
                    @for line in &overview.admission {
                        tr data-agent=(line.agent) {
                            td { (line.agent) }
                            td.num data-field="waiting" { (line.waiting) }
                            td.num data-field="in_flight" { (line.in_flight) }
                            td.num data-field="limit" title={ "ceiling " (line.ceiling) } { (line.admit_limit) }
                            td.num data-field="oldest_wait" {
                                @match line.oldest_wait_secs {
                                    Some(secs) => { (format!("{secs:.1} s")) }
                                    None => { "-" }
                                }
                            }
                        }
                    }
                }
            }
            section {
                h2 { "Queues" }
                table #queues {
                    tr { th { "queue" } th { "ready" } th { "consumers" } }
                    @for queue in &overview.queues {
                        tr {
                            td { (queue.queue) }
                            @if let Some(error) = &queue.error {
                                td colspan="2" .muted { (error) }
                            } @else {
                                td.num { (queue.messages.unwrap_or(0)) }
                                td.num { (queue.consumers.unwrap_or(0)) }
                            }
                        }
                    }
                }
            }
            section {
                h2 { a href="/alerts" { "Open alerts" } " (" (activity.open_alerts) ")" }
                @if overview.alerts.is_empty() {
                    p.muted { "None." }
                } @else {
                    ul #open-alerts {
                        @for alert in &overview.alerts {
                            li {
                                "#" (alert.id) " " (alert.kind) " "
                                @if let Some(order) = &alert.order_id { a href={ "/orders/" (order) } { (order) } }
                                ": " (alert.message)
                            }
                        }
                    }
                }
                p { a href="/dead-letters" { "Dead letters to look at: " (activity.pending_dead_letters) } }
            }
        }
    }
}
