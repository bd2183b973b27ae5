//! Admission control's rules, in one place and pure: which slots an order
//! holds ([`slots_held`]), how a decision moves the agents' counters
//! ([`admission_delta`]), an order's place in a line ([`admit_key`]),
//! whether an agent has room for an attempt ([`has_room`]), and how the
//! supervisors adapt each agent's limit ([`adapted_limit`]). The store
//! reads and writes the counters (`crate::admission`, the write kernel);
//! what they mean is decided here.

use chrono::{DateTime, Utc};

use super::{to_micros, ProcessRow, StepRow};
use crate::model::{ProcessState, StepState};

/// How one agent's admission counters move with a decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmissionDelta {
    /// The agent.
    pub agent: String,
    /// Attempts in flight: +1 for a slot taken, -1 for one given back.
    pub in_flight: i32,
    /// Orders in line.
    pub waiting: i32,
    /// Of the slots given back, those of attempts that never started: not
    /// completions, so they do not count towards the agent's measured rate.
    pub unstarted: i32,
}

/// The agents whose slots an order holds, one per attempt in flight (one
/// step, or each member of a parallel group), while a scheduler holds the
/// order with a deadline.
pub fn slots_held<'a>(process: &ProcessRow, steps: &'a [StepRow]) -> Vec<&'a str> {
    let in_flight = match process.state {
        ProcessState::Processing => StepState::Running,
        ProcessState::Compensating => StepState::Compensating,
        _ => return Vec::new(),
    };
    if process.locked_by.is_none() || process.complete_by.is_none() {
        return Vec::new();
    }
    steps
        .iter()
        .filter(|step| step.state == in_flight)
        .map(|step| step.agent.as_str())
        .collect()
}

/// How the admission counters move when an order goes from `before` to
/// `after` (process record and steps): a slot given back and one taken, a
/// place in line left and one taken.
pub fn admission_delta(
    before: (&ProcessRow, &[StepRow]),
    after: (&ProcessRow, &[StepRow]),
) -> Vec<AdmissionDelta> {
    let mut deltas: Vec<AdmissionDelta> = Vec::new();
    let mut add = |agent: Option<&str>, in_flight: i32, waiting: i32| {
        let Some(agent) = agent else { return };
        match deltas.iter_mut().find(|d| d.agent == agent) {
            Some(delta) => {
                delta.in_flight += in_flight;
                delta.waiting += waiting;
            }
            None => deltas.push(AdmissionDelta {
                agent: agent.to_owned(),
                in_flight,
                waiting,
                unstarted: 0,
            }),
        }
    };
    for agent in slots_held(before.0, before.1) {
        add(Some(agent), -1, 0);
    }
    for agent in slots_held(after.0, after.1) {
        add(Some(agent), 1, 0);
    }
    add(before.0.waiting_for.as_deref(), 0, -1);
    add(after.0.waiting_for.as_deref(), 0, 1);
    deltas.retain(|d| d.in_flight != 0 || d.waiting != 0);
    deltas.sort_by(|a, b| a.agent.cmp(&b.agent));
    deltas
}

/// Levels of priority are worth this much waiting: an order of priority p
/// goes before orders of priority p-1 that started waiting less than this
/// before it, and never waits more than this per level behind later ones.
pub const PRIORITY_STEP: chrono::TimeDelta = chrono::TimeDelta::seconds(10);

/// Compensations go before any new work of the same agent.
pub const UNDO_HEAD_START: chrono::TimeDelta = chrono::TimeDelta::days(1);

/// An order's place in an agent's line: the time it started waiting, less
/// [`PRIORITY_STEP`] per priority level, less [`UNDO_HEAD_START`] for an undo.
pub fn admit_key(now: DateTime<Utc>, priority: i16, undo: bool) -> DateTime<Utc> {
    let head_start = PRIORITY_STEP * i32::from(priority)
        + if undo {
            UNDO_HEAD_START
        } else {
            chrono::TimeDelta::zero()
        };
    to_micros(now - head_start)
}

/// Whether an agent with `in_flight` attempts under `limit`, and `waiting`
/// orders in its line, has room for one more: fewer in flight than the
/// limit and, for new forward work, nobody in line before it
/// (`first_in_line`: an undo, or the order at the head of the line, does
/// not queue behind others).
pub fn has_room(in_flight: i32, limit: i32, waiting: i32, first_in_line: bool) -> bool {
    in_flight < limit && (waiting == 0 || first_in_line)
}

/// One agent's admission row at the end of a measuring window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// The limit in force.
    pub limit: i32,
    /// The limit it starts at, and the least it keeps while idle.
    pub initial: i32,
    /// The highest it may go.
    pub ceiling: i32,
    /// Orders in its line now.
    pub waiting: i32,
    /// The most attempts in flight during the window.
    pub peak_in_flight: i32,
    /// Attempts settled during the window (an attempt that never started
    /// is none).
    pub settled: i64,
    /// The window's length, in seconds.
    pub seconds: f64,
    /// The agent's shortest step deadline, in milliseconds.
    pub deadline_ms: i32,
}

/// The control law of admission: the limit of attempts in flight follows
/// what the agent's replicas measurably finish. The completions of the
/// window give a rate, and `rate × deadline × deadline_share` is the
/// number of attempts that can wait and run within that share of a step's
/// deadline (the target).
///
/// - The limit grows to the target at once: a fast agent must not be held
///   back.
/// - While orders wait in the agent's line, it shrinks towards the target,
///   at most halving per window; a line means the limit is in full use, so
///   it may go up to the ceiling.
/// - While nobody waits, only a limit in use is trusted (as TCP's
///   congestion window validation): it never exceeds twice the most
///   attempts in flight during the window, or the initial limit, so a limit
///   learnt while the remote service was fast and busy decays while it is
///   quiet instead of admitting the next burst at once.
/// - The ceiling caps it, and it never drops below one.
pub fn adapted_limit(window: &Window, deadline_share: f64) -> i32 {
    let rate = window.settled as f64 / window.seconds.max(0.001);
    let target = (rate * f64::from(window.deadline_ms) / 1000.0 * deadline_share).ceil() as i64;
    let limit = i64::from(window.limit);
    let (trusted, proposed) = if window.waiting > 0 {
        (i64::from(window.ceiling), target.max(limit / 2))
    } else {
        (
            i64::from(window.initial).max(2 * i64::from(window.peak_in_flight)),
            target.max(limit),
        )
    };
    let adapted = i64::from(window.ceiling).min(trusted).min(proposed.max(1));
    i32::try_from(adapted).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn window() -> Window {
        Window {
            limit: 40,
            initial: 16,
            ceiling: 1000,
            waiting: 0,
            peak_in_flight: 40,
            settled: 500,
            seconds: 5.0,
            deadline_ms: 10_000,
        }
    }

    #[test]
    fn a_fast_agent_with_a_line_grows_to_its_target_at_once() {
        // 100 a second for 10 s, half of it: 500.
        let busy = Window {
            waiting: 300,
            ..window()
        };
        assert_eq!(adapted_limit(&busy, 0.5), 500);
        // Never past the ceiling.
        assert_eq!(
            adapted_limit(
                &Window {
                    ceiling: 200,
                    ..busy
                },
                0.5
            ),
            200
        );
    }

    #[test]
    fn a_slow_agent_with_a_line_shrinks_at_most_by_half_per_window() {
        // 1 a second: a target of 5.
        let slow = Window {
            waiting: 300,
            settled: 5,
            limit: 400,
            ..window()
        };
        assert_eq!(adapted_limit(&slow, 0.5), 200);
        assert_eq!(adapted_limit(&Window { limit: 8, ..slow }, 0.5), 5);
        // Nothing settled at all: halves, and never below one.
        let stuck = Window {
            settled: 0,
            limit: 1,
            ..slow
        };
        assert_eq!(adapted_limit(&stuck, 0.5), 1);
    }

    #[test]
    fn an_idle_limit_is_only_trusted_as_far_as_it_was_used() {
        // Nobody waits and only 10 were in flight: at most 2 × 10, or the initial 16.
        let quiet = Window {
            limit: 500,
            peak_in_flight: 10,
            settled: 50,
            ..window()
        };
        assert_eq!(adapted_limit(&quiet, 0.5), 20);
        let idle = Window {
            peak_in_flight: 0,
            settled: 0,
            ..quiet
        };
        assert_eq!(adapted_limit(&idle, 0.5), 16);
    }

    #[test]
    fn room_needs_a_free_slot_and_for_new_work_an_empty_line() {
        assert!(has_room(3, 4, 0, false));
        assert!(!has_room(4, 4, 0, true), "no free slot");
        assert!(!has_room(3, 4, 2, false), "new work queues behind the line");
        assert!(
            has_room(3, 4, 2, true),
            "an undo or the head of the line does not"
        );
    }
}
