//! The rules: one function per event, sharing a [`Draft`] that collects
//! the changes and turns them into a [`Decision`]. One module per kind of
//! step ([`super::kind::Kind`]), holding what that kind does on each event
//! it receives: [`call`] (its start, an agent's reply, a missed deadline, a
//! dead letter), [`wait`], [`delay`], [`child`]; what the parked kinds
//! share is in [`park`]. The events every kind meets have modules of their
//! own: [`start`] (intake, claims), [`operator`] (resubmit, resume,
//! cancel), [`moved`] (a version move), [`group`] (steps that run side by
//! side). A new kind is one variant of `Kind` and one module here: the
//! compiler lists every match that must name it.

mod call;
mod child;
mod delay;
mod group;
mod moved;
mod operator;
mod park;
mod start;
mod wait;

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};

use sas_messages::{AttemptId, StatusEvent, StepKind, StepReply};

use super::kind::Kind;
use super::undo::undo_not_before;
use super::{
    admission_delta, status, AdmissionDelta, AlertKind, Context, Decision, Event, HistoryEvent,
    HistoryLine, NewAlert, ProcessRow, Snapshot, StepChange, StepRow, Verdict,
};
use crate::model::{ProcessState, Progress, StepState};

/// Decides what `event` does to the order in `snapshot`. Pure: the same
/// inputs always give the same decision.
pub fn decide(snapshot: &Snapshot, event: &Event<'_>, ctx: &Context<'_>) -> Decision {
    let mut draft = Draft::new(snapshot, ctx);
    match *event {
        Event::Submitted => start::submitted(&mut draft),
        Event::Claimed => start::claimed(&mut draft),
        Event::Reply(reply) => call::replied(&mut draft, reply),
        Event::DeadlineMissed { policy, jitter } => {
            call::deadline_missed(&mut draft, policy, jitter)
        }
        Event::DeadLettered {
            attempt_id,
            reason,
            no_call,
        } => call::dead_lettered(&mut draft, attempt_id, reason, no_call),
        Event::Resubmitted { earlier } => operator::resubmitted(&mut draft, earlier),
        Event::Resumed { reason, earlier } => operator::resumed(&mut draft, reason, earlier),
        Event::Cancelled { reason } => operator::cancelled(&mut draft, reason),
        Event::EventArrived => wait::event_arrived(&mut draft),
        Event::Moved {
            plan,
            mapping,
            from,
            to,
        } => moved::moved(&mut draft, plan, mapping, (from, to)),
        Event::ChildEnded {
            step,
            child,
            state,
            results,
        } => child::ended(&mut draft, (step, child), state, results),
        Event::UndoneForParent { reason } => child::undone_for_parent(&mut draft, reason),
        Event::ChildRefused { step, reason } => child::refused(&mut draft, step, reason),
        Event::ChildStopped {
            step,
            child,
            reason,
        } => child::stopped(&mut draft, (step, child), reason),
    }
    draft.finish()
}

/// Why an order ends in `error`, as each record says it.
struct Failure<'a> {
    /// The step that could not be undone.
    step: Option<&'a str>,
    /// Its attempt, when one message settled it.
    attempt_id: Option<AttemptId>,
    /// The alert's kind.
    kind: AlertKind,
    /// The history line's detail.
    detail: String,
    /// The order's `last_error`.
    last_error: &'a str,
    /// The alert's message and the `failed` status's detail.
    message: &'a str,
}

/// A decision being made: the order's rows as they will be, and what to
/// record and publish.
struct Draft<'a> {
    snapshot: &'a Snapshot,
    ctx: &'a Context<'a>,
    verdict: Verdict,
    process: ProcessRow,
    steps: Vec<StepRow>,
    changed: BTreeSet<usize>,
    history: Vec<HistoryLine>,
    alert: Option<NewAlert>,
    resolve_alerts: bool,
    progress: Progress,
    /// The agent of an attempt given back that never started: its slot is
    /// no completion.
    unstarted: Option<String>,
    /// The agent of the attempt a reply answered, with how long it was in
    /// flight, queued at the agent, and waited for its call slots
    /// (milliseconds): what admission control measures.
    answered: Option<(String, i64, i64, i64)>,
    /// The mailbox event a wait step used.
    used_event: Option<String>,
    /// The business key the order now waits with, if its wait has one.
    wait_key: Option<crate::machine::park::WaitKey>,
    /// A move replaced the steps, to this version (see [`Decision::moved`]).
    moved: Option<i32>,
    /// A key the remote asked to rest.
    key_pause: Option<super::concurrency::KeyPause>,
    /// What a reply said of an adaptive key's remote.
    key_sample: Option<super::key_learning::KeySample>,
    /// What this decision asks of a child order.
    child: Option<super::child::ChildCommand>,
}

impl<'a> Draft<'a> {
    fn new(snapshot: &'a Snapshot, ctx: &'a Context<'a>) -> Self {
        Self {
            snapshot,
            ctx,
            verdict: Verdict::Applied,
            process: snapshot.process.clone(),
            steps: snapshot.steps.clone(),
            changed: BTreeSet::new(),
            history: Vec::new(),
            alert: None,
            resolve_alerts: false,
            progress: Progress {
                reply_to: snapshot.reply_to.clone(),
                correlation_id: snapshot.reply_correlation_id.clone(),
                trace_id: snapshot.trace_id.clone(),
                ..Progress::default()
            },
            unstarted: None,
            answered: None,
            used_event: None,
            wait_key: None,
            moved: None,
            key_pause: None,
            key_sample: None,
            child: None,
        }
    }

    fn unchanged(&mut self, reason: &str) {
        self.verdict = Verdict::Unchanged(reason.to_owned());
    }

    /// A reply that answers no awaited attempt: only a history line.
    fn stale(&mut self, reply: &StepReply, reason: String) {
        self.log(
            HistoryEvent::StaleReply,
            Some(&reply.step),
            Some(reply.attempt_id),
            Some(reason.clone()),
        );
        self.verdict = Verdict::Stale(reason);
    }

    fn change_step(&mut self, index: usize, change: impl FnOnce(&mut StepRow)) {
        change(&mut self.steps[index]);
        self.changed.insert(index);
    }

    fn log(
        &mut self,
        event: HistoryEvent,
        step: Option<&str>,
        attempt_id: Option<AttemptId>,
        detail: Option<String>,
    ) {
        self.history.push(HistoryLine {
            event,
            step: step.map(str::to_owned),
            attempt_id,
            detail,
        });
    }

    fn notify(&mut self, event: StatusEvent, step: Option<&str>, detail: Option<&str>) {
        let message = status(&self.snapshot.order_id, event, step, detail, self.ctx.now);
        self.progress.statuses.push(message);
    }

    /// The forward run is given up: undo what was, or may have been, done.
    fn start_compensation(
        &mut self,
        step: Option<&str>,
        attempt_id: Option<AttemptId>,
        reason: &str,
    ) {
        self.process.state = ProcessState::Compensating;
        self.process.failure_count = 0;
        self.process.last_error = Some(reason.to_owned());
        self.log(
            HistoryEvent::CompensationStarted,
            step,
            attempt_id,
            Some(reason.to_owned()),
        );
        self.notify(StatusEvent::Compensating, step, Some(reason));
    }

    /// The order can neither finish nor be undone: `error`, an alert, a
    /// `failed` status.
    fn fail(&mut self, failure: Failure<'_>) {
        self.process.state = ProcessState::Error;
        self.process.locked_by = None;
        self.process.complete_by = None;
        // Out of any line: an order in error waits for no slot.
        self.process.waiting_for = None;
        self.process.waiting_key = None;
        self.process.admit_key = None;
        self.process.last_error = Some(failure.last_error.to_owned());
        self.log(
            HistoryEvent::Error,
            failure.step,
            failure.attempt_id,
            Some(failure.detail),
        );
        self.alert = Some(NewAlert {
            kind: failure.kind,
            message: failure.message.to_owned(),
        });
        self.notify(StatusEvent::Failed, failure.step, Some(failure.message));
    }

    /// Step `index` failed for good and its workflow says to stop there
    /// (`on_failure = "stop"`): the order ends in `error`, nothing undone,
    /// for an operator to resume from this step once the cause is fixed,
    /// or to cancel (which undoes it).
    fn stop_at(&mut self, index: usize, attempt_id: Option<AttemptId>, reason: &str) {
        let name = self.steps[index].name.clone();
        let order_id = self.snapshot.order_id.clone();
        self.change_step(index, |step| {
            step.state = StepState::Failed;
            step.last_error = Some(reason.to_owned());
        });
        let message = format!(
            "order {order_id}: {reason}; its workflow says to stop here (on_failure = \"stop\"), nothing was undone: fix the cause and resume it from this step (sasctl resume), or cancel it to undo it"
        );
        self.fail(Failure {
            step: Some(&name),
            attempt_id,
            kind: AlertKind::StepFailed,
            detail: format!("{reason}; stopped for an operator, nothing undone"),
            last_error: reason,
            message: &message,
        });
    }

    /// Starts the next thing the order needs: the first step not completed
    /// (forward), or the last step that had, or may have had, an effect
    /// (compensating: completed, or in flight when it was given up; a step
    /// that failed permanently applied nothing); or finishes the order.
    fn advance(&mut self) {
        let (next, kind) = match self.process.state {
            ProcessState::Processing => {
                let next = self
                    .steps
                    .iter()
                    .position(|s| s.state != StepState::Completed);
                if let Some(index) = next.filter(|&i| self.steps[i].group.is_some()) {
                    return group::start(self, index);
                }
                (next, StepKind::Action)
            }
            ProcessState::Compensating => {
                let next = self.steps.iter().rposition(StepRow::needs_undo);
                let waits = next.and_then(|index| Some((index, self.undo_waits_until(index)?)));
                if let Some((index, at)) = waits {
                    return self.undo_later(index, at);
                }
                (next, StepKind::Compensation)
            }
            _ => return,
        };
        match next {
            Some(index) => self.start_attempt(index, kind),
            None => self.finish_order(),
        }
    }

    /// When the undo of step `index` may be sent, if that is later than
    /// now ([`undo_not_before`]).
    fn undo_waits_until(&self, index: usize) -> Option<DateTime<Utc>> {
        undo_not_before(&self.steps[index], self.ctx.grace).filter(|at| *at > self.ctx.now)
    }

    /// The undo of step `index` may not be sent before `at`: the order
    /// waits for it held by nobody, and a claim then sends it.
    fn undo_later(&mut self, index: usize, at: DateTime<Utc>) {
        self.release_to_claim(at);
        let name = self.steps[index].name.clone();
        let detail = format!(
            "its action may still land until {at} (its attempt's deadline plus the grace period): the undo waits until then"
        );
        self.log(HistoryEvent::UndoWaits, Some(&name), None, Some(detail));
    }

    /// Hands the compensation to a claim: held by nobody, with no deadline
    /// and out of any line, due when its next undo may be sent ([`super::undo`]'s
    /// rule, now at the earliest).
    fn compensate_later(&mut self) {
        let waits = self
            .steps
            .iter()
            .rposition(StepRow::needs_undo)
            .and_then(|index| Some((index, self.undo_waits_until(index)?)));
        match waits {
            Some((index, at)) => self.undo_later(index, at),
            None => self.release_to_claim(self.ctx.now),
        }
    }

    /// Step `index` starts waiting (a wait, a delay, a child) in
    /// `step_state` until `until`, with a new attempt; the order, in
    /// `state`, parked: held by nobody, with no deadline, in no line, due
    /// to look again at `until`. Returns the attempt's id.
    fn park_at(
        &mut self,
        index: usize,
        step_state: StepState,
        state: ProcessState,
        until: DateTime<Utc>,
    ) -> AttemptId {
        let attempt_id = self.ctx.next_attempt_id;
        self.change_step(index, |step| {
            step.state = step_state;
            step.attempt += 1;
            step.attempt_id = Some(attempt_id);
            step.complete_by = Some(until);
        });
        self.process = ProcessRow {
            state,
            locked_by: None,
            complete_by: None,
            not_before: until,
            waiting_for: None,
            admit_key: None,
            waiting_key: None,
            ..self.process.clone()
        };
        attempt_id
    }

    /// The order held by nobody, out of any line, claimable from `at`.
    fn release_to_claim(&mut self, at: DateTime<Utc>) {
        self.process.locked_by = None;
        self.process.complete_by = None;
        self.process.waiting_for = None;
        self.process.waiting_key = None;
        self.process.admit_key = None;
        self.process.not_before = at;
    }

    fn start_attempt(&mut self, index: usize, kind: StepKind) {
        // Each kind's rule gets what its step holds (a call reads its own
        // fields in place: the hot path copies nothing).
        match &self.steps[index].kind {
            Kind::Call(_) => call::start(self, index, kind),
            Kind::Wait(wait) => wait::start(self, index, &wait.clone()),
            Kind::Delay(delay) => delay::start(self, index, &delay.clone()),
            Kind::Child(child) => child::start(self, index, kind, child.clone()),
        }
    }

    fn finish_order(&mut self) {
        let (done, event, status) = if self.process.state == ProcessState::Processing {
            (
                ProcessState::Processed,
                HistoryEvent::Processed,
                StatusEvent::Processed,
            )
        } else {
            (
                ProcessState::Compensated,
                HistoryEvent::Compensated,
                StatusEvent::Compensated,
            )
        };
        self.process.state = done;
        self.process.locked_by = None;
        self.process.complete_by = None;
        self.log(event, None, None, None);
        self.notify(status, None, None);
    }

    fn finish(self) -> Decision {
        let applies = matches!(
            self.verdict,
            Verdict::Applied | Verdict::Resubmitted(_) | Verdict::Resumed { .. }
        );
        if !applies {
            // Only a stale reply leaves a trace: its history line.
            let history = if matches!(self.verdict, Verdict::Stale(_)) {
                self.history
            } else {
                Vec::new()
            };
            return Decision {
                verdict: self.verdict,
                process: None,
                steps: Vec::new(),
                history,
                alert: None,
                resolve_alerts: false,
                progress: Progress {
                    reply_to: self.snapshot.reply_to.clone(),
                    correlation_id: self.snapshot.reply_correlation_id.clone(),
                    trace_id: self.snapshot.trace_id.clone(),
                    ..Progress::default()
                },
                admission: Vec::new(),
                used_event: None,
                wait_key: None,
                moved: None,
                key_pause: None,
                key_sample: None,
                child: None,
            };
        }
        let steps = self
            .changed
            .iter()
            .filter(|_| self.moved.is_none())
            .filter(|&&index| self.steps[index] != self.snapshot.steps[index])
            .map(|&index| {
                let before = &self.snapshot.steps[index];
                StepChange {
                    expected_state: before.state,
                    expected_attempt_id: before.attempt_id,
                    row: self.steps[index].clone(),
                }
            })
            .collect();
        let mut admission = admission_delta(
            (&self.snapshot.process, &self.snapshot.steps),
            (&self.process, &self.steps),
        );
        if let Some(given_back) = &self.unstarted {
            if let Some(delta) = admission.iter_mut().find(|d| &d.agent == given_back) {
                delta.unstarted = 1;
            }
        }
        if let Some((agent, in_flight_ms, queued_ms, slot_wait_ms)) = self.answered {
            let at = match admission.iter().position(|d| d.agent == agent) {
                Some(at) => at,
                None => {
                    // A transient failure keeps its slot until the
                    // supervisor decides: its times count all the same.
                    let at = admission.partition_point(|d| d.agent < agent);
                    admission.insert(
                        at,
                        AdmissionDelta {
                            agent,
                            ..AdmissionDelta::default()
                        },
                    );
                    at
                }
            };
            admission[at].in_flight_ms = in_flight_ms;
            admission[at].queued_ms = queued_ms;
            admission[at].slot_wait_ms = slot_wait_ms;
        }
        let moved = self.moved;
        Decision {
            admission,
            verdict: self.verdict,
            process: (self.process != self.snapshot.process).then_some(self.process),
            steps,
            history: self.history,
            alert: self.alert,
            resolve_alerts: self.resolve_alerts,
            progress: self.progress,
            used_event: self.used_event,
            wait_key: self.wait_key,
            moved: moved.map(|version| super::MovedPlan {
                version,
                steps: self.steps,
            }),
            key_pause: self.key_pause,
            key_sample: self.key_sample,
            child: self.child,
        }
    }
}
