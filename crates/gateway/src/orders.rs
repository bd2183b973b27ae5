//! The client API: submit an order, read its status, wait for its outcome.
//!
//! A submission is validated as intake validates it (the same decoder and
//! [`SubmitOrder::validate`]), then published to the orders queue like any
//! client's, persistent and confirmed: the scheduler's intake stays the one
//! way in. Idempotent on the order id: an id the store already holds with
//! the same content is answered 200 with where to look; with other content
//! 409. Two different orders under one new id sent at the same moment both
//! get 202, and intake keeps the first (the second is dead-lettered as a
//! conflict): the status of the id says which one runs.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use chrono::{DateTime, Utc};
use sas_broker::publish::{json_properties, order_headers, Outgoing};
use sas_messages::SubmitOrder;
use sas_store::machine::StepRow;
use sas_store::reads::queries::{ChildLink, OrderSummary};
use sas_store::ProcessState;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::{Caller, Gateway};

/// What a submission was taken as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Taken {
    /// Published to the orders queue and confirmed by the broker: intake
    /// will store it (202).
    Accepted,
    /// The store already holds this order, with the same content (200).
    AlreadyAccepted,
}

/// The answer to a submission: where to look next.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct Submitted {
    /// The order's id.
    pub order_id: String,
    /// What the submission was taken as.
    pub status: Taken,
    /// Where its status is read (also the `Location` header);
    /// `?wait=SECONDS` waits for its outcome.
    pub status_url: String,
}

/// One step of an order, as a client sees it.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct StepStatus {
    /// The step's name in the workflow.
    pub name: String,
    /// `not_started`, `running`, `completed`, `failed`, `compensating`, `compensated`.
    pub state: String,
    /// Attempts so far.
    pub attempts: i32,
    /// The order a child step started (`ord-1:fulfil`), once it started:
    /// read it here as any order of the tenant.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub child_order_id: Option<String>,
}

/// An order's status.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct OrderStatusView {
    /// The order's id.
    pub order_id: String,
    /// `pending`, `processing`, `compensating`, `processed`, `compensated` or `error`.
    pub state: String,
    /// The workflow it follows.
    pub workflow: String,
    /// The version of the workflow it started with.
    pub workflow_version: i32,
    /// Once it has ended: `processed` (every step done), `compensated`
    /// (undone as a whole) or `failed` (could be neither: operators were
    /// alerted); `null` while it runs.
    pub outcome: Option<String>,
    /// Deadlines missed so far.
    pub failure_count: i32,
    /// The last error seen, if any.
    pub last_error: Option<String>,
    /// Its steps, in order.
    pub steps: Vec<StepStatus>,
    /// The order whose child step started this one, if one did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parent_order_id: Option<String>,
    /// When intake stored it.
    pub created_at: DateTime<Utc>,
    /// When it last changed.
    pub updated_at: DateTime<Utc>,
}

impl OrderStatusView {
    /// The view of an order, its parent (if a child step started it) and
    /// the children its steps started, oldest first.
    fn new(
        summary: &OrderSummary,
        steps: &[StepRow],
        parent: Option<&str>,
        children: &[ChildLink],
    ) -> Self {
        let outcome = match summary.state {
            ProcessState::Processed => Some("processed"),
            ProcessState::Compensated => Some("compensated"),
            ProcessState::Error => Some("failed"),
            _ => None,
        };
        Self {
            order_id: sas_messages::ids::client_id(&summary.order_id).to_owned(),
            state: summary.state.as_str().to_owned(),
            workflow: summary.workflow.clone(),
            workflow_version: summary.workflow_version,
            outcome: outcome.map(str::to_owned),
            failure_count: summary.failure_count,
            last_error: summary.last_error.clone(),
            steps: steps
                .iter()
                .map(|step| StepStatus {
                    name: step.name.clone(),
                    state: step.state.as_str().to_owned(),
                    attempts: step.attempt,
                    child_order_id: ChildLink::latest(children, &step.name)
                        .map(|child| sas_messages::ids::client_id(&child.order_id).to_owned()),
                })
                .collect(),
            parent_order_id: parent.map(|id| sas_messages::ids::client_id(id).to_owned()),
            created_at: summary.created_at,
            updated_at: summary.updated_at,
        }
    }
}

/// A refusal or failure: what went wrong and what to do.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct Problem {
    /// What went wrong, and what to do about it.
    pub error: String,
}

/// An error answer.
pub fn problem(status: StatusCode, error: impl Into<String>) -> Response {
    let error = error.into();
    metrics::counter!("sas_gateway_refused_total", "status" => status.as_str().to_owned())
        .increment(1);
    (status, Json(Problem { error })).into_response()
}

/// 503 with `Retry-After` for a store that failed (logged).
pub(crate) fn store_unavailable(error: &sas_store::StoreError) -> Response {
    tracing::warn!(%error, "the state store failed");
    let mut response = problem(
        StatusCode::SERVICE_UNAVAILABLE,
        "the state store cannot be reached: try again shortly",
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
    response
}

fn counted(outcome: &'static str) {
    metrics::counter!("sas_gateway_submissions_total", "outcome" => outcome).increment(1);
}

/// The answer to a body that could not be read: 413 over the gateway's
/// limit, 408 for one that did not arrive within
/// [`crate::BODY_READ_TIMEOUT`] (a client that trickles its body holds a
/// connection no longer).
pub(crate) fn unreadable_body(rejection: &BytesRejection) -> Response {
    let status = rejection.status();
    if status == StatusCode::PAYLOAD_TOO_LARGE {
        return problem(status, "the body is over the gateway's 1 MiB limit");
    }
    problem(
        StatusCode::REQUEST_TIMEOUT,
        format!(
            "the body did not arrive within {} s: send it whole, at once",
            crate::BODY_READ_TIMEOUT.as_secs()
        ),
    )
}

/// `POST /v1/orders`: a [`SubmitOrder`] as JSON.
pub async fn submit(
    State(gateway): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let body = match body {
        Ok(body) => body,
        Err(rejection) => return unreadable_body(&rejection),
    };
    let order = match parse_submission(&body, gateway.settings.amqp.max_message_bytes) {
        Ok(order) => order,
        Err((status, error)) => {
            counted("invalid");
            return problem(status, error);
        }
    };
    let tenant = match gateway.tenant_of(&caller) {
        Ok(tenant) => tenant,
        Err(refused) => return *refused,
    };
    if let Some(refused) = refuse_for_tenant(&gateway, &tenant, &order) {
        counted("forbidden");
        return refused;
    }
    if let Some(reason) = gateway.workflows.refusal(&gateway.store, &order).await {
        counted("invalid");
        return problem(StatusCode::BAD_REQUEST, reason);
    }
    let stored_id = order.order_id.qualified(&tenant);
    if let Some(answer) = answer_if_stored(&gateway, &order, &stored_id).await {
        return answer;
    }
    if let Some(refused) = refuse_over_quota(&gateway, &tenant).await {
        counted("over_quota");
        return refused;
    }
    match publish_order(&gateway, &order, &stored_id, &caller).await {
        Ok(()) => {
            counted("accepted");
            tracing::info!(order_id = %order.order_id, client = %caller.0, "order accepted over HTTP");
            submitted(&order, StatusCode::ACCEPTED, Taken::Accepted)
        }
        Err(error) => {
            counted("unavailable");
            tracing::warn!(order_id = %order.order_id, %error, "order not confirmed by the broker");
            not_confirmed(&format!("the order was not accepted: the broker did not confirm it ({error}); send the same order again, which is safe (idempotent on order_id)"))
        }
    }
}

/// 429 with `Retry-After` when the tenant is over its quota now (read
/// without taking a turn; intake takes it, and still refuses what gets
/// past this check in a race). A store that cannot be read lets the order
/// through: intake enforces the quota either way.
async fn refuse_over_quota(gateway: &Gateway, tenant: &str) -> Option<Response> {
    let quota = gateway.tenancy.quota(tenant)?;
    let wait = match gateway.store.admission().quota_wait(tenant, quota).await {
        Ok(wait) => wait?,
        Err(error) => {
            tracing::warn!(tenant, %error, "the tenant's quota could not be read: the order goes to intake, which applies it");
            return None;
        }
    };
    let seconds = wait.as_secs_f64().ceil().max(1.0) as u64;
    let mut response = problem(
        StatusCode::TOO_MANY_REQUESTS,
        format!(
            "over tenant {tenant}'s quota ({} orders a second, burst {}): nothing was sent; send it again in {seconds} s",
            quota.per_second, quota.burst
        ),
    );
    response.headers_mut().insert(
        axum::http::header::RETRY_AFTER,
        axum::http::HeaderValue::from(seconds),
    );
    Some(response)
}

/// The answer refusing `order` at once for what its client's tenant may
/// not do (the schedulers would refuse it too): a workflow or a priority
/// the tenant may not use (403), or, with tenancy configured, a
/// `reply_to` (400: the gateway's clients read their status over HTTP,
/// and a queue named here would be the gateway's, not theirs).
fn refuse_for_tenant(gateway: &Gateway, tenant: &str, order: &SubmitOrder) -> Option<Response> {
    if let Err(reason) = gateway
        .tenancy
        .may_start(tenant, order.workflow(), order.priority())
    {
        return Some(problem(StatusCode::FORBIDDEN, reason));
    }
    if gateway.tenancy.is_configured() && order.reply_to.is_some() {
        return Some(problem(
            StatusCode::BAD_REQUEST,
            "reply_to: an order sent over HTTP names no reply queue; read its status at its status_url (?wait=SECONDS for the outcome)",
        ));
    }
    None
}

/// 503 with `Retry-After`: the broker did not confirm what was to be
/// published; `message` says to send it again.
pub(crate) fn not_confirmed(message: &str) -> Response {
    let mut response = problem(StatusCode::SERVICE_UNAVAILABLE, message);
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("5"));
    response
}

/// Decodes and validates a submission's body as intake would (at most
/// `limit` bytes), or the status and reason to refuse it with: 413 over
/// the size limit, 400 otherwise.
fn parse_submission(body: &[u8], limit: usize) -> Result<SubmitOrder, (StatusCode, String)> {
    let order: SubmitOrder = match sas_messages::decode::decode(body, limit) {
        Ok(order) => order,
        Err(error @ sas_messages::decode::DecodeError::TooLarge { .. }) => {
            return Err((StatusCode::PAYLOAD_TOO_LARGE, error.to_string()));
        }
        Err(error) => return Err((StatusCode::BAD_REQUEST, error.to_string())),
    };
    if let Err(error) = order.validate() {
        return Err((StatusCode::BAD_REQUEST, error.to_string()));
    }
    Ok(order)
}

/// The answer for an order id the store already holds: 200 for the same
/// content, 409 for other content; 503 when the store cannot say. `None`
/// for a new id, which is published.
async fn answer_if_stored(
    gateway: &Gateway,
    order: &SubmitOrder,
    stored_id: &str,
) -> Option<Response> {
    // Stored as intake stores it: under the tenant's id.
    let mut stored = order.clone();
    stored.order_id = stored_id.into();
    let content = serde_json::to_value(&stored).expect("wire types always serialize");
    match gateway.store.reads().order_body(stored_id).await {
        Ok(Some(existing)) if existing == content => {
            counted("duplicate");
            Some(submitted(order, StatusCode::OK, Taken::AlreadyAccepted))
        }
        Ok(Some(_)) => {
            counted("conflict");
            Some(problem(
                StatusCode::CONFLICT,
                format!(
                    "order {} was already submitted with other content: an order id names one order; choose a new id",
                    order.order_id
                ),
            ))
        }
        Ok(None) => None,
        Err(error) => Some(store_unavailable(&error)),
    }
}

/// Publishes the order to the orders exchange, persistent, and waits for
/// the broker's confirm (up to `gateway.publish_timeout_ms`).
///
/// # Errors
/// When the broker has not confirmed it by then.
async fn publish_order(
    gateway: &Gateway,
    order: &SubmitOrder,
    stored_id: &str,
    caller: &Caller,
) -> Result<(), sas_broker::BrokerError> {
    // Sent on the client's behalf (the schedulers believe the header from
    // the gateway's broker user, amqp.delegating_users); a refusal's dead
    // letter is recorded under the id the client's GET looks up.
    let mut headers = order_headers(stored_id, None);
    headers.insert(
        sas_messages::headers::SENDER.into(),
        sas_broker::lapin::types::AMQPValue::LongString(caller.identity().into()),
    );
    let properties = json_properties(&format!("gateway-{stored_id}"))
        .with_correlation_id(order.order_id.to_string().into())
        .with_headers(headers);
    // To the orders exchange, as every client publishes (a client's broker
    // user may publish there and nowhere else).
    let body = serde_json::to_vec(order).expect("wire types always serialize");
    publish_confirmed(gateway, gateway.names.orders(), body, properties).await
}

/// Publishes `body` to `exchange` (a fanout, as clients publish),
/// persistent and mandatory, and waits for the broker's confirm (up to
/// `gateway.publish_timeout_ms`).
///
/// # Errors
/// When the broker has not confirmed it by then.
pub(crate) async fn publish_confirmed(
    gateway: &Gateway,
    exchange: String,
    body: Vec<u8>,
    properties: sas_broker::lapin::BasicProperties,
) -> Result<(), sas_broker::BrokerError> {
    let message = Outgoing {
        exchange,
        routing_key: String::new(),
        body,
        properties,
        mandatory: true,
    };
    let give_up = tokio::time::Instant::now()
        + Duration::from_millis(gateway.settings.gateway.publish_timeout_ms);
    gateway
        .publisher
        .deliver(None, &[message], give_up, &gateway.shutdown)
        .await
}

/// The answer to a submission taken (`status`): where to look next, in the
/// body and the `Location` header.
fn submitted(order: &SubmitOrder, code: StatusCode, status: Taken) -> Response {
    let status_url = format!("/v1/orders/{}", order.order_id);
    let mut response = (
        code,
        Json(Submitted {
            order_id: order.order_id.to_string(),
            status,
            status_url: status_url.clone(),
        }),
    )
        .into_response();
    if let Ok(location) = HeaderValue::from_str(&status_url) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    response
}

/// `?wait=SECONDS`.
#[derive(Debug, Deserialize)]
pub struct StatusQuery {
    /// Wait up to this long (at most `gateway.max_wait_secs`) for the order
    /// to end, or, for an id not stored yet, to appear.
    #[serde(default)]
    pub wait: Option<u64>,
}

/// What `GET /v1/orders/{id}` answers (422) for an order intake refused:
/// it was never stored, and never will be under that body.
#[derive(Debug, Clone, Serialize, JsonSchema)]
pub struct RejectedView {
    /// What happened, and what to do about it.
    pub error: String,
    /// The order.
    pub order_id: String,
    /// Always `rejected`.
    pub state: &'static str,
    /// Why intake refused it.
    pub reason: String,
    /// When the refusal was recorded.
    pub rejected_at: DateTime<Utc>,
}

/// How often a waiting request reads the order again.
const WAIT_POLL: Duration = Duration::from_millis(250);

/// `GET /v1/orders/{id}`.
pub async fn status(
    State(gateway): State<Arc<Gateway>>,
    Extension(caller): Extension<Caller>,
    Path(order_id): Path<String>,
    Query(query): Query<StatusQuery>,
) -> Response {
    let wait = Duration::from_secs(
        query
            .wait
            .unwrap_or(0)
            .min(gateway.settings.gateway.max_wait_secs),
    );
    // Held until the answer: a waiting read takes one of the client's places.
    let _long_poll = if wait.is_zero() {
        None
    } else {
        match gateway.long_polls.enter(&caller.0) {
            Some(place) => Some(place),
            None => {
                return problem(
                    StatusCode::TOO_MANY_REQUESTS,
                    format!(
                        "client {} holds {} waiting reads already (gateway.max_long_polls_per_client): ask without ?wait, or once one has been answered",
                        caller.0, gateway.settings.gateway.max_long_polls_per_client
                    ),
                )
            }
        }
    };
    let tenant = match gateway.tenant_of(&caller) {
        Ok(tenant) => tenant,
        Err(refused) => return *refused,
    };
    // Another tenant's order of the same id is another order: this
    // client's own, or none at all.
    let stored_id = sas_messages::OrderId::from(order_id.as_str()).qualified(&tenant);
    if order_id.contains(sas_messages::ids::TENANT_SEPARATOR) {
        return problem(
            StatusCode::NOT_FOUND,
            format!("no order {order_id}: name an order by the id you submitted"),
        );
    }
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        // The process record and steps only: a waiting request reads them
        // every quarter second, and needs neither the body nor the history.
        let status = match gateway.store.reads().order_status(&stored_id).await {
            Ok(status) => status,
            Err(error) => return store_unavailable(&error),
        };
        // Not stored: intake may have refused it (an unknown workflow,
        // attributes against its schema), which ends it as surely.
        let refusal = match &status {
            Some(_) => None,
            None => match gateway
                .store
                .reads()
                .order_refusal(
                    &stored_id,
                    &gateway.names,
                    gateway.settings.amqp.user().as_deref(),
                )
                .await
            {
                Ok(refusal) => refusal,
                Err(error) => return store_unavailable(&error),
            },
        };
        let ended = refusal.is_some()
            || status
                .as_ref()
                .is_some_and(|(summary, _)| summary.state.is_terminal());
        if ended || tokio::time::Instant::now() + WAIT_POLL > deadline {
            if let Some(refusal) = refusal {
                metrics::counter!("sas_gateway_refused_total", "status" => "422").increment(1);
                let rejected = RejectedView {
                    error: format!("order {order_id} was rejected at intake: {}; correct it and submit it again", refusal.reason),
                    order_id,
                    state: "rejected",
                    reason: refusal.reason,
                    rejected_at: refusal.at,
                };
                return (StatusCode::UNPROCESSABLE_ENTITY, Json(rejected)).into_response();
            }
            return match status {
                Some((summary, steps)) => {
                    let reads = gateway.store.reads();
                    let links = tokio::try_join!(reads.parent_of(&stored_id), reads.children_of(&stored_id));
                    let (parent, children) = match links {
                        Ok(links) => links,
                        Err(error) => return store_unavailable(&error),
                    };
                    let parent = parent.map(|link| link.order_id);
                    let view = OrderStatusView::new(&summary, &steps, parent.as_deref(), &children);
                    Json(view).into_response()
                }
                None => problem(
                    StatusCode::NOT_FOUND,
                    format!("no order {order_id}: not submitted, not stored yet (ask again with ?wait=SECONDS), or removed by retention"),
                ),
            };
        }
        tokio::select! {
            () = tokio::time::sleep(WAIT_POLL) => {}
            () = gateway.shutdown.cancelled() => {
                return problem(StatusCode::SERVICE_UNAVAILABLE, "the gateway is shutting down: ask again");
            }
        }
    }
}
