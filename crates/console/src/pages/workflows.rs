//! The workflows: every version a scheduler registered, its steps, and how
//! many orders have it (waiting, running, ended); for operators, moving the
//! waiting orders of one version to another, as `sasctl orders move` does:
//! a look at what would move and what stays and why, then a button that
//! moves the number of orders the look found.

use std::sync::Arc;

use axum::extract::{RawQuery, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Extension;
use chrono::{DateTime, Utc};
use maud::{html, Markup};
use sas_store::machine::kind::{ChildStep, DelayStep, Kind, WaitStep};
use sas_store::machine::park::OnTimeout;
use sas_store::reads::workflows::WorkflowVersion;
use sas_store::NewStep;
use serde::Serialize;

use crate::actions::{parse_mapping, MoveAsk, MoveOutcome};
use crate::auth::Principal;
use crate::error::{Failure, PageFailure};
use crate::Console;

/// One step of a registered version, as the page and `GET /api/workflows`
/// show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StepView {
    /// The step's name.
    pub name: String,
    /// `call` (an agent's action), `wait` (for an event) or `delay`.
    pub kind: &'static str,
    /// What it does, said for the operator (`call inventory.reserve`,
    /// `wait for approved`, `delay 10 s`).
    pub does: String,
    /// A call's agent.
    pub agent: Option<String>,
    /// A call's action.
    pub action: Option<String>,
    /// A call's undo, if it has one.
    pub compensation: Option<String>,
    /// The event a wait waits for.
    pub event: Option<String>,
    /// What a wait's timeout does.
    pub on_timeout: Option<OnTimeout>,
    /// How long one attempt (or a wait) may take.
    pub timeout_ms: u64,
}

impl StepView {
    /// The view of `step`.
    pub fn of(step: &NewStep) -> Self {
        let timeout_ms = u64::try_from(step.timeout.as_millis()).unwrap_or(u64::MAX);
        let mut view = Self {
            name: step.name.clone(),
            kind: "call",
            does: String::new(),
            agent: None,
            action: None,
            compensation: None,
            event: None,
            on_timeout: None,
            timeout_ms,
        };
        match &step.kind {
            Kind::Call(call) => {
                view.does = format!("call {}.{}", call.agent, call.action);
                view.agent = Some(call.agent.clone());
                view.action = Some(call.action.clone());
                view.compensation.clone_from(&call.compensation);
            }
            Kind::Wait(WaitStep {
                event,
                on_timeout,
                correlation_key,
                senders,
            }) => {
                view.kind = "wait";
                view.does = match correlation_key {
                    Some(key) => format!("wait for {event} (or by key {key})"),
                    None => format!("wait for {event}"),
                };
                if !senders.is_empty() {
                    view.does
                        .push_str(&format!(", from {} only", senders.join(", ")));
                }
                view.event = Some(event.clone());
                view.on_timeout = Some(*on_timeout);
            }
            Kind::Delay(DelayStep {
                delay_ms,
                not_before,
            }) => {
                view.kind = "delay";
                view.does = format!("delay {}", duration_text(*delay_ms));
                if let Some(pointer) = not_before {
                    view.does
                        .push_str(&format!(", not before the order's {pointer}"));
                }
            }
            Kind::Child(ChildStep {
                workflow, version, ..
            }) => {
                view.kind = "child";
                view.does =
                    format!("start an order of {workflow} (version {version}) and wait for it");
            }
        }
        view
    }
}

/// A duration in milliseconds, said in seconds when whole.
fn duration_text(ms: u64) -> String {
    if ms.is_multiple_of(1000) {
        format!("{} s", ms / 1000)
    } else {
        format!("{ms} ms")
    }
}

/// Orders of one version, by state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct OrderCounts {
    /// `pending`: in a line, in backoff or at a wait (what a move may take).
    pub waiting: i64,
    /// `processing` or `compensating`.
    pub running: i64,
    /// `processed`, `error` or `compensated`.
    pub ended: i64,
}

/// One version of a workflow, as the page and `GET /api/workflows` show it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkflowView {
    /// The workflow.
    pub workflow: String,
    /// The version.
    pub version: i32,
    /// When a scheduler first registered it; `None` when none did (orders
    /// of it exist, but no move can target it).
    pub registered_at: Option<DateTime<Utc>>,
    /// Its steps, when registered.
    pub steps: Option<Vec<StepView>>,
    /// Its orders, by state.
    pub orders: OrderCounts,
}

impl WorkflowView {
    fn of(version: &WorkflowVersion) -> Self {
        Self {
            workflow: version.name.clone(),
            version: version.version,
            registered_at: version.registered_at,
            steps: version
                .steps
                .as_ref()
                .map(|steps| steps.iter().map(StepView::of).collect()),
            orders: OrderCounts {
                waiting: version.waiting,
                running: version.running,
                ended: version.ended,
            },
        }
    }
}

/// Every workflow version (see [`sas_store::reads::Reads::workflow_versions`]).
///
/// # Errors
/// 503 when the store fails.
pub async fn load(console: &Console) -> Result<Vec<WorkflowView>, Failure> {
    Ok(console
        .store
        .reads()
        .workflow_versions()
        .await?
        .iter()
        .map(WorkflowView::of)
        .collect())
}

/// What the move form holds, as typed (shown again with a look, a result
/// or an error).
#[derive(Debug, Clone, Default)]
pub struct MoveForm {
    /// The workflow.
    pub workflow: String,
    /// The version the orders have.
    pub from: String,
    /// The version to move them to.
    pub to: String,
    /// `OLD=NEW` lines.
    pub mapping: String,
}

impl MoveForm {
    /// The form's fields out of `pairs` (a query string or a posted form):
    /// `workflow`, `from`, `to`, and `mapping` (lines; repeated, each is
    /// one or more lines).
    fn from_pairs(pairs: &[(String, String)]) -> Self {
        let field = |name: &str| {
            pairs
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, v)| v.trim().to_owned())
                .unwrap_or_default()
        };
        let mapping: Vec<&str> = pairs
            .iter()
            .filter(|(n, _)| n == "mapping")
            .flat_map(|(_, v)| v.lines())
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        Self {
            workflow: field("workflow"),
            from: field("from"),
            to: field("to"),
            mapping: mapping.join("\n"),
        }
    }

    /// The move it asks for, with `confirm` (400 for a version that is no
    /// number or a mapping line that is not `OLD=NEW`).
    fn ask(&self, confirm: Option<usize>) -> Result<MoveAsk, Failure> {
        let version = |name: &str, text: &str| {
            text.parse::<i32>().map_err(|_| {
                Failure::bad_request(format!("{name} must be a version number (got {text:?})"))
            })
        };
        Ok(MoveAsk {
            workflow: self.workflow.clone(),
            from: version("from", &self.from)?,
            to: version("to", &self.to)?,
            mapping: parse_mapping(self.mapping.lines())?,
            confirm,
        })
    }
}

/// What the page shows under the move form.
enum Shown {
    /// Nothing yet.
    Form,
    /// A look or a move.
    Outcome(MoveOutcome),
    /// A move refused as a whole (400, 404, 409).
    Refused(Failure),
}

/// `GET /workflows` (`?workflow=&from=&to=` fill in the move form).
pub async fn page(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    RawQuery(raw): RawQuery,
) -> Result<Response, PageFailure> {
    let form = MoveForm::from_pairs(&super::query_pairs(raw.as_deref()));
    render(&console, &who, &form, Shown::Form, StatusCode::OK).await
}

/// `POST /workflows/move`: without `confirm`, a look; with `confirm=N`
/// (the look's count), the move. A refused move shows the page again with
/// the error (400, 404 unknown version, 409 more than confirmed).
pub async fn move_orders(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    body: String,
) -> Result<Response, PageFailure> {
    let pairs: Vec<(String, String)> = form_urlencoded::parse(body.as_bytes())
        .into_owned()
        .collect();
    let form = MoveForm::from_pairs(&pairs);
    let confirm = match pairs.iter().find(|(name, _)| name == "confirm") {
        None => Ok(None),
        Some((_, text)) => text.trim().parse::<usize>().map(Some).map_err(|_| {
            Failure::bad_request(format!(
                "confirm must be the number of orders the look said would move (got {text:?}): look again"
            ))
        }),
    };
    let asked = confirm.and_then(|confirm| form.ask(confirm));
    let outcome = match asked {
        Ok(ask) => console.move_orders(&ask, &who).await,
        Err(failure) => Err(failure),
    };
    match outcome {
        Ok(outcome) => {
            render(
                &console,
                &who,
                &form,
                Shown::Outcome(outcome),
                StatusCode::OK,
            )
            .await
        }
        Err(failure) if failure.status == StatusCode::SERVICE_UNAVAILABLE => Err(failure.into()),
        Err(failure) => {
            let status = failure.status;
            render(&console, &who, &form, Shown::Refused(failure), status).await
        }
    }
}

async fn render(
    console: &Console,
    who: &Principal,
    form: &MoveForm,
    shown: Shown,
    status: StatusCode,
) -> Result<Response, PageFailure> {
    let versions = load(console).await?;
    let page = super::layout(
        "Workflows",
        "/workflows",
        who,
        html! {
            h1 { "Workflows" }
            p.muted {
                "Every version a scheduler registered when it started, and every version some order has. "
                "An order keeps the version it started with, unless an operator moves it."
            }
            (versions_table(&versions))
            @if super::may_act(who) {
                (move_section(console, who, form, &versions, &shown))
            }
        },
    );
    Ok((status, page).into_response())
}

fn versions_table(versions: &[WorkflowView]) -> Markup {
    html! {
        @if versions.is_empty() { p.muted #no-workflows { "No workflow registered yet: a scheduler registers its workflows when it starts." } }
        table #workflows {
            tr {
                th { "workflow" } th { "version" } th { "steps" } th { "registered (UTC)" }
                th { "waiting" } th { "running" } th { "ended" }
            }
            @for view in versions {
                tr data-workflow=(view.workflow) data-version=(view.version)
                    data-waiting=(view.orders.waiting) data-running=(view.orders.running) data-ended=(view.orders.ended) {
                    td { (view.workflow) }
                    td.num { (view.version) }
                    td {
                        @match &view.steps {
                            Some(steps) => {
                                ol.steps { @for step in steps {
                                    li data-step=(step.name) data-kind=(step.kind) {
                                        strong { (step.name) } ": " (step.does)
                                        @if let Some(undo) = &step.compensation { span.muted { " (undo " (undo) ")" } }
                                        @if let Some(on_timeout) = step.on_timeout {
                                            span.muted { " (up to " (duration_text(step.timeout_ms)) ", then " (crate::actions::on_timeout_text(on_timeout)) ")" }
                                        }
                                    }
                                } }
                            }
                            None => { span.muted { "not registered: no scheduler runs it, so no move can go to it" } }
                        }
                    }
                    td { (super::when_opt(view.registered_at)) }
                    td.num.waiting { (view.orders.waiting) }
                    td.num.running { (view.orders.running) }
                    td.num.ended { (view.orders.ended) }
                }
            }
        }
    }
}

fn move_section(
    console: &Console,
    who: &Principal,
    form: &MoveForm,
    versions: &[WorkflowView],
    shown: &Shown,
) -> Markup {
    let mut names: Vec<&str> = versions.iter().map(|v| v.workflow.as_str()).collect();
    names.dedup();
    html! {
        section #move {
            h2 { "Move waiting orders to another version" }
            p.muted {
                "Only waiting orders move (in a line, in backoff or at a wait step); each keeps what its steps did, "
                "under the new version's definitions. Old steps go to the steps of the same name, or as the mapping says (OLD=NEW, one a line). "
                "An order the move would be unsafe for stays as it is, with the reason. "
                "Look first: nothing changes until you confirm."
            }
            form method="post" action="/workflows/move" #move-form {
                (super::csrf_field(console, who))
                p {
                    label { "workflow " input type="text" name="workflow" list="workflow-names" required value=(form.workflow); }
                    " "
                    label { "from version " input type="number" name="from" required value=(form.from); }
                    " "
                    label { "to version " input type="number" name="to" required value=(form.to); }
                }
                datalist #workflow-names { @for name in &names { option value=(name) {} } }
                p {
                    label { "step mapping (OLD=NEW, one a line; optional)" br;
                        textarea name="mapping" rows="3" cols="40" { (form.mapping) }
                    }
                }
                button type="submit" #look { "Look" }
            }
            @match shown {
                Shown::Form => {}
                Shown::Refused(failure) => {
                    p.error #move-error role="alert" data-status=(failure.status.as_u16()) { (failure.message) }
                }
                Shown::Outcome(outcome) => { (outcome_part(console, who, form, outcome)) }
            }
        }
    }
}

fn outcome_part(
    console: &Console,
    who: &Principal,
    form: &MoveForm,
    outcome: &MoveOutcome,
) -> Markup {
    let moved = outcome.moved.len();
    let id = if outcome.applied {
        "move-done"
    } else {
        "move-look"
    };
    html! {
        section id=(id) data-moved=(moved) data-refused=(outcome.refused.len()) data-not-waiting=(outcome.not_waiting) {
            @if outcome.applied {
                h3 { "Moved" }
                p.notice role="status" #move-message { (outcome.message) " Each order's history says what changed (moved, by " (who.actor()) ")." }
            } @else {
                h3 { "Look: version " (outcome.from) " to " (outcome.to) " of " (outcome.workflow) }
                p #move-message { (outcome.message) }
            }
            @if outcome.at_limit() {
                p.error { "Only the first " (outcome.limit) " waiting orders were looked at (console.bulk_limit): move again for the rest." }
            }
            @if moved > 0 {
                table #move-moved {
                    tr { th { "order" } th { @if outcome.applied { "moved" } @else { "would move" } } }
                    @for order in &outcome.moved {
                        tr data-order=(order.order_id) {
                            td { a href={ "/orders/" (order.order_id) } { (order.order_id) } }
                            td { (order.detail) }
                        }
                    }
                }
            }
            @if !outcome.refused.is_empty() {
                table #move-refused {
                    tr { th { "order" } th { "stays, because" } }
                    @for order in &outcome.refused {
                        tr data-order=(order.order_id) {
                            td { a href={ "/orders/" (order.order_id) } { (order.order_id) } }
                            td { (order.reason) }
                        }
                    }
                }
            }
            @if !outcome.applied {
                @if moved == 0 {
                    p.muted #nothing-to-move { "Nothing would move." }
                } @else {
                    form method="post" action="/workflows/move" #confirm-move-form {
                        (super::csrf_field(console, who))
                        input type="hidden" name="workflow" value=(form.workflow);
                        input type="hidden" name="from" value=(outcome.from);
                        input type="hidden" name="to" value=(outcome.to);
                        @for line in form.mapping.lines() { input type="hidden" name="mapping" value=(line); }
                        input type="hidden" name="confirm" value=(moved);
                        button.danger type="submit" #confirm-move data-count=(moved) { "Move " (moved) " orders" }
                        span.muted { " (refused if more would move by then: look again)" }
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use sas_store::machine::kind::{CallStep, DelayStep, Kind, WaitStep};
    use sas_store::machine::park::OnTimeout;
    use sas_store::NewStep;

    use super::{MoveForm, StepView};

    fn step(name: &str, kind: Kind) -> NewStep {
        NewStep {
            name: name.into(),
            kind,
            timeout: Duration::from_millis(1500),
            group: None,
        }
    }

    #[test]
    fn a_step_says_what_it_does_by_kind() {
        let call = StepView::of(&step(
            "reserve_stock",
            Kind::Call(CallStep::new("inventory", "reserve", Some("release"))),
        ));
        assert_eq!(
            (call.kind, call.does.as_str()),
            ("call", "call inventory.reserve")
        );
        assert_eq!(call.compensation.as_deref(), Some("release"));
        assert_eq!(call.timeout_ms, 1500);
        let wait = StepView::of(&step(
            "approval",
            Kind::Wait(WaitStep {
                event: "approved".into(),
                on_timeout: OnTimeout::Fail,
                correlation_key: None,
                senders: Vec::new(),
            }),
        ));
        assert_eq!(
            (wait.kind, wait.does.as_str()),
            ("wait", "wait for approved")
        );
        assert_eq!((wait.agent, wait.compensation), (None, None));
        assert_eq!(wait.on_timeout, Some(OnTimeout::Fail));
        let delay = StepView::of(&step(
            "cooling_off",
            Kind::Delay(DelayStep {
                delay_ms: 600_000,
                not_before: Some("/attributes/ship_after".into()),
            }),
        ));
        assert_eq!(delay.kind, "delay");
        assert_eq!(
            delay.does,
            "delay 600 s, not before the order's /attributes/ship_after"
        );
    }

    #[test]
    fn the_form_reads_its_mapping_from_lines_or_repeated_fields() {
        let pairs = |list: &[(&str, &str)]| -> Vec<(String, String)> {
            list.iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect()
        };
        let typed = MoveForm::from_pairs(&pairs(&[
            ("workflow", " order "),
            ("from", "1"),
            ("to", "2"),
            ("mapping", "a=b\r\n\r\n c = d \r\n"),
        ]));
        let carried = MoveForm::from_pairs(&pairs(&[
            ("workflow", "order"),
            ("from", "1"),
            ("to", "2"),
            ("mapping", "a=b"),
            ("mapping", "c = d"),
        ]));
        for form in [&typed, &carried] {
            let ask = form.ask(Some(2)).unwrap();
            assert_eq!((ask.workflow.as_str(), ask.from, ask.to), ("order", 1, 2));
            let mapping: Vec<(&str, &str)> = ask
                .mapping
                .iter()
                .map(|(k, v)| (k.as_str(), v.as_str()))
                .collect();
            assert_eq!(mapping, [("a", "b"), ("c", "d")]);
            assert_eq!(ask.confirm, Some(2));
        }
        for (from, mapping) in [("x", "a=b"), ("1", "a"), ("1", "=b"), ("1", "a=b\na=c")] {
            let form = MoveForm::from_pairs(&pairs(&[
                ("workflow", "order"),
                ("from", from),
                ("to", "2"),
                ("mapping", mapping),
            ]));
            let refused = form.ask(None).unwrap_err();
            assert_eq!(
                refused.status,
                axum::http::StatusCode::BAD_REQUEST,
                "{mapping}"
            );
        }
    }
}
