//! A circuit breaker around the remote service.
//!
//! After `failure_threshold` consecutive transient faults the circuit opens:
//! no call goes out (requests wait in the agent for the probe, within their
//! deadline) instead of piling onto a service that is down. After
//! `cool_down` one probe is let through (half-open); its success closes the
//! circuit, its failure opens it again.
//!
//! A call may go out only with a [`Permit`] from [`CircuitBreaker::allow`],
//! and its outcome goes back through it ([`Permit::succeeded`],
//! [`Permit::failed`]). The probe is a value ([`Probe`]) so that every way
//! its call can end hands something back: dropped without an outcome (the
//! call was abandoned because the broker connection was lost, it waited
//! past its start-by for a call slot, the agent shut down), it hands the
//! probe back: the circuit is open again with its cool-down already served,
//! so the next call is the next probe. And a probe out for `cool_down` (a
//! call that hangs) no longer holds the others back: the next call is
//! another probe. Before, a probe that ended without an outcome left the
//! circuit half-open until the agent restarted, and every request waited
//! for it and expired.
//!
//! Metrics, per agent: `sas_circuit_state` (0 closed, 1 open, 2 half-open)
//! and `sas_circuit_open_seconds`, the seconds since the circuit last left
//! closed (0 while closed), which open and half-open in turn do not reset:
//! kept current on every decision and by the agent's one-second tick
//! ([`CircuitBreaker::publish`]); the alert `SasCircuitNotClosed` reads it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The breaker's state, as exported in the `sas_circuit_state` gauge.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CircuitState {
    /// Calls go through (gauge 0).
    Closed,
    /// Calls fail fast (gauge 1).
    Open,
    /// A probe is in flight (gauge 2).
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
    /// While open: when the next probe may go out (the end of the
    /// cool-down; now, when a probe was handed back).
    probe_due: Instant,
    /// While half-open: when the current probe went out.
    probe_sent: Instant,
    /// The number of the latest probe: only that probe's hand-back counts.
    probe: u64,
    /// When the circuit last left closed; `None` while closed.
    left_closed: Option<Instant>,
}

/// A thread-safe circuit breaker.
#[derive(Debug)]
pub struct CircuitBreaker {
    name: String,
    failure_threshold: u32,
    cool_down: Duration,
    inner: Mutex<Inner>,
}

/// Leave to make one call, from [`CircuitBreaker::allow`]. Its outcome goes
/// back through [`Permit::succeeded`] or [`Permit::failed`]; a probe dropped
/// without one is handed back (see [`Probe`]).
#[derive(Debug)]
#[must_use = "a permit records the call's outcome; a probe dropped unused is handed back"]
pub enum Permit<'a> {
    /// The circuit is closed: an ordinary call.
    Closed(&'a CircuitBreaker),
    /// The call that probes an open circuit past its cool-down.
    Probe(Probe<'a>),
}

impl Permit<'_> {
    /// Whether this call is the circuit's probe.
    pub fn is_probe(&self) -> bool {
        matches!(self, Self::Probe(_))
    }

    /// The call reached the service and got an answer (a success, a
    /// refusal, "in progress", an answer it cannot use): the service is up,
    /// and the circuit closes.
    pub fn succeeded(self) {
        match self {
            Self::Closed(breaker) => breaker.record_success(),
            Self::Probe(probe) => probe.settle(true),
        }
    }

    /// A transient fault of the service (it could not be reached, failed or
    /// timed out): counts towards opening the circuit; a probe's opens it
    /// again for a cool-down.
    pub fn failed(self) {
        match self {
            Self::Closed(breaker) => breaker.record_failure(),
            Self::Probe(probe) => probe.settle(false),
        }
    }
}

/// The probe of a circuit past its cool-down (inside [`Permit::Probe`]).
/// Dropped without an outcome, it hands the probe back: the circuit is open
/// again with its cool-down served, so the next call probes at once. So no
/// way out of a call (a lost broker connection, a start-by that passed
/// while it waited for a call slot, shutdown) leaves the circuit half-open.
#[derive(Debug)]
pub struct Probe<'a> {
    breaker: &'a CircuitBreaker,
    number: u64,
    settled: bool,
}

impl Probe<'_> {
    fn settle(mut self, succeeded: bool) {
        self.settled = true;
        if succeeded {
            self.breaker.record_success();
        } else {
            self.breaker.record_failure();
        }
    }
}

impl Drop for Probe<'_> {
    fn drop(&mut self) {
        if !self.settled {
            self.breaker.hand_back(self.number);
        }
    }
}

impl CircuitBreaker {
    /// A closed breaker for the remote service of agent `name`.
    pub fn new(name: &str, failure_threshold: u32, cool_down: Duration) -> Self {
        let now = Instant::now();
        let breaker = Self {
            name: name.to_owned(),
            failure_threshold,
            cool_down,
            inner: Mutex::new(Inner {
                state: CircuitState::Closed,
                consecutive_failures: 0,
                probe_due: now,
                probe_sent: now,
                probe: 0,
                left_closed: None,
            }),
        };
        breaker.publish();
        breaker
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sets the gauges `sas_circuit_state` and `sas_circuit_open_seconds`
    /// to the breaker's state now: the agent calls it every second, so that
    /// the time out of closed keeps growing while no call decides anything.
    pub fn publish(&self) {
        let inner = self.lock();
        self.publish_locked(&inner);
    }

    fn publish_locked(&self, inner: &Inner) {
        metrics::gauge!("sas_circuit_state", "agent" => self.name.clone()).set(inner.state.gauge());
        metrics::gauge!("sas_circuit_open_seconds", "agent" => self.name.clone())
            .set(open_seconds(inner));
    }

    fn transition(&self, inner: &mut Inner, to: CircuitState) {
        if inner.state != to {
            tracing::warn!(agent = %self.name, from = ?inner.state, to = ?to, "circuit breaker state changed");
            match (inner.state, to) {
                (CircuitState::Closed, _) => inner.left_closed = Some(Instant::now()),
                (_, CircuitState::Closed) => inner.left_closed = None,
                _ => {}
            }
            inner.state = to;
        }
        self.publish_locked(inner);
    }

    /// The current state.
    pub fn state(&self) -> CircuitState {
        self.lock().state
    }

    /// Seconds since the circuit last left closed, 0 while closed (the
    /// `sas_circuit_open_seconds` gauge).
    pub fn open_seconds(&self) -> f64 {
        open_seconds(&self.lock())
    }

    /// Leave for a call now, or `None` while the circuit fails fast.
    /// Closed: an ordinary call. Open past its cool-down (or with a probe
    /// handed back), or half-open with its probe out for `cool_down`
    /// already (a call that hangs): this call is the probe, and the circuit
    /// is half-open.
    pub fn allow(&self) -> Option<Permit<'_>> {
        let mut inner = self.lock();
        let now = Instant::now();
        let probe = match inner.state {
            CircuitState::Closed => return Some(Permit::Closed(self)),
            CircuitState::Open => now >= inner.probe_due,
            CircuitState::HalfOpen => {
                let late = now.saturating_duration_since(inner.probe_sent) >= self.cool_down;
                if late {
                    tracing::warn!(agent = %self.name, cool_down = ?self.cool_down, "the circuit's probe has been out for its cool-down without an outcome; letting another call probe");
                }
                late
            }
        };
        if !probe {
            self.publish_locked(&inner);
            return None;
        }
        inner.probe = inner.probe.wrapping_add(1);
        inner.probe_sent = now;
        self.transition(&mut inner, CircuitState::HalfOpen);
        Some(Permit::Probe(Probe {
            breaker: self,
            number: inner.probe,
            settled: false,
        }))
    }

    /// How long until a call may be let through: the rest of the cool-down
    /// while open, a short pause while a probe is out, zero when closed.
    pub fn retry_after(&self) -> Duration {
        let inner = self.lock();
        match inner.state {
            CircuitState::Closed => Duration::ZERO,
            CircuitState::Open => inner.probe_due.saturating_duration_since(Instant::now()),
            CircuitState::HalfOpen => (self.cool_down / 10).max(Duration::from_millis(10)),
        }
    }

    /// Records a call that reached the service and got an answer (success or
    /// a permanent refusal): the service is up.
    fn record_success(&self) {
        let mut inner = self.lock();
        inner.consecutive_failures = 0;
        self.transition(&mut inner, CircuitState::Closed);
    }

    /// Records a transient fault.
    fn record_failure(&self) {
        let mut inner = self.lock();
        inner.consecutive_failures = inner.consecutive_failures.saturating_add(1);
        if inner.state == CircuitState::HalfOpen
            || inner.consecutive_failures >= self.failure_threshold
        {
            inner.probe_due = Instant::now() + self.cool_down;
            self.transition(&mut inner, CircuitState::Open);
        }
    }

    /// Probe `number` ended without an outcome: if it is still the one the
    /// half-open circuit waits for, the circuit opens with its cool-down
    /// served, so that the next call probes at once.
    fn hand_back(&self, number: u64) {
        let mut inner = self.lock();
        if inner.state != CircuitState::HalfOpen || inner.probe != number {
            return;
        }
        tracing::warn!(agent = %self.name, "the circuit's probe ended without an outcome (its call was abandoned); the next call probes");
        inner.probe_due = Instant::now();
        self.transition(&mut inner, CircuitState::Open);
    }
}

fn open_seconds(inner: &Inner) -> f64 {
    inner
        .left_closed
        .map_or(0.0, |left| left.elapsed().as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens `breaker` (whose threshold is 1) with a failure of a call.
    fn open(breaker: &CircuitBreaker) {
        breaker.allow().expect("closed").failed();
        assert_eq!(breaker.state(), CircuitState::Open);
    }

    #[test]
    fn the_circuit_opens_after_the_threshold_and_fails_fast() {
        let breaker = CircuitBreaker::new("t", 3, Duration::from_secs(60));
        for _ in 0..2 {
            breaker.allow().expect("closed").failed();
            assert!(breaker.allow().is_some());
        }
        breaker.allow().expect("closed").failed();
        assert_eq!(breaker.state(), CircuitState::Open);
        assert!(breaker.allow().is_none());
    }

    #[test]
    fn after_the_cool_down_one_probe_goes_through_and_its_success_closes_the_circuit() {
        let breaker = CircuitBreaker::new("t", 1, Duration::from_millis(50));
        open(&breaker);
        assert!(breaker.allow().is_none(), "cooling down");
        std::thread::sleep(Duration::from_millis(60));
        let probe = breaker.allow().expect("the probe");
        assert!(probe.is_probe());
        assert_eq!(breaker.state(), CircuitState::HalfOpen);
        assert!(breaker.allow().is_none(), "only one probe at a time");
        probe.succeeded();
        assert_eq!(breaker.state(), CircuitState::Closed);
        assert!(!breaker.allow().expect("closed").is_probe());
    }

    #[test]
    fn a_failed_probe_opens_the_circuit_again_for_a_cool_down() {
        let breaker = CircuitBreaker::new("t", 1, Duration::from_millis(50));
        open(&breaker);
        std::thread::sleep(Duration::from_millis(60));
        breaker.allow().expect("the probe").failed();
        assert_eq!(breaker.state(), CircuitState::Open);
        assert!(breaker.allow().is_none(), "a new cool-down");
        assert!(breaker.retry_after() > Duration::from_millis(20));
    }

    #[test]
    fn a_probe_dropped_without_an_outcome_lets_the_next_call_probe_at_once() {
        let breaker = CircuitBreaker::new("t", 1, Duration::from_secs(60));
        breaker.allow().expect("closed").failed();
        // The cool-down served, as if 60 s had passed.
        breaker.lock().probe_due = Instant::now();
        let probe = breaker.allow().expect("the probe");
        assert_eq!(breaker.state(), CircuitState::HalfOpen);
        // Its call was abandoned (a lost connection, a start-by passed
        // while it waited for a call slot, shutdown).
        drop(probe);
        assert_eq!(breaker.state(), CircuitState::Open);
        assert_eq!(breaker.retry_after(), Duration::ZERO);
        let next = breaker
            .allow()
            .expect("the next call probes, no new cool-down");
        assert!(next.is_probe());
        next.succeeded();
        assert_eq!(breaker.state(), CircuitState::Closed);
    }

    #[test]
    fn a_probe_out_longer_than_the_cool_down_lets_another_call_probe() {
        let breaker = CircuitBreaker::new("t", 1, Duration::from_millis(50));
        open(&breaker);
        std::thread::sleep(Duration::from_millis(60));
        let hanging = breaker.allow().expect("the first probe");
        assert!(breaker.allow().is_none(), "the probe is out");
        std::thread::sleep(Duration::from_millis(60));
        let second = breaker.allow().expect("another probe: the first hangs");
        assert!(second.is_probe());
        assert!(breaker.allow().is_none(), "one probe at a time again");
        // The first one ends without an outcome: the second is the probe
        // the circuit waits for, so nothing changes.
        drop(hanging);
        assert_eq!(breaker.state(), CircuitState::HalfOpen);
        second.succeeded();
        assert_eq!(breaker.state(), CircuitState::Closed);
    }

    #[test]
    fn a_success_resets_the_count_of_consecutive_failures() {
        let breaker = CircuitBreaker::new("t", 2, Duration::from_secs(60));
        breaker.allow().expect("closed").failed();
        breaker.allow().expect("closed").succeeded();
        breaker.allow().expect("closed").failed();
        assert_eq!(breaker.state(), CircuitState::Closed);
    }

    #[test]
    fn the_time_out_of_closed_counts_from_leaving_closed_until_closing() {
        let breaker = CircuitBreaker::new("t", 1, Duration::from_millis(20));
        assert_eq!(breaker.open_seconds(), 0.0);
        open(&breaker);
        std::thread::sleep(Duration::from_millis(30));
        let probe = breaker.allow().expect("the probe");
        // Half-open does not reset it, nor does opening again.
        probe.failed();
        std::thread::sleep(Duration::from_millis(30));
        let probe = breaker.allow().expect("the probe");
        let out = breaker.open_seconds();
        assert!(out >= 0.05, "{out}");
        probe.succeeded();
        assert_eq!(breaker.open_seconds(), 0.0);
    }
}
