//! The remote's own word on when to come back: a 429 (or a 503) with
//! `Retry-After` pauses the lane, so that no call of this replica reaches
//! that service before the time it named, instead of each request retrying
//! on its own backoff and hammering a service that asked for quiet.
//!
//! A request waits out the pause before it takes a call slot, within its
//! start deadline; one whose deadline comes first, and whose calls were all
//! answered "slow down" (nothing applied), answers `not_started`: the order
//! goes back to its agent's line at its place, and no failure counts.
//!
//! A pause is at most `agent.max_pause_ms` (a `Retry-After` of a day would
//! stop the lane for a day; the cap is logged). It is this replica's: each
//! replica learns it from its own first call, one call each.
//!
//! A request limited by key (its `limit_key`, see the store's
//! `machine::concurrency`) does not pause the lane: a 429 with
//! `Retry-After` to it is that key's limit at the remote, so the agent
//! answers `not_started` at once with the pause
//! (`x-sas-retry-after-ms`), and the scheduler holds the key's orders
//! until then while the lane's other requests go on.
//!
//! Visible as `sas_agent_paused_until_seconds{agent}` (Unix time the last
//! pause ends; 0 when the lane never paused) and
//! `sas_agent_throttled_total{agent}` (answers that asked to slow down).

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// One lane's pause: until when no call may start.
#[derive(Debug)]
pub struct Pause {
    agent: String,
    longest: Duration,
    until: Mutex<Option<Instant>>,
}

impl Pause {
    /// No pause yet, for agent `agent`; no pause longer than `longest`.
    pub fn new(agent: &str, longest: Duration) -> Self {
        metrics::gauge!("sas_agent_paused_until_seconds", "agent" => agent.to_owned()).set(0.0);
        Self {
            agent: agent.to_owned(),
            longest,
            until: Mutex::new(None),
        }
    }

    /// The longest pause a service may ask for (`agent.max_pause_ms`).
    pub fn longest(&self) -> Duration {
        self.longest
    }

    /// How long calls must still wait, if the lane is paused now.
    pub fn remaining(&self) -> Option<Duration> {
        let until = (*self.until.lock().unwrap_or_else(|e| e.into_inner()))?;
        until
            .checked_duration_since(Instant::now())
            .filter(|left| !left.is_zero())
    }

    /// The remote asked to come back after `retry_after`: the lane pauses
    /// until then (capped at the longest pause), or longer if it was
    /// paused longer already. Returns the pause applied from now.
    pub fn extend(&self, retry_after: Duration) -> Duration {
        let wanted = retry_after.min(self.longest);
        if wanted < retry_after {
            tracing::warn!(agent = %self.agent, retry_after_ms = retry_after.as_millis() as u64, longest_ms = self.longest.as_millis() as u64, "the remote asked for a longer pause than agent.max_pause_ms; pausing for that long");
        }
        let now = Instant::now();
        let mut until = self.until.lock().unwrap_or_else(|e| e.into_inner());
        let end = until.filter(|&u| u > now + wanted).unwrap_or(now + wanted);
        if until.is_none_or(|u| u < end) {
            tracing::warn!(agent = %self.agent, pause_ms = (end - now).as_millis() as u64, "the remote asked to slow down (Retry-After): no call until then");
        }
        *until = Some(end);
        let unix = SystemTime::now()
            .checked_add(end - now)
            .and_then(|at| at.duration_since(UNIX_EPOCH).ok())
            .map_or(0.0, |d| d.as_secs_f64());
        metrics::gauge!("sas_agent_paused_until_seconds", "agent" => self.agent.clone()).set(unix);
        end - now
    }
}

/// The pause an HTTP `Retry-After` value asks for: delay-seconds, or an
/// HTTP date (a date already past asks for none). `None` for a value that
/// is neither.
pub fn retry_after(value: &str) -> Option<Duration> {
    let value = value.trim();
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    let at = chrono::DateTime::parse_from_rfc2822(value).ok()?;
    let left = at.with_timezone(&chrono::Utc) - chrono::Utc::now();
    Some(left.to_std().unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retry_after_reads_seconds_and_http_dates() {
        assert_eq!(retry_after("2"), Some(Duration::from_secs(2)));
        assert_eq!(retry_after(" 120 "), Some(Duration::from_secs(120)));
        assert_eq!(
            retry_after("Wed, 21 Oct 2015 07:28:00 GMT"),
            Some(Duration::ZERO),
            "a date past asks for no pause"
        );
        let soon = (chrono::Utc::now() + chrono::Duration::seconds(30)).to_rfc2822();
        let left = retry_after(&soon).unwrap();
        assert!(left > Duration::from_secs(25) && left <= Duration::from_secs(30));
        assert_eq!(retry_after("soon"), None);
        assert_eq!(retry_after("-1"), None);
    }

    #[test]
    fn a_pause_is_capped_never_shortened_and_ends() {
        let pause = Pause::new("payment", Duration::from_millis(200));
        assert_eq!(pause.remaining(), None);
        let applied = pause.extend(Duration::from_secs(3600));
        assert!(applied <= Duration::from_millis(200), "capped: {applied:?}");
        let shorter = pause.extend(Duration::from_millis(10));
        assert!(
            shorter > Duration::from_millis(100),
            "not shortened: {shorter:?}"
        );
        assert!(pause.remaining().is_some());
        std::thread::sleep(Duration::from_millis(220));
        assert_eq!(pause.remaining(), None);
    }
}
