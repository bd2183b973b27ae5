//! The retention loop: deletes finished orders and old dead letters (see
//! [`sas_store::writes::retention`]), so that a deployment running for years keeps
//! a bounded database.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use sas_runtime::Next;
use sas_store::writes::retention::Retention;
use sas_store::StoreError;

use crate::Supervisor;

impl Supervisor {
    /// Every `retention.interval_ms` until shutdown, deletes what the policy
    /// allows, one small batch per transaction, going again at once while a
    /// batch comes back full. Does nothing when both ages are 0.
    ///
    /// # Errors
    /// An age below the database's floor for this role ([`Self::check_floor`]):
    /// the supervisor is shut down, and `run` returns the error.
    pub async fn retention_loop(self: Arc<Self>) -> anyhow::Result<()> {
        let settings = &self.settings.retention;
        let retention = settings.retention();
        if retention.finished.is_none() && retention.dead_letters.is_none() {
            tracing::info!("retention off: every order and dead letter is kept");
            return Ok(());
        }
        if let Err(error) = self.check_floor(&retention).await {
            self.shutdown.cancel();
            return Err(error);
        }
        let interval = Duration::from_millis(settings.interval_ms);
        let tick = || async {
            let next = match self.store.writes().retire(&retention).await {
                Ok(retired) => {
                    metrics::counter!("sas_retired_total", "what" => "orders")
                        .increment(retired.orders);
                    metrics::counter!("sas_retired_total", "what" => "dead_letters")
                        .increment(retired.dead_letters);
                    metrics::counter!("sas_retired_total", "what" => "schedule_runs")
                        .increment(retired.schedule_runs);
                    if retired.orders + retired.dead_letters + retired.schedule_runs > 0 {
                        tracing::debug!(
                            orders = retired.orders,
                            dead_letters = retired.dead_letters,
                            schedule_runs = retired.schedule_runs,
                            "retired"
                        );
                    }
                    let most = retired
                        .orders
                        .max(retired.dead_letters)
                        .max(retired.schedule_runs);
                    Next::after(
                        usize::try_from(most).unwrap_or(usize::MAX),
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
        Ok(())
    }

    /// Refuses a retention age below the database's floor for this role
    /// (migration 0022): the database would refuse every pass, and the
    /// finished orders would pile up behind a warning a minute. Waits out a
    /// database that is not there yet (the rest of the supervisor runs
    /// meanwhile); shutdown ends the wait.
    ///
    /// # Errors
    /// An age below the floor, naming the setting and what to do; or a
    /// database that answers with an error that is not transient.
    async fn check_floor(&self, retention: &Retention) -> anyhow::Result<()> {
        let Some(floor) = sas_runtime::retry_transient(
            &self.shutdown,
            "reading the retention floor",
            StoreError::is_transient,
            || self.store.writes().retention_floor(),
        )
        .await
        else {
            return Ok(());
        };
        let floor = floor.map_err(|error| {
            anyhow::anyhow!("cannot read the database's retention floor ({error}): are the migrations up to date (0022)?")
        })?;
        if let Some((setting, age)) = retention.below(floor) {
            anyhow::bail!(
                "{setting} = {} is below the database's retention floor of {} s for this role, so every retention pass would be refused: \
                 raise {setting}, or have the schema owner lower the floor (UPDATE retention_floor SET min_age = interval '10 minutes')",
                age.as_secs(),
                floor.as_secs()
            );
        }
        Ok(())
    }
}
