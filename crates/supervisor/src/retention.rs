//! The retention loop: deletes finished orders and old dead letters (see
//! [`sas_store::writes::retention`]), so that a deployment running for years keeps
//! a bounded database.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use sas_runtime::Next;

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
        let tick = || async {
            let next = match self.store.writes().retire(&retention).await {
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
                    Next::after(
                        usize::try_from(retired.orders.max(retired.dead_letters))
                            .unwrap_or(usize::MAX),
                        i64::from(retention.batch),
                    )
                }
                Err(error) => {
                    tracing::warn!(error = %error, "cannot delete finished orders or old dead letters; retrying at the next interval");
                    Next::Wait
                }
            };
            Ok::<_, Infallible>(next)
        };
        let Ok(()) = sas_runtime::every(interval, &self.shutdown, tick).await;
    }
}
