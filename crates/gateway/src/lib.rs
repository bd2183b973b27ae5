//! The HTTP gateway: orders in and status out over HTTP, for clients that
//! do not speak AMQP.
//!
//! - [`orders`]: `POST /v1/orders`, `GET /v1/orders/{id}` (`?wait=` for the outcome).
//! - [`clients`]: client secrets, apart from the console's operators.
//! - [`openapi`]: the OpenAPI document, served at `/v1/openapi.json`.
//! - [`settings`]: the `[gateway]` section and the rest.
//! - [`workflows`]: the registered workflows, to refuse at once an order
//!   intake would refuse.
//!
//! A submission is published to the orders queue like any client's, so
//! the scheduler's intake stays the one way in; the status is read from
//! the state store.

pub mod clients;
pub mod events;
pub mod long_polls;
pub mod openapi;
pub mod orders;
pub mod schedules;
pub mod settings;
pub mod workflows;

use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::Context as _;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{get, post};
use axum::{Json, Router};
use sas_broker::publish::SharedPublisher;
use sas_broker::Session;
use sas_messages::QueueNames;
use sas_runtime::login_limit::LoginLimiter;
use sas_store::Store;
use tokio_util::sync::CancellationToken;

pub use settings::Settings;

/// What every request handler shares.
pub struct Gateway {
    /// The settings it was started with.
    pub settings: Settings,
    /// The state store, read for status.
    pub store: Store,
    /// Publishes submitted orders on whatever connection is up.
    pub publisher: SharedPublisher,
    /// Queue names.
    pub names: QueueNames,
    /// Client secrets.
    pub clients: clients::Clients,
    /// Failed authentications by client address.
    pub logins: LoginLimiter,
    /// Waiting reads open, per client.
    pub long_polls: long_polls::LongPolls,
    /// Which client belongs to which tenant, and what each tenant may
    /// start (`gateway.tenancy_file`).
    pub tenancy: sas_runtime::tenancy::Tenancy,
    /// The workflows the schedulers registered, to refuse at once what
    /// intake would refuse.
    pub workflows: workflows::Workflows,
    /// Fired on SIGTERM: waiting requests end.
    pub shutdown: CancellationToken,
}

/// The authenticated client of a request (its name).
#[derive(Debug, Clone)]
pub struct Caller(pub String);

impl Caller {
    /// The identity the schedulers know the client by (`gateway:<name>`),
    /// sent with what it submits ([`sas_messages::headers::SENDER`]).
    pub fn identity(&self) -> String {
        format!("gateway:{}", self.0)
    }
}

impl Gateway {
    /// The tenant `caller` acts within: its orders' stored ids carry it.
    ///
    /// # Errors
    /// 403 when the tenancy file gives the client to no tenant.
    pub fn tenant_of(&self, caller: &Caller) -> Result<String, Box<Response>> {
        self.tenancy.sender(&caller.identity()).tenant.ok_or_else(|| {
            Box::new(orders::problem(
                StatusCode::FORBIDDEN,
                format!(
                    "client {} belongs to no tenant: an operator adds gateway:{} to a tenant's members in the tenancy file",
                    caller.0, caller.0
                ),
            ))
        })
    }
}

/// Lets in requests that carry a client's secret; 401 otherwise, 429 while
/// the client (by name, from this address) or, for a secret that names no
/// client, the address has failed too often. Checked again once the
/// check's turn comes (see [`clients::Clients::turn`]), so wrong secrets
/// queued for one client stop costing hash checks once it is blocked.
async fn guard(State(gateway): State<Arc<Gateway>>, mut request: Request, next: Next) -> Response {
    let address = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(peer)| peer.ip().to_string());
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok());
    let presented = match gateway.clients.presented(authorization) {
        Ok(presented) => presented,
        Err(refusal) => return unauthorized(&refusal),
    };
    let keys = presented.limit_keys(&gateway.clients, address.as_deref());
    if let Some(wait) = gateway.logins.blocked(&keys) {
        return too_many_failures(wait);
    }
    // A secret that passed lately needs no check, so no turn: a client
    // whose name someone is guessing is not held behind the guesses.
    if let Some(name) = gateway.clients.remembered(&presented) {
        request.extensions_mut().insert(Caller(name));
        return next.run(request).await;
    }
    // Checks of one name take turns; a queue of guesses (from many
    // addresses) holds a request at most this long, then it is told to
    // come back rather than wait behind them.
    let Ok(turn) = tokio::time::timeout(CHECK_TURN_WAIT, gateway.clients.turn(&presented)).await
    else {
        let mut response = orders::problem(
            StatusCode::SERVICE_UNAVAILABLE,
            "the secret checks of this client are busy (many failed attempts lately): try again in 1 s",
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(1u64));
        return response;
    };
    if let Some(wait) = gateway.logins.blocked(&keys) {
        return too_many_failures(wait);
    }
    let checked = gateway.clients.check(&presented).await;
    drop(turn);
    match checked {
        Ok(name) => {
            request.extensions_mut().insert(Caller(name));
            next.run(request).await
        }
        Err(refusal) => {
            gateway.logins.failed(&keys);
            metrics::counter!("sas_gateway_failed_logins_total").increment(1);
            tracing::warn!(keys = ?keys, "gateway: a wrong client secret");
            unauthorized(&refusal)
        }
    }
}

/// The longest a request waits for its turn to have its secret checked.
pub const CHECK_TURN_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// 429 with `Retry-After`: too many failed logins under these keys.
fn too_many_failures(wait: std::time::Duration) -> Response {
    let seconds = wait.as_secs().max(1);
    let mut response = orders::problem(
        StatusCode::TOO_MANY_REQUESTS,
        format!("too many failed authentications for this client from this address: try again in {seconds} s"),
    );
    response
        .headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
    response
}

/// 401 with `WWW-Authenticate`, saying what was wrong.
fn unauthorized(refusal: &clients::Refusal) -> Response {
    let mut response = orders::problem(
        StatusCode::UNAUTHORIZED,
        match refusal {
            clients::Refusal::Missing => {
                "send the client's name and secret: Authorization: Bearer <name>:<secret>"
            }
            clients::Refusal::Wrong => "no client has this secret",
        },
    );
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        HeaderValue::from_static("Bearer realm=\"sas gateway\""),
    );
    response
}

/// How long a client may take to send a request's body: a body that
/// trickles in is answered 408 and its connection closed.
pub const BODY_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The gateway's routes: the client API behind the guard and the OpenAPI
/// document; with `ops` (no `gateway.ops_listen`), also `/metrics`,
/// `/healthz` and `/readyz` on the same port.
pub fn router(gateway: Arc<Gateway>, ops: Option<Router>) -> Router {
    let api = Router::new()
        .route("/v1/orders", post(orders::submit))
        .route("/v1/orders/{order_id}", get(orders::status))
        .route("/v1/orders/{order_id}/events", post(events::submit))
        .route(
            "/v1/correlation-keys/{key}/events",
            post(events::submit_for_key),
        )
        .route(
            "/v1/schedules",
            get(schedules::list).post(schedules::create),
        )
        .route(
            "/v1/schedules/{name}",
            get(schedules::show).delete(schedules::delete),
        )
        .route("/v1/schedules/{name}/{action}", post(schedules::act))
        .layer(axum::middleware::from_fn_with_state(gateway.clone(), guard))
        .with_state(gateway);
    let document = Router::new().route(
        "/v1/openapi.json",
        get(|| async { Json(openapi::document()) }),
    );
    let mut app = api.merge(document);
    if let Some(ops) = ops {
        app = app.merge(ops);
    }
    app.layer(
        tower_http::set_header::SetResponseHeaderLayer::if_not_present(
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
    )
    .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(
        BODY_READ_TIMEOUT,
    ))
    .layer(tower_http::limit::RequestBodyLimitLayer::new(1024 * 1024))
}

/// The operations routes (`/metrics`, `/healthz`, `/readyz`).
///
/// # Errors
/// When the metrics recorder cannot be installed.
fn ops_router(gateway: &Gateway, session: &Session) -> anyhow::Result<Router> {
    sas_runtime::ops::router(
        sas_runtime::ops::broker_and_database_readiness(
            session.connected_check(),
            gateway.store.reachable_check(),
        ),
        gateway.shutdown.clone(),
    )
}

/// Runs the gateway until `shutdown`.
///
/// # Errors
/// When the settings are unusable or the address cannot be bound. Outages
/// of the broker or the database are waited out (`/readyz` says so; a
/// submission meanwhile is answered 503).
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let id = sas_runtime::instance_id("gateway", &settings.gateway.id);
    let clients = clients::parse_clients(&settings.gateway.clients).map_err(anyhow::Error::msg)?;
    for client in clients.iter().filter(|client| client.secret_in_clear()) {
        tracing::warn!(
            client = %client.name,
            "gateway.clients holds this client's secret in clear: store its argon2 hash instead (`gateway hash-secret`)"
        );
    }
    let tenancy = sas_runtime::tenancy::Tenancy::load(&settings.gateway.tenancy_file)
        .map_err(anyhow::Error::msg)?;
    let store = Store::connect_lazy(&settings.database, &id).context("database settings")?;
    let session = Session::new(settings.amqp.clone(), id.clone());
    let gateway = Arc::new(Gateway {
        names: settings.amqp.names(),
        publisher: session.publisher(),
        clients: clients::Clients::new(clients),
        logins: LoginLimiter::new(settings.gateway.login_failures_per_minute),
        long_polls: long_polls::LongPolls::new(settings.gateway.max_long_polls_per_client),
        tenancy,
        workflows: workflows::Workflows::default(),
        store,
        shutdown: shutdown.clone(),
        settings,
    });
    let ops = ops_router(&gateway, &session)?;
    let ops_listen = gateway.settings.gateway.ops_listen.clone();
    let (app, ops_server) = if ops_listen.is_empty() {
        (router(gateway.clone(), Some(ops)), None)
    } else {
        // Plain HTTP: the operators' port apart from the clients' (the
        // clients' port takes http.tls_cert_file).
        let ops_server = sas_runtime::ops::serve_app(&ops_listen, ops, None, shutdown.clone())
            .await
            .context("gateway.ops_listen")?;
        tracing::info!(gateway = %id, local_addr = %ops_server.local_addr, "gateway operations endpoint: /metrics, /healthz, /readyz");
        (router(gateway.clone(), None), Some(ops_server))
    };
    let http = &gateway.settings.http;
    let server =
        sas_runtime::ops::serve_app(&http.listen, app, http.tls()?, shutdown.clone()).await?;
    tracing::info!(gateway = %id, local_addr = %server.local_addr, operations_apart = ops_server.is_some(), "gateway serving /v1/orders, /v1/openapi.json");
    if !gateway
        .store
        .migrate_if_asked(&gateway.settings.database, &shutdown)
        .await
        .context("cannot apply database migrations")?
    {
        return Ok(());
    }
    let stop = shutdown.clone();
    session
        .run(shutdown.clone(), move |_connection, _publisher| {
            let stop = stop.clone();
            async move {
                stop.cancelled().await;
                Ok(())
            }
        })
        .await;
    if let Some(ops_server) = ops_server {
        ops_server.stopped().await?;
    }
    server.stopped().await
}
