//! Retrying an operation through transient failures (a database restart, a
//! lost connection) instead of giving the message back to its queue, where
//! each return would count towards the quorum queue's delivery limit.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::backoff::{Backoff, Jitter};

/// The waits of [`retry_transient`]: from 50 ms doubling up to 5 s, as
/// they come (one caller waiting on one dependency).
pub const TRANSIENT: Backoff = Backoff::new(
    Duration::from_millis(50),
    Duration::from_secs(5),
    Jitter::None,
);

/// Runs `operation` until it succeeds, fails permanently, or `shutdown` fires.
///
/// Transient errors (as told by `is_transient`) are retried after the waits
/// of [`TRANSIENT`]. Returns `None` on shutdown, and `Some(Err(_))`
/// for a permanent error.
pub async fn retry_transient<T, E, F, Fut>(
    shutdown: &CancellationToken,
    what: &str,
    is_transient: impl Fn(&E) -> bool,
    mut operation: F,
) -> Option<Result<T, E>>
where
    E: std::fmt::Display,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let mut tries = 0;
    loop {
        match operation().await {
            Ok(value) => return Some(Ok(value)),
            Err(error) if is_transient(&error) => {
                tries += 1;
                let wait = TRANSIENT.wait(tries);
                tracing::warn!(error = %error, retry_in_ms = wait.as_millis() as u64, "{what} failed; retrying");
                tokio::select! {
                    () = tokio::time::sleep(wait) => {}
                    () = shutdown.cancelled() => return None,
                }
            }
            Err(error) => return Some(Err(error)),
        }
    }
}
