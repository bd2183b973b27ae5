//! The HTML pages, rendered on the server with maud. No script is needed
//! to use them; a few lines of inline JavaScript keep the live parts
//! current (see [`crate::live`]).
//!
//! - [`overview`]: orders by state and per minute, queues, open alerts.
//! - [`orders`]: the filtered list with keyset pages, and bulk actions.
//! - [`order`]: one order's timeline, steps, payload; resubmit, cancel, and
//!   the event its wait step waits for.
//! - [`workflows`]: the registered workflow versions with their orders by
//!   state; moving waiting orders from one version to another.
//! - [`schedules`]: durable schedules, their runs; create, pause, resume,
//!   trigger, delete.
//! - [`alerts`], [`dead_letters`]: their lists and actions.

pub mod alerts;
pub mod dead_letters;
pub mod order;
pub mod orders;
pub mod overview;
pub mod schedules;
pub mod workflows;

use std::sync::Arc;

use axum::http::header;
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use axum::Router;
use chrono::{DateTime, Utc};
use maud::{html, Markup, DOCTYPE};

use crate::auth::{Principal, Role};
use crate::guard::CSRF_FIELD;
use crate::Console;

/// The pages' routes (behind the guard).
pub fn routes() -> Router<Arc<Console>> {
    Router::new()
        .route("/", get(overview::page))
        .route("/orders", get(orders::list))
        .route("/orders/{id}", get(order::page))
        .route("/orders/{id}/resubmit", post(order::resubmit))
        .route("/orders/{id}/resume", post(order::resume))
        .route("/orders/{id}/cancel", post(order::cancel))
        .route("/orders/{id}/signal", post(order::signal))
        .route("/bulk/{action}", get(orders::preview).post(orders::bulk))
        .route("/workflows", get(workflows::page))
        .route("/workflows/move", post(workflows::move_orders))
        .route("/schedules", get(schedules::page).post(schedules::create))
        .route("/schedules/{tenant}/{name}", get(schedules::show))
        .route("/schedules/{tenant}/{name}/{action}", post(schedules::act))
        .route("/alerts", get(alerts::page))
        .route("/alerts/{id}/acknowledge", post(alerts::acknowledge))
        .route("/alerts/{id}/resolve", post(alerts::resolve))
        .route("/dead-letters", get(dead_letters::page))
        .route("/dead-letters/{id}/replay", post(dead_letters::replay))
        .route("/dead-letters/{id}/discard", post(dead_letters::discard))
}

/// The stylesheet and the live pages' script, served without
/// authentication (they hold nothing). The script is a file, not inline,
/// so that the Content-Security-Policy allows no inline script.
pub fn static_routes() -> Router {
    Router::new()
        .route(
            "/static/console.css",
            get(|| async {
                (
                    [
                        (header::CONTENT_TYPE, "text/css; charset=utf-8"),
                        (header::CACHE_CONTROL, "max-age=3600"),
                    ],
                    include_str!("../../static/console.css"),
                )
            }),
        )
        .route(
            "/static/live.js",
            get(|| async {
                (
                    [
                        (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
                        (header::CACHE_CONTROL, "max-age=3600"),
                    ],
                    include_str!("../../static/live.js"),
                )
            }),
        )
}

/// A whole page: the navigation, who is logged in, and `body`.
pub fn layout(title: &str, here: &str, who: &Principal, body: Markup) -> Html<String> {
    let nav = [
        ("/", "Overview"),
        ("/orders", "Orders"),
        ("/workflows", "Workflows"),
        ("/schedules", "Schedules"),
        ("/alerts", "Alerts"),
        ("/dead-letters", "Dead letters"),
    ];
    Html(
        html! {
            (DOCTYPE)
            html lang="en" {
                head {
                    meta charset="utf-8";
                    meta name="viewport" content="width=device-width, initial-scale=1";
                    title { (title) " - sas console" }
                    link rel="stylesheet" href="/static/console.css";
                }
                body {
                    header {
                        strong { "sas console" }
                        @for (href, label) in nav {
                            a href=(href) class=[(href == here).then_some("here")] { (label) }
                        }
                        span.who { (who.name) " (" (who.role.as_str()) ")" }
                    }
                    main { (body) }
                }
            }
        }
        .into_string(),
    )
}

/// The hidden CSRF field of an action's form.
pub fn csrf_field(console: &Console, who: &Principal) -> Markup {
    html! { input type="hidden" name=(CSRF_FIELD) value=(console.auth.csrf_token(who)); }
}

/// Whether `who` may act (and so sees the action buttons).
pub fn may_act(who: &Principal) -> bool {
    who.role >= Role::Operator
}

/// An instant as the pages show it (UTC, to the millisecond).
pub fn when(at: DateTime<Utc>) -> String {
    at.format("%Y-%m-%d %H:%M:%S%.3f").to_string()
}

/// An optional instant, or a dash.
pub fn when_opt(at: Option<DateTime<Utc>>) -> String {
    at.map_or_else(|| "-".to_owned(), when)
}

/// A state, styled.
pub fn state_badge(state: &str) -> Markup {
    html! { span class={ "state state-" (state) } { (state) } }
}

/// A notice passed on a redirect after an action (`?notice=...`).
pub fn notice(text: Option<&str>) -> Markup {
    html! { @if let Some(text) = text { p.notice role="status" { (text) } } }
}

/// Redirects to `path` with `notice` shown there (303: the browser GETs it).
pub fn redirect_with_notice(path: &str, notice: &str) -> Response {
    let encoded: String = form_urlencoded::byte_serialize(notice.as_bytes()).collect();
    let separator = if path.contains('?') { '&' } else { '?' };
    Redirect::to(&format!("{path}{separator}notice={encoded}")).into_response()
}

/// The pairs of a raw query string.
pub fn query_pairs(raw: Option<&str>) -> Vec<(String, String)> {
    form_urlencoded::parse(raw.unwrap_or_default().as_bytes())
        .into_owned()
        .collect()
}

/// Borrowed view of owned pairs, for the filter parsers.
pub fn borrowed(pairs: &[(String, String)]) -> Vec<(&str, &str)> {
    pairs
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect()
}

/// The script that keeps `#live` current from the event stream at `url`:
/// each event carries the fragment's new HTML.
pub fn live_script(url: &str) -> Markup {
    html! { script src="/static/live.js" data-live=(url) {} }
}
