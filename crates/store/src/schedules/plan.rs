//! What becomes of a schedule's due occurrences, decided in one place and
//! pure: which start, which are skipped for a run still going (the
//! [`Overlap`] policy), which fell out of the catch-up window (missed),
//! which waits in the buffer, and the next occurrence to decide.

use chrono::{DateTime, TimeDelta, Utc};

use super::spec::{Overlap, Timing};

/// The most occurrences of the catch-up window one decision takes: the
/// rest stay due, for the next tick (a per-second schedule after a long
/// outage does not make one huge transaction).
pub const MAX_RUNS_PER_DECISION: usize = 100;

/// The most missed occurrences counted one by one; past it, the stretch
/// up to the window is skipped over and its count is a floor.
pub const MAX_MISSED_COUNTED: u32 = 100_000;

/// A due schedule as its row says, read under its lock.
#[derive(Debug, Clone)]
pub struct Due {
    /// The first occurrence not yet decided.
    pub next_run: Option<DateTime<Utc>>,
    /// An occurrence waiting for the last run to end (`buffer_one`).
    pub buffered: Option<DateTime<Utc>>,
    /// A run asked by hand.
    pub trigger_at: Option<DateTime<Utc>>,
    /// Paused: only a run asked by hand starts.
    pub paused: bool,
    /// The overlap policy.
    pub overlap: Overlap,
    /// How far back an occurrence may still start.
    pub catch_up: TimeDelta,
    /// Whether the order of the last run started has not ended yet.
    pub last_running: bool,
}

/// What one occurrence became.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Its order starts.
    Start,
    /// Skipped, for the reason given.
    Skip(&'static str),
    /// It and the ones after it up to `through` (`count` in all) were older
    /// than the catch-up window when decided.
    Missed {
        /// The last occurrence of the stretch.
        through: DateTime<Utc>,
        /// How many (a floor when [`MAX_MISSED_COUNTED`] was reached).
        count: u32,
    },
}

/// One decided occurrence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Run {
    /// When it was due (for a run asked by hand, when it was asked).
    pub occurrence: DateTime<Utc>,
    /// Asked by hand (`trigger`) rather than due by the expression.
    pub by_hand: bool,
    /// What became of it.
    pub outcome: Outcome,
}

/// The decision for one due schedule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The occurrences decided, in time order (a run asked by hand last).
    pub runs: Vec<Run>,
    /// The occurrence that waits for the last run to end, after this.
    pub buffered: Option<DateTime<Utc>>,
    /// The first occurrence left to decide (`None`: the expression has no more).
    pub next_run: Option<DateTime<Utc>>,
}

/// Why an occurrence is skipped under [`Overlap::Skip`].
pub const SKIPPED_RUNNING: &str = "the last run had not ended (overlap skip)";
/// Why an occurrence is skipped under [`Overlap::BufferOne`].
pub const SKIPPED_BUFFER_FULL: &str =
    "an occurrence already waited for the last run to end (overlap buffer_one)";

/// Decides schedule `due` (timing `timing`) at `now`.
pub fn plan(due: &Due, timing: &Timing, now: DateTime<Utc>) -> Plan {
    let mut runs = Vec::new();
    let (window, next_run) = if due.paused {
        (Vec::new(), due.next_run)
    } else {
        let (missed, window, next_run) = due_occurrences(due, timing, now);
        runs.extend(missed);
        (window, next_run)
    };
    let mut running = due.last_running;
    let mut buffered = due.buffered;
    let start = |runs: &mut Vec<Run>, occurrence, running: &mut bool| {
        runs.push(Run {
            occurrence,
            by_hand: false,
            outcome: Outcome::Start,
        });
        *running = true;
    };
    // An occurrence in the buffer goes first, once the run it waited for ended.
    if let (Some(waiting), false) = (buffered, running) {
        if !due.paused {
            start(&mut runs, waiting, &mut running);
            buffered = None;
        }
    }
    for occurrence in window {
        match due.overlap {
            Overlap::Allow => start(&mut runs, occurrence, &mut running),
            _ if !running => start(&mut runs, occurrence, &mut running),
            Overlap::Skip => runs.push(Run {
                occurrence,
                by_hand: false,
                outcome: Outcome::Skip(SKIPPED_RUNNING),
            }),
            Overlap::BufferOne if buffered.is_none() => buffered = Some(occurrence),
            Overlap::BufferOne => runs.push(Run {
                occurrence,
                by_hand: false,
                outcome: Outcome::Skip(SKIPPED_BUFFER_FULL),
            }),
        }
    }
    if let Some(asked) = due.trigger_at {
        runs.push(Run {
            occurrence: asked,
            by_hand: true,
            outcome: Outcome::Start,
        });
    }
    Plan {
        runs,
        buffered,
        next_run,
    }
}

/// The due occurrences of `due` at `now`: the stretch older than the
/// catch-up window (as one missed run), those within it (at most
/// [`MAX_RUNS_PER_DECISION`]), and the first occurrence left after them.
fn due_occurrences(
    due: &Due,
    timing: &Timing,
    now: DateTime<Utc>,
) -> (Option<Run>, Vec<DateTime<Utc>>, Option<DateTime<Utc>>) {
    let cutoff = now
        .checked_sub_signed(due.catch_up)
        .unwrap_or(DateTime::<Utc>::MIN_UTC);
    let mut missed: Option<Run> = None;
    let mut window = Vec::new();
    let mut at = due.next_run;
    while let Some(occurrence) = at.filter(|&t| t <= now) {
        if occurrence < cutoff {
            let stretch = missed.get_or_insert(Run {
                occurrence,
                by_hand: false,
                outcome: Outcome::Missed {
                    through: occurrence,
                    count: 0,
                },
            });
            if let Outcome::Missed { through, count } = &mut stretch.outcome {
                *through = occurrence;
                *count += 1;
                at = if *count >= MAX_MISSED_COUNTED {
                    timing.next_from(cutoff)
                } else {
                    timing.next_after(occurrence)
                };
            }
            continue;
        }
        if window.len() == MAX_RUNS_PER_DECISION {
            break;
        }
        window.push(occurrence);
        at = timing.next_after(occurrence);
    }
    (missed, window, at)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::schedules::spec::tests::utc;

    fn every_ten_seconds() -> Timing {
        Timing::parse("*/10 * * * * *", "UTC").unwrap()
    }

    fn due(next_run: &str, overlap: Overlap, last_running: bool) -> Due {
        Due {
            next_run: Some(utc(next_run)),
            buffered: None,
            trigger_at: None,
            paused: false,
            overlap,
            catch_up: TimeDelta::seconds(30),
            last_running,
        }
    }

    fn started(runs: &[Run]) -> Vec<DateTime<Utc>> {
        runs.iter()
            .filter(|run| run.outcome == Outcome::Start)
            .map(|run| run.occurrence)
            .collect()
    }

    #[test]
    fn one_due_occurrence_starts_and_the_next_is_left() {
        let plan = plan(
            &due("2026-11-29T10:00:00Z", Overlap::Skip, false),
            &every_ten_seconds(),
            utc("2026-11-29T10:00:00.300Z"),
        );
        assert_eq!(started(&plan.runs), [utc("2026-11-29T10:00:00Z")]);
        assert_eq!(plan.runs.len(), 1);
        assert_eq!(plan.next_run, Some(utc("2026-11-29T10:00:10Z")));
    }

    #[test]
    fn after_an_outage_the_window_runs_in_order_and_older_ones_are_one_missed_stretch() {
        // Due since 09:58:00; at 10:00:05 with a 30 s window, 09:59:40 to
        // 10:00:00 run and the ten before are missed.
        let plan = plan(
            &due("2026-11-29T09:58:00Z", Overlap::Allow, false),
            &every_ten_seconds(),
            utc("2026-11-29T10:00:05Z"),
        );
        assert_eq!(
            plan.runs[0],
            Run {
                occurrence: utc("2026-11-29T09:58:00Z"),
                by_hand: false,
                outcome: Outcome::Missed {
                    through: utc("2026-11-29T09:59:30Z"),
                    count: 10
                }
            }
        );
        assert_eq!(
            started(&plan.runs),
            [
                utc("2026-11-29T09:59:40Z"),
                utc("2026-11-29T09:59:50Z"),
                utc("2026-11-29T10:00:00Z")
            ]
        );
        assert_eq!(plan.next_run, Some(utc("2026-11-29T10:00:10Z")));
    }

    #[test]
    fn skip_starts_the_first_of_the_window_and_skips_the_rest_or_all_while_a_run_goes_on() {
        let timing = every_ten_seconds();
        let now = utc("2026-11-29T10:00:05Z");
        let idle = plan(
            &due("2026-11-29T09:59:40Z", Overlap::Skip, false),
            &timing,
            now,
        );
        assert_eq!(started(&idle.runs), [utc("2026-11-29T09:59:40Z")]);
        assert_eq!(idle.runs.len(), 3);
        assert!(idle.runs[1..]
            .iter()
            .all(|run| run.outcome == Outcome::Skip(SKIPPED_RUNNING)));
        let busy = plan(
            &due("2026-11-29T09:59:40Z", Overlap::Skip, true),
            &timing,
            now,
        );
        assert!(started(&busy.runs).is_empty());
        assert_eq!(busy.runs.len(), 3);
    }

    #[test]
    fn buffer_one_keeps_the_first_while_a_run_goes_on_and_starts_it_when_the_run_ended() {
        let timing = every_ten_seconds();
        let now = utc("2026-11-29T10:00:05Z");
        let busy = plan(
            &due("2026-11-29T09:59:50Z", Overlap::BufferOne, true),
            &timing,
            now,
        );
        assert_eq!(busy.buffered, Some(utc("2026-11-29T09:59:50Z")));
        assert_eq!(
            busy.runs,
            [Run {
                occurrence: utc("2026-11-29T10:00:00Z"),
                by_hand: false,
                outcome: Outcome::Skip(SKIPPED_BUFFER_FULL)
            }]
        );
        // The run ended: the buffered occurrence starts; the one due now
        // waits behind it.
        let ended = Due {
            buffered: busy.buffered,
            last_running: false,
            ..due("2026-11-29T10:00:10Z", Overlap::BufferOne, false)
        };
        let next = plan(&ended, &timing, utc("2026-11-29T10:00:12Z"));
        assert_eq!(started(&next.runs), [utc("2026-11-29T09:59:50Z")]);
        assert_eq!(next.buffered, Some(utc("2026-11-29T10:00:10Z")));
    }

    #[test]
    fn a_run_asked_by_hand_starts_even_paused_or_overlapping_and_decides_nothing_else() {
        let asked = utc("2026-11-29T10:00:03.250Z");
        let paused = Due {
            paused: true,
            trigger_at: Some(asked),
            ..due("2026-11-29T09:00:00Z", Overlap::Skip, true)
        };
        let plan = plan(&paused, &every_ten_seconds(), utc("2026-11-29T10:00:05Z"));
        assert_eq!(
            plan.runs,
            [Run {
                occurrence: asked,
                by_hand: true,
                outcome: Outcome::Start
            }]
        );
        assert_eq!(plan.next_run, paused.next_run);
    }

    #[test]
    fn a_long_outage_of_a_per_second_schedule_is_decided_a_bounded_slice_at_a_time() {
        let every_second = Timing::parse("* * * * * *", "UTC").unwrap();
        let long = Due {
            catch_up: TimeDelta::hours(1),
            ..due("2026-11-29T08:00:00Z", Overlap::Allow, false)
        };
        let plan = plan(&long, &every_second, utc("2026-11-29T10:00:00Z"));
        let Outcome::Missed { through, count } = plan.runs[0].outcome else {
            panic!("the first hour is missed: {:?}", plan.runs[0]);
        };
        assert_eq!((through, count), (utc("2026-11-29T08:59:59Z"), 3600));
        assert_eq!(started(&plan.runs).len(), MAX_RUNS_PER_DECISION);
        assert_eq!(plan.next_run, Some(utc("2026-11-29T09:01:40Z")));
    }
}
