//! Failed logins, counted and slowed down (the console's users, the HTTP
//! gateway's clients): after `max` failures within a minute from one
//! client address, or for one user name, further requests with credentials
//! from it (or for it) are answered 429 with `Retry-After` until the minute
//! is over, without checking the credentials, so that guessing a secret
//! costs minutes per handful of tries and a flood of wrong ones cannot make
//! a service spend its CPU on hash checks. Counting by name as well stops
//! one guesser spread over many addresses; it also means a guesser can keep
//! a name locked out (the callers log and count each failure).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The window failures are counted in.
pub const WINDOW: Duration = Duration::from_secs(60);
/// Most keys followed at once; expired ones are dropped past it.
const MAX_KEYS: usize = 100_000;

/// Failures by key (`ip:<address>`, `user:<name>`), in fixed windows.
pub struct LoginLimiter {
    max: u32,
    windows: Mutex<HashMap<String, (Instant, u32)>>,
}

impl LoginLimiter {
    /// A limiter allowing `max` failures a minute per key (0 turns it off).
    pub fn new(max: u32) -> Self {
        Self {
            max,
            windows: Mutex::new(HashMap::new()),
        }
    }

    /// How long until `keys` may try again, if any of them is over its limit.
    pub fn blocked(&self, keys: &[String]) -> Option<Duration> {
        self.blocked_at(keys, Instant::now())
    }

    /// Counts a failed login for each of `keys`.
    pub fn failed(&self, keys: &[String]) {
        self.failed_at(keys, Instant::now());
    }

    fn blocked_at(&self, keys: &[String], now: Instant) -> Option<Duration> {
        if self.max == 0 {
            return None;
        }
        let windows = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        keys.iter()
            .filter_map(|key| windows.get(key))
            .filter(|(start, failures)| *failures >= self.max && now < *start + WINDOW)
            .map(|(start, _)| *start + WINDOW - now)
            .max()
    }

    fn failed_at(&self, keys: &[String], now: Instant) {
        if self.max == 0 {
            return;
        }
        let mut windows = self.windows.lock().unwrap_or_else(|e| e.into_inner());
        if windows.len() >= MAX_KEYS {
            windows.retain(|_, (start, _)| now < *start + WINDOW);
        }
        for key in keys {
            let window = windows.entry(key.clone()).or_insert((now, 0));
            if now >= window.0 + WINDOW {
                *window = (now, 0);
            }
            window.1 += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(ip: &str, user: &str) -> Vec<String> {
        vec![format!("ip:{ip}"), format!("user:{user}")]
    }

    #[test]
    fn the_failure_past_the_limit_blocks_until_the_window_ends() {
        let limiter = LoginLimiter::new(3);
        let t0 = Instant::now();
        for i in 0..3 {
            assert_eq!(
                limiter.blocked_at(&keys("10.0.0.1", "ann"), t0),
                None,
                "try {i}"
            );
            limiter.failed_at(&keys("10.0.0.1", "ann"), t0);
        }
        let wait = limiter.blocked_at(&keys("10.0.0.1", "ann"), t0 + Duration::from_secs(10));
        assert_eq!(wait, Some(Duration::from_secs(50)));
        // The same name from elsewhere is blocked; another name from elsewhere is not.
        assert!(limiter.blocked_at(&keys("10.0.0.2", "ann"), t0).is_some());
        assert_eq!(limiter.blocked_at(&keys("10.0.0.2", "bob"), t0), None);
        // A minute later the window has passed.
        assert_eq!(
            limiter.blocked_at(&keys("10.0.0.1", "ann"), t0 + WINDOW),
            None
        );
        limiter.failed_at(&keys("10.0.0.1", "ann"), t0 + WINDOW);
        assert_eq!(
            limiter.blocked_at(&keys("10.0.0.1", "ann"), t0 + WINDOW),
            None,
            "a new window"
        );
    }

    #[test]
    fn zero_turns_it_off() {
        let limiter = LoginLimiter::new(0);
        for _ in 0..100 {
            limiter.failed(&keys("10.0.0.1", "ann"));
        }
        assert_eq!(limiter.blocked(&keys("10.0.0.1", "ann")), None);
    }
}
