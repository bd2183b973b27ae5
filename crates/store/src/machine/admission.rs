//! Admission control's rules, in one place and pure: which slots an order
//! holds ([`slots_held`]), how a decision moves the agents' counters
//! ([`admission_delta`]), an order's place in a line ([`admit_key`]),
//! whether an agent has room for an attempt ([`has_room`]), how urgent
//! work passes a limit full of less urgent work ([`Levels`]), and how the
//! supervisors adapt each agent's limit and cap ([`adapted_limit`],
//! [`adapted_cap`]). The store
//! reads and writes the counters (`crate::admission`, the write kernel);
//! what they mean is decided here.

use chrono::{DateTime, Utc};

use super::{to_micros, ProcessRow, StepRow};
use crate::model::{ProcessState, StepState};

/// How one agent's admission counters move with a decision.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
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
    /// Of an attempt a reply answered: milliseconds from its dispatch to
    /// the reply (database clock). Summed over a window, divided by its
    /// length: the attempts the agent had in flight on average.
    pub in_flight_ms: i64,
    /// Of an attempt a reply answered: the milliseconds it queued before
    /// its first call, as the agent reported them. Summed over a window,
    /// divided by its length: the attempts queued at the agent on average.
    pub queued_ms: i64,
    /// Of an attempt a reply answered: the milliseconds it waited for the
    /// agent's call slots, as the agent reported them.
    pub slot_wait_ms: i64,
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
        .filter_map(|step| step.kind.agent())
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
                ..AdmissionDelta::default()
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

// Who goes first, here and at an agent's call slots alike.
pub use sas_messages::{PRIORITY_STEP, UNDO_HEAD_START};

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
    /// The milliseconds in flight of the attempts answered during the
    /// window, summed ([`AdmissionDelta::in_flight_ms`]): 0 when nothing was
    /// answered.
    pub in_flight_ms: i64,
    /// The milliseconds those attempts queued at the agent, summed
    /// ([`AdmissionDelta::queued_ms`]): 0 from agents that do not say.
    pub queued_ms: i64,
    /// The milliseconds they waited for the agent's call slots, summed
    /// ([`AdmissionDelta::slot_wait_ms`]).
    pub slot_wait_ms: i64,
}

/// Attempts waiting for the agent's call slots, on average over a window,
/// from which the law takes the remote service to be what holds the
/// attempts up: below it, attempts that queue wait for hops (the broker,
/// the replies), which a lower limit would not shorten.
pub const SLOTS_FULL: f64 = 0.5;

/// Attempts the control law keeps queued at an agent while orders wait in
/// its line, as a share of what its calls and hops hold: enough that a call
/// slot that frees finds the next attempt already there, though the next
/// one from the line takes a reply, a claim and a request to arrive, and
/// the broker hands requests to replicas in turn, not to the one whose
/// slot is free (one replica of 4 slots: 2 queued; 8 replicas of one slot:
/// 4). An urgent order from the line passes everything else.
pub const QUEUE_SHARE: f64 = 0.5;
/// The least queue the law aims at, in attempts.
pub const QUEUE_LEAST: f64 = 1.0;

/// The control law of admission: the limit of attempts in flight keeps
/// every call slot of the agent's replicas busy and little more, and never
/// more than can finish within `deadline_share` of a step's deadline (the
/// target: the completions of the window give a rate, and `rate ×
/// deadline × deadline_share` attempts can wait and run in that time).
///
/// Measured windows (answered attempts with their times, see
/// [`Window::in_flight_ms`]): by Little's law the window's milliseconds in
/// flight over its length are the attempts in flight on average, and the
/// milliseconds queued over its length those queued at the agent (in its
/// queue, or for a call slot); the difference is what the calls and the
/// hops hold. While orders wait in the agent's line (a line means the
/// limit binds) and at least [`SLOTS_FULL`] attempts wait for the agent's
/// call slots on average (the remote service is what holds them up), the
/// law is TCP Vegas's, around a queue target of
/// [`QUEUE_SHARE`] of what the calls and hops held, at least
/// [`QUEUE_LEAST`]: with more than twice the target queued at the agent
/// the limit comes down, at once, to what the calls and hops held plus the
/// target; with less than half of it a call slot may be idle, and it
/// doubles; in between it stays. So
/// the backlog waits in the line, where urgent orders go first, and not in
/// the agent queue, where they would wait behind all of it. While nobody
/// waits (and attempts waited for call slots) the limit is trusted as far
/// as it was used: twice the most
/// attempts in flight during the window, or what the calls and hops held
/// plus the queue target.
///
/// With a line whose attempts do not wait for call slots (they wait for
/// the broker or the replies, which a lower limit would not shorten, while
/// a longer line costs a claim per order), the limit doubles towards the
/// target; it is never pulled up to it at once, since a window in which
/// the slots happened to keep up would then flood them.
///
/// Windows in which nothing was answered, and windows without a line whose
/// attempts did not wait for call slots (which includes every window of
/// agents that do not report queue times), follow the law that came before:
/// - the limit grows to the target at once: a fast agent must not be held
///   back;
/// - while orders wait in the agent's line, it shrinks towards the target,
///   at most halving per window; a line means the limit is in full use, so
///   it may go up to the ceiling;
/// - while nobody waits, only a limit in use is trusted (as TCP's
///   congestion window validation): it never exceeds twice the most
///   attempts in flight during the window, or the initial limit, so a limit
///   learnt while the remote service was fast and busy decays while it is
///   quiet instead of admitting the next burst at once.
///
/// The ceiling caps it, and it never drops below one.
pub fn adapted_limit(window: &Window, deadline_share: f64) -> i32 {
    let Measured {
        seconds,
        target,
        queued,
        queue_target,
        working,
    } = Measured::new(window, deadline_share);
    let limit = i64::from(window.limit);
    let peak = i64::from(window.peak_in_flight);
    let measured = window.in_flight_ms > 0;
    let slots_full = measured && window.slot_wait_ms as f64 / 1000.0 / seconds >= SLOTS_FULL;
    let adapted = if slots_full {
        let proposed = if window.waiting == 0 {
            (2 * peak).max(working)
        } else if queued > 2.0 * queue_target {
            working
        } else if queued < queue_target / 2.0 {
            2 * limit
        } else {
            limit
        };
        // What the calls hold is finishing: only a queue may be cut to
        // respect the deadline.
        proposed.min(target.max(working))
    } else if measured && window.waiting > 0 {
        // A line, and call slots to spare: the limit doubles towards the
        // target, or comes down towards it at most by half.
        if target >= limit {
            (2 * limit).min(target)
        } else {
            target.max(limit / 2)
        }
    } else {
        let (trusted, proposed) = if window.waiting > 0 {
            (i64::from(window.ceiling), target.max(limit / 2))
        } else {
            (i64::from(window.initial).max(2 * peak), target.max(limit))
        };
        trusted.min(proposed)
    };
    let adapted = i64::from(window.ceiling).min(adapted.max(1));
    i32::try_from(adapted).unwrap_or(i32::MAX)
}

/// What a window measured, as [`adapted_limit`] and [`adapted_cap`] read it.
struct Measured {
    /// The window's length (at least a millisecond).
    seconds: f64,
    /// The deadline target: `rate × deadline × deadline_share` attempts.
    target: i64,
    /// Attempts queued at the agent on average.
    queued: f64,
    /// The queue the law aims at while the slots are full.
    queue_target: f64,
    /// What the calls and hops held plus that queue.
    working: i64,
}

impl Measured {
    fn new(window: &Window, deadline_share: f64) -> Self {
        let seconds = window.seconds.max(0.001);
        let rate = window.settled as f64 / seconds;
        let target = (rate * f64::from(window.deadline_ms) / 1000.0 * deadline_share).ceil() as i64;
        let in_flight = window.in_flight_ms as f64 / 1000.0 / seconds;
        let queued = (window.queued_ms as f64 / 1000.0 / seconds).min(in_flight);
        let held = in_flight - queued;
        let queue_target = (held * QUEUE_SHARE).max(QUEUE_LEAST);
        Self {
            seconds,
            target,
            queued,
            queue_target,
            working: (held + queue_target).ceil() as i64,
        }
    }
}

/// The most attempts an agent may have in flight when urgent work passes
/// its limit ([`Levels`]): what can wait and run within `deadline_share` of
/// a step's deadline at the window's rate (the limit's own deadline
/// target), or, if more, what the calls and hops held plus the queue the
/// law aims at (the bound [`adapted_limit`] keeps too), under the ceiling.
/// A window that measured no completions gives what the calls held (at
/// least one attempt), so an agent nobody has measured lets nothing pass.
pub fn adapted_cap(window: &Window, deadline_share: f64) -> i32 {
    let measured = Measured::new(window, deadline_share);
    let cap = measured
        .target
        .max(measured.working)
        .min(i64::from(window.ceiling));
    i32::try_from(cap.max(1)).unwrap_or(i32::MAX)
}

/// The level an undo counts at when urgent work passes a full limit: above
/// every priority (0 to 9), as undos go first in the lines and at the call
/// slots.
pub const UNDO_LEVEL: i16 = 10;

/// An agent's attempts in flight by level (an order's priority, or
/// [`UNDO_LEVEL`] for an undo): how urgent work passes a full limit.
///
/// An agent serves the requests it holds by the lines' rule (undos first,
/// then priority), so what stands before a new attempt at level `l` is only
/// what is in flight at `l` or above. The limit, which keeps the attempts
/// ahead of a new one to what keeps the call slots busy, is therefore
/// applied per level: the head of a line at level `l` may start while
/// fewer than the limit are in flight at `l` or above, even though the
/// limit is full of less urgent work (at the start of an overload, the
/// first measuring window admits up to the deadline target before the law
/// cuts the limit, and the line would otherwise stay closed until those
/// drain, seconds later). The cap ([`adapted_cap`]) bounds the whole, so
/// what passes still runs within the deadline. It counts where the agents
/// hold what is in flight (their `amqp.prefetch` times their replicas above
/// the cap); what they do not hold waits in the broker's queue, first come,
/// first served, as it did before. Only heads pass, in line
/// order, so the line's order is kept, aging included: an order that has
/// waited long enough to stand before urgent ones holds them back until
/// the limit has room for it.
///
/// Tenants pass the same way ([`Head::fresh`]): an agent hands the
/// requests it holds to its call slots in the order of their tenants'
/// turns (the agent's `turns`), so a request of a tenant with nothing in
/// flight there stands behind the calls and the more urgent levels only,
/// not behind another tenant's backlog held at the agent. Held back at the
/// limit instead, it would wait for a round of replies to free room, and
/// then, reaching the agent just after those replies' slots were taken
/// again by what the agent held, for another round (the noisy-neighbour
/// phase's quiet tenant, docs/performance.md). Such a head passes while
/// fewer than the limit are in flight at levels above its own and fewer
/// than twice the limit in all, under the cap, also from behind a head
/// that must wait (that one waits for its own
/// tenant's work, which the fresh head does not stand behind at the
/// agent); each tenant passes one attempt so (its next has one ahead of
/// it). The scheduler claims as soon as an order joins a line while
/// tenants are configured, so that it passes then, not at the next reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Levels {
    /// `at_or_above[l]`: attempts in flight at level `l` or above.
    at_or_above: [i64; UNDO_LEVEL as usize + 1],
}

impl Levels {
    /// From the attempts in flight per level (levels outside 0 to
    /// [`UNDO_LEVEL`] are clamped into it).
    pub fn new(in_flight: impl IntoIterator<Item = (i16, i64)>) -> Self {
        let mut at_or_above = [0; UNDO_LEVEL as usize + 1];
        for (level, count) in in_flight {
            let level = level.clamp(0, UNDO_LEVEL) as usize;
            for slot in &mut at_or_above[..=level] {
                *slot += count;
            }
        }
        Self { at_or_above }
    }

    /// Admits the longest prefix of `candidates` (the levels of a line's
    /// heads, in line order) that fits: each under `limit` at its level and
    /// at most `room` in all (the cap less what is in flight). Counts the
    /// ones admitted as in flight, and returns how many there are. Stops at
    /// the first that does not fit: the ones behind it wait behind it.
    pub fn admit(&mut self, limit: i32, room: i64, candidates: &[i16]) -> usize {
        let heads: Vec<Head> = candidates
            .iter()
            .map(|&level| Head {
                level,
                fresh: false,
            })
            .collect();
        self.admit_heads(limit, room, &heads).len()
    }

    /// [`Levels::admit`] for heads that may be [`Head::fresh`], returning
    /// the indices of those admitted. A head that is not fresh fits while
    /// fewer than `limit` are in flight at its level or above, and only
    /// until one such head does not fit: the ones behind it wait behind it,
    /// in line order. A fresh head fits while fewer than `limit` are in
    /// flight at levels above its own (what stands before it at the agent)
    /// and fewer than twice `limit` in all (so that many light tenants
    /// passing together never more than double what the agent holds), even
    /// behind a head that did not fit: that one waits for its own tenant's
    /// work, which the fresh head does not stand behind at the agent. A
    /// fresh head that does not fit stops the rest. All under `room`.
    pub fn admit_heads(&mut self, limit: i32, room: i64, candidates: &[Head]) -> Vec<usize> {
        let mut admitted = Vec::new();
        let mut blocked = false;
        for (index, head) in candidates.iter().enumerate() {
            if admitted.len() as i64 >= room {
                break;
            }
            let level = head.level.clamp(0, UNDO_LEVEL) as usize;
            let fits = if head.fresh {
                self.at_or_above.get(level + 1).copied().unwrap_or(0) < i64::from(limit)
                    && self.at_or_above[0] < 2 * i64::from(limit)
            } else {
                !blocked && self.at_or_above[level] < i64::from(limit)
            };
            match (fits, head.fresh) {
                (true, _) => {}
                // Held back by more urgent work, or by the bound on fresh
                // passes: it holds back what stands behind it, as an
                // order that has aged to the front does.
                (false, true) => break,
                (false, false) => {
                    blocked = true;
                    continue;
                }
            }
            for slot in &mut self.at_or_above[..=level] {
                *slot += 1;
            }
            admitted.push(index);
        }
        admitted
    }
}

/// A head of a full line, as [`Levels::admit_heads`] weighs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Head {
    /// Its order's priority, or [`UNDO_LEVEL`] for an undo.
    pub level: i16,
    /// It took a turn in the line (tenants are configured), and it is the
    /// first head of a tenant with nothing in flight at the agent: the
    /// agent gives its request the head's turn, before the requests it
    /// holds of tenants with a backlog there at its level (another fresh
    /// tenant's ties with it, and the two go in arrival order).
    pub fresh: bool,
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
            in_flight_ms: 0,
            queued_ms: 0,
            slot_wait_ms: 0,
        }
    }

    /// A window of 1 s in which a remote of 4 call slots at 100 ms a call
    /// finished 40 attempts, each in flight `in_flight` ms on average, of
    /// which `queued` at the agent; a step deadline of 10 s.
    fn measured(limit: i32, waiting: i32, in_flight: i64, queued: i64) -> Window {
        Window {
            limit,
            initial: 256,
            ceiling: 1000,
            waiting,
            peak_in_flight: limit,
            settled: 40,
            seconds: 1.0,
            deadline_ms: 10_000,
            in_flight_ms: 40 * in_flight,
            queued_ms: 40 * queued,
            slot_wait_ms: 40 * queued,
        }
    }

    #[test]
    fn with_a_line_attempts_queued_at_the_agent_come_back_to_the_line() {
        // 256 in flight, 6.4 s each, 6.29 s of it queued: the calls and
        // hops hold 4.4 on average (40 × 0.11 s), and half as many more may
        // queue.
        assert_eq!(adapted_limit(&measured(256, 500, 6400, 6290), 0.5), 7);
        // 2 queued on average, about the target: it stays.
        assert_eq!(adapted_limit(&measured(7, 500, 160, 50), 0.5), 7);
        // Less than half the target queued (0.8 of 4.6, with 9.2 in calls
        // and hops): a slot may be idle, it doubles.
        assert_eq!(adapted_limit(&measured(7, 500, 250, 20), 0.5), 14);
        // A slow remote of one slot: at least one attempt may queue.
        let one_slot = Window {
            settled: 10,
            in_flight_ms: 10 * 400,
            queued_ms: 10 * 290,
            slot_wait_ms: 10 * 290,
            ..measured(4, 500, 0, 0)
        };
        assert_eq!(adapted_limit(&one_slot, 0.5), 3);
    }

    #[test]
    fn with_a_line_and_free_call_slots_the_limit_doubles_towards_the_deadline_target() {
        // Attempts queue (in the broker, in replies) but hardly any waits
        // for a call slot: the remote is not what holds them up, and a
        // lower limit would only make the line longer.
        let hops = Window {
            slot_wait_ms: 40 * 5,
            ..measured(7, 500, 300, 200)
        };
        assert_eq!(adapted_limit(&hops, 0.5), 14);
        // Past the target (40 a second for half of 10 s): at most halved.
        assert_eq!(adapted_limit(&Window { limit: 500, ..hops }, 0.5), 250);
        assert_eq!(adapted_limit(&Window { limit: 300, ..hops }, 0.5), 200);
    }

    #[test]
    fn measured_growth_stops_at_the_deadline_target_and_the_ceiling() {
        // 40 a second for 10 s, half of it: 200.
        assert_eq!(adapted_limit(&measured(150, 500, 110, 0), 0.5), 200);
        let low_ceiling = Window {
            ceiling: 100,
            ..measured(80, 500, 110, 0)
        };
        assert_eq!(adapted_limit(&low_ceiling, 0.5), 100);
    }

    #[test]
    fn measured_without_a_line_at_full_slots_the_limit_is_what_was_used() {
        // Attempts waited for call slots, 10 at most in flight: twice that,
        // not the initial 256, which would flood the slots at the next
        // burst.
        let quiet = Window {
            peak_in_flight: 10,
            ..measured(256, 0, 110, 50)
        };
        assert_eq!(adapted_limit(&quiet, 0.5), 20);
        // Used less than the calls held (the peak was reset in the
        // window): what they held, 8, plus the queue target, 4.
        let reset = Window {
            peak_in_flight: 1,
            ..measured(256, 0, 300, 100)
        };
        assert_eq!(adapted_limit(&reset, 0.5), 12);
        // No attempt waited for a slot: the law that came before, which
        // keeps the initial limit for a burst.
        let idle_slots = Window {
            peak_in_flight: 10,
            ..measured(256, 0, 110, 0)
        };
        assert_eq!(adapted_limit(&idle_slots, 0.5), 256);
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
    fn the_cap_is_the_deadline_target_or_what_the_calls_held() {
        // 40 a second for half of 10 s.
        assert_eq!(adapted_cap(&measured(7, 500, 250, 200), 0.5), 200);
        // Calls that hold more than the target keep what they hold.
        // 2 calls of 4 s a second: 8 in flight, a queue target of 4; the
        // deadline target is 10.
        let slow = Window {
            settled: 2,
            in_flight_ms: 2 * 4000,
            queued_ms: 0,
            slot_wait_ms: 0,
            ..measured(7, 500, 0, 0)
        };
        assert_eq!(adapted_cap(&slow, 0.5), 12);
        let low_ceiling = Window {
            ceiling: 100,
            ..measured(7, 500, 250, 200)
        };
        assert_eq!(adapted_cap(&low_ceiling, 0.5), 100);
        // Nothing measured: nothing passes the limit.
        let idle = Window {
            settled: 0,
            in_flight_ms: 0,
            queued_ms: 0,
            ..window()
        };
        assert_eq!(adapted_cap(&idle, 0.5), 1);
    }

    #[test]
    fn urgent_work_passes_a_limit_full_of_less_urgent_work() {
        // 190 attempts of priority 5 in flight under a limit of 7.
        let mut levels = Levels::new([(5, 190)]);
        // Heads of priority 9, 9, 6, then 5: the first three pass, the one
        // at 5 would queue behind the 190, and so waits, and so does the 9
        // behind it.
        assert_eq!(levels.admit(7, 100, &[9, 9, 6, 5, 9]), 3);
        // Now 2 are in flight at 9: 5 more may pass at 9.
        assert_eq!(levels.admit(7, 100, &[9; 10]), 5);
        assert_eq!(levels.admit(7, 100, &[9]), 0);
        // Undos pass the urgent work, up to the limit of their own.
        assert_eq!(levels.admit(7, 100, &[UNDO_LEVEL; 9]), 7);
        assert_eq!(levels.admit(7, 100, &[UNDO_LEVEL]), 0);
    }

    #[test]
    fn a_tenant_with_nothing_in_flight_passes_a_limit_full_of_another_tenants_work() {
        let head = |level, fresh| Head { level, fresh };
        // 8 attempts of priority 5 in flight (a busy tenant's) under a
        // limit of 8.
        let mut levels = Levels::new([(5, 8)]);
        // A quiet tenant's head passes; the busy tenant's behind it waits,
        // and so does what stands behind that.
        assert_eq!(
            levels.admit_heads(8, 100, &[head(5, true), head(5, false), head(5, false)]),
            [0]
        );
        // Also from behind the busy tenant's head, which waits for its own
        // tenant's work; the busy tenant's next heads keep waiting.
        assert_eq!(
            levels.admit_heads(8, 100, &[head(5, false), head(5, true), head(5, false)]),
            [1]
        );
        // Under the cap only.
        assert_eq!(
            levels.admit_heads(8, 0, &[head(5, true)]),
            Vec::<usize>::new()
        );
        assert_eq!(
            levels.admit_heads(8, 1, &[head(5, true), head(5, true)]),
            [0]
        );
        // Light tenants passing together stop at twice the limit in all:
        // 11 in flight now, so 5 more.
        assert_eq!(levels.admit_heads(8, 100, &[head(5, true); 9]).len(), 5);
        // A fresh head held back holds back what stands behind it.
        let mut aged = Levels::new([(3, 8)]);
        assert!(aged
            .admit_heads(8, 100, &[head(2, true), head(9, false)])
            .is_empty());
        // Not past a limit full of more urgent work: that stands before it
        // at the agent too.
        let mut urgent = Levels::new([(9, 8)]);
        assert!(urgent.admit_heads(8, 100, &[head(5, true)]).is_empty());
        assert_eq!(urgent.admit_heads(8, 100, &[head(9, true)]), [0]);
        // Undos take turns among themselves as well: a limit full of one
        // tenant's undos lets another tenant's first undo pass, while
        // fewer than twice the limit are in flight in all.
        let mut crowded = Levels::new([(UNDO_LEVEL, 8), (5, 40)]);
        assert!(crowded
            .admit_heads(8, 100, &[head(UNDO_LEVEL, true)])
            .is_empty());
        let mut undos = Levels::new([(UNDO_LEVEL, 8), (5, 4)]);
        assert!(undos
            .admit_heads(8, 100, &[head(UNDO_LEVEL, false)])
            .is_empty());
        assert_eq!(undos.admit_heads(8, 100, &[head(UNDO_LEVEL, true)]), [0]);
    }

    #[test]
    fn what_passes_the_limit_stays_under_the_cap() {
        let mut levels = Levels::new([(5, 190), (UNDO_LEVEL, 2)]);
        assert_eq!(levels.admit(7, 3, &[9; 10]), 3, "room under the cap");
        assert_eq!(levels.admit(7, 0, &[UNDO_LEVEL]), 0);
        // Levels out of range count as the nearest in range.
        let clamped = Levels::new([(-1, 4), (12, 1)]);
        assert_eq!(clamped, Levels::new([(0, 4), (UNDO_LEVEL, 1)]));
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
