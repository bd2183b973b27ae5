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

/// Orders in progress at the end of each minute of the last hour, oldest
/// first: worked back from the number in progress now, less what was
/// received or resubmitted and plus what ended after each minute.
fn in_progress(overview: &Overview) -> Vec<i64> {
    let now: i64 = overview
        .activity
        .by_state
        .iter()
        .filter(|(state, _)| !state.is_terminal())
        .map(|(_, n)| n)
        .sum();
    let received: Vec<i64> = series(overview, "received")
        .iter()
        .zip(series(overview, "resubmitted"))
        .map(|(a, b)| a + b)
        .collect();
    let ended: Vec<i64> = ["processed", "compensated", "error"]
        .iter()
        .map(|event| series(overview, event))
        .fold(vec![0; 60], |sum, one| {
            sum.iter().zip(one).map(|(a, b)| a + b).collect()
        });
    let mut level = now;
    let mut levels = vec![0; 60];
    for minute in (0..60).rev() {
        levels[minute] = level.max(0);
        level = level - received[minute] + ended[minute];
    }
    levels
}

/// The smallest round number (1, 2 or 5 times a power of ten) at or above `value`.
fn round_up(value: i64) -> i64 {
    let mut scale = 1;
    loop {
        for step in [1, 2, 5] {
            if step * scale >= value {
                return step * scale;
            }
        }
        scale *= 10;
    }
}

/// A chart of 60 per-minute values with a value axis (0, half, top) and a
/// time axis (minutes before now).
fn chart(id: &str, title: &str, values: &[i64], bad: bool) -> Markup {
    const W: f64 = 360.0;
    const H: f64 = 150.0;
    const LEFT: f64 = 44.0;
    const BOTTOM: f64 = 22.0;
    const TOP: f64 = 8.0;
    let top = round_up(values.iter().copied().max().unwrap_or(0).max(1));
    let plot_w = W - LEFT - 8.0;
    let plot_h = H - BOTTOM - TOP;
    let slot = plot_w / values.len().max(1) as f64;
    let y = |value: f64| TOP + plot_h - value / top as f64 * plot_h;
    html! {
        figure.chart #(id) {
            figcaption { (title) }
            svg class={ "chart" @if bad { " bad" } } width=(W) height=(H) viewBox={ "0 0 " (W) " " (H) } role="img"
                aria-label={ (title) ", last hour, at most " (values.iter().max().unwrap_or(&0)) } {
                @for tick in [0, top / 2, top] {
                    line x1=(LEFT) y1=(y(tick as f64)) x2=(W - 8.0) y2=(y(tick as f64)) stroke="#dde2e8" {}
                    text x=(LEFT - 4.0) y=(y(tick as f64) + 4.0) font-size="11" text-anchor="end" fill="#66707a" { (tick) }
                }
                @for (i, value) in values.iter().enumerate() {
                    @let height = *value as f64 / top as f64 * plot_h;
                    rect.value x=(LEFT + i as f64 * slot) y=(TOP + plot_h - height) width=((slot - 1.0).max(1.0)) height=(height) {
                        title { (60 - i) " min ago: " (value) }
                    }
                }
                line x1=(LEFT) y1=(TOP + plot_h) x2=(W - 8.0) y2=(TOP + plot_h) stroke="#9aa5b1" {}
                @for minutes in [60, 45, 30, 15, 0] {
                    @let x = LEFT + (60 - minutes) as f64 * slot;
                    text x=(x) y=(H - 6.0) font-size="11" text-anchor=(if minutes == 0 { "end" } else { "middle" }) fill="#66707a" {
                        @if minutes == 0 { "now" } @else { "-" (minutes) " min" }
                    }
                }
            }
        }
    }
}

/// The part of the overview that the live stream replaces.
pub fn fragment(overview: &Overview) -> Markup {
    html! {
        p.muted { "As of " (super::when(overview.activity.now)) " (database clock)." }
        div.grid {
            (orders_by_state(overview))
            (last_hour_counts(overview))
            (last_hour_charts(overview))
            (agents_lines(overview))
            (key_lines(overview))
            (queue_depths(overview))
            (open_alerts(overview))
        }
    }
}

/// The "Orders by state" section: a count per state, each linking to the
/// orders in it, and the total.
fn orders_by_state(overview: &Overview) -> Markup {
    let activity = &overview.activity;
    let total: i64 = activity.by_state.iter().map(|(_, n)| n).sum();
    html! {
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
    }
}

/// The "Last hour, per minute" section: each milestone's count in the last
/// minute and in the last hour.
fn last_hour_counts(overview: &Overview) -> Markup {
    let rows = [
        ("received", "Received"),
        ("processed", "Processed (throughput)"),
        ("retry_scheduled", "Retries (missed deadlines)"),
        ("compensation_started", "Compensations started"),
        ("compensated", "Compensated"),
        ("error", "Ended in error"),
        ("resubmitted", "Resubmitted by operators"),
    ];
    html! {
        section {
            h2 { "Last hour, per minute" }
            table #per-minute {
                tr { th { "" } th { "last minute" } th { "last hour" } }
                @for (event, label) in rows {
                    @let values = series(overview, event);
                    tr {
                        td { (label) }
                        td.num { (values.last().copied().unwrap_or(0)) }
                        td.num data-event=(event) { (values.iter().sum::<i64>()) }
                    }
                }
            }
        }
    }
}

/// The "Last hour, charted" section: throughput, backlog and compensations
/// per minute.
fn last_hour_charts(overview: &Overview) -> Markup {
    html! {
        section #charts {
            h2 { "Last hour, charted" }
            (chart("chart-throughput", "Processed per minute (throughput)", &series(overview, "processed"), false))
            (chart("chart-backlog", "Orders in progress at each minute's end (backlog)", &in_progress(overview), false))
            (chart("chart-compensations", "Compensations started per minute", &series(overview, "compensation_started"), true))
        }
    }
}

/// The "Agents' lines" section: each agent's orders waiting in Postgres
/// for admission, in flight, its limit and its oldest wait.
fn agents_lines(overview: &Overview) -> Markup {
    html! {
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
                        td.num data-field="limit" title={ "ceiling " (line.ceiling) ", cap " (line.admit_cap) " (urgent orders pass a full limit up to it)" } { (line.admit_limit) }
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
    }
}

/// The "Keys' lines" section: the busiest keys of the workflows'
/// concurrency limits, with orders waiting or attempts in flight.
fn key_lines(overview: &Overview) -> Markup {
    html! {
        section {
            h2 { "Keys' lines" }
            p.muted { "Steps limited by key (a merchant's API): orders wait here when their key is at its limit. Idle keys are not listed." }
            @if overview.keys.is_empty() {
                p.muted #key-lines { "No key has an attempt in flight or an order waiting." }
            } @else {
                table #key-lines {
                    tr { th { "key" } th { "waiting" } th { "in flight" } th { "limit" } th { "rate/s" } th { "oldest wait" } th { "paused until" } }
                    @for key in &overview.keys {
                        tr data-key=(key.key) {
                            td { (key.key) }
                            td.num data-field="waiting" { (key.waiting) }
                            td.num data-field="in_flight" { (key.in_flight) }
                            td.num data-field="limit" title="learnt/declared, for an adaptive key" { (key.limit_shown()) }
                            td.num data-field="per_second" {
                                @match key.per_second { Some(rate) => { (rate) } None => { "-" } }
                            }
                            td.num data-field="oldest_wait" {
                                @match key.oldest_wait_secs {
                                    Some(secs) => { (format!("{secs:.1} s")) }
                                    None => { "-" }
                                }
                            }
                            td data-field="paused_until" {
                                @match key.paused_until {
                                    Some(until) => { (super::when(until)) }
                                    None => { "-" }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The "Queues" section: each queue's ready messages and consumers, or why
/// the broker could not say.
fn queue_depths(overview: &Overview) -> Markup {
    html! {
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
    }
}

/// The "Open alerts" section: the newest open alerts, and the dead letters
/// waiting for an operator.
fn open_alerts(overview: &Overview) -> Markup {
    let activity = &overview.activity;
    html! {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backlog_is_worked_back_from_now() {
        use sas_store::reads::overview::{Activity, MinuteCount};
        use sas_store::ProcessState;
        let now = DateTime::from_timestamp(1_700_000_000, 0).unwrap();
        let minute =
            |ago: i64| now.duration_trunc(Duration::minutes(1)).unwrap() - Duration::minutes(ago);
        let count = |ago: i64, event: &str, count: i64| MinuteCount {
            minute: minute(ago),
            event: event.into(),
            count,
        };
        // 10 received 5 minutes ago, 4 processed 2 minutes ago, one of them
        // resubmitted in the last minute: 7 in progress now.
        let overview = Overview {
            activity: Activity {
                by_state: vec![(ProcessState::Processing, 7), (ProcessState::Processed, 3)],
                per_minute: vec![
                    count(5, "received", 10),
                    count(2, "processed", 4),
                    count(0, "resubmitted", 1),
                ],
                now,
                open_alerts: 0,
                pending_dead_letters: 0,
            },
            admission: Vec::new(),
            keys: Vec::new(),
            queues: Vec::new(),
            alerts: Vec::new(),
        };
        let levels = in_progress(&overview);
        assert_eq!(levels.len(), 60);
        assert_eq!(&levels[53..], &[0, 10, 10, 10, 6, 6, 7]);
        assert!(levels[..54].iter().all(|n| *n == 0), "{levels:?}");
    }

    #[test]
    fn round_up_reaches_the_next_round_number() {
        assert_eq!(
            [0, 1, 3, 7, 10, 11, 240, 5001].map(round_up),
            [1, 1, 5, 10, 10, 20, 500, 10_000]
        );
    }

    #[test]
    fn a_chart_labels_its_value_and_time_axes() {
        let mut values = vec![0; 60];
        values[59] = 37;
        let drawn = chart("c", "Processed", &values, false).into_string();
        for label in [">0<", ">25<", ">50<", ">-60 min<", ">-15 min<", ">now<"] {
            assert!(drawn.contains(label), "{label} in {drawn}");
        }
        assert_eq!(drawn.matches("class=\"value\"").count(), 60);
    }
}
