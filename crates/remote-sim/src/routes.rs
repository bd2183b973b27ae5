//! The HTTP API of the simulated services.
//!
//! - `POST`, `PUT` or `PATCH /{service}/{operation}` with an
//!   `Idempotency-Key` header and a JSON body: the call (the operations are
//!   [`SERVICES`]; all three methods are the same call).
//! - `GET /side-effects`: every decided key (applied or refused), oldest
//!   first, with the deciding call's method and body.
//! - `GET /stats`: counters.
//! - `PUT /admin/faults` (all services) or `PUT /admin/faults/{service}`:
//!   change latency and fault rates at run time.
//! - `GET`/`PUT /admin/provider`: the provider mode (`lenient` or `strict`)
//!   and its late answers, at run time.
//! - `PUT /admin/throttle/{service}` `{"for_ms": N}`: the service answers
//!   every call 429 with `Retry-After` for the next N ms (nothing applied),
//!   as a provider rate-limiting an API key does.
//! - `PUT /admin/throttle/{service}/{merchant}` `{"for_ms": N}`: the same,
//!   for one merchant's API key of the service.
//! - `PUT /admin/capacity/{service}/{merchant}` `{"calls": N, "call_ms": M}`:
//!   the merchant's API serves N calls at once, M ms each; more wait there
//!   (see [`crate::capacity`]).
//! - `GET /concurrency`: calls in flight per merchant.
//! - `GET /healthz`, `GET /readyz`, `GET /metrics` (`sas_sim_calls_total{service,outcome}`).
//!
//! With `sim.auth_token` set, the service routes require
//! `Authorization: Bearer <token>` (401 otherwise); with `sim.admin_token`,
//! so do `/admin/*`, `/side-effects` and `/stats`.
//!
//! Strict mode, like a real payment API:
//! - a call for a key whose first call is still being answered gets 409;
//! - `late_answer_rate` of the actions are applied at once and answered
//!   `late_answer_ms` later;
//! - the undo (`<key>:undo`, by the compensation of the action's pair) of
//!   a key never applied gets 404, not recorded
//!   (a retry looks again); with `late_action = "refuse"` it tombstones the
//!   action key, so the action arriving late is refused (410);
//! - `applied_at` in the ledger says when each effect was applied.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::ledger::{Decision, Entry, Ledger};
use crate::settings::{check_forgetting, Faults, LateAction, Mode, Provider, Settings};

/// Services and the operations each offers, in pairs: an action, then the
/// compensation that undoes it. The first pair serves the order workflow;
/// the second a return (goods received, the payment credited back, the
/// stock restocked).
pub const SERVICES: [(&str, &[(&str, &str)]); 3] = [
    (
        "inventory",
        &[("reserve", "release"), ("restock", "destock")],
    ),
    ("payment", &[("charge", "refund"), ("credit", "debit")]),
    ("shipping", &[("ship", "cancel"), ("receive", "reject")]),
];

/// SKUs starting with this are always out of stock (a permanent fault on reserve).
pub const OUT_OF_STOCK_PREFIX: &str = "OUT-OF-STOCK";

/// Shared state of the simulator.
#[derive(Clone)]
pub struct SimState {
    ledger: Arc<Mutex<Ledger>>,
    faults: Arc<RwLock<(Faults, HashMap<String, Faults>)>>,
    rng: Arc<Mutex<StdRng>>,
    decline_above_cents: i64,
    shutdown: CancellationToken,
    provider: Arc<RwLock<Provider>>,
    /// `sim.keys_kept_secs`, which strict mode may not be switched on beside.
    keys_kept_secs: u64,
    /// `sim.record_bodies`: the ledger keeps each deciding call's body.
    record_bodies: bool,
    /// Strict mode: keys whose call is being answered.
    in_flight: Arc<Mutex<HashSet<String>>>,
    auth_token: Option<Arc<str>>,
    admin_token: Option<Arc<str>>,
    /// Services answering 429 with `Retry-After` until the instant each
    /// names (`PUT /admin/throttle/{service}`), as a provider rate-limiting
    /// an API key does.
    throttles: Arc<Mutex<HashMap<String, std::time::Instant>>>,
    /// Calls in flight per merchant (`GET /concurrency`).
    concurrency: crate::concurrency::Concurrency,
    /// Merchants' APIs that serve so many calls at once.
    capacities: crate::capacity::Capacities,
}

/// Marks a key in flight until the answer is sent or the caller went away
/// (the handler's future is dropped then).
struct InFlight {
    keys: Arc<Mutex<HashSet<String>>>,
    key: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.keys
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&self.key);
    }
}

impl SimState {
    /// State from settings, reloading the journal if one is configured.
    ///
    /// # Errors
    /// When the journal cannot be read.
    pub fn new(settings: &Settings, shutdown: CancellationToken) -> anyhow::Result<Self> {
        let seed = if settings.sim.seed == 0 {
            rand::random()
        } else {
            settings.sim.seed
        };
        Ok(Self {
            ledger: Arc::new(Mutex::new(Ledger::open(
                &settings.sim.journal_file,
                settings.sim.keys_kept_secs,
            )?)),
            faults: Arc::new(RwLock::new((settings.sim.faults, HashMap::new()))),
            rng: Arc::new(Mutex::new(StdRng::seed_from_u64(seed))),
            decline_above_cents: settings.sim.decline_above_cents,
            shutdown,
            provider: Arc::new(RwLock::new(settings.sim.provider())),
            keys_kept_secs: settings.sim.keys_kept_secs,
            record_bodies: settings.sim.record_bodies,
            in_flight: Arc::default(),
            auth_token: settings.sim.auth_token.get().map(Arc::from),
            admin_token: settings.sim.admin_token.get().map(Arc::from),
            throttles: Arc::default(),
            concurrency: crate::concurrency::Concurrency::default(),
            capacities: crate::capacity::Capacities::default(),
        })
    }

    fn provider(&self) -> Provider {
        *self.provider.read().unwrap_or_else(|e| e.into_inner())
    }

    fn faults_for(&self, service: &str) -> Faults {
        let guard = self.faults.read().unwrap_or_else(|e| e.into_inner());
        guard.1.get(service).copied().unwrap_or(guard.0)
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The router of the simulator.
pub fn router(state: SimState) -> Router {
    let services = Router::new()
        .route("/{service}/{operation}", post(call).put(call).patch(call))
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_service_token,
        ));
    let admin = Router::new()
        .route("/side-effects", get(side_effects))
        .route("/stats", get(stats))
        .route("/concurrency", get(concurrency))
        .route("/admin/faults", put(set_faults))
        .route("/admin/faults/{service}", put(set_service_faults))
        .route("/admin/provider", get(get_provider).put(set_provider))
        .route("/admin/throttle/{service}", put(set_throttle))
        .route(
            "/admin/throttle/{service}/{merchant}",
            put(set_merchant_throttle),
        )
        .route(
            "/admin/capacity/{service}/{merchant}",
            put(set_merchant_capacity),
        )
        .route_layer(axum::middleware::from_fn_with_state(
            state.clone(),
            require_admin_token,
        ));
    services.merge(admin).with_state(state)
}

/// The trace id of a W3C `traceparent` value (`00-<32 hex>-<16 hex>-<2 hex>`).
fn trace_id_of(traceparent: &str) -> Option<String> {
    let parts: Vec<&str> = traceparent.trim().split('-').collect();
    let hex =
        |text: &str, len: usize| text.len() == len && text.bytes().all(|b| b.is_ascii_hexdigit());
    (parts.len() == 4
        && parts[0] == "00"
        && hex(parts[1], 32)
        && hex(parts[2], 16)
        && hex(parts[3], 2))
    .then(|| parts[1].to_ascii_lowercase())
}

fn bearer_matches(headers: &HeaderMap, token: &str) -> bool {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .is_some_and(|given| given.as_bytes() == token.as_bytes())
}

fn unauthorized(what: &str) -> Response {
    let mut response = error(
        StatusCode::UNAUTHORIZED,
        format!("{what} require Authorization: Bearer <token>; missing or wrong"),
    );
    response.headers_mut().insert(
        axum::http::header::WWW_AUTHENTICATE,
        axum::http::HeaderValue::from_static("Bearer"),
    );
    response
}

async fn require_service_token(
    State(state): State<SimState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match &state.auth_token {
        Some(token) if !bearer_matches(request.headers(), token) => {
            tracing::info!(path = %request.uri().path(), "refused a call without the right bearer token (401)");
            unauthorized("the service routes")
        }
        _ => next.run(request).await,
    }
}

async fn require_admin_token(
    State(state): State<SimState>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    match &state.admin_token {
        Some(token) if !bearer_matches(request.headers(), token) => {
            unauthorized("the admin routes")
        }
        _ => next.run(request).await,
    }
}

fn error(status: StatusCode, message: impl Into<String>) -> Response {
    (status, Json(json!({ "error": message.into() }))).into_response()
}

fn answer(decision: &Decision) -> Response {
    match decision {
        Decision::Applied { result } => (StatusCode::OK, Json(result.clone())).into_response(),
        Decision::Refused {
            status,
            error: reason,
        } => error(
            StatusCode::from_u16(*status).unwrap_or(StatusCode::UNPROCESSABLE_ENTITY),
            reason.clone(),
        ),
    }
}

/// A business refusal that does not depend on chance.
fn business_rule(
    state: &SimState,
    service: &str,
    operation: &str,
    order: &serde_json::Value,
) -> Option<Decision> {
    match (service, operation) {
        ("inventory", "reserve") => {
            let items = order.get("items")?.as_array()?;
            let missing = items.iter().find_map(|line| {
                let sku = line.get("sku")?.as_str()?;
                sku.starts_with(OUT_OF_STOCK_PREFIX).then(|| sku.to_owned())
            })?;
            Some(Decision::Refused {
                status: 409,
                error: format!("sku {missing} is out of stock"),
            })
        }
        ("payment", "charge") => {
            let amount = order.get("amount_cents")?.as_i64()?;
            (amount > state.decline_above_cents).then(|| Decision::Refused {
                status: 402,
                error: format!(
                    "payment of {amount} cents declined (limit {})",
                    state.decline_above_cents
                ),
            })
        }
        _ => None,
    }
}

/// An answer given before a call is decided (boxed: a response is large).
type Refusal = Box<Response>;

fn refuse(status: StatusCode, message: impl Into<String>) -> Refusal {
    Box::new(error(status, message))
}

/// One call as the handler reads it.
struct Call {
    service: String,
    operation: String,
    /// The action of the operation's pair in [`SERVICES`], which this call
    /// is or undoes.
    action: &'static str,
    /// The HTTP method (`POST`, `PUT` or `PATCH`).
    method: String,
    /// The request body, as received.
    body: serde_json::Value,
    key: String,
    order: serde_json::Value,
    order_id: Option<String>,
    trace_id: Option<String>,
}

impl Call {
    /// The call, or the answer to a call this service cannot take: an
    /// unknown service or operation (404), no idempotency key (400).
    fn read(
        service: String,
        operation: String,
        method: &Method,
        headers: &HeaderMap,
        payload: serde_json::Value,
    ) -> Result<Self, Refusal> {
        let Some((_, pairs)) = SERVICES.iter().find(|(name, _)| *name == service) else {
            return Err(refuse(
                StatusCode::NOT_FOUND,
                format!("no service {service:?}"),
            ));
        };
        let Some(&(action, _)) = pairs
            .iter()
            .find(|(action, compensation)| operation == *action || operation == *compensation)
        else {
            return Err(refuse(
                StatusCode::NOT_FOUND,
                format!("{service} has no operation {operation:?}"),
            ));
        };
        let header = |name: &str| headers.get(name).and_then(|v| v.to_str().ok());
        let Some(key) = header("idempotency-key").map(str::to_owned) else {
            return Err(refuse(
                StatusCode::BAD_REQUEST,
                "the Idempotency-Key header is required",
            ));
        };
        let order = payload
            .get("order")
            .cloned()
            .unwrap_or(serde_json::Value::Null);
        let order_id = order
            .get("order_id")
            .and_then(|v| v.as_str())
            .map(str::to_owned);
        Ok(Self {
            action,
            method: method.as_str().to_owned(),
            body: payload,
            trace_id: header("traceparent").and_then(trace_id_of),
            service,
            operation,
            key,
            order,
            order_id,
        })
    }

    fn is_action(&self) -> bool {
        self.operation == self.action
    }
}

/// What a call was decided to do, under the ledger's lock.
struct Decided {
    decision: Decision,
    /// Applied, but the answer never comes.
    hang: bool,
    /// Applied, and the answer comes after the caller gave up.
    late: bool,
    /// Strict mode: the key stays in flight while this is held.
    in_flight: Option<InFlight>,
}

async fn call(
    State(state): State<SimState>,
    Path((service, operation)): Path<(String, String)>,
    method: Method,
    headers: HeaderMap,
    Json(payload): Json<serde_json::Value>,
) -> Response {
    let mut call = match Call::read(service, operation, &method, &headers, payload) {
        Ok(call) => call,
        Err(response) => return *response,
    };
    if !state.record_bodies {
        call.body = serde_json::Value::Null;
    }
    // At the remote from here to its answer (a throttled call too: the
    // merchant's API saw it).
    let _counted = state.concurrency.enter(&call.service, &call.order);
    let merchant = call
        .order
        .pointer("/attributes/merchant_id")
        .and_then(|m| m.as_str());
    if let Some(answer) = throttled(&state, &call.service, merchant) {
        return answer;
    }
    if let Some(merchant) = merchant {
        state
            .capacities
            .serve(&format!("{}:{merchant}", call.service))
            .await;
    }
    let faults = state.faults_for(&call.service);
    let provider = state.provider();
    let decided = match decide(&state, &call, &faults, &provider) {
        Ok(decided) => decided,
        Err(response) => return *response,
    };
    tracing::debug!(
        key = call.key,
        method = call.method,
        service = call.service,
        operation = call.operation,
        decision = ?decided.decision,
        hang = decided.hang,
        late = decided.late,
        "call decided"
    );
    deliver(&state, &faults, &provider, decided).await
}

/// A 429 with `Retry-After` (whole seconds, rounded up) while `service`
/// is throttled: counted, nothing applied or recorded for its key.
fn throttled(state: &SimState, service: &str, merchant: Option<&str>) -> Option<Response> {
    let left = {
        let throttles = state.throttles.lock().unwrap_or_else(|e| e.into_inner());
        let now = std::time::Instant::now();
        // The service's own limit, or its merchant's API key's.
        let merchant = merchant.and_then(|m| throttles.get(&format!("{service}:{m}")));
        [throttles.get(service), merchant]
            .into_iter()
            .flatten()
            .filter_map(|until| until.checked_duration_since(now))
            .max()?
    };
    let mut ledger = state.ledger();
    ledger.stats.calls += 1;
    ledger.stats.throttled += 1;
    metrics::counter!("sas_sim_calls_total", "service" => service.to_owned()).increment(1);
    let seconds = left.as_millis().div_ceil(1000).max(1);
    let mut response = error(
        StatusCode::TOO_MANY_REQUESTS,
        format!("rate limited: retry after {seconds} s; nothing applied"),
    );
    response.headers_mut().insert(
        axum::http::header::RETRY_AFTER,
        axum::http::HeaderValue::from(seconds as u64),
    );
    Some(response)
}

/// 404 for a service remote-sim does not offer.
fn unknown_service(service: &str) -> Option<Response> {
    (!SERVICES.iter().any(|(name, _)| *name == service))
        .then(|| error(StatusCode::NOT_FOUND, format!("no service {service:?}")))
}

/// Body of `PUT /admin/throttle/{service}`.
#[derive(Debug, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Throttle {
    /// How long the service answers 429, from now, in milliseconds (0 ends it).
    for_ms: u64,
}

async fn set_throttle(
    State(state): State<SimState>,
    Path(service): Path<String>,
    Json(throttle): Json<Throttle>,
) -> Response {
    throttle_until(&state, service, None, &throttle)
}

/// `PUT /admin/throttle/{service}/{merchant}`: one merchant's API key of
/// the service answers 429 with `Retry-After` for `for_ms`; the others go on.
async fn set_merchant_throttle(
    State(state): State<SimState>,
    Path((service, merchant)): Path<(String, String)>,
    Json(throttle): Json<Throttle>,
) -> Response {
    throttle_until(&state, service, Some(merchant), &throttle)
}

/// `PUT /admin/capacity/{service}/{merchant}`: the merchant's API of the
/// service serves so many calls at once (see [`crate::capacity`]).
async fn set_merchant_capacity(
    State(state): State<SimState>,
    Path((service, merchant)): Path<(String, String)>,
    Json(capacity): Json<crate::capacity::Capacity>,
) -> Response {
    if let Some(unknown) = unknown_service(&service) {
        return unknown;
    }
    if let Err(why) = capacity.check() {
        return error(StatusCode::BAD_REQUEST, why);
    }
    tracing::info!(
        service,
        merchant,
        calls = capacity.calls,
        call_ms = capacity.call_ms,
        "capacity set"
    );
    state
        .capacities
        .set(format!("{service}:{merchant}"), capacity);
    StatusCode::NO_CONTENT.into_response()
}

/// Throttles `service` (or one `merchant` of it) for the time `throttle` says.
fn throttle_until(
    state: &SimState,
    service: String,
    merchant: Option<String>,
    throttle: &Throttle,
) -> Response {
    if let Some(unknown) = unknown_service(&service) {
        return unknown;
    }
    if throttle.for_ms > 86_400_000 {
        return error(
            StatusCode::BAD_REQUEST,
            "for_ms must be at most a day (86400000)",
        );
    }
    tracing::info!(service, merchant, for_ms = throttle.for_ms, "throttled");
    let until = std::time::Instant::now() + Duration::from_millis(throttle.for_ms);
    let key = match merchant {
        Some(merchant) => format!("{service}:{merchant}"),
        None => service,
    };
    state
        .throttles
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, until);
    StatusCode::NO_CONTENT.into_response()
}

/// Decides the call and records it in the ledger, under one lock, so two
/// concurrent calls with the same key (a retry racing a slow first call)
/// apply once. `Err` is an answer that records nothing new: a key in flight
/// (strict, 409), a key decided before (its decision again), an undo with
/// nothing to undo (strict, 404), a simulated transient fault (503).
fn decide(
    state: &SimState,
    call: &Call,
    faults: &Faults,
    provider: &Provider,
) -> Result<Decided, Refusal> {
    let strict = provider.mode == Mode::Strict;
    let mut ledger = state.ledger();
    ledger.stats.calls += 1;
    metrics::counter!("sas_sim_calls_total", "service" => call.service.clone()).increment(1);
    let mut in_flight = state.in_flight.lock().unwrap_or_else(|e| e.into_inner());
    met_before(&mut ledger, &in_flight, call, strict)?;
    if strict && !call.is_action() {
        nothing_to_undo(&mut ledger, &in_flight, call, provider)?;
    }
    let roll: f64 = state.rng.lock().unwrap_or_else(|e| e.into_inner()).random();
    if roll < faults.transient_fault_rate {
        ledger.stats.transient_faults += 1;
        return Err(refuse(
            StatusCode::SERVICE_UNAVAILABLE,
            "simulated transient fault; nothing applied",
        ));
    }
    let (decision, hang) = outcome(state, call, faults, roll);
    let applied = matches!(decision, Decision::Applied { .. });
    if !applied {
        ledger.stats.permanent_faults += 1;
    }
    let late = strict && call.is_action() && applied && !hang && rolls_late(state, provider);
    record(&mut ledger, call, &decision, applied)?;
    ledger.stats.hangs += u64::from(hang);
    ledger.stats.late_answers += u64::from(late);
    // Strict mode: the key is in flight until its answer leaves (or the
    // caller gives up): a retry meanwhile gets 409.
    let in_flight = strict.then(|| {
        in_flight.insert(call.key.clone());
        InFlight {
            keys: state.in_flight.clone(),
            key: call.key.clone(),
        }
    });
    Ok(Decided {
        decision,
        hang,
        late,
        in_flight,
    })
}

/// The answer for a key met before, which records nothing new: strict
/// mode's 409 while its first call is still being answered, else the
/// decision made then (counted as deduplicated). `Ok` for a new key.
fn met_before(
    ledger: &mut Ledger,
    in_flight: &HashSet<String>,
    call: &Call,
    strict: bool,
) -> Result<(), Refusal> {
    if strict && in_flight.contains(&call.key) {
        ledger.stats.in_progress += 1;
        return Err(refuse(
            StatusCode::CONFLICT,
            format!(
                "a request with key {:?} is in progress; retry later",
                call.key
            ),
        ));
    }
    if let Some(decision) = ledger.decided(&call.key) {
        let decision = decision.clone();
        ledger.stats.deduplicated += 1;
        return Err(Box::new(answer(&decision)));
    }
    Ok(())
}

/// Whether an applied action is answered late: a draw under the provider's
/// `late_answer_rate` (no draw when that is 0).
fn rolls_late(state: &SimState, provider: &Provider) -> bool {
    provider.late_answer_rate > 0.0
        && state
            .rng
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .random::<f64>()
            < provider.late_answer_rate
}

/// Records the call's decision in the ledger (an applied one as applied
/// now), or the 500 answer when the ledger cannot keep it.
fn record(
    ledger: &mut Ledger,
    call: &Call,
    decision: &Decision,
    applied: bool,
) -> Result<(), Refusal> {
    let at = now_micros();
    let entry = Entry {
        key: call.key.clone(),
        service: call.service.clone(),
        operation: call.operation.clone(),
        order_id: call.order_id.clone(),
        decision: decision.clone(),
        at,
        applied_at: applied.then_some(at),
        trace_id: call.trace_id.clone(),
        method: Some(call.method.clone()),
        body: call.body.clone(),
    };
    if let Err(e) = ledger.decide(entry) {
        return Err(refuse(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")));
    }
    Ok(())
}

/// Strict mode, an undo: `Err(404)` when its action was never applied,
/// and then, if the provider refuses late actions, the action's key is
/// tombstoned (its undo came first: the action, should it arrive, is
/// refused with 410). `Ok` when there is something to undo.
fn nothing_to_undo(
    ledger: &mut Ledger,
    in_flight: &HashSet<String>,
    call: &Call,
    provider: &Provider,
) -> Result<(), Refusal> {
    let key = call.key.as_str();
    let action_key = key.find(":undo").map(|at| &key[..at]);
    let applied = action_key
        .and_then(|action_key| ledger.decided(action_key))
        .is_some_and(|decision| matches!(decision, Decision::Applied { .. }));
    if applied {
        return Ok(());
    }
    ledger.stats.nothing_to_undo += 1;
    if let Some(action_key) = action_key {
        if provider.late_action == LateAction::Refuse
            && ledger.decided(action_key).is_none()
            && !in_flight.contains(action_key)
        {
            ledger.stats.tombstones += 1;
            let tombstone = Entry {
                key: action_key.to_owned(),
                service: call.service.clone(),
                operation: call.action.to_owned(),
                order_id: call.order_id.clone(),
                decision: Decision::Refused {
                    status: 410,
                    error: format!("tombstoned: its undo {key:?} came first; nothing applied"),
                },
                at: now_micros(),
                applied_at: None,
                trace_id: None,
                // No call of the action was made.
                method: None,
                body: serde_json::Value::Null,
            };
            if let Err(e) = ledger.decide(tombstone) {
                return Err(refuse(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}")));
            }
        }
    }
    Err(refuse(
        StatusCode::NOT_FOUND,
        format!(
            "nothing to undo: {} was never applied",
            action_key.unwrap_or(key)
        ),
    ))
}

/// What the service does with a call past its transient faults (`roll` in
/// [0, 1) chose among the fault rates): its business rule's refusal, a
/// simulated permanent fault, or applied; and whether it then hangs.
fn outcome(state: &SimState, call: &Call, faults: &Faults, roll: f64) -> (Decision, bool) {
    let is_action = call.is_action();
    let permanent = is_action && roll < faults.transient_fault_rate + faults.permanent_fault_rate;
    let hang = !permanent
        && roll < faults.transient_fault_rate + faults.permanent_fault_rate + faults.hang_rate;
    let decision = if let Some(refusal) = is_action
        .then(|| business_rule(state, &call.service, &call.operation, &call.order))
        .flatten()
    {
        refusal
    } else if permanent {
        Decision::Refused {
            status: 422,
            error: "simulated permanent fault".into(),
        }
    } else {
        Decision::Applied {
            result: json!({
                "id": format!("{}-{}", call.operation, uuid::Uuid::new_v4().simple()),
                "service": call.service,
                "operation": call.operation,
                "order_id": call.order_id,
            }),
        }
    };
    (decision, hang)
}

/// Answers a decided call as the faults say: after the latency (the effect
/// is applied and the answer is slow, so a caller killed meanwhile leaves an
/// applied effect whose retry must be deduplicated), late, or never.
async fn deliver(
    state: &SimState,
    faults: &Faults,
    provider: &Provider,
    decided: Decided,
) -> Response {
    if faults.latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.latency_ms)).await;
    }
    let in_flight = decided.in_flight;
    if decided.late {
        // A real provider keeps working when the caller gives up: the key
        // stays in flight (a retry meanwhile gets 409) until the answer
        // would have gone out, even if this caller's connection is gone and
        // this handler is dropped.
        let wait = Duration::from_millis(provider.late_answer_ms);
        let answered = tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            drop(in_flight);
        });
        let _ = answered.await;
    } else {
        drop(in_flight);
    }
    if decided.hang {
        // Applied, but the answer never comes: the caller must time out and
        // retry, and the retry must be deduplicated.
        // Released only by shutdown, so that a graceful stop does not wait forever.
        state.shutdown.cancelled().await;
        return error(StatusCode::SERVICE_UNAVAILABLE, "shutting down");
    }
    answer(&decided.decision)
}

/// The wall clock, to the microsecond.
fn now_micros() -> chrono::DateTime<chrono::Utc> {
    use chrono::SubsecRound;
    chrono::Utc::now().trunc_subsecs(6)
}

async fn side_effects(State(state): State<SimState>) -> Json<Vec<Entry>> {
    Json(state.ledger().entries().cloned().collect())
}

async fn concurrency(
    State(state): State<SimState>,
) -> Json<std::collections::BTreeMap<String, crate::concurrency::KeyCalls>> {
    Json(state.concurrency.snapshot())
}

async fn stats(State(state): State<SimState>) -> Json<crate::ledger::Stats> {
    Json(state.ledger().stats)
}

async fn set_faults(State(state): State<SimState>, Json(faults): Json<Faults>) -> Response {
    if let Err(message) = faults.validate() {
        return error(StatusCode::BAD_REQUEST, message);
    }
    let mut guard = state.faults.write().unwrap_or_else(|e| e.into_inner());
    *guard = (faults, HashMap::new());
    tracing::info!(?faults, "faults changed for every service");
    StatusCode::NO_CONTENT.into_response()
}

async fn set_service_faults(
    State(state): State<SimState>,
    Path(service): Path<String>,
    Json(faults): Json<Faults>,
) -> Response {
    if let Some(unknown) = unknown_service(&service) {
        return unknown;
    }
    if let Err(message) = faults.validate() {
        return error(StatusCode::BAD_REQUEST, message);
    }
    tracing::info!(service, ?faults, "faults changed");
    state
        .faults
        .write()
        .unwrap_or_else(|e| e.into_inner())
        .1
        .insert(service, faults);
    StatusCode::NO_CONTENT.into_response()
}

async fn get_provider(State(state): State<SimState>) -> Json<Provider> {
    Json(state.provider())
}

async fn set_provider(State(state): State<SimState>, Json(provider): Json<Provider>) -> Response {
    if let Err(message) = provider
        .validate()
        .and_then(|()| check_forgetting(provider.mode, state.keys_kept_secs))
    {
        return error(StatusCode::BAD_REQUEST, message);
    }
    *state.provider.write().unwrap_or_else(|e| e.into_inner()) = provider;
    tracing::info!(?provider, "provider behaviour changed");
    StatusCode::NO_CONTENT.into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A simulator with `strict` mode and the given late-action policy,
    /// served on a free port; returns its base URL and a client.
    async fn serve(configure: impl FnOnce(&mut Settings)) -> (String, reqwest::Client) {
        let mut settings: Settings = toml::from_str(crate::settings::DEFAULTS).unwrap();
        configure(&mut settings);
        let state = SimState::new(&settings, CancellationToken::new()).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, router(state)).await });
        // reqwest is built without a crypto provider of its own.
        let _ = rustls::crypto::ring::default_provider().install_default();
        (format!("http://{addr}"), reqwest::Client::new())
    }

    fn strict(settings: &mut Settings) {
        settings.sim.mode = Mode::Strict;
    }

    async fn post(client: &reqwest::Client, url: &str, key: &str) -> u16 {
        client
            .post(url)
            .header("Idempotency-Key", key)
            .json(&json!({ "order": { "order_id": "o1", "amount_cents": 100 } }))
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    }

    async fn entries(client: &reqwest::Client, base: &str) -> Vec<Entry> {
        client
            .get(format!("{base}/side-effects"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// Strict mode's 404 to the undo of a forgotten action would read as
    /// "never charged": the two settings are refused together, at start and
    /// when the mode is switched at run time.
    #[tokio::test]
    async fn strict_mode_is_refused_while_keys_are_forgotten() {
        let mut settings: Settings = toml::from_str(crate::settings::DEFAULTS).unwrap();
        settings.sim.keys_kept_secs = 60;
        assert!(sas_runtime::Validate::validate(&settings).is_ok());
        settings.sim.mode = Mode::Strict;
        let refused = sas_runtime::Validate::validate(&settings).unwrap_err();
        assert!(refused.contains("sim.keys_kept_secs"), "{refused}");

        let (base, client) = serve(|settings| settings.sim.keys_kept_secs = 60).await;
        let put = |mode: &'static str| {
            client
                .put(format!("{base}/admin/provider"))
                .json(&json!({ "mode": mode }))
                .send()
        };
        assert_eq!(put("strict").await.unwrap().status().as_u16(), 400);
        assert_eq!(put("lenient").await.unwrap().status().as_u16(), 204);
        let mode: Provider = client
            .get(format!("{base}/admin/provider"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(
            mode.mode,
            Mode::Lenient,
            "the refused switch changed nothing"
        );
    }

    #[tokio::test]
    async fn strict_mode_answers_409_while_the_same_key_is_in_flight() {
        let (base, client) = serve(|settings| {
            strict(settings);
            settings.sim.late_answer_rate = 1.0;
            settings.sim.late_answer_ms = 1500;
        })
        .await;
        let url = format!("{base}/payment/charge");
        let (first, second) = tokio::join!(post(&client, &url, "o1:charge"), async {
            // The second call goes out once the first one is decided.
            tokio::task::yield_now().await;
            post(&client, &url, "o1:charge").await
        });
        let mut statuses = [first, second];
        statuses.sort_unstable();
        assert_eq!(statuses, [200, 409]);
        // Answered: the key is no longer in flight, and a repeat gets the first answer.
        assert_eq!(post(&client, &url, "o1:charge").await, 200);
        let applied = entries(&client, &base)
            .await
            .into_iter()
            .filter(|e| matches!(e.decision, Decision::Applied { .. }))
            .count();
        assert_eq!(applied, 1);
    }

    #[tokio::test]
    async fn strict_mode_answers_404_to_the_undo_of_a_key_never_applied_and_tombstones_it() {
        let (base, client) = serve(strict).await;
        assert_eq!(
            post(&client, &format!("{base}/payment/refund"), "o1:charge:undo").await,
            404
        );
        // The charge arriving after its undo is refused: nothing applied.
        assert_eq!(
            post(&client, &format!("{base}/payment/charge"), "o1:charge").await,
            410
        );
        let entries = entries(&client, &base).await;
        assert!(
            entries
                .iter()
                .all(|e| !matches!(e.decision, Decision::Applied { .. })),
            "{entries:?}"
        );
        // The undo's 404 was not recorded: a retry looks again (still nothing to undo).
        assert_eq!(
            post(&client, &format!("{base}/payment/refund"), "o1:charge:undo").await,
            404
        );
    }

    #[tokio::test]
    async fn strict_mode_with_late_action_apply_applies_an_action_after_its_undo() {
        let (base, client) = serve(|settings| {
            strict(settings);
            settings.sim.late_action = LateAction::Apply;
        })
        .await;
        assert_eq!(
            post(&client, &format!("{base}/payment/refund"), "o1:charge:undo").await,
            404
        );
        assert_eq!(
            post(&client, &format!("{base}/payment/charge"), "o1:charge").await,
            200
        );
    }

    #[tokio::test]
    async fn strict_mode_undoes_an_applied_action_and_records_when_each_applied() {
        let (base, client) = serve(strict).await;
        assert_eq!(
            post(&client, &format!("{base}/payment/charge"), "o1:charge").await,
            200
        );
        assert_eq!(
            post(&client, &format!("{base}/payment/refund"), "o1:charge:undo").await,
            200
        );
        let entries = entries(&client, &base).await;
        let action = entries[0].applied_at.expect("applied_at of the action");
        let undo = entries[1].applied_at.expect("applied_at of the undo");
        assert!(undo >= action);
        assert_eq!(action.timestamp_subsec_nanos() % 1000, 0, "micros");
    }

    #[tokio::test]
    async fn lenient_mode_applies_the_undo_of_an_unknown_key_as_before() {
        let (base, client) = serve(|_| {}).await;
        assert_eq!(
            post(&client, &format!("{base}/payment/refund"), "o1:charge:undo").await,
            200
        );
    }

    #[tokio::test]
    async fn the_mode_changes_at_run_time_through_the_admin_api_which_wants_its_token() {
        let (base, client) = serve(|settings| {
            settings.sim.admin_token = "adm".into();
        })
        .await;
        let put = |token: Option<&str>| {
            let mut request = client
                .put(format!("{base}/admin/provider"))
                .json(&json!({ "mode": "strict" }));
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            request.send()
        };
        assert_eq!(put(None).await.unwrap().status().as_u16(), 401);
        assert_eq!(put(Some("wrong")).await.unwrap().status().as_u16(), 401);
        assert_eq!(put(Some("adm")).await.unwrap().status().as_u16(), 204);
        assert_eq!(
            post(&client, &format!("{base}/payment/refund"), "o1:charge:undo").await,
            404,
            "strict now"
        );
    }

    #[tokio::test]
    async fn a_call_without_the_bearer_token_is_refused_with_401() {
        let (base, client) = serve(|settings| {
            settings.sim.auth_token = "svc".into();
        })
        .await;
        let url = format!("{base}/payment/charge");
        assert_eq!(post(&client, &url, "k").await, 401);
        let status = client
            .post(&url)
            .bearer_auth("svc")
            .header("Idempotency-Key", "k")
            .json(&json!({}))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status.as_u16(), 200);
    }

    #[tokio::test]
    async fn a_put_or_patch_is_the_same_call_and_the_ledger_records_its_method_and_body() {
        let (base, client) = serve(|settings| settings.sim.record_bodies = true).await;
        let body = json!({ "account": "a-1", "amount_cents": 250, "reason": "return" });
        let status = client
            .put(format!("{base}/payment/credit"))
            .header("Idempotency-Key", "o1:refund")
            .json(&body)
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status.as_u16(), 200);
        let status = client
            .patch(format!("{base}/inventory/restock"))
            .header("Idempotency-Key", "o1:restock")
            .json(&json!({ "order": { "order_id": "o1" }, "results": {} }))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status.as_u16(), 200);
        assert_eq!(
            post(&client, &format!("{base}/shipping/receive"), "o1:receive").await,
            200
        );
        let entries = entries(&client, &base).await;
        let [credit, restock, receive] = entries.as_slice() else {
            panic!("{entries:?}")
        };
        assert_eq!(credit.method.as_deref(), Some("PUT"));
        assert_eq!(credit.body, body);
        assert_eq!(credit.operation, "credit");
        assert_eq!(credit.order_id, None, "the body names no order");
        assert_eq!(restock.method.as_deref(), Some("PATCH"));
        assert_eq!(restock.order_id.as_deref(), Some("o1"));
        assert_eq!(receive.method.as_deref(), Some("POST"));
        assert_eq!(receive.body["order"]["order_id"], "o1");
        // As `GET /side-effects` shows it.
        let raw: serde_json::Value = client
            .get(format!("{base}/side-effects"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(raw[0]["method"], "PUT");
        assert_eq!(raw[0]["body"], body);
        // Other methods are not calls.
        let status = client
            .get(format!("{base}/payment/credit"))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status.as_u16(), 405);
    }

    #[tokio::test]
    async fn every_pair_of_every_service_is_served_and_nothing_else() {
        let (base, client) = serve(|_| {}).await;
        for (service, pairs) in SERVICES {
            for (action, compensation) in pairs {
                for operation in [action, compensation] {
                    let url = format!("{base}/{service}/{operation}");
                    assert_eq!(
                        post(&client, &url, &format!("{service}:{operation}")).await,
                        200,
                        "{url}"
                    );
                }
            }
        }
        for (service, operation) in [
            ("payment", "restock"),
            ("inventory", "credit"),
            ("shipping", "x"),
        ] {
            assert_eq!(
                post(&client, &format!("{base}/{service}/{operation}"), "k").await,
                404
            );
        }
        assert_eq!(
            post(&client, &format!("{base}/returns/receive"), "k").await,
            404
        );
    }

    #[tokio::test]
    async fn strict_mode_undoes_the_new_pairs_as_the_first_ones() {
        let (base, client) = serve(strict).await;
        // An undo of a credit never applied: 404, and the credit is tombstoned.
        assert_eq!(
            post(&client, &format!("{base}/payment/debit"), "r1:credit:undo").await,
            404
        );
        assert_eq!(
            post(&client, &format!("{base}/payment/credit"), "r1:credit").await,
            410
        );
        let tombstone = entries(&client, &base).await.remove(0);
        assert_eq!(
            (tombstone.key.as_str(), tombstone.operation.as_str()),
            ("r1:credit", "credit")
        );
        assert_eq!(tombstone.method, None);
        // An applied restock is undone by destock.
        assert_eq!(
            post(&client, &format!("{base}/inventory/restock"), "r2:restock").await,
            200
        );
        assert_eq!(
            post(
                &client,
                &format!("{base}/inventory/destock"),
                "r2:restock:undo"
            )
            .await,
            200
        );
        // receive is an action (of its pair), not an undo looking for one.
        assert_eq!(
            post(&client, &format!("{base}/shipping/receive"), "r3:receive").await,
            200
        );
    }
}
