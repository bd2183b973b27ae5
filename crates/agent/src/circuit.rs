//! A circuit breaker around the remote service.
//!
//! After `failure_threshold` consecutive transient faults the circuit opens:
//! no call goes out (requests wait in the agent for the probe, within their
//! deadline) instead of piling onto a service that is down. After `cool_down` one probe is let through
//! (half-open); its success closes the circuit, its failure opens it again.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The breaker's state, as exported in the `sas_circuit_state` gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    /// Calls go through (gauge 0).
    Closed,
    /// Calls fail fast (gauge 1).
    Open,
    /// One probe is in flight (gauge 2).
    HalfOpen,
}

impl CircuitState {
    fn gauge(self) -> f64 {
        match self {
            Self::Closed => 0.0,
            Self::Open => 1.0,
            Self::HalfOpen => 2.0,
        }
    }
}

#[derive(Debug)]
struct Inner {
    state: CircuitState,
    consecutive_failures: u32,
    opened_at: Instant,
}

/// A thread-safe circuit breaker.
#[derive(Debug)]
pub struct CircuitBreaker {
    name: String,
    failure_threshold: u32,
    cool_down: Duration,
    inner: Mutex<Inner>,
}

impl CircuitBreaker {
    /// A closed breaker for the remote service of agent `name`.
    pub fn new(name: &str, failure_threshold: u32, cool_down: Duration) -> Self {
        let breaker = Self {
            name: name.to_owned(),
            failure_threshold,
            cool_down,
            inner: Mutex::new(Inner {
                state: CircuitState::Closed,
                consecutive_failures: 0,
                opened_at: Instant::now(),
            }),
        };
        breaker.publish(CircuitState::Closed);
        breaker
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn publish(&self, state: CircuitState) {
        metrics::gauge!("sas_circuit_state", "agent" => self.name.clone()).set(state.gauge());
    }

    fn transition(&self, inner: &mut Inner, to: CircuitState) {
        if inner.state != to {
            tracing::warn!(agent = %self.name, from = ?inner.state, to = ?to, "circuit breaker state changed");
            inner.state = to;
            self.publish(to);
        }
    }

    /// The current state.
    pub fn state(&self) -> CircuitState {
        self.lock().state
    }

    /// Whether a call may go out now. An open circuit past its cool-down
    /// turns half-open and lets this one call through as the probe.
    pub fn allow(&self) -> bool {
        let mut inner = self.lock();
        match inner.state {
            CircuitState::Closed => true,
            CircuitState::HalfOpen => false,
            CircuitState::Open if inner.opened_at.elapsed() >= self.cool_down => {
                self.transition(&mut inner, CircuitState::HalfOpen);
                true
            }
            CircuitState::Open => false,
        }
    }

    /// How long until a call may be let through: the rest of the cool-down
    /// while open, a short pause while a probe is out, zero when closed.
    pub fn retry_after(&self) -> Duration {
        let inner = self.lock();
        match inner.state {
            CircuitState::Closed => Duration::ZERO,
            CircuitState::Open => self.cool_down.saturating_sub(inner.opened_at.elapsed()),
            CircuitState::HalfOpen => (self.cool_down / 10).max(Duration::from_millis(10)),
        }
    }

    /// Records a call that reached the service and got an answer (success or
    /// a permanent refusal): the service is up.
    pub fn record_success(&self) {
        let mut inner = self.lock();
        inner.consecutive_failures = 0;
        self.transition(&mut inner, CircuitState::Closed);
    }

    /// Records a transient fault.
    pub fn record_failure(&self) {
        let mut inner = self.lock();
        inner.consecutive_failures = inner.consecutive_failures.saturating_add(1);
        if inner.state == CircuitState::HalfOpen
            || inner.consecutive_failures >= self.failure_threshold
        {
            inner.opened_at = Instant::now();
            self.transition(&mut inner, CircuitState::Open);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_circuit_opens_after_the_threshold_and_fails_fast() {
        let breaker = CircuitBreaker::new("t", 3, Duration::from_secs(60));
        for _ in 0..2 {
            breaker.record_failure();
            assert!(breaker.allow());
        }
        breaker.record_failure();
        assert_eq!(breaker.state(), CircuitState::Open);
        assert!(!breaker.allow());
    }

    #[test]
    fn after_the_cool_down_one_probe_goes_through_and_its_success_closes_the_circuit() {
        let breaker = CircuitBreaker::new("t", 1, Duration::from_millis(0));
        breaker.record_failure();
        assert_eq!(breaker.state(), CircuitState::Open);
        assert!(breaker.allow(), "the probe");
        assert_eq!(breaker.state(), CircuitState::HalfOpen);
        assert!(!breaker.allow(), "only one probe at a time");
        breaker.record_success();
        assert_eq!(breaker.state(), CircuitState::Closed);
        assert!(breaker.allow());
    }

    #[test]
    fn a_failed_probe_opens_the_circuit_again() {
        let breaker = CircuitBreaker::new("t", 1, Duration::from_secs(60));
        breaker.record_failure();
        {
            let mut inner = breaker.lock();
            inner.opened_at = Instant::now() - Duration::from_secs(61);
        }
        assert!(breaker.allow());
        breaker.record_failure();
        assert_eq!(breaker.state(), CircuitState::Open);
        assert!(!breaker.allow());
    }

    #[test]
    fn a_success_resets_the_count_of_consecutive_failures() {
        let breaker = CircuitBreaker::new("t", 2, Duration::from_secs(60));
        breaker.record_failure();
        breaker.record_success();
        breaker.record_failure();
        assert_eq!(breaker.state(), CircuitState::Closed);
    }
}
