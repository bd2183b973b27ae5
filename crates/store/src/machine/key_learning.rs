//! Limits that learn: a step may declare its key's concurrency limit
//! `adaptive` (`concurrency = { key = "/attributes/merchant_id", limit = 20,
//! adaptive = true }`). The declared limit is then a ceiling; each key
//! learns the limit its remote copes with from the remote's own answers,
//! so a merchant whose API slows down gets fewer calls before it starts
//! refusing them, and one that copes gets up to the ceiling.
//!
//! The law ([`Learnt::learn`]) is a latency gradient, as Netflix's
//! concurrency limits and TCP Vegas use, with TCP's slow start and
//! multiplicative decrease:
//! - each answer's time at the remote (the agent measures its last call) moves
//!   two averages: `recent` (about the last five answers) and `base` (the
//!   remote's time when not loaded: it follows faster answers within about
//!   ten, slower ones over about five hundred, so a remote that has become
//!   slower for good is taken as it is in the end);
//! - while `recent` stays within [`TOLERANCE`] times `base` (plus
//!   [`SLACK_MS`]) and the limit is in use (it was full before the batch
//!   of answers came), the limit grows: by one per answer until the first
//!   cut (slow start: it doubles each round trip), then by one per round
//!   trip. A limit not in use does not grow: as
//!   TCP's congestion window validation, only a limit that was tried is
//!   trusted, so a quiet spell does not let the next burst in at a limit
//!   nobody measured;
//! - beyond it, the limit shrinks in proportion, at most a tenth per
//!   answer;
//! - a 429 with `Retry-After` halves it, once per round trip.
//!
//! A key starts at one attempt ([`Learnt::new`]) and climbs: the first
//! answers measure the remote unloaded. What a key learnt is kept in the
//! store (`key_learnt`) and forgotten after ten quiet minutes; a key then
//! starts again from one.

use chrono::{DateTime, Utc};
use serde::Serialize;

/// How much slower than unloaded the remote's recent answers may be before
/// a key's limit shrinks (1.5: half as slow again).
pub const TOLERANCE: f64 = 1.5;

/// Milliseconds of a remote's answers that are noise, not load: a remote
/// answering in 2 ms is not loaded when it answers in 5.
pub const SLACK_MS: f64 = 5.0;

/// How far one answer moves `recent` towards itself.
const RECENT_WEIGHT: f64 = 0.2;

/// How far one answer faster than `base` moves it down (a few fast
/// answers, not the one fastest, make the remote's unloaded time).
const BASE_FALL: f64 = 0.1;

/// How far one answer slower than `base` moves it up.
const BASE_RISE: f64 = 0.002;

/// The most one answer shrinks the limit by, as a share of it.
const MOST_SHRINK: f64 = 0.1;

/// The shortest round trip a 429's halving waits for before halving again.
const LEAST_ROUND_MS: f64 = 100.0;

/// What a key has learnt of its remote.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Learnt {
    /// The limit now (fractional: one per round trip grows it by a
    /// fraction per answer); the key lets `floor(limit)` in flight, within
    /// the declared ceiling.
    pub limit: f64,
    /// The remote's time unloaded, in milliseconds (0: nothing measured).
    pub base_ms: f64,
    /// The remote's recent time, in milliseconds.
    pub recent_ms: f64,
    /// When the limit was last cut; `None` while the key is in slow start.
    pub cut_at: Option<DateTime<Utc>>,
}

/// What one reply says of a key's remote.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum KeySignal {
    /// The remote answered after this many milliseconds of calls.
    Answered {
        /// The calls' time at the remote.
        ms: u64,
    },
    /// The remote asked the key to rest (a 429 with `Retry-After`).
    Refused,
}

/// One reply's word on an adaptive key: the store moves the key's learnt
/// limit with it, in the reply's transaction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KeySample {
    /// The key line.
    pub key: String,
    /// The step's declared limit: the most the key may learn.
    pub ceiling: i32,
    /// What the reply said.
    pub signal: KeySignal,
}

impl Default for Learnt {
    fn default() -> Self {
        Self::new()
    }
}

impl Learnt {
    /// A key nothing is known of: one attempt at a time, in slow start.
    pub fn new() -> Self {
        Self {
            limit: 1.0,
            base_ms: 0.0,
            recent_ms: 0.0,
            cut_at: None,
        }
    }

    /// The attempts the key lets in flight, within `ceiling`.
    pub fn limit(&self, ceiling: i32) -> i32 {
        // `as` saturates; the limit is kept within 1..=ceiling.
        (self.limit.floor() as i32).clamp(1, ceiling.max(1))
    }

    /// Moves the limit with what a reply at `now` said (see the module).
    /// `in_use`: whether the key's limit was in use (it was full before
    /// the batch of answers this one came in).
    pub fn learn(&mut self, signal: KeySignal, ceiling: i32, in_use: bool, now: DateTime<Utc>) {
        match signal {
            KeySignal::Refused => {
                let round =
                    chrono::Duration::milliseconds(self.recent_ms.max(LEAST_ROUND_MS) as i64);
                if self.cut_at.is_none_or(|at| now - at >= round) {
                    self.limit /= 2.0;
                    self.cut_at = Some(now);
                }
            }
            KeySignal::Answered { ms } => {
                let ms = (ms as f64).max(1.0);
                if self.base_ms <= 0.0 {
                    self.base_ms = ms;
                    self.recent_ms = ms;
                } else {
                    self.recent_ms += (ms - self.recent_ms) * RECENT_WEIGHT;
                    let weight = if ms < self.base_ms {
                        BASE_FALL
                    } else {
                        BASE_RISE
                    };
                    self.base_ms += (ms - self.base_ms) * weight;
                }
                let allowed = TOLERANCE * self.base_ms + SLACK_MS;
                if self.recent_ms > allowed {
                    let gradient = (allowed / self.recent_ms).max(1.0 - MOST_SHRINK);
                    self.limit *= gradient;
                    self.cut_at = Some(now);
                } else if !in_use {
                    // Not tried: not trusted further.
                } else if self.cut_at.is_none() {
                    self.limit += 1.0;
                } else {
                    self.limit += 1.0 / self.limit.max(1.0);
                }
            }
        }
        self.limit = self.limit.clamp(1.0, f64::from(ceiling.max(1)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_800_000_000, 0).unwrap() + chrono::Duration::milliseconds(ms)
    }

    /// A merchant's API that serves `capacity` calls at once in `call_ms`
    /// each; the calls beyond queue there. Runs `answers` round trips of a
    /// key holding its limit in flight; returns the limits seen.
    fn against(capacity: f64, call_ms: f64, ceiling: i32, rounds: usize) -> (Learnt, Vec<i32>) {
        let mut learnt = Learnt::new();
        let mut seen = Vec::new();
        let mut clock = 0.0;
        for _ in 0..rounds {
            let in_flight = learnt.limit(ceiling);
            let ms = call_ms * (f64::from(in_flight) / capacity).max(1.0);
            clock += ms;
            for _ in 0..in_flight {
                learnt.learn(
                    KeySignal::Answered { ms: ms as u64 },
                    ceiling,
                    true,
                    at(clock as i64),
                );
            }
            seen.push(learnt.limit(ceiling));
        }
        (learnt, seen)
    }

    #[test]
    fn a_key_starts_at_one_and_doubles_each_round_trip_while_its_remote_keeps_up() {
        let (learnt, seen) = against(100.0, 50.0, 20, 8);
        assert_eq!(&seen[..4], &[2, 4, 8, 16]);
        assert_eq!(learnt.limit(20), 20, "up to the ceiling, never past it");
        assert!(learnt.cut_at.is_none(), "never cut");
    }

    #[test]
    fn a_remote_that_slows_under_load_holds_the_key_near_what_it_serves_in_time() {
        // Four at once in 50 ms; more queue there. Within the tolerance
        // (75 ms plus the slack), about six.
        let (_, seen) = against(4.0, 50.0, 20, 200);
        let settled = &seen[100..];
        assert!(settled.iter().all(|&l| (3..=8).contains(&l)), "{settled:?}");
        // The ceiling would have let twenty in, five times as slow.
        assert!(seen.iter().skip(20).all(|&l| l < 20), "{seen:?}");
    }

    #[test]
    fn a_remote_that_slows_for_its_own_reasons_gets_less_then_is_taken_as_it_is() {
        let mut learnt = Learnt::new();
        for n in 0..100 {
            learnt.learn(KeySignal::Answered { ms: 40 }, 10, true, at(n * 10));
        }
        assert_eq!(learnt.limit(10), 10);
        // Three times as slow, whatever the load.
        for n in 100..130 {
            learnt.learn(KeySignal::Answered { ms: 120 }, 10, true, at(n * 10));
        }
        assert!(learnt.limit(10) <= 3, "{learnt:?}");
        // Hundreds of answers later its base has followed: it grows again.
        for n in 130..2_000 {
            learnt.learn(KeySignal::Answered { ms: 120 }, 10, true, at(n * 10));
        }
        assert_eq!(learnt.limit(10), 10, "{learnt:?}");
    }

    #[test]
    fn a_429_halves_the_limit_once_per_round_trip() {
        let mut learnt = Learnt::new();
        for n in 0..16 {
            learnt.learn(KeySignal::Answered { ms: 200 }, 32, true, at(n));
        }
        assert_eq!(learnt.limit(32), 17);
        learnt.learn(KeySignal::Refused, 32, true, at(1_000));
        assert_eq!(learnt.limit(32), 8);
        // The calls in flight answer 429 too: one round trip, one cut.
        learnt.learn(KeySignal::Refused, 32, true, at(1_050));
        assert_eq!(learnt.limit(32), 8);
        learnt.learn(KeySignal::Refused, 32, true, at(1_200));
        assert_eq!(learnt.limit(32), 4);
        for n in 0..10 {
            learnt.learn(KeySignal::Refused, 32, true, at(2_000 + n * 1_000));
        }
        assert_eq!(learnt.limit(32), 1, "never below one");
        // Out of slow start: one more per round trip (one per limit's
        // answers), no longer one per answer.
        for n in 0..3 {
            learnt.learn(KeySignal::Answered { ms: 200 }, 32, true, at(20_000 + n));
        }
        assert_eq!(learnt.limit(32), 2);
    }

    #[test]
    fn a_limit_not_in_use_does_not_grow() {
        let mut learnt = Learnt::new();
        for n in 0..4 {
            learnt.learn(KeySignal::Answered { ms: 50 }, 20, true, at(n));
        }
        assert_eq!(learnt.limit(20), 5);
        // A trickle: one call at a time, never the limit's worth.
        for n in 4..100 {
            learnt.learn(KeySignal::Answered { ms: 50 }, 20, false, at(n));
        }
        assert_eq!(learnt.limit(20), 5, "only a limit tried is trusted");
        // It still shrinks when the remote slows.
        for n in 100..110 {
            learnt.learn(KeySignal::Answered { ms: 500 }, 20, false, at(n));
        }
        assert!(learnt.limit(20) < 5, "{learnt:?}");
    }

    #[test]
    fn a_fast_remote_s_jitter_is_not_load() {
        let mut learnt = Learnt::new();
        for n in 0..200 {
            let ms = if n % 3 == 0 { 6 } else { 2 };
            learnt.learn(KeySignal::Answered { ms }, 50, true, at(n));
        }
        assert_eq!(learnt.limit(50), 50, "{learnt:?}");
    }
}
