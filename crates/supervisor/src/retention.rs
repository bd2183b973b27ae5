//! The retention loop: deletes finished orders and old dead letters (see
//! [`sas_store::retention`]), so that a deployment running for years keeps
//! a bounded database.

use std::sync::Arc;
use std::time::Duration;

use crate::Supervisor;

impl Supervisor {
    /// Every `retention.interval_ms` until shutdown, deletes what the policy
    /// allows, one small batch per transaction, going again at once while a
    /// batch comes back full. Does nothing when both ages are 0.
    pub async fn retention_loop(self: Arc<Self>) {
        let settings = &self.settings.retention;
        let retention = settings.retention();
        if retention.finished.is_none() && retention.dead_letters.is_none() {
            tracing::info!("retention off: every order and dead letter is kept");
            return;
        }
        let interval = Duration::from_millis(settings.interval_ms);
        let batch = u64::try_from(retention.batch).unwrap_or(1);
        loop {
            let full = match self.store.retire(&retention).await {
                Ok(retired) => {
                    metrics::counter!("sas_retired_total", "what" => "orders")
                        .increment(retired.orders);
                    metrics::counter!("sas_retired_total", "what" => "dead_letters")
                        .increment(retired.dead_letters);
                    if retired.orders + retired.dead_letters > 0 {
                        tracing::debug!(
                            orders = retired.orders,
                            dead_letters = retired.dead_letters,
                            "retired"
                        );
                    }
                    retired.orders == batch || retired.dead_letters == batch
                }
                Err(error) => {
                    tracing::warn!(error = %error, "cannot delete finished orders or old dead letters; retrying at the next interval");
                    false
                }
            };
            if full && !self.shutdown.is_cancelled() {
                tokio::task::yield_now().await;
                continue;
            }
            tokio::select! {
                () = tokio::time::sleep(interval) => {}
                () = self.shutdown.cancelled() => return,
            }
        }
    }
}
