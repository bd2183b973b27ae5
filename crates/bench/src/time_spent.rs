//! Where a set of orders spent their time, from their history: each gap
//! between two consecutive history lines of an order (named by the two
//! events and the step of the later one), plus the client's send before the
//! first line and its hearing of the end after the last. Averaged over the
//! orders, side by side for two runs, it says which hop a neighbour slows
//! (the noisy-neighbour phase reports it for the quiet tenant alone and
//! beside the noisy one).

use std::collections::HashMap;
use std::time::Instant;

use chrono::{DateTime, Utc};
use serde::Serialize;

/// One kind of gap, over the orders that had it.
#[derive(Debug, Clone, Default, Serialize, PartialEq)]
pub struct Gap {
    /// `<earlier event> -> <later event>[ <later step>]`, or `sent ->` the
    /// first line, or the last line `-> heard`.
    pub between: String,
    /// Orders that had this gap.
    pub orders: usize,
    /// Its mean, milliseconds.
    pub mean_ms: f64,
    /// Its longest, milliseconds.
    pub max_ms: f64,
}

/// Turns the benchmark's [`Instant`]s into wall-clock times, which the
/// history's are: one reading of both clocks, taken once.
#[derive(Debug, Clone, Copy)]
pub struct Clock {
    instant: Instant,
    wall: DateTime<Utc>,
}

impl Clock {
    /// Both clocks now.
    pub fn now() -> Self {
        Self {
            instant: Instant::now(),
            wall: Utc::now(),
        }
    }

    /// The wall-clock time of `at`.
    pub fn wall(&self, at: Instant) -> DateTime<Utc> {
        let offset = if at >= self.instant {
            chrono::Duration::from_std(at - self.instant)
        } else {
            chrono::Duration::from_std(self.instant - at).map(|d| -d)
        };
        self.wall + offset.unwrap_or_default()
    }
}

/// One history line, as read for [`gaps`].
pub struct Line {
    /// The order it belongs to.
    pub order_id: String,
    /// Its event.
    pub event: String,
    /// Its step, if any.
    pub step: Option<String>,
    /// When it was written.
    pub at: DateTime<Utc>,
}

/// The gaps of every order of `sent` (stored id to send time), in the
/// order they first appear, from `lines` (every history line of those
/// orders, in any order) and `heard` (stored id to when the client heard
/// of its end).
pub fn gaps(
    lines: Vec<Line>,
    sent: &HashMap<String, DateTime<Utc>>,
    heard: &HashMap<String, DateTime<Utc>>,
) -> Vec<Gap> {
    let mut by_order: HashMap<String, Vec<Line>> = HashMap::new();
    for line in lines {
        by_order
            .entry(line.order_id.clone())
            .or_default()
            .push(line);
    }
    let mut kinds: Vec<String> = Vec::new();
    let mut samples: HashMap<String, Vec<f64>> = HashMap::new();
    let mut add = |between: String, ms: f64| {
        if !samples.contains_key(&between) {
            kinds.push(between.clone());
        }
        samples.entry(between).or_default().push(ms);
    };
    let ms = |from: DateTime<Utc>, to: DateTime<Utc>| {
        (to - from).num_microseconds().unwrap_or(0) as f64 / 1000.0
    };
    let mut ids: Vec<&String> = sent.keys().collect();
    ids.sort();
    for id in ids {
        let Some(mut lines) = by_order.remove(id) else {
            continue;
        };
        lines.sort_by_key(|line| line.at);
        let name = |line: &Line| match &line.step {
            Some(step) => format!("{} {step}", line.event),
            None => line.event.clone(),
        };
        if let Some(first) = lines.first() {
            add(format!("sent -> {}", name(first)), ms(sent[id], first.at));
        }
        for pair in lines.windows(2) {
            add(
                format!("{} -> {}", pair[0].event, name(&pair[1])),
                ms(pair[0].at, pair[1].at),
            );
        }
        if let (Some(last), Some(heard)) = (lines.last(), heard.get(id)) {
            add(format!("{} -> heard", last.event), ms(last.at, *heard));
        }
    }
    kinds
        .into_iter()
        .map(|between| {
            let values = &samples[&between];
            Gap {
                orders: values.len(),
                mean_ms: values.iter().sum::<f64>() / values.len() as f64,
                max_ms: values.iter().copied().fold(0.0, f64::max),
                between,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn line(order: &str, event: &str, step: Option<&str>, ms: i64) -> Line {
        Line {
            order_id: order.into(),
            event: event.into(),
            step: step.map(Into::into),
            at: DateTime::<Utc>::UNIX_EPOCH + chrono::Duration::milliseconds(ms),
        }
    }

    #[test]
    fn each_gap_is_named_by_its_two_lines_and_averaged_over_the_orders() {
        let at = |ms| DateTime::<Utc>::UNIX_EPOCH + chrono::Duration::milliseconds(ms);
        let sent = HashMap::from([("a".to_owned(), at(0)), ("b".to_owned(), at(0))]);
        let heard = HashMap::from([("a".to_owned(), at(130))]);
        let lines = vec![
            line("a", "dispatched", Some("reserve"), 10),
            line("a", "received", None, 4),
            line("a", "processed", None, 120),
            line("b", "received", None, 8),
            line("b", "dispatched", Some("reserve"), 40),
            line("c", "received", None, 1),
        ];
        let gaps = gaps(lines, &sent, &heard);
        let shown: Vec<(&str, usize, f64, f64)> = gaps
            .iter()
            .map(|g| (g.between.as_str(), g.orders, g.mean_ms, g.max_ms))
            .collect();
        assert_eq!(
            shown,
            vec![
                ("sent -> received", 2, 6.0, 8.0),
                ("received -> dispatched reserve", 2, 19.0, 32.0),
                ("dispatched -> processed", 1, 110.0, 110.0),
                ("processed -> heard", 1, 10.0, 10.0),
            ]
        );
    }

    #[test]
    fn the_clock_maps_instants_before_and_after_its_reading() {
        let clock = Clock::now();
        let later = clock.instant + std::time::Duration::from_millis(250);
        assert_eq!(
            clock.wall(later) - clock.wall,
            chrono::Duration::milliseconds(250)
        );
        if let Some(earlier) = clock
            .instant
            .checked_sub(std::time::Duration::from_millis(40))
        {
            assert_eq!(
                clock.wall(earlier) - clock.wall,
                chrono::Duration::milliseconds(-40)
            );
        }
    }
}
