//! The one growing wait between tries, used wherever a delay is computed:
//! the supervisor's retry of a missed step, the agent's retry of a call,
//! a reconnection to the broker, a transient database failure.
//!
//! Try `n` (1-based) waits `base × 2^(n-1)`, capped at `max`, then spread by
//! its [`Jitter`] so that many waiters that failed together do not come back
//! together.

use std::time::Duration;

/// How a wait is spread.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// Exactly the capped wait: one waiter alone, or tests.
    None,
    /// Anywhere from zero to the capped wait ("full jitter"): spreads
    /// retries of one remote service widest.
    Full,
    /// Half the capped wait, plus up to the other half ("equal jitter"):
    /// never much shorter than the growth asks, still spread.
    Equal,
}

/// A growing, capped, jittered wait between tries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// The first try's wait, before jitter.
    pub base: Duration,
    /// The longest wait, before jitter.
    pub max: Duration,
    /// How each wait is spread.
    pub jitter: Jitter,
}

impl Backoff {
    /// Waits from `base` doubling up to `max`, spread as `jitter` says.
    pub const fn new(base: Duration, max: Duration, jitter: Jitter) -> Self {
        Self { base, max, jitter }
    }

    /// The wait of try `tries` (1-based; 0 counts as 1) before jitter:
    /// `base × 2^(tries-1)`, capped at `max`.
    pub fn ceiling(&self, tries: u32) -> Duration {
        let exponent = tries.saturating_sub(1).min(20);
        self.base.saturating_mul(1 << exponent).min(self.max)
    }

    /// The wait of try `tries`, with the jitter drawn from `unit`, a number
    /// in [0, 1) (clamped), so that a pure caller or a test can fix it.
    pub fn wait_with(&self, tries: u32, unit: f64) -> Duration {
        let ceiling = self.ceiling(tries);
        let unit = unit.clamp(0.0, 1.0);
        match self.jitter {
            Jitter::None => ceiling,
            Jitter::Full => ceiling.mul_f64(unit),
            Jitter::Equal => ceiling.mul_f64(0.5 + unit / 2.0),
        }
    }

    /// The wait of try `tries`, with a random jitter.
    pub fn wait(&self, tries: u32) -> Duration {
        self.wait_with(tries, rand::random())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn doubles_from_the_base_up_to_the_cap() {
        let backoff = Backoff::new(100 * MS, 1000 * MS, Jitter::None);
        let waits: Vec<u128> = (0..7).map(|n| backoff.wait(n).as_millis()).collect();
        assert_eq!(waits, [100, 100, 200, 400, 800, 1000, 1000]);
        // No overflow however many tries.
        assert_eq!(backoff.ceiling(u32::MAX), 1000 * MS);
    }

    #[test]
    fn jitter_spreads_within_its_range() {
        let full = Backoff::new(100 * MS, 1000 * MS, Jitter::Full);
        let equal = Backoff {
            jitter: Jitter::Equal,
            ..full
        };
        assert_eq!(full.wait_with(3, 0.0), Duration::ZERO);
        assert_eq!(full.wait_with(3, 0.5), 200 * MS);
        assert_eq!(equal.wait_with(3, 0.0), 200 * MS);
        assert_eq!(equal.wait_with(3, 1.0), 400 * MS);
        assert_eq!(
            equal.wait_with(3, 7.0),
            400 * MS,
            "a unit above 1 is clamped"
        );
        for _ in 0..100 {
            let wait = equal.wait(3);
            assert!((200 * MS..=400 * MS).contains(&wait), "{wait:?}");
            assert!(full.wait(3) <= 400 * MS);
        }
    }
}
