//! The simulated remote services that agents wrap: inventory (reserve,
//! release), payment (charge, refund) and shipping (ship, cancel).
//!
//! They behave like well-made remote APIs: each call carries an
//! `Idempotency-Key`, and a key is decided once: a repeat gets the first
//! answer and applies nothing. Latency and faults are configurable (also at
//! run time through `PUT /admin/faults`), and every side effect applied is
//! recorded (`GET /side-effects`), so tests can count them.
//!
//! - [`ledger`]: the decisions taken per key, the side effects, the journal.
//! - [`routes`]: the HTTP API.

pub mod ledger;
pub mod routes;
pub mod settings;

use tokio_util::sync::CancellationToken;

pub use settings::Settings;

/// Serves the simulated services until `shutdown`.
///
/// # Errors
/// When the journal cannot be read or the address cannot be bound.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let state = routes::SimState::new(&settings, shutdown.clone())?;
    let listener = tokio::net::TcpListener::bind(&settings.http.listen)
        .await
        .map_err(|e| {
            anyhow::anyhow!("cannot listen on http.listen={}: {e}", settings.http.listen)
        })?;
    tracing::info!(addr = %listener.local_addr()?, faults = ?settings.sim.faults, "remote-sim listening");
    let app = routes::router(state).merge(sas_runtime::ops::router(
        sas_runtime::ops::always_ready(),
        shutdown.clone(),
    )?);
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await?;
    Ok(())
}
