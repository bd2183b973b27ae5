//! Waiting for a condition by polling it, with a deadline.

use std::future::Future;
use std::time::{Duration, Instant};

/// Polls `check` every 100 ms until it returns `Some`, or panics with
/// `what` and the last observation after `timeout`.
///
/// # Panics
/// When the deadline passes.
pub async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, String>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        match check().await {
            Ok(value) => return value,
            Err(observed) if Instant::now() >= deadline => {
                panic!("timed out after {timeout:?} waiting for {what}; last seen: {observed}")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Waits until `base`'s `/readyz` answers 200 (at most 20 s): a service
/// started with [`crate::TestEnv::spawn`] is connected to the broker and the
/// database.
///
/// # Panics
/// When it is not ready in time.
pub async fn wait_ready(what: &str, base: &str) {
    let http = crate::http_client();
    let url = format!("{base}/readyz");
    wait_until(
        &format!("{what} to be ready"),
        Duration::from_secs(20),
        || {
            let (http, url) = (http.clone(), url.clone());
            async move {
                let response = http.get(&url).send().await.map_err(|e| e.to_string())?;
                if response.status().is_success() {
                    Ok(())
                } else {
                    Err(response.text().await.unwrap_or_default())
                }
            }
        },
    )
    .await;
}
