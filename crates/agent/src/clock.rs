//! This agent's idea of the database clock.
//!
//! Deadlines (`complete_by`, `start_by`) come from the database clock. An
//! agent whose own clock runs behind would start calls too late, after the
//! supervisor gave up and the undo went out. Each request's `dispatched_at`
//! (database clock) is compared with the local time it arrived: the request
//! cannot have arrived before it was sent, so `dispatched_at - received` is a
//! lower bound of how far this clock runs behind. The estimate keeps the
//! largest recent sample, halving with age, and is added to the local time
//! whenever a deadline is checked.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use chrono::{DateTime, Utc};

/// How long an estimate takes to halve without a new sample as large.
const HALF_LIFE: Duration = Duration::from_secs(60);

/// Lag worth a log line.
const WORTH_LOGGING: Duration = Duration::from_millis(250);

/// The local clock, shifted by the test-only offset, and how far it runs
/// behind the database clock.
#[derive(Debug)]
pub struct Clock {
    offset: chrono::Duration,
    behind: Mutex<Estimate>,
}

#[derive(Debug)]
struct Estimate {
    value: Duration,
    at: Instant,
    logged: bool,
}

impl Clock {
    /// A clock shifted by `offset_ms` (test only; 0 in production).
    pub fn new(offset_ms: i64) -> Self {
        metrics::gauge!("sas_agent_clock_behind_seconds").set(0.0);
        Self {
            offset: chrono::Duration::milliseconds(offset_ms),
            behind: Mutex::new(Estimate {
                value: Duration::ZERO,
                at: Instant::now(),
                logged: false,
            }),
        }
    }

    /// This host's time (with the test offset).
    pub fn local_now(&self) -> DateTime<Utc> {
        Utc::now() + self.offset
    }

    /// The best estimate of the database clock's time now: the local time
    /// plus how far it runs behind.
    pub fn database_now(&self) -> DateTime<Utc> {
        self.local_now() + chrono::Duration::from_std(self.behind()).unwrap_or_default()
    }

    /// How far this clock is estimated to run behind the database clock.
    pub fn behind(&self) -> Duration {
        let estimate = self.lock();
        decayed(estimate.value, estimate.at.elapsed())
    }

    /// Records a request dispatched at `dispatched_at` (database clock) and
    /// received at `received` (local clock).
    pub fn observe(&self, dispatched_at: DateTime<Utc>, received: DateTime<Utc>) {
        let sample = (dispatched_at - received)
            .to_std()
            .unwrap_or(Duration::ZERO);
        let mut estimate = self.lock();
        let current = decayed(estimate.value, estimate.at.elapsed());
        let value = current.max(sample);
        estimate.value = value;
        estimate.at = Instant::now();
        metrics::gauge!("sas_agent_clock_behind_seconds").set(value.as_secs_f64());
        if value > WORTH_LOGGING && !estimate.logged {
            estimate.logged = true;
            tracing::warn!(
                behind_ms = value.as_millis() as u64,
                "this host's clock runs behind the database clock; deadlines are moved earlier by as much (check NTP)"
            );
        } else if value <= WORTH_LOGGING {
            estimate.logged = false;
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Estimate> {
        self.behind.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn decayed(value: Duration, age: Duration) -> Duration {
    let halvings = age.as_secs_f64() / HALF_LIFE.as_secs_f64();
    value.mul_f64(0.5f64.powf(halvings))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_clock_two_seconds_behind_is_measured_and_corrected() {
        let clock = Clock::new(-2000);
        let received = clock.local_now();
        clock.observe(Utc::now(), received);
        let behind = clock.behind();
        assert!(
            behind > Duration::from_millis(1900) && behind <= Duration::from_millis(2100),
            "{behind:?}"
        );
        let error = (clock.database_now() - Utc::now()).num_milliseconds().abs();
        assert!(error < 150, "{error} ms off");
    }

    #[test]
    fn a_request_that_waited_in_the_queue_says_nothing_of_the_clock() {
        let clock = Clock::new(0);
        clock.observe(Utc::now() - chrono::Duration::seconds(5), Utc::now());
        assert_eq!(clock.behind(), Duration::ZERO);
    }

    #[test]
    fn the_estimate_keeps_the_recent_maximum_and_fades() {
        assert_eq!(
            decayed(Duration::from_secs(2), Duration::ZERO),
            Duration::from_secs(2)
        );
        assert_eq!(
            decayed(Duration::from_secs(2), HALF_LIFE),
            Duration::from_secs(1)
        );
        let clock = Clock::new(0);
        let now = Utc::now();
        clock.observe(now + chrono::Duration::seconds(1), now);
        clock.observe(now, now);
        assert!(clock.behind() > Duration::from_millis(900));
    }
}
