//! Claiming ready orders: the heads of the agents' lines as their slots
//! free (new orders and next steps that waited for admission), orders the
//! supervisor sent back after their backoff, and compensations nobody
//! holds.

use std::sync::Arc;
use std::time::Duration;

use sas_broker::{BrokerError, Publisher};
use sas_runtime::Next;

use crate::Scheduler;

impl Scheduler {
    /// Claims ready orders every `claim_interval_ms` (at once again when a
    /// claim came back full), until shutdown: the heads of the agents'
    /// lines as their slots free (new orders and next steps that waited for
    /// admission), orders back from the supervisor's backoff, and
    /// compensations nobody holds.
    ///
    /// While agents have free slots a new order is not on this path: the
    /// intake and each reply start the next step themselves.
    ///
    /// What a claim publishes is sent in a task of its own (see
    /// [`Scheduler::announce`]): when the connection is lost, this loop is
    /// dropped with it, and the claimed orders' requests still go out on
    /// the next connection instead of waiting for their deadline.
    ///
    /// # Errors
    /// When a request cannot be published even on a later connection.
    pub async fn claim_loop(self: Arc<Self>, publisher: Publisher) -> Result<(), BrokerError> {
        let interval = Duration::from_millis(self.settings.scheduler.claim_interval_ms);
        sas_runtime::every(interval, &self.shutdown, || self.claim_once(&publisher)).await
    }

    /// One claim: up to a batch of ready orders (see
    /// [`sas_store::Store::claim_ready`]), each one's request published.
    /// Says whether the batch came back full.
    ///
    /// # Errors
    /// When a request cannot be published even on a later connection.
    pub async fn claim_once(self: &Arc<Self>, publisher: &Publisher) -> Result<Next, BrokerError> {
        let batch = self.settings.scheduler.claim_batch;
        // The claim's transaction runs in a task of its own: this loop is
        // dropped when the broker connection is lost (it is joined with
        // the consumers), and a transaction dropped halfway, a query
        // still waiting on a lock, can leave its pooled connection inside
        // an open transaction that a later statement then joins and
        // loses. Run to its end, the claim commits or rolls back; what
        // it claimed and could not publish waits for the supervisor.
        let claim = {
            let (store, id) = (self.store.clone(), self.id.clone());
            tokio::spawn(async move { store.writes().claim_ready(&id, batch).await })
        };
        let claimed = match claim.await {
            Ok(Ok(claimed)) => claimed,
            Ok(Err(error)) => {
                tracing::warn!(error = %error, "cannot claim ready orders");
                Vec::new()
            }
            Err(error) => {
                tracing::error!(error = %error, "the claim task failed");
                Vec::new()
            }
        };
        let next = Next::after(claimed.len(), batch);
        for claim in &claimed {
            let progress = &claim.progress;
            if let Some(dispatch) = &progress.dispatch {
                tracing::info!(order_id = %dispatch.order_id, step = %dispatch.step, attempt = dispatch.attempt, "claimed order");
            }
            if let Some((agent, waited)) = &claim.waited {
                metrics::histogram!("sas_admission_wait_seconds", "agent" => agent.clone())
                    .record(waited.as_secs_f64());
            }
            metrics::counter!("sas_orders_claimed_total").increment(1);
        }
        let announced = {
            let (me, publisher) = (self.clone(), publisher.clone());
            tokio::spawn(async move {
                for claim in &claimed {
                    me.announce(Some(&publisher), &claim.progress).await?;
                }
                Ok::<(), BrokerError>(())
            })
        };
        match announced.await {
            Ok(result) => result?,
            Err(error) => tracing::error!(error = %error, "the task announcing claims failed"),
        }
        Ok(next)
    }
}
