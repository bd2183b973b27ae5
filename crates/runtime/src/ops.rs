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

/// Installs the Prometheus recorder and serves the endpoint on
/// `http.listen` (HTTPS with `http.tls_cert_file`) until `shutdown`.
///
/// # Errors
/// When the address cannot be bound, the TLS files cannot be used, or a
/// recorder is already installed.
pub async fn serve(
    http: &crate::settings::HttpSettings,
    readiness: Readiness,
    shutdown: CancellationToken,
) -> anyhow::Result<OpsServer> {
    let app = router(readiness, shutdown.clone())?;
    let server = serve_app(&http.listen, app, http.tls()?, shutdown)
        .await
        .map_err(|e| anyhow::anyhow!("http.listen: {e}"))?;
    let local_addr = server.local_addr;
    tracing::info!(%local_addr, https = !http.tls_cert_file.is_empty(), "operations endpoint: /metrics /healthz /readyz");
    Ok(OpsServer { local_addr })
}

/// A service's own HTTP routes (the console's, the gateway's), served with
/// the operations endpoint merged in, until shutdown.
pub struct AppServer {
    /// The address it listens on.
    pub local_addr: SocketAddr,
    task: tokio::task::JoinHandle<std::io::Result<()>>,
}

/// How long a client may take to send a request's headers before its
/// connection is closed: a client that trickles them (slowloris) holds a
/// connection and a task for no longer than this.
pub const HEADER_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Serves `app` on `listen` until `shutdown`, with each request's peer
/// address available (`ConnectInfo<SocketAddr>`, for limits by client),
/// over HTTP/1.1 with [`HEADER_READ_TIMEOUT`] (axum's own server sets no
/// timer, so it waits for headers for ever), inside TLS when `tls` is
/// given (the handshake within the same timeout). On shutdown it stops
/// accepting and lets the open connections finish (see
/// [`AppServer::stopped`]).
///
/// # Errors
/// When the address cannot be bound.
pub async fn serve_app(
    listen: &str,
    app: Router,
    tls: Option<rustls::ServerConfig>,
    shutdown: CancellationToken,
) -> anyhow::Result<AppServer> {
    let tls = tls.map(|mut config| {
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        tokio_rustls::TlsAcceptor::from(Arc::new(config))
    });
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .map_err(|e| anyhow::anyhow!("cannot listen on {listen}: {e}"))?;
    let local_addr = listener.local_addr()?;
    let task = tokio::spawn(async move {
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        loop {
            let (stream, peer) = tokio::select! {
                accepted = listener.accept() => match accepted {
                    Ok(accepted) => accepted,
                    Err(error) => {
                        // Out of file descriptors, a reset before accept:
                        // wait a moment rather than spin.
                        tracing::warn!(%error, "cannot accept a connection");
                        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                        continue;
                    }
                },
                () = shutdown.cancelled() => break,
            };
            let service = hyper_util::service::TowerToHyperService::new(
                app.clone()
                    .layer(axum::Extension(axum::extract::ConnectInfo(peer))),
            );
            let watcher = graceful.watcher();
            let tls = tls.clone();
            tokio::spawn(async move {
                let served = match tls {
                    None => watcher.watch(http1(stream, service)).await,
                    Some(acceptor) => {
                        match tokio::time::timeout(HEADER_READ_TIMEOUT, acceptor.accept(stream))
                            .await
                        {
                            Ok(Ok(stream)) => watcher.watch(http1(stream, service)).await,
                            Ok(Err(error)) => {
                                tracing::debug!(%error, %peer, "TLS handshake failed");
                                return;
                            }
                            Err(_) => {
                                tracing::debug!(%peer, "TLS handshake not done within the header timeout");
                                return;
                            }
                        }
                    }
                };
                if let Err(error) = served {
                    tracing::debug!(%error, %peer, "connection ended with an error");
                }
            });
        }
        drop(listener);
        graceful.shutdown().await;
        Ok(())
    });
    Ok(AppServer { local_addr, task })
}

/// One HTTP/1.1 connection over `io` (a TCP or a TLS stream), with the
/// header read timeout.
fn http1<I>(
    io: I,
    service: hyper_util::service::TowerToHyperService<Router>,
) -> hyper::server::conn::http1::Connection<
    hyper_util::rt::TokioIo<I>,
    hyper_util::service::TowerToHyperService<Router>,
>
where
    I: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    hyper::server::conn::http1::Builder::new()
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .serve_connection(hyper_util::rt::TokioIo::new(io), service)
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
