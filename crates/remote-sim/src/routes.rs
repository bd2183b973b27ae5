//! The HTTP API of the simulated services.
//!
//! - `POST /{service}/{operation}` with an `Idempotency-Key` header: the call.
//! - `GET /side-effects`: every decided key (applied or refused), oldest first.
//! - `GET /stats`: counters.
//! - `PUT /admin/faults` (all services) or `PUT /admin/faults/{service}`:
//!   change latency and fault rates at run time.
//! - `GET /healthz`, `GET /readyz`, `GET /metrics` (`sas_sim_calls_total{service,outcome}`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::ledger::{Decision, Entry, Ledger};
use crate::settings::{Faults, Settings};

/// Services and the operations each offers: the action first, then its compensation.
pub const SERVICES: [(&str, [&str; 2]); 3] = [
    ("inventory", ["reserve", "release"]),
    ("payment", ["charge", "refund"]),
    ("shipping", ["ship", "cancel"]),
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
            ledger: Arc::new(Mutex::new(Ledger::open(&settings.sim.journal_file)?)),
            faults: Arc::new(RwLock::new((settings.sim.faults, HashMap::new()))),
            rng: Arc::new(Mutex::new(StdRng::seed_from_u64(seed))),
            decline_above_cents: settings.sim.decline_above_cents,
            shutdown,
        })
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
    Router::new()
        .route("/side-effects", get(side_effects))
        .route("/stats", get(stats))
        .route("/admin/faults", put(set_faults))
        .route("/admin/faults/{service}", put(set_service_faults))
        .route("/{service}/{operation}", post(call))
        .with_state(state)
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

async fn call(
    State(state): State<SimState>,
    Path((service, operation)): Path<(String, String)>,
    headers: HeaderMap,
    Json(payload): Json<serde_json::Value>,
) -> Response {
    let Some((_, operations)) = SERVICES.iter().find(|(name, _)| *name == service) else {
        return error(StatusCode::NOT_FOUND, format!("no service {service:?}"));
    };
    if !operations.contains(&operation.as_str()) {
        return error(
            StatusCode::NOT_FOUND,
            format!("{service} has no operation {operation:?}"),
        );
    }
    let is_action = operation == operations[0];
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned)
    else {
        return error(
            StatusCode::BAD_REQUEST,
            "the Idempotency-Key header is required",
        );
    };
    let faults = state.faults_for(&service);
    let order = payload
        .get("order")
        .cloned()
        .unwrap_or(serde_json::Value::Null);
    let order_id = order
        .get("order_id")
        .and_then(|v| v.as_str())
        .map(str::to_owned);

    // Deciding and recording happen under one lock, so two concurrent calls
    // with the same key (a retry racing a slow first call) apply once.
    let (decision, hang) = {
        let mut ledger = state.ledger();
        ledger.stats.calls += 1;
        metrics::counter!("sas_sim_calls_total", "service" => service.clone()).increment(1);
        if let Some(decision) = ledger.decided(&key) {
            let decision = decision.clone();
            ledger.stats.deduplicated += 1;
            return answer(&decision);
        }
        let roll: f64 = state.rng.lock().unwrap_or_else(|e| e.into_inner()).gen();
        if roll < faults.transient_fault_rate {
            ledger.stats.transient_faults += 1;
            return error(
                StatusCode::SERVICE_UNAVAILABLE,
                "simulated transient fault; nothing applied",
            );
        }
        let permanent =
            is_action && roll < faults.transient_fault_rate + faults.permanent_fault_rate;
        let hang = !permanent
            && roll < faults.transient_fault_rate + faults.permanent_fault_rate + faults.hang_rate;
        let decision = if let Some(refusal) = is_action
            .then(|| business_rule(&state, &service, &operation, &order))
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
                    "id": format!("{operation}-{}", uuid::Uuid::new_v4().simple()),
                    "service": service,
                    "operation": operation,
                    "order_id": order_id,
                }),
            }
        };
        match &decision {
            Decision::Applied { .. } => {}
            Decision::Refused { .. } => ledger.stats.permanent_faults += 1,
        }
        let entry = Entry {
            key: key.clone(),
            service: service.clone(),
            operation: operation.clone(),
            order_id: order_id.clone(),
            decision: decision.clone(),
            at: chrono::Utc::now(),
        };
        if let Err(e) = ledger.decide(entry) {
            return error(StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}"));
        }
        if hang {
            ledger.stats.hangs += 1;
        }
        (decision, hang)
    };
    tracing::debug!(key, service, operation, ?decision, hang, "call decided");
    // The latency comes after the decision: the effect is applied and the
    // answer is slow, so a caller killed meanwhile leaves an applied effect
    // whose retry must be deduplicated.
    if faults.latency_ms > 0 {
        tokio::time::sleep(Duration::from_millis(faults.latency_ms)).await;
    }
    if hang {
        // Applied, but the answer never comes: the caller must time out and
        // retry, and the retry must be deduplicated.
        // Released only by shutdown, so that a graceful stop does not wait forever.
        state.shutdown.cancelled().await;
        return error(StatusCode::SERVICE_UNAVAILABLE, "shutting down");
    }
    answer(&decision)
}

async fn side_effects(State(state): State<SimState>) -> Json<Vec<Entry>> {
    Json(state.ledger().entries().to_vec())
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
    if !SERVICES.iter().any(|(name, _)| *name == service) {
        return error(StatusCode::NOT_FOUND, format!("no service {service:?}"));
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
