//! The orders this scheduler acknowledged, checked against the database
//! after it lost its connections.
//!
//! Intake acknowledges an order to RabbitMQ only once its commit returned;
//! the broker then forgets the message. With strict synchronous replication
//! a failover loses no acknowledged commit. Should one be lost anyway (an
//! asynchronous pair, a cluster manager that let a frozen primary take its
//! lock back), the orders acknowledged in the lost window are gone, and
//! nothing would say so. So each scheduler remembers the ids of the orders
//! it acknowledged in the last `scheduler.acknowledged_audit_secs`, and
//! whenever its pool opened connections in place of some it lost since it
//! last looked (a failover, a database or proxy restart cut the old ones;
//! not a pool growing under load), it asks the
//! database it reaches now which of them it does not hold. Those are counted
//! (`sas_orders_lost_total`), logged with every id, and named in one
//! `orders_lost` alert with the window they were acknowledged in
//! (`sas_audit_acknowledged_orders` says how many it remembers). Intake is
//! idempotent on the order id: publishing them again (from the client's
//! records; the remote services' ledgers show which steps they reached)
//! restores them, and the steps they had done are not done twice (their
//! idempotency keys are the same).

use std::collections::{HashSet, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};

use crate::Scheduler;

/// How often the audit looks whether the pool opened new connections.
pub const LOOK_EVERY: Duration = Duration::from_secs(1);

/// Most order ids one check sends in a statement.
const CHECK_AT_ONCE: usize = 5_000;

/// Most lost order ids an alert's message names (the log names them all).
const NAMED_IN_ALERT: usize = 50;

/// The orders acknowledged lately, oldest first, with when.
#[derive(Debug, Default)]
pub struct Acknowledged {
    entries: Mutex<VecDeque<(Box<str>, DateTime<Utc>)>>,
}

impl Acknowledged {
    /// Remembers that `order_id` was acknowledged now, and forgets what was
    /// acknowledged more than `keep` ago.
    pub fn record(&self, order_id: &str, keep: Duration) {
        if keep.is_zero() {
            return;
        }
        let now = Utc::now();
        let mut entries = self.lock();
        entries.push_back((order_id.into(), now));
        forget_older(&mut entries, now, keep);
        metrics::gauge!("sas_audit_acknowledged_orders").set(entries.len() as f64);
    }

    /// What is remembered, oldest first, after forgetting what is older
    /// than `keep`.
    fn recent(&self, keep: Duration) -> Vec<(Box<str>, DateTime<Utc>)> {
        let mut entries = self.lock();
        forget_older(&mut entries, Utc::now(), keep);
        entries.iter().cloned().collect()
    }

    /// Forgets `lost`: reported once.
    fn forget(&self, lost: &HashSet<&str>) {
        let mut entries = self.lock();
        entries.retain(|(order_id, _)| !lost.contains(order_id.as_ref()));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, VecDeque<(Box<str>, DateTime<Utc>)>> {
        self.entries.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn forget_older(
    entries: &mut VecDeque<(Box<str>, DateTime<Utc>)>,
    now: DateTime<Utc>,
    keep: Duration,
) {
    let keep = chrono::Duration::from_std(keep).unwrap_or(chrono::Duration::MAX);
    while entries.front().is_some_and(|(_, at)| now - *at > keep) {
        entries.pop_front();
    }
}

/// Checks the acknowledged orders whenever the pool replaced connections
/// since the last look, until shutdown.
pub async fn run(scheduler: Arc<Scheduler>) {
    let keep = Duration::from_secs(scheduler.settings.scheduler.acknowledged_audit_secs);
    if keep.is_zero() {
        return;
    }
    // Registered at 0, so that an alert on its increase sees the first loss.
    metrics::counter!("sas_orders_lost_total").absolute(0);
    // Connections the pool had closed when the orders were last checked.
    let mut checked = Pool::now(&scheduler.store).closed();
    loop {
        tokio::select! {
            () = tokio::time::sleep(LOOK_EVERY) => {}
            () = scheduler.shutdown.cancelled() => return,
        }
        let now = Pool::now(&scheduler.store);
        if !now.check_due(checked) {
            continue;
        }
        match check(&scheduler, keep).await {
            Ok(()) => checked = now.closed(),
            // Looked again at the next tick: the database may still be away.
            Err(error) => {
                tracing::warn!(error = %error, "cannot check the acknowledged orders yet")
            }
        }
    }
}

/// The pool at one look: connections opened so far, and open now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Pool {
    opened: u64,
    size: u32,
}

impl Pool {
    fn now(store: &sas_store::Store) -> Self {
        Self {
            opened: store.connections_opened(),
            size: store.connections_open(),
        }
    }

    /// Connections it closed so far (lost, or retired for age): what it
    /// opened, less what is open.
    fn closed(self) -> i64 {
        i64::try_from(self.opened).unwrap_or(i64::MAX) - i64::from(self.size)
    }

    /// Whether the orders are due a check: it closed connections since
    /// `checked` were (a failover, a restart; a pool that only grows under
    /// load reaches the same primary), and holds one again.
    fn check_due(self, checked: i64) -> bool {
        self.closed() > checked && self.size > 0
    }
}

/// Asks the database which acknowledged orders it does not hold, and
/// reports those it lost.
///
/// # Errors
/// When the database fails.
async fn check(scheduler: &Scheduler, keep: Duration) -> Result<(), sas_store::StoreError> {
    let recent = scheduler.acknowledged.recent(keep);
    let mut lost: Vec<(String, DateTime<Utc>)> = Vec::new();
    for chunk in recent.chunks(CHECK_AT_ONCE) {
        let ids: Vec<&str> = chunk.iter().map(|(id, _)| id.as_ref()).collect();
        let missing: HashSet<String> = scheduler
            .store
            .reads()
            .missing_orders(&ids)
            .await?
            .into_iter()
            .collect();
        lost.extend(
            chunk
                .iter()
                .filter(|(id, _)| missing.contains(id.as_ref()))
                .map(|(id, at)| (id.to_string(), *at)),
        );
    }
    tracing::info!(
        checked = recent.len(),
        lost = lost.len(),
        "acknowledged orders checked after the pool opened new connections"
    );
    if lost.is_empty() {
        return Ok(());
    }
    let message = lost_message(&scheduler.id, &lost);
    metrics::counter!("sas_orders_lost_total").increment(lost.len() as u64);
    let ids: Vec<&str> = lost.iter().map(|(id, _)| id.as_str()).collect();
    tracing::error!(lost = lost.len(), order_ids = ?ids, "{message}");
    scheduler.store.writes().alert_orders_lost(&message).await?;
    scheduler.acknowledged.forget(&ids.into_iter().collect());
    Ok(())
}

/// The alert's words: how many, acknowledged when, which, and what to do.
fn lost_message(scheduler: &str, lost: &[(String, DateTime<Utc>)]) -> String {
    let first = lost
        .iter()
        .map(|(_, at)| *at)
        .min()
        .unwrap_or_else(Utc::now);
    let last = lost.iter().map(|(_, at)| *at).max().unwrap_or(first);
    let named: Vec<&str> = lost
        .iter()
        .take(NAMED_IN_ALERT)
        .map(|(id, _)| id.as_str())
        .collect();
    let more = lost.len().saturating_sub(NAMED_IN_ALERT);
    let more = if more > 0 {
        format!(" and {more} more (all in {scheduler}'s log)")
    } else {
        String::new()
    };
    format!(
        "{} orders {scheduler} acknowledged between {} and {} are not in the database it reaches after \
         losing its connections: the primary it reaches now does not hold commits an earlier one \
         acknowledged (a failover lost them). Orders: {}{more}. Publish them again from your records \
         (intake is idempotent; their steps' effects at the remote services are not repeated), and \
         check the cluster's replication settings.",
        lost.len(),
        first.to_rfc3339(),
        last.to_rfc3339(),
        named.join(", ")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_older_than_the_window_is_forgotten_and_what_is_reported_too() {
        let acknowledged = Acknowledged::default();
        acknowledged
            .lock()
            .push_back(("old".into(), Utc::now() - chrono::Duration::seconds(120)));
        acknowledged.record("a", Duration::from_secs(60));
        acknowledged.record("b", Duration::from_secs(60));
        let ids: Vec<String> = acknowledged
            .recent(Duration::from_secs(60))
            .into_iter()
            .map(|(id, _)| id.to_string())
            .collect();
        assert_eq!(ids, ["a", "b"]);
        acknowledged.forget(&HashSet::from(["a"]));
        assert_eq!(acknowledged.recent(Duration::from_secs(60)).len(), 1);
    }

    #[test]
    fn a_pool_that_grows_is_not_checked_and_one_that_replaced_connections_is() {
        let checked = Pool { opened: 5, size: 5 }.closed();
        assert!(!Pool { opened: 8, size: 8 }.check_due(checked), "grown");
        // Lost all five: nothing to check on until it holds one again.
        assert!(!Pool { opened: 5, size: 0 }.check_due(checked));
        assert!(Pool { opened: 8, size: 3 }.check_due(checked));
        // Lost two and grew by two.
        assert!(Pool { opened: 9, size: 7 }.check_due(checked));
    }

    #[test]
    fn the_alert_names_the_window_and_at_most_fifty_orders() {
        let at = Utc::now();
        let lost: Vec<(String, DateTime<Utc>)> = (0..60)
            .map(|n| (format!("o-{n}"), at + chrono::Duration::seconds(n)))
            .collect();
        let message = lost_message("scheduler-0", &lost);
        assert!(
            message.starts_with("60 orders scheduler-0 acknowledged between"),
            "{message}"
        );
        assert!(
            message.contains("o-49") && !message.contains("o-50,"),
            "{message}"
        );
        assert!(message.contains("and 10 more"), "{message}");
        assert!(message.contains("Publish them again"), "{message}");
    }
}
