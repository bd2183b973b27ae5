//! A merchant's API that copes with only so much: each call of a merchant
//! given a capacity (`PUT /admin/capacity/{service}/{merchant}`
//! `{"calls": N, "call_ms": M}`) holds one of `N` call slots for `M` ms,
//! and waits for one while all are busy. Its answers slow down as more of
//! its calls arrive at once, as a real API's do under load before it
//! refuses any: what an adaptive key's limit learns from. `{"calls": 0}`
//! ends it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::Semaphore;

/// The most call slots a merchant's API may be given.
pub const MOST_CALLS: u32 = 10_000;

/// The longest a call of a merchant's API may take.
pub const LONGEST_CALL_MS: u64 = 60_000;

/// A merchant's API's capacity: the body of
/// `PUT /admin/capacity/{service}/{merchant}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Capacity {
    /// Calls it serves at once (0: no limit, as before).
    pub calls: u32,
    /// Milliseconds each call takes once it has a slot.
    #[serde(default)]
    pub call_ms: u64,
}

impl Capacity {
    /// Checks the numbers.
    ///
    /// # Errors
    /// What is wrong, naming the field.
    pub fn check(&self) -> Result<(), String> {
        if self.calls > MOST_CALLS {
            return Err(format!("calls must be at most {MOST_CALLS}"));
        }
        if self.call_ms > LONGEST_CALL_MS {
            return Err(format!("call_ms must be at most {LONGEST_CALL_MS}"));
        }
        Ok(())
    }
}

/// One merchant's call slots.
#[derive(Debug)]
struct Slots {
    free: Semaphore,
    call: Duration,
}

/// Every merchant's capacity, by `<service>:<merchant>`.
#[derive(Debug, Clone, Default)]
pub struct Capacities {
    merchants: Arc<Mutex<HashMap<String, Arc<Slots>>>>,
}

impl Capacities {
    /// Gives `key` (`<service>:<merchant>`) `capacity` from now on (calls
    /// under way keep the slots they hold).
    pub fn set(&self, key: String, capacity: Capacity) {
        let mut merchants = self.merchants.lock().unwrap_or_else(|e| e.into_inner());
        if capacity.calls == 0 {
            merchants.remove(&key);
            return;
        }
        let slots = Slots {
            free: Semaphore::new(capacity.calls as usize),
            call: Duration::from_millis(capacity.call_ms),
        };
        merchants.insert(key, Arc::new(slots));
    }

    /// Serves one call of `key`: waits for a slot, then holds it for the
    /// call's time. At once for a key without a capacity.
    pub async fn serve(&self, key: &str) {
        let slots = self
            .merchants
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
            .cloned();
        let Some(slots) = slots else { return };
        let _slot = slots.free.acquire().await;
        tokio::time::sleep(slots.call).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn calls_beyond_the_capacity_wait_for_a_slot() {
        let capacities = Capacities::default();
        capacities.set(
            "payment:m-1".into(),
            Capacity {
                calls: 2,
                call_ms: 100,
            },
        );
        let started = tokio::time::Instant::now();
        let calls: Vec<_> = (0..5)
            .map(|_| {
                let capacities = capacities.clone();
                tokio::spawn(async move {
                    capacities.serve("payment:m-1").await;
                    started.elapsed()
                })
            })
            .collect();
        let mut took = Vec::new();
        for call in calls {
            took.push(call.await.unwrap().as_millis());
        }
        took.sort_unstable();
        assert_eq!(took, [100, 100, 200, 200, 300]);
        // Another merchant, or none set: at once.
        let other = tokio::time::Instant::now();
        capacities.serve("payment:m-2").await;
        assert_eq!(other.elapsed(), Duration::ZERO);
        capacities.set(
            "payment:m-1".into(),
            Capacity {
                calls: 0,
                call_ms: 0,
            },
        );
        capacities.serve("payment:m-1").await;
        assert_eq!(other.elapsed(), Duration::ZERO);
        assert!(Capacity {
            calls: MOST_CALLS + 1,
            call_ms: 0
        }
        .check()
        .unwrap_err()
        .starts_with("calls"));
    }
}
