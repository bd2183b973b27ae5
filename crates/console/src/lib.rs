//! The operator console: server-rendered pages and a JSON API over the
//! state store, acting through the same store transitions as `sasctl`.
//!
//! - [`settings`]: the `[console]` section and the rest.
//! - [`auth`], [`guard`]: users and roles, basic auth and bearer tokens,
//!   hashed secrets, CSRF tokens; the middleware every page and API request
//!   passes (failed logins slowed down by [`sas_runtime::login_limit`]).
//! - [`timeline`]: an order's run drawn as SVG.
//! - [`actions`]: resubmit, cancel, bulk actions by filter, events for wait
//!   steps, moves of waiting orders to another workflow version, alerts,
//!   dead letters.
//! - [`overview`]: the overview's numbers, cached briefly.
//! - [`broker`]: queue depths by passive declares; replays.
//! - [`pages`]: the HTML pages; [`api`]: the same as JSON.
//! - [`live`]: server-sent events that keep the overview and an order's page current.
//! - [`error`]: failures answered as HTML or JSON.

pub mod actions;
pub mod api;
pub mod auth;
pub mod broker;
pub mod error;
pub mod guard;
pub mod live;
pub mod overview;
pub mod pages;
pub mod schedules;
pub mod settings;
pub mod timeline;

use std::sync::Arc;

use std::time::Duration;

use anyhow::Context as _;
use axum::http::{header, HeaderValue, StatusCode};
use axum::Router;
use sas_announce::Announcer;
use sas_broker::Session;
use sas_messages::QueueNames;
use sas_store::Store;
use tokio_util::sync::CancellationToken;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::set_header::SetResponseHeaderLayer;
use tower_http::timeout::TimeoutLayer;

pub use settings::Settings;

/// What every request handler shares.
pub struct Console {
    /// The settings it was started with.
    pub settings: Settings,
    /// The state store.
    pub store: Store,
    /// The broker session (status messages of actions, replays, events for
    /// wait steps).
    pub session: Session,
    /// The session's connection, for passive declares.
    pub connection: broker::CurrentConnection,
    /// Queue and exchange names.
    pub names: QueueNames,
    /// Publishes what a cancellation asks for, as the services do.
    pub announcer: Announcer,
    /// Users, roles and CSRF tokens.
    pub auth: auth::Authenticator,
    /// Failed logins by client address and by name.
    pub logins: sas_runtime::login_limit::LoginLimiter,
    /// The roles of console users (`console.tenancy_file`).
    pub tenancy: sas_runtime::tenancy::Tenancy,
    /// The overview's numbers, computed at most once per live interval.
    pub overview_cache: overview::Cache,
    /// Fired on SIGTERM: live streams end.
    pub shutdown: CancellationToken,
}

/// The console's routes: the pages, the API and the live streams behind
/// the [`guard`], and `/metrics`, `/healthz`, `/readyz` and the stylesheet open.
///
/// # Errors
/// When the metrics recorder cannot be installed.
pub fn router(console: Arc<Console>, shutdown: CancellationToken) -> anyhow::Result<Router> {
    let ops = sas_runtime::ops::router(
        sas_runtime::ops::broker_and_database_readiness(
            console.session.connected_check(),
            console.store.reachable_check(),
        ),
        shutdown,
    )?;
    // Pages and the API must answer within the timeout; the live streams
    // are meant to last.
    let timeout = Duration::from_millis(console.settings.console.request_timeout_ms);
    let guarded = pages::routes()
        .merge(api::routes())
        .layer(TimeoutLayer::with_status_code(
            StatusCode::SERVICE_UNAVAILABLE,
            timeout,
        ))
        .merge(live::routes())
        .layer(axum::middleware::from_fn_with_state(
            console.clone(),
            guard::guard,
        ))
        .with_state(console);
    Ok(security_headers(
        guarded.merge(ops).merge(pages::static_routes()),
    ))
}

/// The Content-Security-Policy of every answer: scripts and styles from
/// the console only (inline style attributes allowed; no inline script),
/// live streams to itself, forms posted to itself, never framed.
pub const CONTENT_SECURITY_POLICY: &str = "default-src 'none'; script-src 'self'; \
     style-src 'self' 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; \
     form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

/// Headers every answer carries: the policy above, no MIME sniffing, no
/// framing, no referrer to other sites (`same-origin`: with `no-referrer`
/// a browser sends `Origin: null` on a form post, which the CSRF check
/// refuses); and a body limit on every request.
fn security_headers(router: Router) -> Router {
    let headers = [
        (header::CONTENT_SECURITY_POLICY, CONTENT_SECURITY_POLICY),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::REFERRER_POLICY, "same-origin"),
    ];
    let mut router = router.layer(RequestBodyLimitLayer::new(MAX_BODY_BYTES));
    for (name, value) in headers {
        router = router.layer(SetResponseHeaderLayer::if_not_present(
            name,
            HeaderValue::from_static(value),
        ));
    }
    router
}

/// Largest request body read (a bulk action's form is far smaller).
pub const MAX_BODY_BYTES: usize = 256 * 1024;

/// Runs the console until `shutdown`.
///
/// # Errors
/// When the settings are unusable or the address cannot be bound. Outages
/// of the broker or the database are waited out (`/readyz` says so).
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let id = sas_runtime::instance_id("console", &settings.console.id);
    let users = auth::parse_users(&settings.console.users).map_err(anyhow::Error::msg)?;
    for user in users.iter().filter(|user| user.secret_in_clear()) {
        tracing::warn!(
            user = %user.name,
            "console.users holds this user's secret in clear: store its argon2 hash instead (`console hash-secret`)"
        );
    }
    let anonymous = settings
        .console
        .anonymous_role()
        .map_err(anyhow::Error::msg)?;
    let tenancy = sas_runtime::tenancy::Tenancy::load(&settings.console.tenancy_file)
        .map_err(anyhow::Error::msg)?;
    let store = Store::connect_lazy(&settings.database, &id)
        .context("database settings")?
        .with_deadlines(settings.deadlines);
    let session = Session::new(settings.amqp.clone(), id.clone());
    let console = Arc::new(Console {
        tenancy,
        auth: auth::Authenticator::new(users, anonymous, &settings.console.csrf_key),
        logins: sas_runtime::login_limit::LoginLimiter::new(
            settings.console.login_failures_per_minute,
        ),
        names: settings.amqp.names(),
        announcer: Announcer::new(&settings.amqp),
        connection: broker::CurrentConnection::default(),
        overview_cache: overview::Cache::default(),
        store,
        session: session.clone(),
        shutdown: shutdown.clone(),
        settings,
    });
    let app = router(console.clone(), shutdown.clone())?;
    let http = &console.settings.http;
    let server =
        sas_runtime::ops::serve_app(&http.listen, app, http.tls()?, shutdown.clone()).await?;
    tracing::info!(console = %id, local_addr = %server.local_addr, "console serving pages, /api, /metrics, /healthz, /readyz");
    if !console
        .store
        .migrate_if_asked(&console.settings.database, &shutdown)
        .await
        .context("cannot apply database migrations")?
    {
        return Ok(());
    }
    let slot = console.connection.clone();
    let stop = shutdown.clone();
    session
        .run(shutdown.clone(), move |connection, _publisher| {
            let (slot, stop) = (slot.clone(), stop.clone());
            async move {
                slot.set(Some(connection));
                stop.cancelled().await;
                slot.set(None);
                Ok(())
            }
        })
        .await;
    console.connection.set(None);
    server.stopped().await
}
