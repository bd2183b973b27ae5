//! The JSON API: what the pages show and do, for scripts. Same guard as
//! the pages: basic auth or a bearer token; actions need the operator role
//! and the user's CSRF token in `X-CSRF-Token` (from `GET /api/session`).
//! Failures are `{"error": "..."}` with the HTTP status saying which kind.

use std::collections::BTreeMap;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, Query, RawQuery, State};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use sas_store::reads::search::{OrderFilter, Page};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::actions::{BulkOutcome, Done, EventSent, MoveAsk, MoveOutcome, OrderAction, Preview};
use crate::auth::Principal;
use crate::error::{ApiFailure, Failure};
use crate::pages::{borrowed, query_pairs};
use crate::Console;

/// The API's routes (behind the guard).
pub fn routes() -> Router<Arc<Console>> {
    Router::new()
        .route("/api/session", get(session))
        .route("/api/overview", get(overview))
        .route("/api/orders", get(orders))
        .route("/api/orders/{id}", get(order))
        .route("/api/orders/{id}/resubmit", post(resubmit))
        .route("/api/orders/{id}/resume", post(resume))
        .route("/api/orders/{id}/cancel", post(cancel))
        .route("/api/orders/{id}/signal", post(signal))
        .route("/api/bulk/{action}/preview", get(preview))
        .route("/api/bulk/{action}", post(bulk))
        .route("/api/workflows", get(workflows))
        .route("/api/workflows/move", post(move_orders))
        .route("/api/schedules", get(schedules).post(create_schedule))
        .route("/api/schedules/{tenant}/{name}", get(schedule))
        .route(
            "/api/schedules/{tenant}/{name}/{action}",
            post(act_on_schedule),
        )
        .route("/api/alerts", get(alerts))
        .route("/api/alerts/{id}/acknowledge", post(acknowledge))
        .route("/api/alerts/{id}/resolve", post(resolve))
        .route("/api/dead-letters", get(dead_letters))
        .route("/api/dead-letters/{id}/replay", post(replay))
        .route("/api/dead-letters/{id}/discard", post(discard))
}

type ApiResult<T> = Result<Json<T>, ApiFailure>;

/// Reads an optional JSON body (an empty body is the default).
fn body<T: DeserializeOwned + Default>(bytes: &Bytes) -> Result<T, Failure> {
    if bytes.iter().all(u8::is_ascii_whitespace) {
        return Ok(T::default());
    }
    serde_json::from_slice(bytes)
        .map_err(|e| Failure::bad_request(format!("the body is not the JSON expected: {e}")))
}

/// Who is asking, and the CSRF token their actions must carry.
#[derive(Debug, Serialize)]
pub struct Session {
    /// The caller.
    #[serde(flatten)]
    pub principal: Principal,
    /// Send it as `X-CSRF-Token` with every action.
    pub csrf_token: String,
}

async fn session(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
) -> Json<Session> {
    Json(Session {
        csrf_token: console.auth.csrf_token(&who),
        principal: who,
    })
}

async fn overview(State(console): State<Arc<Console>>) -> ApiResult<Value> {
    let overview = console.overview().await?;
    Ok(Json(serde_json::to_value(&*overview).unwrap_or_default()))
}

async fn orders(
    State(console): State<Arc<Console>>,
    RawQuery(raw): RawQuery,
) -> ApiResult<sas_store::reads::search::OrderPage> {
    let pairs = query_pairs(raw.as_deref());
    let filter = OrderFilter::from_pairs(borrowed(&pairs), &crate::pages::orders::PAGE_PARAMETERS)?;
    let page = Page::from_pairs(borrowed(&pairs), console.settings.console.page_size)?;
    Ok(Json(
        console.store.reads().search_orders(&filter, &page).await?,
    ))
}

async fn order(
    State(console): State<Arc<Console>>,
    Path(order_id): Path<String>,
) -> ApiResult<Value> {
    let view = crate::pages::order::load(&console, &order_id).await?;
    let (what, remaining) =
        crate::pages::order::remaining(view.detail.summary.state, &view.detail.steps);
    let remaining: Vec<&str> = remaining.iter().map(|s| s.name.as_str()).collect();
    let waiting = crate::actions::waiting_for_event(view.detail.summary.state, &view.detail.steps)
        .map(|waiting| {
            json!({
                "step": waiting.step.name,
                "event": waiting.event,
                "until": waiting.step.complete_by,
                "on_timeout": waiting.on_timeout,
            })
        });
    Ok(Json(json!({
        "order": view.detail,
        "delivery": view.delivery,
        "remaining": { "what": what, "steps": remaining },
        "waiting": waiting,
    })))
}

async fn resubmit(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(order_id): Path<String>,
) -> ApiResult<Done> {
    Ok(Json(console.resubmit(&order_id, &who).await?))
}

/// Body of a resume.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResumeBody {
    /// What was fixed, recorded in the history (required).
    #[serde(default)]
    reason: String,
}

async fn resume(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(order_id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Done> {
    let request: ResumeBody = body(&bytes)?;
    Ok(Json(
        console.resume(&order_id, &request.reason, &who).await?,
    ))
}

/// Body of a cancellation.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CancelBody {
    /// Why, recorded in the history.
    #[serde(default)]
    reason: String,
}

async fn cancel(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(order_id): Path<String>,
    bytes: Bytes,
) -> ApiResult<Done> {
    let request: CancelBody = body(&bytes)?;
    Ok(Json(
        console.cancel(&order_id, &request.reason, &who).await?,
    ))
}

/// Body of an event sent to an order's wait step.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SignalBody {
    /// The event's name, as the wait step names it (`approved`).
    #[serde(default)]
    event: String,
}

async fn signal(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(order_id): Path<String>,
    bytes: Bytes,
) -> ApiResult<EventSent> {
    let request: SignalBody = body(&bytes)?;
    if request.event.is_empty() {
        return Err(Failure::bad_request(
            "an event needs {\"event\": NAME}, the name the order's wait step waits for (GET /api/orders/ID shows it)",
        )
        .into());
    }
    Ok(Json(
        console.send_event(&order_id, &request.event, &who).await?,
    ))
}

async fn preview(
    State(console): State<Arc<Console>>,
    Path(action): Path<String>,
    RawQuery(raw): RawQuery,
) -> ApiResult<Preview> {
    let action: OrderAction = action.parse()?;
    let pairs = query_pairs(raw.as_deref());
    let filter = OrderFilter::from_pairs(borrowed(&pairs), &[])?;
    Ok(Json(console.preview(action, &filter).await?))
}

/// Body of a bulk action: the count its preview returned, and why (what
/// was fixed, for a resume: required).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct BulkBody {
    confirmed: Option<i64>,
    #[serde(default)]
    reason: String,
}

async fn bulk(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(action): Path<String>,
    RawQuery(raw): RawQuery,
    bytes: Bytes,
) -> ApiResult<BulkOutcome> {
    let action: OrderAction = action.parse()?;
    let pairs = query_pairs(raw.as_deref());
    let filter = OrderFilter::from_pairs(borrowed(&pairs), &[])?;
    let request: BulkBody = body(&bytes)?;
    let confirmed = request.confirmed.filter(|n| *n >= 0).ok_or_else(|| {
        Failure::bad_request(format!(
            "a bulk action needs {{\"confirmed\": N}}, N being the count GET /api/bulk/{}/preview returned for the same filter",
            action.as_str()
        ))
    })?;
    Ok(Json(
        console
            .bulk(action, &filter, confirmed, &request.reason, &who)
            .await?,
    ))
}

async fn workflows(
    State(console): State<Arc<Console>>,
) -> ApiResult<Vec<crate::pages::workflows::WorkflowView>> {
    Ok(Json(crate::pages::workflows::load(&console).await?))
}

async fn schedules(
    State(console): State<Arc<Console>>,
) -> ApiResult<Vec<crate::pages::schedules::Listed>> {
    Ok(Json(crate::pages::schedules::load(&console).await?))
}

async fn schedule(
    State(console): State<Arc<Console>>,
    Path((tenant, name)): Path<(String, String)>,
) -> ApiResult<Value> {
    let (schedule, runs) = crate::pages::schedules::load_one(&console, &tenant, &name).await?;
    Ok(Json(json!({ "schedule": schedule, "runs": runs })))
}

async fn create_schedule(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    bytes: Bytes,
) -> ApiResult<Done> {
    let ask: sas_store::schedules::ScheduleAsk = serde_json::from_slice(&bytes)
        .map_err(|e| Failure::bad_request(format!("the body is not the schedule expected: {e}")))?;
    Ok(Json(console.create_schedule(&ask, &who).await?))
}

async fn act_on_schedule(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path((tenant, name, action)): Path<(String, String, String)>,
) -> ApiResult<Done> {
    Ok(Json(
        console
            .act_on_schedule(&tenant, &name, &action, &who)
            .await?,
    ))
}

/// Body of a move of waiting orders: without `confirm`, a look.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct MoveBody {
    #[serde(default)]
    workflow: String,
    from: Option<i32>,
    to: Option<i32>,
    /// Old step names to new ones.
    #[serde(default)]
    mapping: BTreeMap<String, String>,
    /// How many orders the look said would move.
    confirm: Option<usize>,
}

async fn move_orders(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    bytes: Bytes,
) -> ApiResult<MoveOutcome> {
    let request: MoveBody = body(&bytes)?;
    let (Some(from), Some(to)) = (request.from, request.to) else {
        return Err(Failure::bad_request(
            "a move needs {\"workflow\": W, \"from\": VERSION, \"to\": VERSION}, with \"mapping\": {OLD: NEW} for renamed steps, and \"confirm\": N (the look's count of moved orders) to move them",
        )
        .into());
    };
    let ask = MoveAsk {
        workflow: request.workflow,
        from,
        to,
        mapping: request.mapping,
        confirm: request.confirm,
    };
    Ok(Json(console.move_orders(&ask, &who).await?))
}

/// Query of the alerts list.
#[derive(Debug, Deserialize)]
struct AlertsQuery {
    #[serde(default)]
    all: bool,
}

async fn alerts(
    State(console): State<Arc<Console>>,
    Query(query): Query<AlertsQuery>,
) -> ApiResult<Vec<sas_store::reads::queries::Alert>> {
    Ok(Json(console.store.reads().alerts(query.all, 1000).await?))
}

async fn acknowledge(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<i64>,
) -> ApiResult<Done> {
    Ok(Json(console.acknowledge_alert(id, &who).await?))
}

/// Body of a resolution.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct ResolveBody {
    #[serde(default)]
    note: String,
}

async fn resolve(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<i64>,
    bytes: Bytes,
) -> ApiResult<Done> {
    let request: ResolveBody = body(&bytes)?;
    Ok(Json(console.resolve_alert(id, &request.note, &who).await?))
}

async fn dead_letters(
    State(console): State<Arc<Console>>,
) -> ApiResult<Vec<sas_store::reads::queries::DeadLetter>> {
    Ok(Json(console.store.reads().dead_letters(1000).await?))
}

async fn replay(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<i64>,
) -> ApiResult<Done> {
    Ok(Json(console.replay_dead_letter(id, &who).await?))
}

async fn discard(
    State(console): State<Arc<Console>>,
    Extension(who): Extension<Principal>,
    Path(id): Path<i64>,
) -> ApiResult<Done> {
    Ok(Json(console.discard_dead_letter(id, &who).await?))
}
