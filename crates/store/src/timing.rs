//! The deadline margins that keep an undo from reaching a remote service
//! before the action it undoes.
//!
//! An attempt's `complete_by` is a database-clock instant. Agents stop
//! *starting* calls `start_margin_ms` before it (the request's `start_by`),
//! and supervisors act on a missed deadline only `grace_ms` after it. A call
//! started at the last allowed moment by an agent whose clock runs behind,
//! and carried over the network, still lands before the supervisor can send
//! its undo as long as the two margins together exceed the clock difference
//! and network delay the deployment tolerates (`max_clock_skew_ms`). The
//! scheduler uses the first margin and the supervisor the second; both read
//! the same `[deadlines]` section and check it as a whole, so a deployment
//! cannot shrink one without the other noticing.

use std::time::Duration;

use serde::Deserialize;

/// `[deadlines]`: shared by the scheduler and the supervisor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeadlineSettings {
    /// How long before `complete_by` agents stop starting calls.
    pub start_margin_ms: u64,
    /// How long after `complete_by` the supervisor waits before acting.
    pub grace_ms: u64,
    /// Largest clock difference between an agent and the database, plus
    /// network delay, that the margins must absorb.
    pub max_clock_skew_ms: u64,
}

impl DeadlineSettings {
    /// Checks the margins against each other and against the shortest step
    /// deadline, naming the keys.
    ///
    /// # Errors
    /// A message naming the keys when they do not fit.
    pub fn validate(&self, shortest_step_timeout: Option<Duration>) -> Result<(), String> {
        if self.start_margin_ms + self.grace_ms <= self.max_clock_skew_ms {
            return Err(format!(
                "deadlines.start_margin_ms ({}) + deadlines.grace_ms ({}) must exceed \
                 deadlines.max_clock_skew_ms ({}): otherwise an undo can reach a remote \
                 service before a late call of the action it undoes",
                self.start_margin_ms, self.grace_ms, self.max_clock_skew_ms
            ));
        }
        if let Some(timeout) = shortest_step_timeout {
            if u128::from(self.start_margin_ms) * 2 > timeout.as_millis() {
                return Err(format!(
                    "deadlines.start_margin_ms ({}) must be at most half the shortest step \
                     timeout ({} ms), or agents would have almost no time to start a call",
                    self.start_margin_ms,
                    timeout.as_millis()
                ));
            }
        }
        Ok(())
    }

    /// The start margin.
    pub fn start_margin(&self) -> Duration {
        Duration::from_millis(self.start_margin_ms)
    }

    /// The supervisor's grace period.
    pub fn grace(&self) -> Duration {
        Duration::from_millis(self.grace_ms)
    }
}

impl Default for DeadlineSettings {
    fn default() -> Self {
        Self {
            start_margin_ms: 1000,
            grace_ms: 2000,
            max_clock_skew_ms: 1000,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn margins_that_do_not_cover_the_skew_are_refused_naming_the_keys() {
        let settings = DeadlineSettings {
            start_margin_ms: 200,
            grace_ms: 300,
            max_clock_skew_ms: 500,
        };
        let error = settings.validate(None).unwrap_err();
        assert!(
            error.contains("deadlines.grace_ms") && error.contains("max_clock_skew_ms"),
            "{error}"
        );
        assert!(DeadlineSettings::default()
            .validate(Some(Duration::from_secs(10)))
            .is_ok());
    }

    #[test]
    fn a_start_margin_over_half_the_shortest_timeout_is_refused() {
        let error = DeadlineSettings::default()
            .validate(Some(Duration::from_millis(1500)))
            .unwrap_err();
        assert!(error.contains("start_margin_ms"), "{error}");
    }
}
