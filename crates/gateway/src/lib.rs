//! The HTTP gateway: orders in and status out over HTTP, for clients that
//! do not speak AMQP.
//!
//! - [`orders`]: `POST /v1/orders`, `GET /v1/orders/{id}` (`?wait=` for the outcome).
//! - [`clients`]: client secrets, apart from the console's operators.
//! - [`openapi`]: the OpenAPI document, served at `/v1/openapi.json`.
//! - [`settings`]: the `[gateway]` section and the rest.
//!
//! A submission is published to the orders queue like any client's, so
//! the scheduler's intake stays the one way in; the status is read from
//! the state store.

pub mod clients;
pub mod events;
pub mod long_polls;
pub mod openapi;
pub mod orders;
pub mod settings;

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
    /// Fired on SIGTERM: waiting requests end.
    pub shutdown: CancellationToken,
}

/// The authenticated client of a request (its name).
#[derive(Debug, Clone)]
pub struct Caller(pub String);

/// Lets in requests that carry a client's secret; 401 otherwise, 429 while
/// the address has failed too often.
async fn guard(State(gateway): State<Arc<Gateway>>, mut request: Request, next: Next) -> Response {
    let keys: Vec<String> = request
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|ConnectInfo(peer)| format!("ip:{}", peer.ip()))
        .into_iter()
        .collect();
    if let Some(wait) = gateway.logins.blocked(&keys) {
        let seconds = wait.as_secs().max(1);
        let mut response = orders::problem(
            StatusCode::TOO_MANY_REQUESTS,
            format!("too many failed authentications from this address: try again in {seconds} s"),
        );
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        return response;
    }
    let authorization = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok());
    match gateway.clients.authenticate(authorization).await {
        Ok(name) => {
            request.extensions_mut().insert(Caller(name));
            next.run(request).await
        }
        Err(refusal) => {
            if refusal == clients::Refusal::Wrong {
                gateway.logins.failed(&keys);
                tracing::warn!(keys = ?keys, "gateway: a wrong client secret");
            }
            let mut response = orders::problem(
                StatusCode::UNAUTHORIZED,
                match refusal {
                    clients::Refusal::Missing => {
                        "send the client's secret: Authorization: Bearer <secret>"
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
    }
}

/// The gateway's routes: the client API behind the guard; the OpenAPI
/// document, `/metrics`, `/healthz` and `/readyz` open.
///
/// # Errors
/// When the metrics recorder cannot be installed.
pub fn router(gateway: Arc<Gateway>, session: &Session) -> anyhow::Result<Router> {
    let ops = sas_runtime::ops::router(
        sas_runtime::ops::broker_and_database_readiness(
            session.connected_check(),
            gateway.store.reachable_check(),
        ),
        gateway.shutdown.clone(),
    )?;
    let api = Router::new()
        .route("/v1/orders", post(orders::submit))
        .route("/v1/orders/{order_id}", get(orders::status))
        .route("/v1/orders/{order_id}/events", post(events::submit))
        .route(
            "/v1/correlation-keys/{key}/events",
            post(events::submit_for_key),
        )
        .layer(axum::middleware::from_fn_with_state(gateway.clone(), guard))
        .with_state(gateway);
    let document = Router::new().route(
        "/v1/openapi.json",
        get(|| async { Json(openapi::document()) }),
    );
    Ok(api
        .merge(document)
        .merge(ops)
        .layer(
            tower_http::set_header::SetResponseHeaderLayer::if_not_present(
                header::X_CONTENT_TYPE_OPTIONS,
                HeaderValue::from_static("nosniff"),
            ),
        )
        .layer(tower_http::limit::RequestBodyLimitLayer::new(1024 * 1024)))
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
    let store = Store::connect_lazy(&settings.database, &id).context("database settings")?;
    let session = Session::new(settings.amqp.clone(), id.clone());
    let gateway = Arc::new(Gateway {
        names: settings.amqp.names(),
        publisher: session.publisher(),
        clients: clients::Clients::new(clients),
        logins: LoginLimiter::new(settings.gateway.login_failures_per_minute),
        long_polls: long_polls::LongPolls::new(settings.gateway.max_long_polls_per_client),
        store,
        shutdown: shutdown.clone(),
        settings,
    });
    let app = router(gateway.clone(), &session)?;
    let server =
        sas_runtime::ops::serve_app(&gateway.settings.http.listen, app, shutdown.clone()).await?;
    tracing::info!(gateway = %id, local_addr = %server.local_addr, "gateway serving /v1/orders, /v1/openapi.json, /metrics, /healthz, /readyz");
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
    server.stopped().await
}
