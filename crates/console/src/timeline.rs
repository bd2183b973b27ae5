//! An order's run as a picture: a lane per step, a bar per attempt from its
//! dispatch to its answer, colored by outcome, with the waits between
//! (a line, a backoff) and the moments that concern the whole order
//! (compensation, operators' actions, the end) marked across the lanes.
//!
//! The picture is derived from the history alone, which holds every
//! decision with its step and attempt: [`Timeline::build`] reads it into
//! bars, waits and marks (pure, tested here), and [`svg`] draws them as
//! server-rendered SVG (no script, no Node toolchain).

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use maud::{html, Markup};
use sas_store::machine::HistoryEvent;
use sas_store::reads::queries::HistoryEntry;

/// What became of one attempt: the bar's color.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The remote service did it.
    Succeeded,
    /// The agent reported a failure that may pass: the supervisor retries.
    TransientFailure,
    /// The deadline passed with no answer.
    DeadlineMissed,
    /// The remote service refused for good.
    Failed,
    /// The agent made no call (its start-by passed while it waited).
    NotStarted,
    /// Given up without an answer: an operator cancelled or resubmitted
    /// the order, or a newer attempt took its place (a late answer to it
    /// is ignored as stale).
    Abandoned,
    /// No answer yet.
    InFlight,
}

impl Outcome {
    /// Every outcome, in the legend's order.
    pub const ALL: [Self; 7] = [
        Self::Succeeded,
        Self::TransientFailure,
        Self::DeadlineMissed,
        Self::Failed,
        Self::NotStarted,
        Self::Abandoned,
        Self::InFlight,
    ];

    /// The class the stylesheet colors, and the legend's words.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Succeeded => "succeeded",
            Self::TransientFailure => "transient failure",
            Self::DeadlineMissed => "deadline missed",
            Self::Failed => "failed for good",
            Self::NotStarted => "not started",
            Self::Abandoned => "abandoned",
            Self::InFlight => "in flight",
        }
    }

    fn class(self) -> &'static str {
        match self {
            Self::Succeeded => "ok",
            Self::TransientFailure => "transient",
            Self::DeadlineMissed => "missed",
            Self::Failed => "failed",
            Self::NotStarted => "unstarted",
            Self::Abandoned => "abandoned",
            Self::InFlight => "flight",
        }
    }

    fn color(self) -> &'static str {
        match self {
            Self::Succeeded => "#2e7d32",
            Self::TransientFailure => "#f2a900",
            Self::DeadlineMissed => "#e65100",
            Self::Failed => "#c62828",
            Self::NotStarted => "#9e9e9e",
            Self::Abandoned => "#8d6e63",
            Self::InFlight => "#1e63b5",
        }
    }
}

/// Whether an attempt ran the step's action or its undo.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// The step's action, forward.
    Action,
    /// The step's compensation.
    Undo,
}

/// One attempt: a bar in its step's lane.
#[derive(Debug, Clone, PartialEq)]
pub struct Bar {
    /// The step's lane, from 0.
    pub lane: usize,
    /// Action or undo.
    pub direction: Direction,
    /// The attempt's number in its lane and direction, from 1.
    pub number: u32,
    /// Dispatched.
    pub start: DateTime<Utc>,
    /// Answered, given up, or now while in flight.
    pub end: DateTime<Utc>,
    /// What became of it.
    pub outcome: Outcome,
    /// The answer's detail or error.
    pub detail: Option<String>,
}

/// Why a step waited between attempts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitKind {
    /// In its agent's line for a free slot (admission control).
    Line,
    /// In backoff after a missed deadline or a failure.
    Backoff,
    /// A wait or delay step parked for its event or its time.
    Parked,
    /// An undo held until its action can no longer land (its deadline and
    /// the grace period).
    UndoHeld,
}

impl WaitKind {
    /// The line's class, dash pattern and title.
    fn style(self) -> (&'static str, &'static str, &'static str) {
        match self {
            Self::Line => ("line", "2 3", "waiting in its agent's line"),
            Self::Backoff => ("backoff", "6 3", "backoff before the next attempt"),
            Self::Parked => ("parked", "1 1", "waiting for its event or its time"),
            Self::UndoHeld => (
                "undo-held",
                "8 2 2 2",
                "undo held until its action can no longer land",
            ),
        }
    }
}

/// A stretch of time a step spent waiting: a thin line in its lane.
#[derive(Debug, Clone, PartialEq)]
pub struct Wait {
    /// The step's lane.
    pub lane: usize,
    /// Why it waited.
    pub kind: WaitKind,
    /// From.
    pub start: DateTime<Utc>,
    /// Until its next dispatch, or now.
    pub end: DateTime<Utc>,
}

/// What a mark says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkKind {
    /// The order was stored.
    Received,
    /// A retry was scheduled for a step (drawn in its lane).
    Retry,
    /// A reply for an attempt no longer current was ignored (in its lane).
    Stale,
    /// The order started undoing what it had done.
    Compensation,
    /// An operator acted (resubmit, resume, cancel, an alert or dead letter handled).
    Operator,
    /// The order ended: processed, compensated or in error.
    End,
    /// A wait step's timeout passed without its event.
    TimedOut,
    /// A child order the step waits for stopped in error (in its lane).
    ChildStopped,
    /// A line of a step the plan no longer names (a version move renamed
    /// or dropped it): no lane to draw it in, so across them, named.
    Unplaced,
}

/// A moment: across every lane, or in one lane when it concerns one step.
#[derive(Debug, Clone, PartialEq)]
pub struct Mark {
    /// When.
    pub at: DateTime<Utc>,
    /// What kind of moment.
    pub kind: MarkKind,
    /// The step's lane, when it concerns one step.
    pub lane: Option<usize>,
    /// The history's event.
    pub label: String,
    /// Who decided, and why.
    pub detail: String,
}

/// Everything the picture shows, read from an order's history.
#[derive(Debug, Clone, PartialEq)]
pub struct Timeline {
    /// The lanes' step names, in workflow order.
    pub lanes: Vec<String>,
    /// Every attempt.
    pub bars: Vec<Bar>,
    /// Every wait between attempts.
    pub waits: Vec<Wait>,
    /// Every moment worth a mark.
    pub marks: Vec<Mark>,
    /// The picture's first instant (the first history line).
    pub start: DateTime<Utc>,
    /// Its last: the last history line, or now while the order runs.
    pub end: DateTime<Utc>,
}

impl Timeline {
    /// Reads `history` (oldest first) into bars, waits and marks, one lane
    /// per name in `steps` (workflow order). Attempts still open are drawn
    /// up to `now` when `running`, else up to the last history line.
    pub fn build(
        steps: &[String],
        history: &[HistoryEntry],
        now: DateTime<Utc>,
        running: bool,
    ) -> Self {
        let lane_of: HashMap<&str, usize> = steps
            .iter()
            .enumerate()
            .map(|(i, name)| (name.as_str(), i))
            .collect();
        let start = history.first().map_or(now, |h| h.at);
        let last = history.last().map_or(now, |h| h.at);
        let end = if running { now.max(last) } else { last };
        let mut builder = Builder {
            bars: Vec::new(),
            open: HashMap::new(),
            waiting: HashMap::new(),
            waits: Vec::new(),
            marks: Vec::new(),
        };
        for entry in history {
            let lane = entry.step.as_deref().and_then(|s| lane_of.get(s).copied());
            builder.read(entry, lane);
        }
        for (_, index) in builder.open.drain() {
            builder.bars[index].end = end;
        }
        for (lane, (kind, from)) in builder.waiting.drain() {
            builder.waits.push(Wait {
                lane,
                kind,
                start: from,
                end,
            });
        }
        builder.waits.sort_by_key(|w| (w.start, w.lane));
        Self {
            lanes: steps.to_vec(),
            bars: builder.bars,
            waits: builder.waits,
            marks: builder.marks,
            start,
            end,
        }
    }
}

/// The reading state: the attempt open in each lane, the wait begun in each.
struct Builder {
    bars: Vec<Bar>,
    open: HashMap<usize, usize>,
    waiting: HashMap<usize, (WaitKind, DateTime<Utc>)>,
    waits: Vec<Wait>,
    marks: Vec<Mark>,
}

impl Builder {
    fn read(&mut self, entry: &HistoryEntry, lane: Option<usize>) {
        use HistoryEvent as E;
        let detail = entry.detail.clone();
        match (entry.event, lane) {
            (E::Dispatched | E::CompensationDispatched, Some(lane)) => self.dispatch(entry, lane),
            (E::StepCompleted | E::StepCompensated, Some(lane)) => {
                self.close(lane, entry.at, Outcome::Succeeded, detail);
            }
            (E::TransientFailure, Some(lane)) => {
                self.close(lane, entry.at, Outcome::TransientFailure, detail);
                self.waiting.insert(lane, (WaitKind::Backoff, entry.at));
            }
            (E::NotStarted, Some(lane)) => {
                self.close(lane, entry.at, Outcome::NotStarted, detail);
            }
            (E::Queued, Some(lane)) => {
                self.waiting
                    .entry(lane)
                    .or_insert((WaitKind::Line, entry.at));
            }
            (E::RetryScheduled | E::CompensationRetryScheduled, lane) => {
                if let Some(lane) = lane {
                    self.close(lane, entry.at, Outcome::DeadlineMissed, detail.clone());
                    self.waiting.insert(lane, (WaitKind::Backoff, entry.at));
                }
                self.mark(entry, MarkKind::Retry, lane);
            }
            (E::StaleReply, lane) => self.mark(entry, MarkKind::Stale, lane),
            (E::ChildStopped, lane) => self.mark(entry, MarkKind::ChildStopped, lane),
            (E::CompensationStarted | E::Error, lane) => {
                self.stop_going_forward(entry, lane, detail)
            }
            (E::Received, _) => self.mark(entry, MarkKind::Received, None),
            (E::Processed | E::Compensated, _) => self.mark(entry, MarkKind::End, None),
            (E::Resubmitted | E::Resumed | E::Cancelled | E::UndoneForParent, _) => {
                self.abandon_in_flight(entry.at);
                self.mark(entry, MarkKind::Operator, None);
            }
            (
                E::AlertAcknowledged
                | E::AlertResolved
                | E::DeadLetterReplayed
                | E::DeadLetterDiscarded
                | E::EventRefused
                | E::Moved,
                _,
            ) => self.mark(entry, MarkKind::Operator, None),
            // A child step's lane waits for its child order, forward or
            // undoing it.
            (E::Waiting | E::ChildStarted | E::ChildUndoRequested, Some(lane)) => {
                self.waiting.insert(lane, (WaitKind::Parked, entry.at));
            }
            (E::UndoWaits, Some(lane)) => {
                self.waiting.insert(lane, (WaitKind::UndoHeld, entry.at));
            }
            (E::WaitEnded | E::ChildEnded, Some(lane)) => self.end_wait(lane, entry.at),
            (E::WaitTimedOut, lane) => {
                if let Some(lane) = lane {
                    self.end_wait(lane, entry.at);
                }
                self.mark(entry, MarkKind::TimedOut, lane);
            }
            // An answer after the order gave the attempt up: beside its bar.
            (E::LateAnswer, lane) => self.mark(entry, MarkKind::Stale, lane),
            // A claim only precedes what it starts (a dispatch, a wait).
            (E::Claimed, _) => {}
            // Step events of a step the plan no longer names (a version
            // move renamed or dropped it): no lane to draw them in.
            (
                E::Dispatched
                | E::CompensationDispatched
                | E::StepCompleted
                | E::StepCompensated
                | E::TransientFailure
                | E::NotStarted
                | E::Queued
                | E::Waiting
                | E::UndoWaits
                | E::WaitEnded
                | E::ChildStarted
                | E::ChildEnded
                | E::ChildUndoRequested,
                None,
            ) => {
                let mut unplaced = entry.clone();
                if let Some(step) = &entry.step {
                    unplaced.detail = Some(match &entry.detail {
                        Some(text) => format!("step {step}, no longer in the plan: {text}"),
                        None => format!("step {step}, no longer in the plan"),
                    });
                }
                self.mark(&unplaced, MarkKind::Unplaced, None);
            }
        }
    }

    /// A dispatch in `lane`: ends the attempt still open there (given up)
    /// and the wait before it, and opens a bar for the new attempt.
    fn dispatch(&mut self, entry: &HistoryEntry, lane: usize) {
        self.close(lane, entry.at, Outcome::Abandoned, None);
        self.end_wait(lane, entry.at);
        let direction = if entry.event == HistoryEvent::Dispatched {
            Direction::Action
        } else {
            Direction::Undo
        };
        let number = 1 + self
            .bars
            .iter()
            .filter(|b| b.lane == lane && b.direction == direction)
            .count() as u32;
        self.open.insert(lane, self.bars.len());
        self.bars.push(Bar {
            lane,
            direction,
            number,
            start: entry.at,
            end: entry.at,
            outcome: Outcome::InFlight,
            detail: None,
        });
    }

    /// The order stops going forward (its compensation starts, or it ends
    /// in error): ends the step's open attempt and its wait, and marks the
    /// moment across the lanes.
    fn stop_going_forward(
        &mut self,
        entry: &HistoryEntry,
        lane: Option<usize>,
        detail: Option<String>,
    ) {
        // A permanent refusal names the attempt it ends; a deadline
        // given up on ends the lane's open attempt.
        if let Some(lane) = lane {
            let outcome = if entry.attempt_id.is_some() {
                Outcome::Failed
            } else {
                Outcome::DeadlineMissed
            };
            self.close(lane, entry.at, outcome, detail);
            self.waiting.remove(&lane);
        }
        let kind = if entry.event == HistoryEvent::Error {
            MarkKind::End
        } else {
            MarkKind::Compensation
        };
        self.mark(entry, kind, None);
    }

    /// A wait in `lane` ended at `at`: its line is drawn up to then.
    fn end_wait(&mut self, lane: usize, at: DateTime<Utc>) {
        if let Some((kind, from)) = self.waiting.remove(&lane) {
            self.waits.push(Wait {
                lane,
                kind,
                start: from,
                end: at,
            });
        }
    }

    /// An operator resubmitted, resumed or cancelled the order: what was in flight
    /// is given up at `at`, and its answer will be stale.
    fn abandon_in_flight(&mut self, at: DateTime<Utc>) {
        let open: Vec<usize> = self.open.keys().copied().collect();
        for lane in open {
            self.close(lane, at, Outcome::Abandoned, None);
        }
    }

    /// Ends the attempt open in `lane`, if one is.
    fn close(&mut self, lane: usize, at: DateTime<Utc>, outcome: Outcome, detail: Option<String>) {
        if let Some(index) = self.open.remove(&lane) {
            let bar = &mut self.bars[index];
            bar.end = at;
            bar.outcome = outcome;
            bar.detail = detail;
        }
    }

    fn mark(&mut self, entry: &HistoryEntry, kind: MarkKind, lane: Option<usize>) {
        let mut detail = format!("by {}", entry.actor);
        if let Some(text) = &entry.detail {
            detail.push_str(": ");
            detail.push_str(text);
        }
        self.marks.push(Mark {
            at: entry.at,
            kind,
            lane,
            label: entry.event.as_str().to_owned(),
            detail,
        });
    }
}

/// Layout of the picture, in SVG units (pixels at 100%).
const WIDTH: f64 = 1000.0;
const LABELS: f64 = 150.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 46.0;
const LANE: f64 = 30.0;
const AXIS: f64 = 26.0;

/// Steps of the time axis to choose from, in milliseconds.
const TICKS_MS: [i64; 24] = [
    1, 2, 5, 10, 20, 50, 100, 200, 500, 1_000, 2_000, 5_000, 10_000, 15_000, 30_000, 60_000,
    120_000, 300_000, 600_000, 900_000, 1_800_000, 3_600_000, 21_600_000, 86_400_000,
];

/// The time axis: where an instant falls, and the ticks to label.
struct Scale {
    start: DateTime<Utc>,
    span_ms: f64,
}

impl Scale {
    fn x(&self, at: DateTime<Utc>) -> f64 {
        let ms = (at - self.start).num_microseconds().unwrap_or(0) as f64 / 1000.0;
        LABELS + (ms / self.span_ms).clamp(0.0, 1.0) * (WIDTH - LABELS - RIGHT)
    }

    /// A round step giving at most 10 ticks.
    fn tick_ms(&self) -> i64 {
        TICKS_MS
            .iter()
            .copied()
            .find(|step| self.span_ms / (*step as f64) <= 10.0)
            .unwrap_or(86_400_000)
    }
}

/// An offset from the order's first instant, as the axis labels it.
pub fn offset_label(ms: i64) -> String {
    match ms {
        0 => "0".to_owned(),
        ms if ms < 1_000 => format!("+{ms} ms"),
        ms if ms < 60_000 => format!("+{} s", trim(ms as f64 / 1000.0)),
        ms if ms < 3_600_000 => format!("+{} min", trim(ms as f64 / 60_000.0)),
        ms => format!("+{} h", trim(ms as f64 / 3_600_000.0)),
    }
}

fn trim(value: f64) -> String {
    let text = format!("{value:.1}");
    text.strip_suffix(".0").map_or(text.clone(), str::to_owned)
}

/// A duration as a bar's tooltip says it.
fn duration_label(from: DateTime<Utc>, to: DateTime<Utc>) -> String {
    let ms = (to - from).num_milliseconds();
    if ms < 1_000 {
        format!("{ms} ms")
    } else {
        format!("{} s", trim(ms as f64 / 1000.0))
    }
}

/// Draws `timeline` as an SVG: lanes, bars, waits, marks, the time axis
/// and a legend.
pub fn svg(timeline: &Timeline) -> Markup {
    let span_ms = ((timeline.end - timeline.start)
        .num_microseconds()
        .unwrap_or(0) as f64
        / 1000.0)
        .max(1.0);
    let scale = Scale {
        start: timeline.start,
        span_ms,
    };
    let lanes = timeline.lanes.len().max(1);
    let bottom = TOP + LANE * lanes as f64;
    let height = bottom + AXIS + 24.0;
    html! {
        svg.timeline xmlns="http://www.w3.org/2000/svg" width=(WIDTH) height=(height)
            viewBox={ "0 0 " (WIDTH) " " (height) } role="img"
            aria-label={ "timeline of " (timeline.lanes.len()) " steps, " (timeline.bars.len()) " attempts" } {
            (draw_lanes(timeline))
            (draw_time_axis(timeline, &scale, bottom))
            (draw_waits(timeline, &scale))
            (draw_attempts(timeline, &scale))
            (draw_marks(timeline, &scale, bottom))
        }
    }
}

/// The lanes, shaded alternately, with the step's name.
fn draw_lanes(timeline: &Timeline) -> Markup {
    html! {
        @for (i, name) in timeline.lanes.iter().enumerate() {
            @let y = TOP + LANE * i as f64;
            rect.lane x="0" y=(y) width=(WIDTH) height=(LANE) fill=(if i % 2 == 0 { "#f4f6f9" } else { "#ffffff" }) {}
            text x="6" y=(y + LANE / 2.0 + 4.0) font-size="12" fill="#1d232a" { (name) }
        }
    }
}

/// The time axis under the lanes (at `bottom`): a gridline and an offset
/// per tick, and the instant the offsets count from.
fn draw_time_axis(timeline: &Timeline, scale: &Scale, bottom: f64) -> Markup {
    let tick = scale.tick_ms();
    let ticks: Vec<i64> = (0..)
        .map(|i| i * tick)
        .take_while(|ms| (*ms as f64) <= scale.span_ms)
        .collect();
    html! {
        @for ms in &ticks {
            @let x = scale.x(timeline.start + chrono::Duration::milliseconds(*ms));
            line x1=(x) y1=(TOP) x2=(x) y2=(bottom) stroke="#d5d9de" stroke-width="1" {}
            text x=(x) y=(bottom + 16.0) font-size="11" text-anchor="middle" fill="#66707a" { (offset_label(*ms)) }
        }
        line x1=(LABELS) y1=(bottom) x2=(WIDTH - RIGHT) y2=(bottom) stroke="#9aa5b1" {}
        text x=(LABELS) y=(bottom + AXIS + 8.0) font-size="11" fill="#66707a" {
            "time since received, " (timeline.start.format("%Y-%m-%d %H:%M:%S%.3f UTC"))
        }
    }
}

/// The waits: a thin line, dashed as its kind says ([`WaitKind::style`]).
fn draw_waits(timeline: &Timeline, scale: &Scale) -> Markup {
    html! {
        @for wait in &timeline.waits {
            @let y = TOP + LANE * wait.lane as f64 + LANE / 2.0;
            @let (class, dashes, title) = wait.kind.style();
            line class={ "wait " (class) }
                x1=(scale.x(wait.start)) y1=(y) x2=(scale.x(wait.end)) y2=(y)
                stroke="#7a8591" stroke-width="2"
                stroke-dasharray=(dashes) {
                title { (title) ", " (duration_label(wait.start, wait.end)) }
            }
        }
    }
}

/// The attempts: actions in the lane's upper half, undos in its lower
/// half, outlined; each colored by its outcome.
fn draw_attempts(timeline: &Timeline, scale: &Scale) -> Markup {
    html! {
        @for bar in &timeline.bars {
            @let lane_y = TOP + LANE * bar.lane as f64;
            @let (y, h) = if bar.direction == Direction::Action { (lane_y + 4.0, 12.0) } else { (lane_y + 16.0, 10.0) };
            @let x = scale.x(bar.start);
            @let w = (scale.x(bar.end) - x).max(3.0);
            rect class={ "attempt " (bar.outcome.class()) @if bar.direction == Direction::Undo { " undo" } }
                data-lane=(bar.lane) x=(x) y=(y) width=(w) height=(h) rx="2"
                fill=(bar.outcome.color())
                stroke=(if bar.direction == Direction::Undo { "#5b2a86" } else { "none" }) stroke-width="1.5" {
                title {
                    (timeline.lanes.get(bar.lane).map_or("", String::as_str))
                    @if bar.direction == Direction::Undo { " undo" }
                    " attempt " (bar.number) ": " (bar.outcome.as_str()) ", " (duration_label(bar.start, bar.end))
                    @if let Some(detail) = &bar.detail { " (" (detail) ")" }
                }
            }
            @if w >= 22.0 && bar.direction == Direction::Action {
                text x=(x + 3.0) y=(y + 10.0) font-size="9" fill="#fff" { "#" (bar.number) }
            }
        }
    }
}

/// The moments: in a lane, a small triangle; for the whole order, a line
/// across the lanes down to `bottom` with its label above, staggered when
/// close.
fn draw_marks(timeline: &Timeline, scale: &Scale, bottom: f64) -> Markup {
    let rows = label_rows(timeline, scale);
    html! {
        @for (i, mark) in timeline.marks.iter().enumerate() {
            @let x = scale.x(mark.at);
            @let color = mark_color(mark.kind);
            @if let Some(lane) = mark.lane {
                @let y = TOP + LANE * lane as f64 + 2.0;
                path class="mark in-lane" d={ "M" (x - 4.0) " " (y) " L" (x + 4.0) " " (y) " L" (x) " " (y + 6.0) " Z" } fill=(color) {
                    title { (mark.label) " " (mark.detail) }
                }
            } @else {
                @let row = rows[i];
                g class="mark order" data-event=(mark.label) {
                    title { (mark.label) " " (mark.detail) }
                    line x1=(x) y1=(row + 4.0) x2=(x) y2=(bottom) stroke=(color) stroke-width="1.5"
                        stroke-dasharray=(if mark.kind == MarkKind::Operator { "4 2" } else { "none" }) {}
                    text x=(x) y=(row) font-size="11" fill=(color)
                        text-anchor=(if x > WIDTH - 120.0 { "end" } else { "middle" }) { (mark.label) }
                }
            }
        }
    }
}

/// The height of each order-wide mark's label: the first of three rows
/// where it does not run into the label before it (marks in a lane get none).
fn label_rows(timeline: &Timeline, scale: &Scale) -> Vec<f64> {
    const ROWS: [f64; 3] = [12.0, 26.0, 40.0];
    let mut ends = [f64::MIN; 3];
    timeline
        .marks
        .iter()
        .map(|mark| {
            let x = scale.x(mark.at);
            let half = mark.label.len() as f64 * 3.3 + 4.0;
            let row = (0..ROWS.len())
                .find(|r| x - half > ends[*r])
                .unwrap_or_else(|| {
                    (0..ROWS.len())
                        .min_by(|a, b| ends[*a].total_cmp(&ends[*b]))
                        .unwrap_or(0)
                });
            if mark.lane.is_none() {
                ends[row] = x + half;
            }
            ROWS[row]
        })
        .collect()
}

fn mark_color(kind: MarkKind) -> &'static str {
    match kind {
        MarkKind::Received => "#66707a",
        MarkKind::Retry => "#e65100",
        MarkKind::Stale => "#9e9e9e",
        MarkKind::Compensation => "#c62828",
        MarkKind::Operator => "#6a1b9a",
        MarkKind::End => "#1d232a",
        MarkKind::TimedOut => "#f2a900",
        MarkKind::ChildStopped => "#ad1457",
        MarkKind::Unplaced => "#8d6e63",
    }
}

/// The legend under the picture: the bars' colors and the marks' shapes.
pub fn legend() -> Markup {
    html! {
        p.legend {
            @for outcome in Outcome::ALL {
                span.key { span.swatch style={ "background:" (outcome.color()) } {} (outcome.as_str()) }
            }
            span.key { span.swatch.undo {} "undo (lower half, outlined)" }
            span.key { "┈ waiting in line, ╌ backoff, ┄ parked at a wait or delay, undo held" }
            span.key { span style={ "color:" (mark_color(MarkKind::Retry)) } { "▼" } " retry scheduled" }
            span.key { span style={ "color:" (mark_color(MarkKind::Operator)) } { "┆" } " operator action" }
            span.key { span style={ "color:" (mark_color(MarkKind::ChildStopped)) } { "▼" } " child order stopped in error" }
            span.key { span style={ "color:" (mark_color(MarkKind::Unplaced)) } { "┆" } " a step no longer in the plan (moved)" }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    fn at(ms: i64) -> DateTime<Utc> {
        DateTime::from_timestamp_millis(1_700_000_000_000 + ms).unwrap()
    }

    fn line(
        ms: i64,
        event: HistoryEvent,
        step: Option<&str>,
        attempt: Option<u128>,
    ) -> HistoryEntry {
        HistoryEntry {
            at: at(ms),
            actor: "scheduler-1".into(),
            event,
            step: step.map(str::to_owned),
            attempt_id: attempt.map(Uuid::from_u128),
            detail: None,
        }
    }

    fn steps() -> Vec<String> {
        ["reserve", "charge", "ship"].map(String::from).to_vec()
    }

    #[test]
    fn a_processed_order_has_one_succeeded_bar_per_step() {
        use HistoryEvent as E;
        let history = vec![
            line(0, E::Received, None, None),
            line(5, E::Dispatched, Some("reserve"), Some(1)),
            line(30, E::StepCompleted, Some("reserve"), Some(1)),
            line(31, E::Dispatched, Some("charge"), Some(2)),
            line(60, E::StepCompleted, Some("charge"), Some(2)),
            line(61, E::Dispatched, Some("ship"), Some(3)),
            line(90, E::StepCompleted, Some("ship"), Some(3)),
            line(90, E::Processed, None, None),
        ];
        let timeline = Timeline::build(&steps(), &history, at(10_000), false);
        assert_eq!(
            timeline.end,
            at(90),
            "an ended order ends at its last line, not now"
        );
        let lanes: Vec<_> = timeline
            .bars
            .iter()
            .map(|b| (b.lane, b.outcome, b.number))
            .collect();
        assert_eq!(
            lanes,
            vec![
                (0, Outcome::Succeeded, 1),
                (1, Outcome::Succeeded, 1),
                (2, Outcome::Succeeded, 1)
            ]
        );
        assert_eq!(timeline.bars[1].start, at(31));
        assert_eq!(timeline.bars[1].end, at(60));
        let marks: Vec<_> = timeline.marks.iter().map(|m| m.kind).collect();
        assert_eq!(marks, vec![MarkKind::Received, MarkKind::End]);
        assert!(timeline.waits.is_empty());
    }

    #[test]
    fn retries_waits_failures_and_undos_are_read_from_the_history() {
        use HistoryEvent as E;
        let history = vec![
            line(0, E::Received, None, None),
            line(1, E::Dispatched, Some("reserve"), Some(1)),
            line(20, E::StepCompleted, Some("reserve"), Some(1)),
            line(21, E::Queued, Some("charge"), None),
            line(400, E::Dispatched, Some("charge"), Some(2)),
            line(900, E::RetryScheduled, Some("charge"), None),
            line(1_500, E::Dispatched, Some("charge"), Some(3)),
            line(1_600, E::TransientFailure, Some("charge"), Some(3)),
            line(2_000, E::Dispatched, Some("charge"), Some(4)),
            line(2_100, E::CompensationStarted, Some("charge"), Some(4)),
            line(2_101, E::CompensationDispatched, Some("reserve"), Some(5)),
            line(2_150, E::StaleReply, Some("charge"), Some(2)),
            line(2_200, E::StepCompensated, Some("reserve"), Some(5)),
            line(2_200, E::Compensated, None, None),
            line(5_000, E::Resubmitted, None, None),
        ];
        let timeline = Timeline::build(&steps(), &history, at(6_000), true);
        let charge: Vec<_> = timeline
            .bars
            .iter()
            .filter(|b| b.lane == 1)
            .map(|b| (b.number, b.outcome))
            .collect();
        assert_eq!(
            charge,
            vec![
                (1, Outcome::DeadlineMissed),
                (2, Outcome::TransientFailure),
                (3, Outcome::Failed)
            ]
        );
        let undo = timeline
            .bars
            .iter()
            .find(|b| b.direction == Direction::Undo)
            .unwrap();
        assert_eq!(
            (undo.lane, undo.number, undo.outcome),
            (0, 1, Outcome::Succeeded)
        );
        let waits: Vec<_> = timeline
            .waits
            .iter()
            .map(|w| (w.lane, w.kind, w.start, w.end))
            .collect();
        assert_eq!(
            waits,
            vec![
                (1, WaitKind::Line, at(21), at(400)),
                (1, WaitKind::Backoff, at(900), at(1_500)),
                (1, WaitKind::Backoff, at(1_600), at(2_000)),
            ]
        );
        let marks: Vec<_> = timeline.marks.iter().map(|m| (m.kind, m.lane)).collect();
        assert_eq!(
            marks,
            vec![
                (MarkKind::Received, None),
                (MarkKind::Retry, Some(1)),
                (MarkKind::Compensation, None),
                (MarkKind::Stale, Some(1)),
                (MarkKind::End, None),
                (MarkKind::Operator, None),
            ]
        );
        assert_eq!(
            timeline.end,
            at(6_000),
            "a running order is drawn up to now"
        );
    }

    #[test]
    fn a_cancel_abandons_the_attempt_in_flight() {
        use HistoryEvent as E;
        let history = vec![
            line(0, E::Received, None, None),
            line(10, E::Dispatched, Some("reserve"), Some(1)),
            line(500, E::Cancelled, None, None),
            line(900, E::StaleReply, Some("reserve"), Some(1)),
            line(1_000, E::CompensationDispatched, Some("reserve"), Some(2)),
        ];
        let timeline = Timeline::build(&steps(), &history, at(1_200), true);
        let bars: Vec<_> = timeline
            .bars
            .iter()
            .map(|b| (b.direction, b.outcome, b.end))
            .collect();
        assert_eq!(
            bars,
            vec![
                (Direction::Action, Outcome::Abandoned, at(500)),
                (Direction::Undo, Outcome::InFlight, at(1_200)),
            ]
        );
    }

    #[test]
    fn an_attempt_without_an_answer_is_in_flight_up_to_now() {
        use HistoryEvent as E;
        let history = vec![
            line(0, E::Received, None, None),
            line(10, E::Dispatched, Some("reserve"), Some(1)),
        ];
        let timeline = Timeline::build(&steps(), &history, at(3_000), true);
        assert_eq!(timeline.bars.len(), 1);
        assert_eq!(timeline.bars[0].outcome, Outcome::InFlight);
        assert_eq!(timeline.bars[0].end, at(3_000));
    }

    #[test]
    fn the_picture_has_a_lane_per_step_a_bar_per_attempt_and_a_labelled_axis() {
        use HistoryEvent as E;
        let history = vec![
            line(0, E::Received, None, None),
            line(5, E::Dispatched, Some("reserve"), Some(1)),
            line(2_500, E::StepCompleted, Some("reserve"), Some(1)),
            line(2_600, E::Dispatched, Some("charge"), Some(2)),
        ];
        let timeline = Timeline::build(&steps(), &history, at(4_000), true);
        let drawn = svg(&timeline).into_string();
        assert_eq!(drawn.matches("class=\"lane\"").count(), 3);
        assert_eq!(drawn.matches("class=\"attempt ").count(), 2);
        assert!(drawn.contains("class=\"attempt ok\""), "{drawn}");
        assert!(drawn.contains("class=\"attempt flight\""), "{drawn}");
        // 4 s at a tick of 500 ms: 0 to +4 s, nine labels.
        assert!(drawn.contains(">+3.5 s<"), "{drawn}");
        assert!(drawn.contains(">+4 s<"), "{drawn}");
    }

    #[test]
    fn axis_labels_read_as_offsets() {
        assert_eq!(offset_label(0), "0");
        assert_eq!(offset_label(200), "+200 ms");
        assert_eq!(offset_label(1_500), "+1.5 s");
        assert_eq!(offset_label(120_000), "+2 min");
        assert_eq!(offset_label(5_400_000), "+1.5 h");
    }

    #[test]
    fn waits_undo_holds_moves_and_timeouts_are_drawn_not_swallowed() {
        use HistoryEvent as E;
        // reserve, then a wait for approval (lane 1) ended by its event,
        // moved to a new version, then a second wait (the charge lane used
        // as one) timed out; the reservation's undo held, then sent.
        let history = vec![
            line(0, E::Received, None, None),
            line(5, E::Dispatched, Some("reserve"), Some(1)),
            line(30, E::StepCompleted, Some("reserve"), Some(1)),
            line(31, E::Waiting, Some("charge"), None),
            // A step of the old version, which the plan no longer names.
            line(40, E::Queued, Some("gift_wrap"), None),
            line(50, E::Moved, None, None),
            line(80, E::WaitEnded, Some("charge"), None),
            line(81, E::Waiting, Some("ship"), None),
            line(200, E::WaitTimedOut, Some("ship"), None),
            line(200, E::CompensationStarted, Some("ship"), None),
            line(201, E::UndoWaits, Some("reserve"), None),
            line(260, E::CompensationDispatched, Some("reserve"), Some(4)),
            line(290, E::StepCompensated, Some("reserve"), Some(4)),
            line(290, E::Compensated, None, None),
        ];
        let timeline = Timeline::build(&steps(), &history, at(10_000), false);
        let waits: Vec<_> = timeline
            .waits
            .iter()
            .map(|w| (w.lane, w.kind, w.start, w.end))
            .collect();
        assert_eq!(
            waits,
            vec![
                (1, WaitKind::Parked, at(31), at(80)),
                (2, WaitKind::Parked, at(81), at(200)),
                (0, WaitKind::UndoHeld, at(201), at(260)),
            ]
        );
        let marks: Vec<_> = timeline.marks.iter().map(|m| (m.kind, m.lane)).collect();
        assert!(
            marks.contains(&(MarkKind::Operator, None)),
            "the move: {marks:?}"
        );
        assert!(marks.contains(&(MarkKind::TimedOut, Some(2))), "{marks:?}");
        let unplaced = timeline
            .marks
            .iter()
            .find(|m| m.kind == MarkKind::Unplaced)
            .expect("the dropped step's line is drawn");
        assert_eq!(
            (unplaced.lane, unplaced.label.as_str()),
            (None, "waiting_for_admission")
        );
        assert!(
            unplaced
                .detail
                .contains("step gift_wrap, no longer in the plan"),
            "{}",
            unplaced.detail
        );
        let svg = svg(&timeline).into_string();
        assert!(svg.contains("waiting for its event or its time"), "{svg}");
        assert!(svg.contains("undo held until its action can no longer land"));
    }

    #[test]
    fn a_child_that_stopped_in_error_is_marked_in_its_step_s_lane_which_waits_on() {
        use HistoryEvent as E;
        let history = vec![
            line(0, E::Received, None, None),
            line(1, E::Dispatched, Some("reserve"), Some(1)),
            line(20, E::StepCompleted, Some("reserve"), Some(1)),
            line(21, E::ChildStarted, Some("charge"), Some(2)),
            line(90, E::ChildStopped, Some("charge"), None),
        ];
        let timeline = Timeline::build(&steps(), &history, at(200), false);
        let marks: Vec<_> = timeline.marks.iter().map(|m| (m.kind, m.lane)).collect();
        assert!(
            marks.contains(&(MarkKind::ChildStopped, Some(1))),
            "{marks:?}"
        );
        let waits: Vec<_> = timeline.waits.iter().map(|w| (w.lane, w.kind)).collect();
        assert_eq!(waits, vec![(1, WaitKind::Parked)], "still waiting for it");
    }
}
