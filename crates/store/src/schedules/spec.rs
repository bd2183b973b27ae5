//! What a schedule says, checked: its name, its cron expression in its
//! time zone ([`Timing`]), what it does when a run is still going
//! ([`Overlap`]), and the id of the order each occurrence becomes
//! ([`occurrence_order_id`]).
//!
//! Daylight-saving changes follow the Open Container Initiative's cron
//! rules, as `croner` implements them: a fixed time that falls in a
//! skipped hour runs at the first time after the gap (02:30 on the night
//! clocks go forward runs at 03:00); a fixed time in a doubled hour runs
//! once, at its first instance; an interval expression (`*/15 * * * *`,
//! `0 * * * *`) runs on both instances of a doubled hour and not in a
//! skipped one.

use std::fmt;
use std::str::FromStr;

use chrono::{DateTime, LocalResult, TimeDelta, TimeZone as _, Utc};
use chrono_tz::Tz;
use croner::parser::{CronParser, Seconds, Year};
use croner::Cron;

/// The catch-up window of a schedule that names none: an hour.
pub const DEFAULT_CATCH_UP_SECS: u64 = 3600;

/// The longest catch-up window: 31 days.
pub const MAX_CATCH_UP_SECS: u64 = 31 * 24 * 3600;

/// Checks a tenant's name as schedules store it: 1 to 64 letters, digits,
/// `_` or `-` (an `@` would make its orders' ids name another tenant).
///
/// # Errors
/// [`InvalidSchedule`] saying what a tenant's name may hold.
pub fn check_tenant(tenant: &str) -> Result<(), InvalidSchedule> {
    if sas_messages::order::is_workflow_name(tenant) {
        Ok(())
    } else {
        Err(InvalidSchedule(format!(
            "a tenant's name is 1 to 64 letters, digits, '_' or '-' (got {tenant:?})"
        )))
    }
}

/// Longest schedule name: its orders' ids are `<name>:<UTC time>` (or
/// `<name>:now-<UTC time with milliseconds>` for a run asked by hand),
/// which must fit an order id's 64 characters.
pub const MAX_NAME_LEN: usize = sas_messages::schedule::MAX_SCHEDULE_NAME_LEN;

/// The most times [`Timing::next_after`] looks at: a doubled hour of a
/// per-second expression, and the quarter of an hour before it, are 8,100.
const MAX_STEPS: usize = 20_000;

/// How far [`Timing::next_after`] steps back, a quarter of an hour at a
/// time, to the start of a doubled hour: past four hours, the span of a
/// two-hour shift's doubled time (both instances).
const FOLD_STEPS_BACK: usize = 8 * 2 + 1;

/// Why a schedule's definition is refused: what is wrong and what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct InvalidSchedule(pub String);

/// Checks a schedule name: 1 to [`MAX_NAME_LEN`] letters, digits, `_` or `-`.
///
/// # Errors
/// [`InvalidSchedule`] saying what a name may hold.
pub fn check_name(name: &str) -> Result<(), InvalidSchedule> {
    if sas_messages::schedule::is_schedule_name(name) {
        Ok(())
    } else {
        Err(InvalidSchedule(format!(
            "a schedule name is 1 to {MAX_NAME_LEN} letters, digits, '_' or '-' (got {name:?})"
        )))
    }
}

/// When a schedule's occurrences fall: a cron expression of 5 fields
/// (minute to day of week) or 6 (seconds first), or a nickname such as
/// `@daily`, read in an IANA time zone.
#[derive(Debug, Clone)]
pub struct Timing {
    cron: Cron,
    zone: Tz,
    expression: String,
}

impl Timing {
    /// Parses `expression` in the zone named `zone` (`Europe/Berlin`, `UTC`).
    ///
    /// # Errors
    /// [`InvalidSchedule`] naming what is wrong: the number of fields, a
    /// field the parser refuses, an unknown zone, or an expression that
    /// never matches.
    pub fn parse(expression: &str, zone: &str) -> Result<Self, InvalidSchedule> {
        let expression = expression.trim();
        let fields = expression.split_whitespace().count();
        if !expression.starts_with('@') && !(5..=6).contains(&fields) {
            return Err(InvalidSchedule(format!(
                "a cron expression has 5 fields (minute hour day-of-month month day-of-week) or 6 (seconds first); {expression:?} has {fields}"
            )));
        }
        let parser = CronParser::builder()
            .seconds(Seconds::Optional)
            .year(Year::Disallowed)
            .build();
        let cron = parser
            .parse(expression)
            .map_err(|error| InvalidSchedule(format!("cron expression {expression:?}: {error}")))?;
        let zone = Tz::from_str(zone).map_err(|_| {
            InvalidSchedule(format!(
                "unknown time zone {zone:?}: name an IANA zone such as \"UTC\" or \"Europe/Berlin\""
            ))
        })?;
        let timing = Self {
            cron,
            zone,
            expression: expression.to_owned(),
        };
        if timing.next_after(Utc::now()).is_none() {
            return Err(InvalidSchedule(format!(
                "cron expression {expression:?} never matches a time to come"
            )));
        }
        Ok(timing)
    }

    /// The expression as given (trimmed).
    pub fn expression(&self) -> &str {
        &self.expression
    }

    /// The zone's IANA name.
    pub fn zone(&self) -> &str {
        self.zone.name()
    }

    /// The first occurrence strictly after `after`, if the expression has one.
    pub fn next_after(&self, after: DateTime<Utc>) -> Option<DateTime<Utc>> {
        // In a doubled hour croner yields, for each wall-clock time, its
        // first instance and then its second, so its times are not in
        // order there, and a search that starts inside the doubled hour
        // never yields the second instances of the wall-clock times before
        // its start: start before the doubled hour, and take the earliest
        // time after `after`. A time that is the first (or only) instance
        // of its wall-clock time comes before everything yielded after it.
        let ambiguous = |at: DateTime<Utc>| {
            let local = at.with_timezone(&self.zone).naive_local();
            matches!(
                self.zone.from_local_datetime(&local),
                LocalResult::Ambiguous(..)
            )
        };
        let mut start = after;
        for _ in 0..FOLD_STEPS_BACK {
            if !ambiguous(start) {
                break;
            }
            start -= TimeDelta::minutes(15);
        }
        let start = start.with_timezone(&self.zone);
        let mut best: Option<DateTime<Utc>> = None;
        for at in self.cron.iter_after(start).take(MAX_STEPS) {
            let utc = at.with_timezone(&Utc);
            if utc <= after {
                continue;
            }
            best = Some(best.map_or(utc, |best| best.min(utc)));
            let first_instance = match self.zone.from_local_datetime(&at.naive_local()) {
                LocalResult::Ambiguous(earliest, _) => earliest == at,
                _ => true,
            };
            if first_instance {
                break;
            }
        }
        best
    }

    /// The first occurrence at or after `from`, if any.
    pub fn next_from(&self, from: DateTime<Utc>) -> Option<DateTime<Utc>> {
        self.next_after(from - TimeDelta::nanoseconds(1))
    }

    /// The next `count` occurrences after `after`, for listings.
    pub fn upcoming(&self, after: DateTime<Utc>, count: usize) -> Vec<DateTime<Utc>> {
        let mut times = Vec::with_capacity(count);
        let mut at = after;
        while times.len() < count {
            match self.next_after(at) {
                Some(next) => {
                    times.push(next);
                    at = next;
                }
                None => break,
            }
        }
        times
    }
}

/// What a schedule does with an occurrence that comes while its last run
/// has not ended (Temporal's overlap policies, by the same names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlap {
    /// The occurrence is skipped (recorded as such).
    Skip,
    /// The first such occurrence waits for the run to end and then starts;
    /// later ones while one waits are skipped.
    BufferOne,
    /// Every occurrence starts, whatever is still running.
    Allow,
}

impl Overlap {
    /// The name stored and shown.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Skip => "skip",
            Self::BufferOne => "buffer_one",
            Self::Allow => "allow",
        }
    }
}

impl fmt::Display for Overlap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Overlap {
    type Err = InvalidSchedule;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "skip" => Ok(Self::Skip),
            "buffer_one" => Ok(Self::BufferOne),
            "allow" => Ok(Self::Allow),
            other => Err(InvalidSchedule(format!(
                "overlap policy {other:?}: use skip, buffer_one or allow"
            ))),
        }
    }
}

/// Checks the order a schedule's runs submit: a JSON object that, with an
/// occurrence's `order_id`, is a valid order. An `order_id` of its own is
/// refused: each run gets its own.
///
/// # Errors
/// [`InvalidSchedule`] saying what is wrong, as intake would.
pub fn check_order(
    order: &serde_json::Value,
    name: &str,
) -> Result<serde_json::Map<String, serde_json::Value>, InvalidSchedule> {
    let Some(template) = order.as_object() else {
        return Err(InvalidSchedule(
            "the order must be a JSON object: an order as sasctl submit --file reads one, without order_id".into(),
        ));
    };
    if template.contains_key("order_id") {
        return Err(InvalidSchedule(
            "the order names an order_id: leave it out, each run's order gets its own (<name>:<UTC time>)".into(),
        ));
    }
    sample_order(template, name)?;
    Ok(template.clone())
}

/// The order a run of schedule `name` would submit now from `template`,
/// validated as intake validates it: what a scheduler checks a tenant's
/// rights against when the schedule is created.
///
/// # Errors
/// [`InvalidSchedule`] saying what is wrong, as intake would.
pub fn sample_order(
    template: &serde_json::Map<String, serde_json::Value>,
    name: &str,
) -> Result<sas_messages::SubmitOrder, InvalidSchedule> {
    let mut sample = template.clone();
    sample.insert(
        "order_id".into(),
        occurrence_order_id(name, Utc::now(), true).into(),
    );
    let order: sas_messages::SubmitOrder =
        serde_json::from_value(serde_json::Value::Object(sample))
            .map_err(|error| InvalidSchedule(format!("the order is not an order: {error}")))?;
    order
        .validate()
        .map_err(|error| InvalidSchedule(error.to_string()))?;
    Ok(order)
}

/// The client id of the order occurrence `at` of schedule `name` becomes:
/// `<name>:<UTC time, to the second>` (`nightly:20261129T020000Z`), or for
/// a run asked by hand, `<name>:now-<UTC time, to the millisecond>`. The
/// same occurrence always gives the same id, so however many schedulers
/// fire it, and whatever dies in between, intake stores it once.
pub fn occurrence_order_id(name: &str, at: DateTime<Utc>, by_hand: bool) -> String {
    if by_hand {
        format!("{name}:now-{}", at.format("%Y%m%dT%H%M%S%.3fZ"))
    } else {
        format!("{name}:{}", at.format("%Y%m%dT%H%M%SZ"))
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// An instant from its RFC 3339 text.
    pub(crate) fn utc(text: &str) -> DateTime<Utc> {
        DateTime::parse_from_rfc3339(text)
            .unwrap()
            .with_timezone(&Utc)
    }

    #[test]
    fn five_and_six_fields_are_read_and_others_refused_with_the_count() {
        let five = Timing::parse("*/10 * * * *", "UTC").unwrap();
        assert_eq!(
            five.next_after(utc("2026-11-29T10:00:00Z")),
            Some(utc("2026-11-29T10:10:00Z"))
        );
        let six = Timing::parse("*/10 * * * * *", "UTC").unwrap();
        assert_eq!(
            six.next_after(utc("2026-11-29T10:00:00Z")),
            Some(utc("2026-11-29T10:00:10Z"))
        );
        let four = Timing::parse("* * * *", "UTC").unwrap_err();
        assert!(four.0.contains("has 4"), "{four}");
        let seven = Timing::parse("0 0 0 1 1 * 2030", "UTC").unwrap_err();
        assert!(seven.0.contains("has 7"), "{seven}");
        assert!(Timing::parse("61 * * * *", "UTC").is_err());
        let zone = Timing::parse("0 2 * * *", "Mars/Olympus").unwrap_err();
        assert!(zone.0.contains("unknown time zone"), "{zone}");
        assert!(Timing::parse("@daily", "UTC").is_ok());
    }

    #[test]
    fn a_nightly_time_in_the_hour_clocks_skip_runs_once_right_after_the_gap() {
        // Europe/Berlin goes from 02:00 to 03:00 on 2027-03-28.
        let nightly = Timing::parse("30 2 * * *", "Europe/Berlin").unwrap();
        let runs = nightly.upcoming(utc("2027-03-26T12:00:00Z"), 3);
        let berlin = chrono_tz::Europe::Berlin;
        let local: Vec<_> = runs
            .iter()
            .map(|at| at.with_timezone(&berlin).naive_local().to_string())
            .collect();
        assert_eq!(
            local,
            [
                "2027-03-27 02:30:00",
                "2027-03-28 03:00:00",
                "2027-03-29 02:30:00"
            ]
        );
    }

    #[test]
    fn a_nightly_time_in_the_doubled_hour_runs_once_and_an_hourly_one_twice() {
        // Europe/Berlin goes from 03:00 back to 02:00 on 2026-10-25: 02:30
        // happens at 00:30 and at 01:30 UTC.
        let nightly = Timing::parse("30 2 * * *", "Europe/Berlin").unwrap();
        let runs = nightly.upcoming(utc("2026-10-24T12:00:00Z"), 2);
        assert_eq!(
            runs,
            [utc("2026-10-25T00:30:00Z"), utc("2026-10-26T01:30:00Z")]
        );
        let hourly = Timing::parse("30 * * * *", "Europe/Berlin").unwrap();
        let runs = hourly.upcoming(utc("2026-10-24T23:45:00Z"), 3);
        assert_eq!(
            runs,
            [
                utc("2026-10-25T00:30:00Z"),
                utc("2026-10-25T01:30:00Z"),
                utc("2026-10-25T02:30:00Z")
            ]
        );
        // Several times an hour: both instances of each, in time order.
        let quarterly = Timing::parse("*/15 * * * *", "Europe/Berlin").unwrap();
        let runs = quarterly.upcoming(utc("2026-10-24T23:50:00Z"), 9);
        let expected: Vec<_> = (0..9)
            .map(|i| utc("2026-10-25T00:00:00Z") + TimeDelta::minutes(15 * i))
            .collect();
        assert_eq!(runs, expected);
        for (after, next) in [
            ("2026-10-25T00:00:00Z", "2026-10-25T00:15:00Z"),
            ("2026-10-25T00:45:00Z", "2026-10-25T01:00:00Z"),
            ("2026-10-25T01:00:00Z", "2026-10-25T01:15:00Z"),
            ("2026-10-25T01:45:00Z", "2026-10-25T02:00:00Z"),
        ] {
            assert_eq!(
                quarterly.next_after(utc(after)),
                Some(utc(next)),
                "after {after}"
            );
        }
        let every_second = Timing::parse("* * * * * *", "Europe/Berlin").unwrap();
        assert_eq!(
            every_second.next_after(utc("2026-10-25T01:30:00Z")),
            Some(utc("2026-10-25T01:30:01Z"))
        );
        // From either instance, the next is the one after it (a scheduler
        // deciding one occurrence at a time must not lose the second).
        assert_eq!(
            hourly.next_after(utc("2026-10-25T00:30:00Z")),
            Some(utc("2026-10-25T01:30:00Z"))
        );
        assert_eq!(
            hourly.next_after(utc("2026-10-25T01:30:00Z")),
            Some(utc("2026-10-25T02:30:00Z"))
        );
    }

    #[test]
    fn an_occurrence_always_names_the_same_order_and_fits_an_order_id() {
        let at = Utc.with_ymd_and_hms(2026, 11, 29, 2, 0, 0).unwrap();
        assert_eq!(
            occurrence_order_id("nightly", at, false),
            "nightly:20261129T020000Z"
        );
        let longest = "n".repeat(MAX_NAME_LEN);
        let by_hand = occurrence_order_id(&longest, at, true);
        assert!(
            by_hand.len() <= sas_messages::order::MAX_ID_LEN,
            "{by_hand}"
        );
        assert!(check_name(&longest).is_ok());
        assert!(check_name(&format!("{longest}n")).is_err());
        assert!(check_name("a b").is_err());
    }

    #[test]
    fn an_order_template_is_an_order_without_its_id() {
        let order: serde_json::Value = serde_json::json!({
            "schema_version": 1, "customer_id": "c", "items": [{"sku": "s", "quantity": 1}],
            "amount_cents": 1, "currency": "EUR"
        });
        let template = check_order(&order, "nightly").expect("a valid template");
        assert!(!template.contains_key("order_id"));
        let refused = |change: &dyn Fn(&mut serde_json::Value)| {
            let mut order = order.clone();
            change(&mut order);
            check_order(&order, "nightly").unwrap_err().0
        };
        assert!(refused(&|o| o["order_id"] = "x".into()).contains("names an order_id"));
        assert!(refused(&|o| o["currency"] = "euro".into()).contains("currency"));
        assert!(refused(&|o| o["colour"] = "red".into()).contains("not an order"));
        assert!(check_order(&serde_json::json!([1]), "nightly")
            .unwrap_err()
            .0
            .contains("JSON object"));
    }

    #[test]
    fn overlap_names_read_back() {
        for overlap in [Overlap::Skip, Overlap::BufferOne, Overlap::Allow] {
            assert_eq!(overlap.as_str().parse::<Overlap>().unwrap(), overlap);
        }
        assert!("queue".parse::<Overlap>().is_err());
    }
}
