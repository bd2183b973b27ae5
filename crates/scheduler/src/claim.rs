//! Claiming ready orders: the heads of the agents' lines as their slots
//! free (new orders and next steps that waited for admission), orders the
//! supervisor sent back after their backoff, and compensations nobody
//! holds.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sas_broker::{BrokerError, Publisher};
use sas_runtime::Next;

use crate::Scheduler;

impl Scheduler {
    /// Claims ready orders every `claim_interval_ms` (at once again when a
    /// claim came back full, or when woken by [`Scheduler::slot_freed`]),
    /// until shutdown: the heads of the agents'
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
        sas_runtime::every_or_woken(interval, &self.claim_wake, &self.shutdown, || {
            self.claim_once(&publisher)
        })
        .await
    }

    /// A reply gave back an agent's slot: while lines are being served (a
    /// claim took an order within the last two claim intervals), claim
    /// again at once rather than at the next interval, so that an order in
    /// line waits for a slot, not for a timer. Wakes coalesce: replies that
    /// come while a claim runs make one more claim. While no line is served
    /// this costs one atomic read: a line that forms is found by the next
    /// interval's claim, which turns this on.
    pub fn slot_freed(&self) {
        let window = Duration::from_millis(self.settings.scheduler.claim_interval_ms) * 2;
        if self.last_claimed.within(window) {
            self.claim_wake.notify_one();
        }
    }

    /// One claim: up to a batch of ready orders (see
    /// [`sas_store::Writes::claim_ready`]), each one's request published.
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
        // A rate-limited key line whose next start comes before the
        // interval: claim then, or its rate is not reached.
        let next = match (
            Next::after(claimed.len(), batch),
            self.store.next_key_start(),
        ) {
            (Next::Wait, Some(due)) => Next::Soon(due),
            (next, _) => next,
        };
        if !claimed.is_empty() {
            self.last_claimed.now();
        }
        for claim in &claimed {
            let progress = &claim.progress;
            for dispatch in &progress.dispatches {
                tracing::info!(order_id = %dispatch.order_id, step = %dispatch.step, attempt = dispatch.attempt, "claimed order");
            }
            if let Some((agent, waited)) = &claim.waited {
                metrics::histogram!("sas_admission_wait_seconds", "agent" => agent.clone())
                    .record(waited.as_secs_f64());
            }
            metrics::counter!("sas_orders_claimed_total").increment(1);
        }
        // All at once: each announce waits for its confirms, a few
        // milliseconds of a quorum queue's commit, and one after another a
        // full batch of 128 took half a second, so that a line emptied at
        // about 250 orders a second however fast the agents were.
        let announced = {
            let (me, publisher) = (self.clone(), publisher.clone());
            tokio::spawn(async move {
                let results = futures_util::future::join_all(
                    claimed
                        .iter()
                        .map(|claim| me.announce(Some(&publisher), &claim.progress)),
                )
                .await;
                results.into_iter().collect::<Result<(), BrokerError>>()
            })
        };
        match announced.await {
            Ok(result) => result?,
            Err(error) => tracing::error!(error = %error, "the task announcing claims failed"),
        }
        Ok(next)
    }
}

/// When a claim of this scheduler last took an order: lines are being
/// served while that is recent. A claim woken by a reply may find nothing
/// (the slot went to the same order's next step) while other lines still
/// wait, so one empty claim does not end the serving; two intervals
/// without a claimed order do.
#[derive(Debug)]
pub struct LastClaimed {
    /// The scheduler's own clock's origin.
    origin: Instant,
    /// Milliseconds from `origin` to the last claimed order, plus one (0:
    /// never).
    at_ms: AtomicU64,
}

impl Default for LastClaimed {
    fn default() -> Self {
        Self {
            origin: Instant::now(),
            at_ms: AtomicU64::new(0),
        }
    }
}

impl LastClaimed {
    /// A claim took an order now.
    fn now(&self) {
        let ms = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
        self.at_ms.store(ms + 1, Ordering::Relaxed);
    }

    /// Whether a claim took an order within `window` of now.
    fn within(&self, window: Duration) -> bool {
        match self.at_ms.load(Ordering::Relaxed) {
            0 => false,
            at => {
                let elapsed = u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
                elapsed.saturating_sub(at - 1)
                    <= u64::try_from(window.as_millis()).unwrap_or(u64::MAX)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_served_for_a_window_after_a_claimed_order() {
        let last = LastClaimed::default();
        assert!(!last.within(Duration::from_secs(3600)), "never claimed");
        last.now();
        assert!(last.within(Duration::from_millis(100)));
        std::thread::sleep(Duration::from_millis(30));
        assert!(!last.within(Duration::from_millis(10)), "window passed");
        assert!(last.within(Duration::from_secs(1)));
    }
}
