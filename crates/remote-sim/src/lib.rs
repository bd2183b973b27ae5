//! The simulated remote services that agents wrap, each with pairs of an
//! action and the compensation that undoes it ([`routes::SERVICES`]):
//! inventory (reserve/release, restock/destock), payment (charge/refund,
//! credit/debit) and shipping (ship/cancel, receive/reject). The first pair
//! of each serves the order workflow, the second a return (goods received,
//! the payment credited back, the stock restocked).
//!
//! They behave like well-made remote APIs: each call (`POST`, `PUT` or
//! `PATCH /{service}/{operation}` with a JSON body) carries an
//! `Idempotency-Key`, and a key is decided once: a repeat gets the first
//! answer and applies nothing. Latency and faults are configurable (also at
//! run time through `PUT /admin/faults`), and every side effect applied is
//! recorded with the call's method and body (`GET /side-effects`), so tests
//! can count them.
//!
//! - [`capacity`]: a merchant's API that serves so many calls at once
//!   (`PUT /admin/capacity/{service}/{merchant}`).
//! - [`concurrency`]: calls in flight per merchant (`GET /concurrency`).
//! - [`ledger`]: the decisions taken per key, the side effects, the journal.
//! - [`routes`]: the HTTP API (plain HTTP, or TLS with `sim.tls_cert_file`).

pub mod capacity;
pub mod concurrency;
pub mod ledger;
pub mod routes;
pub mod settings;

use std::sync::Arc;

use anyhow::Context;
use tokio_util::sync::CancellationToken;

pub use settings::Settings;

/// Serves the simulated services until `shutdown`.
///
/// # Errors
/// When the journal or the TLS files cannot be read or the address cannot be bound.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let state = routes::SimState::new(&settings, shutdown.clone())?;
    let app = routes::router(state).merge(sas_runtime::ops::router(
        sas_runtime::ops::always_ready(),
        shutdown.clone(),
    )?);
    let listener = std::net::TcpListener::bind(&settings.http.listen).map_err(|e| {
        anyhow::anyhow!("cannot listen on http.listen={}: {e}", settings.http.listen)
    })?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let provider = settings.sim.provider();
    if settings.sim.tls_cert_file.is_empty() {
        tracing::info!(%addr, faults = ?settings.sim.faults, ?provider, "remote-sim listening (http)");
        axum::serve(tokio::net::TcpListener::from_std(listener)?, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await?;
        return Ok(());
    }
    let tls = tls_config(&settings.sim.tls_cert_file, &settings.sim.tls_key_file)?;
    tracing::info!(%addr, faults = ?settings.sim.faults, ?provider, "remote-sim listening (https)");
    let handle = axum_server::Handle::new();
    let stopper = handle.clone();
    tokio::spawn(async move {
        shutdown.cancelled().await;
        stopper.graceful_shutdown(Some(std::time::Duration::from_secs(5)));
    });
    axum_server::from_tcp_rustls(
        listener,
        axum_server::tls_rustls::RustlsConfig::from_config(tls),
    )
    .handle(handle)
    .serve(app.into_make_service())
    .await?;
    Ok(())
}

/// remote-sim's rustls configuration: HTTP/2 and HTTP/1.1.
fn tls_config(cert_file: &str, key_file: &str) -> anyhow::Result<Arc<rustls::ServerConfig>> {
    let mut config = sas_runtime::tls::server_config("sim", cert_file, key_file)?
        .context("sim.tls_cert_file is set but sim.tls_key_file is not")?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
