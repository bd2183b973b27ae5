//! The orders list (filters, keyset pages) and bulk actions by filter: a
//! preview with the count, then a confirmation form.

use std::sync::Arc;

use axum::extract::{Path, RawQuery, State};
use axum::response::Html;
use axum::Extension;
use maud::{html, Markup};
use sas_store::reads::search::{OrderFilter, Page};
use sas_store::ProcessState;

use super::{borrowed, query_pairs};
use crate::actions::OrderAction;
use crate::auth::Principal;
use crate::error::{Failure, PageFailure};
use crate::Console;

/// Parameters of the list that are not the filter's.
pub const PAGE_PARAMETERS: [&str; 2] = ["after", "limit"];

/// A filter as a query string (for links).
pub fn filter_query(filter: &OrderFilter) -> String {
    form_urlencoded::Serializer::new(String::new())
        .extend_pairs(filter.to_pairs())
        .finish()
}

fn filter_form(filter: &OrderFilter) -> Markup {
    let value = |v: &Option<String>| v.clone().unwrap_or_default();
    let instant = |v: Option<chrono::DateTime<chrono::Utc>>| {
        v.map(|t| t.format("%Y-%m-%dT%H:%M:%S").to_string())
            .unwrap_or_default()
    };
    html! {
        form.filters method="get" action="/orders" #filters {
            fieldset {
                legend { "state" }
                @for state in ProcessState::ALL {
                    label style="flex-direction:row;gap:.2rem" {
                        input type="checkbox" name="state" value=(state.as_str()) checked[filter.states.contains(&state)];
                        (state.as_str())
                    }
                }
            }
            label { "order id (or its beginning)" input type="search" name="id" value=(value(&filter.id)); }
            label { "parent order" input type="search" name="parent" value=(value(&filter.parent)); }
            label { "customer" input type="text" name="customer" value=(value(&filter.customer)); }
            label { "from (UTC)" input type="datetime-local" step="1" name="from" value=(instant(filter.from)); }
            label { "to (UTC)" input type="datetime-local" step="1" name="to" value=(instant(filter.to)); }
            label { "failures at least" input type="number" min="0" name="min_failures" value=[filter.min_failures]; }
            label { "current step" input type="text" name="step" value=(value(&filter.step)); }
            label { "priority" input type="number" min="0" max="9" name="priority" value=[filter.priority]; }
            button type="submit" #apply-filters { "Filter" }
            a href="/orders" { "Clear" }
        }
    }
}

/// `GET /orders`.
pub async fn list(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    RawQuery(raw): RawQuery,
) -> Result<Html<String>, PageFailure> {
    let pairs = query_pairs(raw.as_deref());
    let filter = OrderFilter::from_pairs(borrowed(&pairs), &PAGE_PARAMETERS)?;
    let page = Page::from_pairs(borrowed(&pairs), console.settings.console.page_size)?;
    let found = console.store.reads().search_orders(&filter, &page).await?;
    let query = filter_query(&filter);
    Ok(super::layout(
        "Orders",
        "/orders",
        &who,
        html! {
            h1 { "Orders" }
            (filter_form(&filter))
            @if super::may_act(&who) {
                p {
                    "With every order this filter selects: "
                    a #bulk-resubmit href={ "/bulk/resubmit?" (query) } { "resubmit…" } " · "
                    a #bulk-resume href={ "/bulk/resume?" (query) } { "resume…" } " · "
                    a #bulk-cancel href={ "/bulk/cancel?" (query) } { "cancel…" }
                    span.muted { " (a preview with the count comes first)" }
                }
            }
            table #orders {
                tr {
                    th { "order" } th { "customer" } th { "state" } th { "current step" }
                    th { "failures" } th { "priority" } th { "submitted" } th { "updated" } th { "last error" }
                }
                @for row in &found.orders {
                    tr data-order=(row.order_id) {
                        td { a href={ "/orders/" (row.order_id) } { (row.order_id) } }
                        td { (row.customer_id.as_deref().unwrap_or("-")) }
                        td { (super::state_badge(row.state.as_str())) }
                        td { (row.current_step.as_deref().unwrap_or("-")) }
                        td.num { (row.failure_count) }
                        td.num { (row.priority) }
                        td { (super::when(row.created_at)) }
                        td { (super::when(row.updated_at)) }
                        td { (row.last_error.as_deref().unwrap_or("")) }
                    }
                }
            }
            @if found.orders.is_empty() { p.muted #no-orders { "No order matches." } }
            p {
                @if page.after.is_some() { a href={ "/orders?" (query) } { "« newest" } " " }
                @if let Some(next) = &found.next {
                    @let next: String = form_urlencoded::byte_serialize(next.as_bytes()).collect();
                    a #next-page href={ "/orders?" (query) @if !query.is_empty() { "&" } "after=" (next) } { "older »" }
                }
            }
        },
    ))
}

/// `GET /bulk/{action}?<filter>`: how many orders the action would go
/// through, and the form that confirms it.
pub async fn preview(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(action): Path<String>,
    RawQuery(raw): RawQuery,
) -> Result<Html<String>, PageFailure> {
    let action: OrderAction = action.parse()?;
    let pairs = query_pairs(raw.as_deref());
    let filter = OrderFilter::from_pairs(borrowed(&pairs), &[])?;
    let preview = console.preview(action, &filter).await?;
    let states: Vec<&str> = action.eligible().iter().map(|s| s.as_str()).collect();
    Ok(super::layout(
        "Confirm bulk action",
        "/orders",
        &who,
        html! {
            h1 { "Bulk " (action.as_str()) }
            p #preview-count data-count=(preview.count) {
                strong { (preview.count) } " orders match this filter among those in state "
                (states.join(" or ")) "."
            }
            @if preview.count > preview.limit {
                p.error { "Only the oldest " (preview.limit) " will be acted on (console.bulk_limit); run it again for the rest." }
            }
            ul {
                @for (name, value) in filter.to_pairs() { li { code { (name) } " = " (value) } }
                @if filter.to_pairs().is_empty() { li { "no filter: every order in those states" } }
            }
            @if preview.count == 0 {
                p { "Nothing to do. " a href={ "/orders?" (filter_query(&filter)) } { "Back to the list" } }
            } @else {
                form method="post" action={ "/bulk/" (action.as_str()) } #confirm-bulk {
                    (super::csrf_field(&console, &who))
                    input type="hidden" name="confirmed" value=(preview.count);
                    @for (name, value) in filter.to_pairs() { input type="hidden" name=(name) value=(value); }
                    @if action == OrderAction::Cancel {
                        p { "Cancelling undoes what each order did, by compensating now." }
                        input type="text" name="reason" placeholder="why (recorded in each history)" size="40";
                        " "
                    }
                    @if action == OrderAction::Resume {
                        p { "Resuming starts each order stopped in error again from the step that failed; an order whose compensation began is skipped, with why." }
                        input type="text" name="reason" required placeholder="what was fixed (recorded in each history)" size="40";
                        " "
                    }
                    button.danger type="submit" #confirm { (action.as_str()) " " (preview.count) " orders" }
                    " " a href={ "/orders?" (filter_query(&filter)) } { "Back" }
                }
            }
        },
    ))
}

/// `POST /bulk/{action}`: the confirmed bulk action.
pub async fn bulk(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(action): Path<String>,
    body: String,
) -> Result<Html<String>, PageFailure> {
    let action: OrderAction = action.parse()?;
    let pairs: Vec<(String, String)> = form_urlencoded::parse(body.as_bytes())
        .into_owned()
        .collect();
    let confirmed = pairs
        .iter()
        .find(|(name, _)| name == "confirmed")
        .and_then(|(_, value)| value.parse::<i64>().ok())
        .filter(|n| *n >= 0)
        .ok_or_else(|| {
            Failure::bad_request(
                "the confirmation lacks the previewed count (confirmed): preview again",
            )
        })?;
    let reason = pairs
        .iter()
        .find(|(name, _)| name == "reason")
        .map_or("", |(_, value)| value.as_str());
    let filter = OrderFilter::from_pairs(
        borrowed(&pairs),
        &["confirmed", "reason", crate::guard::CSRF_FIELD],
    )?;
    let outcome = console
        .bulk(action, &filter, confirmed, reason, &who)
        .await?;
    Ok(super::layout(
        "Bulk action done",
        "/orders",
        &who,
        html! {
            h1 { "Bulk " (action.as_str()) " done" }
            p.notice #bulk-applied data-count=(outcome.applied.len()) {
                (outcome.applied.len()) " orders: " (action.as_str()) " applied."
            }
            @if !outcome.skipped.is_empty() {
                p { (outcome.skipped.len()) " skipped (they moved on meanwhile):" }
                ul { @for (id, why) in &outcome.skipped { li { a href={ "/orders/" (id) } { (id) } ": " (why) } } }
            }
            p { a href={ "/orders?" (filter_query(&filter)) } { "Back to the list" } }
        },
    ))
}
