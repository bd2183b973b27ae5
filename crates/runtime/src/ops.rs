//! The operations HTTP endpoint every service serves: `/metrics` in the
//! Prometheus text format, `/healthz` (the process is alive), `/readyz` (it
//! can reach what it needs: 503 otherwise).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

/// Tells whether the service can do its work now (broker connected, database reachable).
pub type Readiness = Arc<
    dyn Fn() -> std::pin::Pin<Box<dyn std::future::Future<Output = Result<(), String>> + Send>>
        + Send
        + Sync,
>;

/// A running operations endpoint.
pub struct OpsServer {
    /// The address it listens on (useful when configured with port 0).
    pub local_addr: SocketAddr,
}

#[derive(Clone)]
struct OpsState {
    metrics: PrometheusHandle,
    readiness: Readiness,
}

/// Installs the Prometheus recorder (once per process) and returns the
/// router of `/metrics`, `/healthz` and `/readyz`, for a service that serves
/// them beside its own routes.
///
/// # Errors
/// When a recorder is already installed.
pub fn router(readiness: Readiness, shutdown: CancellationToken) -> anyhow::Result<Router> {
    let metrics = PrometheusBuilder::new()
        .set_buckets(&[
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ])?
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full("sas_batch_items".into()),
            &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 1000.0],
        )?
        .install_recorder()?;
    let upkeep = metrics.clone();
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            tokio::select! {
                _ = tick.tick() => upkeep.run_upkeep(),
                () = shutdown.cancelled() => return,
            }
        }
    });
    Ok(Router::new()
        .route(
            "/metrics",
            get(|State(state): State<OpsState>| async move { state.metrics.render() }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(|State(state): State<OpsState>| async move {
                match (state.readiness)().await {
                    Ok(()) => (StatusCode::OK, "ready".to_owned()),
                    Err(reason) => (StatusCode::SERVICE_UNAVAILABLE, reason),
                }
            }),
        )
        .with_state(OpsState { metrics, readiness }))
}

/// Installs the Prometheus recorder and serves the endpoint on `listen` until `shutdown`.
///
/// # Errors
/// When the address cannot be bound or a recorder is already installed.
pub async fn serve(
    listen: &str,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> anyhow::Result<OpsServer> {
    let app = router(readiness, shutdown.clone())?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on http.listen={listen}: {e}"))?;
    let local_addr = listener.local_addr()?;
    tokio::spawn(async move {
        let result = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(error) = result {
            tracing::error!(error = %error, "operations endpoint stopped");
        }
    });
    tracing::info!(%local_addr, "operations endpoint: /metrics /healthz /readyz");
    Ok(OpsServer { local_addr })
}

/// A service's own HTTP routes (the console's, the gateway's), served with
/// the operations endpoint merged in, until shutdown.
pub struct AppServer {
    /// The address it listens on.
    pub local_addr: SocketAddr,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// Serves `app` on `listen` until `shutdown`, with each request's peer
/// address available (`ConnectInfo<SocketAddr>`, for limits by client).
///
/// # Errors
/// When the address cannot be bound.
pub async fn serve_app(
    listen: &str,
    app: Router,
    shutdown: CancellationToken,
) -> anyhow::Result<AppServer> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on http.listen={listen}: {e}"))?;
    let local_addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
    });
    Ok(AppServer { local_addr, task })
}

impl AppServer {
    /// Waits (at most 5 s) for the server to finish its requests after
    /// shutdown fired.
    ///
    /// # Errors
    /// When the server or its task failed.
    pub async fn stopped(self) -> anyhow::Result<()> {
        match tokio::time::timeout(std::time::Duration::from_secs(5), self.task).await {
            Ok(Ok(Ok(()))) | Err(_) => Ok(()),
            Ok(Ok(Err(error))) => Err(anyhow::anyhow!("the HTTP server failed: {error}")),
            Ok(Err(error)) => Err(anyhow::anyhow!("the HTTP server task failed: {error}")),
        }
    }
}

/// Readiness of a service that needs only the broker.
pub fn broker_readiness(connected: impl Fn() -> bool + Send + Sync + 'static) -> Readiness {
    Arc::new(move || {
        let ready = connected();
        Box::pin(async move {
            if ready {
                Ok(())
            } else {
                Err("not connected to RabbitMQ".to_owned())
            }
        })
    })
}

/// Readiness of a service that needs the broker and the database.
pub fn broker_and_database_readiness<F, Fut>(
    connected: impl Fn() -> bool + Send + Sync + 'static,
    database: F,
) -> Readiness
where
    F: Fn() -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = bool> + Send + 'static,
{
    Arc::new(move || {
        let ready = connected();
        let reachable = database();
        Box::pin(async move {
            if !ready {
                return Err("not connected to RabbitMQ".to_owned());
            }
            if !reachable.await {
                return Err("cannot reach Postgres".to_owned());
            }
            Ok(())
        })
    })
}

/// Readiness of a service that depends on nothing: ready once it serves.
pub fn always_ready() -> Readiness {
    Arc::new(|| Box::pin(async { Ok(()) }))
}
