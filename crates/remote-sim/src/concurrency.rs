//! Calls in flight per merchant, as a merchant's API would count them: a
//! call whose order names `attributes.merchant_id` is counted under
//! `<service>:<merchant>` from its arrival to its answer (or until its
//! caller went away), and the most ever counted at once is kept. Tests read
//! it (`GET /concurrency`) to check that a workflow's concurrency limit by
//! key holds at the remote, whatever the schedulers and agents do.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

/// One key's calls: in flight now, and the most at once so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyCalls {
    /// Calls of the key being answered now.
    pub in_flight: u32,
    /// The most that were at once.
    pub peak: u32,
    /// Calls of the key so far.
    pub calls: u64,
}

/// Every key's calls, shared by the handlers.
#[derive(Debug, Clone, Default)]
pub struct Concurrency {
    keys: Arc<Mutex<BTreeMap<String, KeyCalls>>>,
}

impl Concurrency {
    /// Counts a call of `service` for `order` (the request's `order`), if
    /// it names a merchant: in flight until the returned guard is dropped.
    pub fn enter(&self, service: &str, order: &serde_json::Value) -> Option<InFlight> {
        let merchant = order.pointer("/attributes/merchant_id")?;
        let merchant = merchant
            .as_str()
            .map_or_else(|| merchant.to_string(), str::to_owned);
        let key = format!("{service}:{merchant}");
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        let entry = keys.entry(key.clone()).or_default();
        entry.in_flight += 1;
        entry.calls += 1;
        entry.peak = entry.peak.max(entry.in_flight);
        Some(InFlight {
            keys: self.keys.clone(),
            key,
        })
    }

    /// Every key's counts, by key.
    pub fn snapshot(&self) -> BTreeMap<String, KeyCalls> {
        self.keys.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// A call counted in flight until dropped.
#[derive(Debug)]
pub struct InFlight {
    keys: Arc<Mutex<BTreeMap<String, KeyCalls>>>,
    key: String,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = keys.get_mut(&self.key) {
            entry.in_flight = entry.in_flight.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn calls_are_counted_per_service_and_merchant_until_answered() {
        let counts = Concurrency::default();
        let order = json!({"attributes": {"merchant_id": "m-1"}});
        let a = counts.enter("payment", &order).expect("a merchant");
        let b = counts.enter("payment", &order).expect("a merchant");
        let other = counts.enter("shipping", &order).expect("a merchant");
        assert!(counts
            .enter("payment", &json!({"attributes": {}}))
            .is_none());
        drop(a);
        let c = counts.enter("payment", &json!({"attributes": {"merchant_id": 7}}));
        let now = counts.snapshot();
        assert_eq!(
            now["payment:m-1"],
            KeyCalls {
                in_flight: 1,
                peak: 2,
                calls: 2
            }
        );
        assert_eq!(now["shipping:m-1"].peak, 1);
        assert_eq!(now["payment:7"].in_flight, 1);
        drop((b, other, c));
        assert!(counts.snapshot().values().all(|k| k.in_flight == 0));
    }
}
