//! Shutdown on SIGTERM (what containers send) or SIGINT (Ctrl-C).

use tokio_util::sync::CancellationToken;

/// A token cancelled at the first SIGTERM or SIGINT.
///
/// # Panics
/// When signal handlers cannot be installed (no runtime).
pub fn on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let fire = token.clone();
    tokio::spawn(async move {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                .expect("install SIGTERM handler");
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM received; shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT received; shutting down"),
        }
        fire.cancel();
    });
    token
}
