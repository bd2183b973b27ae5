//! One order: its state, what remains to run or to undo, each step with its
//! attempts, deadline, error and results, its run drawn as a timeline, its
//! history, the status messages sent, and its payload; resubmit, resume and cancel;
//! what its wait step waits for, and a button that sends that event.

use std::sync::Arc;

use axum::extract::{Path, Query, State};
use axum::response::{Html, IntoResponse, Response};
use axum::{Extension, Form};
use maud::{html, Markup};
use sas_store::machine::kind::Kind;
use sas_store::machine::StepRow;
use sas_store::reads::queries::{Delivery, OrderDetail};
use sas_store::reads::search::OrderFilter;
use sas_store::{ProcessState, StepState};
use serde::Deserialize;

use crate::auth::Principal;
use crate::error::{Failure, PageFailure};
use crate::timeline::{self, Timeline};
use crate::Console;

/// Everything the order page shows.
pub struct OrderView {
    /// Process record, body, steps and history.
    pub detail: OrderDetail,
    /// Where its status messages went.
    pub delivery: Delivery,
}

/// Reads an order for the page.
///
/// # Errors
/// 404 for no such order; 503 when the store fails.
pub async fn load(console: &Console, order_id: &str) -> Result<OrderView, Failure> {
    let detail = console
        .store
        .reads()
        .order_detail(order_id)
        .await?
        .ok_or_else(|| Failure::not_found(format!("order {order_id}")))?;
    let delivery = console
        .store
        .reads()
        .order_delivery(order_id)
        .await?
        .unwrap_or_default();
    Ok(OrderView { detail, delivery })
}

/// The steps still to run (forward) or to undo (compensating), in the
/// order they will go; empty once the order has ended.
pub fn remaining(state: ProcessState, steps: &[StepRow]) -> (&'static str, Vec<&StepRow>) {
    match state {
        ProcessState::Pending | ProcessState::Processing => (
            "to run",
            steps
                .iter()
                .filter(|s| matches!(s.state, StepState::NotStarted | StepState::Running))
                .collect(),
        ),
        ProcessState::Compensating | ProcessState::Error => (
            "to undo",
            steps
                .iter()
                .rev()
                .filter(|s| {
                    s.kind.undoable()
                        && (matches!(s.state, StepState::Completed | StepState::Compensating)
                            || (s.maybe_applied && s.state != StepState::Compensated))
                })
                .collect(),
        ),
        ProcessState::Processed | ProcessState::Compensated => ("to do", Vec::new()),
    }
}

/// The status message a history event sent, if it sent one (the store
/// keeps the decisions, not the messages; this is how they map).
fn status_of(event: &str) -> Option<&'static str> {
    match event {
        "received" => Some("received"),
        "step_completed" => Some("step_completed"),
        "compensation_started" => Some("compensating"),
        "processed" => Some("processed"),
        "compensated" => Some("compensated"),
        "error" => Some("failed"),
        _ => None,
    }
}

fn json(value: &serde_json::Value) -> String {
    serde_json::to_string_pretty(value).unwrap_or_default()
}

/// The actions `who` may take on the order in its state now.
fn actions(view: &OrderView, console: &Console, who: &Principal) -> Markup {
    let order_id = &view.detail.summary.order_id;
    let state = view.detail.summary.state;
    html! {
        @if super::may_act(who) {
            p #actions {
                @if matches!(state, ProcessState::Error | ProcessState::Compensated) {
                    form.inline method="post" action={ "/orders/" (order_id) "/resubmit" } {
                        (super::csrf_field(console, who))
                        button type="submit" #resubmit { "Resubmit" }
                    }
                }
                @if state == ProcessState::Error {
                    form.inline method="post" action={ "/orders/" (order_id) "/resume" } {
                        (super::csrf_field(console, who))
                        input type="text" name="reason" required placeholder="what was fixed (recorded in the history)" size="40";
                        " "
                        button type="submit" #resume { "Resume from the failed step" }
                    }
                }
                @if matches!(state, ProcessState::Pending | ProcessState::Processing | ProcessState::Error) {
                    form.inline method="post" action={ "/orders/" (order_id) "/cancel" } {
                        (super::csrf_field(console, who))
                        input type="text" name="reason" placeholder="why (recorded in the history)" size="40";
                        " "
                        button.danger type="submit" #cancel { "Cancel: undo what was done" }
                    }
                }
            }
        }
    }
}

/// What the order waits for at a wait step, if it does: the event, until
/// when, what a timeout does; and for operators a button that sends the
/// event (`#send-event`, see [`Console::send_event`]).
fn waiting(view: &OrderView, console: &Console, who: &Principal) -> Markup {
    let detail = &view.detail;
    let Some(waiting) = crate::actions::waiting_for_event(detail.summary.state, &detail.steps)
    else {
        return html! {};
    };
    let order_id = &detail.summary.order_id;
    html! {
        div #waiting data-event=(waiting.event) data-step=(waiting.step.name) {
            p {
                "Waiting at step " strong { (waiting.step.name) } " for the event "
                code #waiting-event { (waiting.event) } " until "
                span #waiting-until { (super::when_opt(waiting.step.complete_by)) } " UTC"
                "; then " (crate::actions::on_timeout_text(waiting.on_timeout)) "."
            }
            @if super::may_act(who) {
                form.inline method="post" action={ "/orders/" (order_id) "/signal" } {
                    (super::csrf_field(console, who))
                    input type="hidden" name="event" value=(waiting.event);
                    button type="submit" #send-event data-event=(waiting.event) {
                        "Send " (waiting.event)
                    }
                    " "
                    span.muted { "its data: " code { "{\"by\": \"" (who.name) "\"}" } }
                }
            }
        }
    }
}

/// The part of the order page that the live stream replaces: with the
/// actions, so that they follow the order's state.
pub fn fragment(view: &OrderView, console: &Console, who: &Principal) -> Markup {
    let detail = &view.detail;
    html! {
        (actions(view, console, who))
        (waiting(view, console, who))
        (summary(view))
        (what_remains(detail))
        (steps_table(&detail.steps))
        (timeline_figure(detail))
        (history_table(detail))
        (status_messages(view))
    }
}

/// The order's summary table: its state, who holds it, its deadline,
/// failures, priority, the agent it waits for, its last error and times.
fn summary(view: &OrderView) -> Markup {
    let s = &view.detail.summary;
    html! {
        table #summary {
            tr { th { "state" } td #order-state data-state=(s.state.as_str()) { (super::state_badge(s.state.as_str())) } }
            tr { th { "held by" } td { (s.locked_by.as_deref().unwrap_or("-")) } }
            tr { th { "deadline of the step in flight" } td { (super::when_opt(s.complete_by)) } }
            tr { th { "failures" } td { (s.failure_count) } }
            tr { th { "priority" } td { (view.delivery.priority) } }
            @if let Some(agent) = &view.delivery.waiting_for { tr { th { "waiting for a slot of" } td { (agent) } } }
            @if let Some(key) = &view.delivery.waiting_key { tr { th { "waiting for room in key" } td { (key) } } }
            tr { th { "last error" } td { (s.last_error.as_deref().unwrap_or("-")) } }
            tr { th { "submitted" } td { (super::when(s.created_at)) } }
            tr { th { "updated" } td { (super::when(s.updated_at)) } }
        }
    }
}

/// "What remains": the steps still to run or to undo, in the order they
/// will go.
fn what_remains(detail: &OrderDetail) -> Markup {
    let (what, remaining) = remaining(detail.summary.state, &detail.steps);
    html! {
        h2 { "What remains " (what) }
        @if remaining.is_empty() {
            p.muted #remaining { "Nothing: the order has ended." }
        } @else {
            ol #remaining { @for step in &remaining {
                li { (step.name) " ("
                    @match &step.kind {
                        Kind::Wait(wait) => { "waits for the event " (wait.event) }
                        Kind::Delay(_) => { "waits for a time" }
                        Kind::Child(child) => {
                            @if what == "to undo" { "undoes its child order of " (child.workflow) } @else { "runs a child order of " (child.workflow) }
                        }
                        Kind::Call(call) => {
                            (call.agent) ": "
                            @if what == "to undo" { (call.compensation.as_deref().unwrap_or("-")) } @else { (call.action) }
                        }
                    }
                    ", " (step.state) ")" }
            } }
        }
    }
}

/// The steps table: each step with its attempts, deadline, idempotency
/// key, error and results.
fn steps_table(steps: &[StepRow]) -> Markup {
    html! {
        h2 { "Steps" }
        table #steps {
            tr { th { "#" } th { "step" } th { "agent" } th { "state" } th { "attempts" } th { "deadline" }
                 th { "idempotency key" } th { "error" } th { "result" } th { "undo result" } }
            @for step in steps {
                tr data-step=(step.name) {
                    td { (step.position) }
                    td { (step.name) br; span.muted { (step.kind.label()) " / " (step.kind.undo_label().unwrap_or("no undo")) } }
                    td { (step.kind.agent().unwrap_or_default()) }
                    td { (step.state) @if step.maybe_applied { br; span.muted { "maybe applied" } } }
                    td.num { (step.attempt) }
                    td { (super::when_opt(step.complete_by)) br; span.muted { (step.timeout_ms) " ms each" } }
                    td { code { (step.idempotency_key) } }
                    td { (step.last_error.as_deref().unwrap_or("")) }
                    td { @if let Some(result) = &step.result { pre { (json(result)) } } }
                    td { @if let Some(result) = &step.undo_result { pre { (json(result)) } } }
                }
            }
        }
    }
}

/// The order's run drawn from its history, one lane per step, up to now
/// while it is still running.
fn timeline_figure(detail: &OrderDetail) -> Markup {
    let lanes: Vec<String> = detail.steps.iter().map(|step| step.name.clone()).collect();
    let running = matches!(
        detail.summary.state,
        ProcessState::Pending | ProcessState::Processing | ProcessState::Compensating
    );
    let picture = Timeline::build(&lanes, &detail.history, chrono::Utc::now(), running);
    html! {
        h2 { "Timeline" }
        figure #timeline {
            (timeline::svg(&picture))
            figcaption { (timeline::legend()) }
        }
    }
}

/// The history table: every event, when, by whom, of which step.
fn history_table(detail: &OrderDetail) -> Markup {
    html! {
        h2 { "History" }
        table #history {
            tr { th { "at" } th { "by" } th { "event" } th { "step" } th { "detail" } }
            @for entry in &detail.history {
                tr data-event=(entry.event.as_str()) {
                    td { (super::when(entry.at)) }
                    td { (entry.actor) }
                    td { (entry.event.as_str()) }
                    td { (entry.step.as_deref().unwrap_or("")) }
                    td { (entry.detail.as_deref().unwrap_or("")) }
                }
            }
        }
    }
}

/// "Status messages sent": where they went, and each one, derived from the
/// history.
fn status_messages(view: &OrderView) -> Markup {
    let detail = &view.detail;
    html! {
        h2 { "Status messages sent" }
        p.muted {
            "To the status exchange (routing key order." (detail.summary.order_id) ")"
            @if let Some(queue) = &view.delivery.reply_to {
                " and to the client's queue " code { (queue) }
                @if let Some(id) = &view.delivery.reply_correlation_id { " with correlation id " code { (id) } }
            }
            ". Derived from the history: the store keeps the decisions, not the messages."
        }
        ol #statuses {
            @for entry in &detail.history {
                @if let Some(status) = status_of(entry.event.as_str()) {
                    li { (super::when(entry.at)) " " strong { (status) }
                        @if let Some(step) = &entry.step { " " (step) }
                        @if let Some(detail) = &entry.detail { @if status != "step_completed" { " — " (detail) } } }
                }
            }
        }
    }
}

/// Query of the order page.
#[derive(Debug, Deserialize)]
pub struct PageQuery {
    /// What the last action did.
    pub notice: Option<String>,
}

/// `GET /orders/{id}`.
pub async fn page(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(order_id): Path<String>,
    Query(query): Query<PageQuery>,
) -> Result<Html<String>, PageFailure> {
    let view = load(&console, &order_id).await?;
    let live_url = format!("/live/orders/{order_id}");
    Ok(super::layout(
        &format!("Order {order_id}"),
        "/orders",
        &who,
        html! {
            h1 { "Order " code { (order_id) } }
            (super::notice(query.notice.as_deref()))
            (family(&view.detail))
            div #live { (fragment(&view, &console, &who)) }
            h2 { "Payload" }
            pre #payload { (json(&view.detail.body)) }
            (super::live_script(&live_url))
        },
    ))
}

/// The order's parent and children (orders its child steps started),
/// each a link to its page.
fn family(detail: &OrderDetail) -> Markup {
    html! {
        @if let Some(parent) = &detail.parent {
            p #parent { "Started by step " code { (parent.step) } " of order "
                a href=(format!("/orders/{}", parent.order_id)) { code { (parent.order_id) } } }
        }
        @if !detail.children.is_empty() {
            p #children { "Child orders: "
                @for (i, child) in detail.children.iter().enumerate() {
                    @if i > 0 { ", " }
                    a href=(format!("/orders/{}", child.order_id)) { code { (child.order_id) } }
                    " (step " (child.step) ")"
                }
                " · "
                a #children-list href={ "/orders?" (super::orders::filter_query(&OrderFilter {
                    parent: Some(detail.summary.order_id.clone()),
                    ..OrderFilter::default()
                })) } { "in the orders list" }
            }
        }
    }
}

/// `POST /orders/{id}/resubmit`.
pub async fn resubmit(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(order_id): Path<String>,
) -> Result<Response, PageFailure> {
    let done = console.resubmit(&order_id, &who).await?;
    Ok(super::redirect_with_notice(&format!("/orders/{order_id}"), &done.message).into_response())
}

/// `POST /orders/{id}/resume`.
pub async fn resume(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(order_id): Path<String>,
    Form(form): Form<CancelForm>,
) -> Result<Response, PageFailure> {
    let done = console.resume(&order_id, &form.reason, &who).await?;
    Ok(super::redirect_with_notice(
        &format!("/orders/{order_id}"),
        &done.message,
    ))
}

/// The cancel form (and the resume form: its reason).
#[derive(Debug, Deserialize)]
pub struct CancelForm {
    /// Why, recorded in the history.
    #[serde(default)]
    pub reason: String,
}

/// `POST /orders/{id}/cancel`.
pub async fn cancel(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(order_id): Path<String>,
    Form(form): Form<CancelForm>,
) -> Result<Response, PageFailure> {
    let done = console.cancel(&order_id, &form.reason, &who).await?;
    Ok(super::redirect_with_notice(
        &format!("/orders/{order_id}"),
        &done.message,
    ))
}

/// The form of the event button.
#[derive(Debug, Deserialize)]
pub struct SignalForm {
    /// The event's name.
    #[serde(default)]
    pub event: String,
}

/// `POST /orders/{id}/signal`: sends the event the order waits for.
pub async fn signal(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(order_id): Path<String>,
    Form(form): Form<SignalForm>,
) -> Result<Response, PageFailure> {
    let sent = console.send_event(&order_id, &form.event, &who).await?;
    Ok(super::redirect_with_notice(
        &format!("/orders/{order_id}"),
        &sent.message,
    ))
}
