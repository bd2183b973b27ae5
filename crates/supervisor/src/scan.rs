//! The periodic scan for held orders whose complete-by has passed.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use sas_runtime::Next;

use sas_store::ProcessState;

use crate::Supervisor;

impl Supervisor {
    /// Until shutdown, three periodic loops ([`sas_runtime::every`]): every
    /// `interval_ms` one [`Supervisor::scan_once`] (at once again when its
    /// batch came back full), every `interval_ms` the gauges and the
    /// adaptation of the admission limits, and every
    /// `admission_reconcile_ms` (the first after one period) their
    /// reconciliation.
    pub async fn scan_loop(self: Arc<Self>) {
        let settings = &self.settings.supervisor;
        let interval = Duration::from_millis(settings.interval_ms);
        let reconcile_every = Duration::from_millis(settings.admission_reconcile_ms);
        let shutdown = &self.shutdown;
        let scans = sas_runtime::every(interval, shutdown, || async {
            Ok::<_, Infallible>(self.scan_once().await)
        });
        let gauges = sas_runtime::every(interval, shutdown, || async {
            self.refresh_gauges().await;
            self.adapt_admission().await;
            self.export_key_gauges().await;
            self.expire_events().await;
            self.adopt_keyed_events().await;
            Ok::<_, Infallible>(Next::Wait)
        });
        let reconciliations = async {
            tokio::select! {
                () = tokio::time::sleep(reconcile_every) => {}
                () = shutdown.cancelled() => return Ok(()),
            }
            sas_runtime::every(reconcile_every, shutdown, || async {
                self.reconcile_admission().await;
                Ok::<_, Infallible>(Next::Wait)
            })
            .await
        };
        let (Ok(()), Ok(()), Ok(())) = tokio::join!(scans, gauges, reconciliations);
    }

    /// Dead-letters a batch of events whose order never came within their
    /// time to live (see [`sas_store::writes::events`]).
    pub async fn expire_events(&self) {
        let source = self.names.events();
        match self
            .store
            .writes()
            .expire_events(&source, self.settings.supervisor.batch)
            .await
        {
            Ok(0) => {}
            Ok(expired) => {
                metrics::counter!("sas_events_expired_total").increment(expired);
                tracing::warn!(expired, "events whose order never came were dead-lettered");
            }
            Err(error) => tracing::warn!(error = %error, "cannot look for expired events"),
        }
    }

    /// Gives events kept by correlation key to the orders that since
    /// parked with their key (see [`sas_store::writes::events`]) and
    /// publishes what those orders do next. Off the schedulers' claims, so
    /// the hot path pays nothing for it; an early event waits at most an
    /// interval once its order parks.
    pub async fn adopt_keyed_events(&self) {
        let batch = self.settings.supervisor.batch;
        match self
            .store
            .writes()
            .adopt_keyed_events(&self.id, batch)
            .await
        {
            Ok(used) => {
                for progress in &used {
                    self.announce(progress).await;
                }
                if !used.is_empty() {
                    tracing::info!(
                        orders = used.len(),
                        "events kept by key given to the orders now waiting with it"
                    );
                }
            }
            Err(error) => {
                tracing::warn!(error = %error, "cannot give events kept by key to their orders")
            }
        }
    }

    /// One scan: recovers up to a batch of expired orders (see
    /// [`sas_store::Writes::recover_expired`]) and publishes what the
    /// decisions say to clients. Says whether the batch came back full.
    pub async fn scan_once(&self) -> Next {
        let settings = &self.settings.supervisor;
        let policy = settings.policy(&self.settings.deadlines);
        match self
            .store
            .writes()
            .recover_expired(&self.id, &policy, settings.batch)
            .await
        {
            Ok(decisions) => {
                let next = Next::after(decisions.len(), settings.batch);
                for decision in decisions {
                    metrics::counter!("sas_step_timeouts_total").increment(1);
                    metrics::counter!("sas_recoveries_total", "to" => decision.to.as_str())
                        .increment(1);
                    tracing::warn!(order_id = %decision.order_id, from = %decision.from, to = %decision.to, failure_count = decision.failure_count, not_before = %decision.not_before, "deadline passed; order recovered");
                    self.announce(&decision.progress).await;
                }
                next
            }
            Err(error) => {
                tracing::warn!(error = %error, "cannot scan for expired orders");
                Next::Wait
            }
        }
    }

    /// Announces a committed decision (see [`sas_announce::Announcer`]):
    /// finished orders are counted whether or not the broker is up; the
    /// status messages are sent if it is, and otherwise logged and dropped
    /// (they are notifications; the state store is the record), so that a
    /// broker outage never stops the scan.
    pub(crate) async fn announce(&self, progress: &sas_store::Progress) {
        let publisher = self.session.publisher().get().ok();
        if let Err(error) = self.announcer.announce(publisher.as_ref(), progress).await {
            let order_id = progress
                .statuses
                .first()
                .map_or("", |s| s.order_id.as_str());
            tracing::warn!(order_id, error = %error, "status messages not sent");
        }
    }

    /// Adapts the agents' admission limits (see [`sas_store::admission`])
    /// and exports each agent's counters: waiting in line, admitted and in
    /// flight, the current limit, and the cap urgent work passes it up to.
    async fn adapt_admission(&self) {
        let adaptation = self.settings.supervisor.adaptation();
        match self.store.admission().adapt(&adaptation).await {
            Ok(agents) => {
                for agent in agents {
                    let name = agent.agent.clone();
                    metrics::gauge!("sas_admission_waiting", "agent" => name.clone())
                        .set(f64::from(agent.waiting));
                    metrics::gauge!("sas_admission_in_flight", "agent" => name.clone())
                        .set(f64::from(agent.in_flight));
                    metrics::gauge!("sas_admission_limit", "agent" => name.clone())
                        .set(f64::from(agent.admit_limit));
                    metrics::gauge!("sas_admission_cap", "agent" => name)
                        .set(f64::from(agent.admit_cap));
                }
            }
            Err(error) => tracing::debug!(error = %error, "cannot adapt admission limits"),
        }
    }

    /// Corrects admission counters that no longer match the orders (see
    /// [`sas_store::Admission::reconcile`]), loudly: a correction
    /// means something changed orders behind the state machine's back.
    async fn reconcile_admission(&self) {
        match self.store.admission().reconcile().await {
            Ok(corrections) => {
                for c in corrections {
                    metrics::counter!("sas_admission_corrections_total", "agent" => c.agent.clone())
                        .increment(1);
                    tracing::warn!(agent = %c.agent, was_in_flight = c.was_in_flight, was_waiting = c.was_waiting, in_flight = c.in_flight, waiting = c.waiting, "admission counters did not match the orders; corrected");
                }
            }
            Err(error) => {
                tracing::debug!(error = %error, "cannot reconcile admission counters; trying again later");
            }
        }
    }

    /// Refreshes the gauges read from the state store: open orders by state
    /// (`sas_orders`), held orders still past complete-by + grace + one scan
    /// interval (`sas_orders_overdue`), and unresolved operator alerts
    /// (`sas_alerts_open`). Every supervisor exports the same counts.
    async fn refresh_gauges(&self) {
        match self.store.reads().count_open_by_state().await {
            Ok(counts) => {
                // Finished orders are counted by sas_orders_finished_total.
                let open = ProcessState::ALL.into_iter().filter(|s| !s.is_finished());
                for state in open {
                    let count = counts
                        .iter()
                        .find(|(s, _)| *s == state)
                        .map_or(0, |(_, n)| *n);
                    metrics::gauge!("sas_orders", "state" => state.as_str()).set(count as f64);
                }
            }
            Err(error) => tracing::debug!(error = %error, "cannot count orders by state"),
        }
        // Past complete-by plus grace plus one interval, a scan has had its
        // chance to recover an order: more of them for minutes means orders
        // are stuck (supervisors failing, or behind).
        let settings = &self.settings;
        let overdue_after =
            settings.deadlines.grace() + Duration::from_millis(settings.supervisor.interval_ms);
        match self
            .store
            .reads()
            .count_overdue_and_open_alerts(overdue_after)
            .await
        {
            Ok((overdue, alerts)) => {
                metrics::gauge!("sas_orders_overdue").set(overdue as f64);
                metrics::gauge!("sas_alerts_open").set(alerts as f64);
            }
            Err(error) => tracing::debug!(error = %error, "cannot count overdue orders and alerts"),
        }
    }
}
