//! The rules: one function per event, sharing a [`Draft`] that collects
//! the changes and turns them into a [`Decision`]. Each event's rules live
//! in a module of their own, so a new kind of event or step is a new file:
//! [`start`] (intake, claims), [`reply`], [`deadline`], [`dead_letter`],
//! [`operator`] (resubmit, cancel), [`park`] (steps that wait for an event
//! or a time), [`group`] (steps that run side by side).

mod child;
mod dead_letter;
mod deadline;
mod delay;
mod group;
mod moved;
mod operator;
mod park;
mod reply;
mod start;
mod wait;

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};

use sas_messages::{AttemptId, StatusEvent, StepKind, StepReply};

use super::dispatch::{attempt_detail, operation, payload, Unbuilt};
use super::kind::Kind;
use super::undo::undo_not_before;
use super::{
    admission_delta, admit_key, status, AdmissionDelta, AlertKind, Context, Decision, Event,
    HistoryEvent, HistoryLine, NewAlert, ProcessRow, Snapshot, StepChange, StepRow, Verdict,
};
use crate::model::{Dispatch, ProcessState, Progress, StepState};

/// Decides what `event` does to the order in `snapshot`. Pure: the same
/// inputs always give the same decision.
pub fn decide(snapshot: &Snapshot, event: &Event<'_>, ctx: &Context<'_>) -> Decision {
    let mut draft = Draft::new(snapshot, ctx);
    match *event {
        Event::Submitted => start::submitted(&mut draft),
        Event::Claimed => start::claimed(&mut draft),
        Event::Reply(reply) => reply::replied(&mut draft, reply),
        Event::DeadlineMissed { policy, jitter } => {
            deadline::deadline_missed(&mut draft, policy, jitter)
        }
        Event::DeadLettered {
            attempt_id,
            reason,
            no_call,
        } => dead_letter::dead_lettered(&mut draft, attempt_id, reason, no_call),
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
        match self.steps[index].kind() {
            Kind::Wait { .. } => return wait::start(self, index),
            Kind::Delay => return delay::start(self, index),
            Kind::Child { .. } => return child::start(self, index, kind),
            Kind::Call => {}
        }
        if self.ctx.closed == Some(self.steps[index].agent.as_str()) {
            return self.wait_for_slot(index, kind);
        }
        if let Some(line) = self.closed_key_line(index) {
            return self.wait_for_key(index, kind, line);
        }
        match self.prepare_call(index, kind, self.ctx.next_attempt_id) {
            Ok((started, dispatch)) => self.start_call(index, kind, started, dispatch),
            Err(unbuilt) => self.refuse_unbuilt(index, kind, &unbuilt),
        }
    }

    /// Attempt `attempt_id` of step `index`'s call as it would start now:
    /// the step in flight with its deadline, and the request to send; or
    /// why that request cannot be built (nothing may be sent then).
    fn prepare_call(
        &self,
        index: usize,
        kind: StepKind,
        attempt_id: AttemptId,
    ) -> Result<(StepRow, Dispatch), Unbuilt> {
        let mut started = self.steps[index].clone();
        started.state = match kind {
            StepKind::Action => StepState::Running,
            StepKind::Compensation => StepState::Compensating,
        };
        started.attempt += 1;
        started.attempt_id = Some(attempt_id);
        started.limit_key = self.key_line(index);
        started.complete_by =
            Some(self.ctx.now + chrono::Duration::milliseconds(i64::from(started.timeout_ms)));
        let results = self
            .steps
            .iter()
            .filter_map(|s| s.result.as_ref().map(|r| (s.name.as_str(), r)));
        let payload = payload(&self.snapshot.body, results);
        let dispatch = Dispatch::for_step(
            &self.snapshot.order_id,
            &started,
            kind,
            payload,
            self.ctx.start_margin,
            self.snapshot.priority,
            self.ctx.max_request_bytes,
        )?;
        Ok((started, dispatch))
    }

    /// Starts a call [`Draft::prepare_call`] prepared: the step in flight,
    /// the order held with it, the request to send.
    fn start_call(&mut self, index: usize, kind: StepKind, started: StepRow, dispatch: Dispatch) {
        self.change_step(index, |step| *step = started);
        let step = &self.steps[index];
        self.process.complete_by = step.complete_by;
        self.process.locked_by = Some(self.ctx.actor.to_owned());
        let event = match kind {
            StepKind::Action => HistoryEvent::Dispatched,
            StepKind::Compensation => HistoryEvent::CompensationDispatched,
        };
        let detail = attempt_detail(step.attempt, &step.agent, operation(step, kind));
        let (name, attempt_id) = (step.name.clone(), step.attempt_id);
        self.progress.dispatches.push(dispatch);
        self.log(event, Some(&name), attempt_id, Some(detail));
    }

    /// The request of step `index`'s next attempt of `kind` could not be
    /// built (a template with a hole, a request too large): nothing is
    /// sent, and an alert names the step and why. An action is refused as
    /// the remote would refuse it, and the order undone; an undo leaves the
    /// order in error with its compensation to finish by hand (or resumed
    /// by an operator once the cause is fixed).
    fn refuse_unbuilt(&mut self, index: usize, kind: StepKind, unbuilt: &Unbuilt) {
        let name = self.steps[index].name.clone();
        let order_id = self.snapshot.order_id.clone();
        match kind {
            StepKind::Action => {
                let reason = format!("the request of step {name} was not sent: {unbuilt}");
                self.change_step(index, |step| {
                    step.state = StepState::Failed;
                    step.last_error = Some(reason.clone());
                });
                self.alert = Some(NewAlert {
                    kind: AlertKind::RequestNotBuilt,
                    message: format!("order {order_id}: {reason}; the order is undone"),
                });
                self.start_compensation(Some(&name), None, &reason);
                self.advance();
            }
            StepKind::Compensation => {
                let reason = format!("the undo of step {name} was not sent: {unbuilt}");
                self.change_step(index, |step| {
                    step.state = StepState::Compensating;
                    step.undo_refused = true;
                    step.last_error = Some(reason.clone());
                });
                let message = format!(
                    "order {order_id}: {reason}; undo it by hand, or fix the cause and resubmit the order to resume its compensation"
                );
                self.fail(Failure {
                    step: Some(&name),
                    attempt_id: None,
                    kind: AlertKind::RequestNotBuilt,
                    detail: reason.clone(),
                    last_error: &reason,
                    message: &message,
                });
            }
        }
    }

    /// No slot of the step's agent is free: the order waits in that agent's
    /// line, held by nobody and with no deadline, so waiting never fails.
    fn wait_for_slot(&mut self, index: usize, kind: StepKind) {
        let now = self.ctx.now;
        self.wait_in_line(index, kind, now, "has no free slot; waiting in its line");
    }

    /// Puts the order in the line of step `index`'s agent, placed as if it
    /// had started waiting at `since`.
    fn wait_in_line(&mut self, index: usize, kind: StepKind, since: DateTime<Utc>, why: &str) {
        let step = &self.steps[index];
        let agent = step.agent.clone();
        let name = step.name.clone();
        self.leave_held(kind, since);
        self.keep_place_from_key_line();
        let detail = format!("{agent} {why}");
        self.process.waiting_for = Some(agent);
        self.process.waiting_key = None;
        self.log(HistoryEvent::Queued, Some(&name), None, Some(detail));
    }

    /// An order taken from a key's line and put in its agent's keeps its
    /// place (its priority and how long it has waited), so that moving
    /// between two long lines never sends it to the back.
    fn keep_place_from_key_line(&mut self) {
        if self.snapshot.process.waiting_key.is_some() {
            if let Some(place) = self.snapshot.process.admit_key {
                self.process.admit_key = Some(place.min(self.process.admit_key.unwrap_or(place)));
            }
        }
    }

    /// The order held by nobody, with no deadline, pending (or
    /// compensating), placed in a line as if it had started waiting at
    /// `since`.
    fn leave_held(&mut self, kind: StepKind, since: DateTime<Utc>) {
        if self.process.state == ProcessState::Processing {
            self.process.state = ProcessState::Pending;
        }
        self.process.locked_by = None;
        self.process.complete_by = None;
        self.process.not_before = self.ctx.now;
        self.process.admit_key = Some(admit_key(
            since,
            self.snapshot.priority,
            kind == StepKind::Compensation,
        ));
    }

    /// The key line of step `index`'s next attempt, when its workflow
    /// limits it by key ([`super::concurrency`]).
    pub(super) fn key_line(&self, index: usize) -> Option<String> {
        let step = &self.steps[index];
        let calls = step.calls.as_ref()?;
        calls.key_limits()?;
        let results = self
            .steps
            .iter()
            .filter_map(|s| s.result.as_ref().map(|r| (s.name.as_str(), r)));
        let context = super::call::context_of(&payload(&self.snapshot.body, results));
        calls.key_line(&step.agent, &context).map(|(line, _)| line)
    }

    /// Step `index`'s key line, when the store found it with no room for
    /// this decision.
    pub(super) fn closed_key_line(&self, index: usize) -> Option<String> {
        let closed = self.ctx.closed_key?;
        self.key_line(index).filter(|line| line == closed)
    }

    /// Step `index`'s key `line` has no room: the order waits in the
    /// key's line, held by nobody and with no deadline. An order taken
    /// from that line and put back keeps its place.
    pub(super) fn wait_for_key(&mut self, index: usize, kind: StepKind, line: String) {
        let limits = self.steps[index]
            .calls
            .as_ref()
            .and_then(|calls| calls.key_limits())
            .map_or_else(String::new, |(limits, _, _)| limits.to_string());
        let why = format!(
            "has no room under {limits} (or its remote asked it to rest); waiting in its line"
        );
        self.wait_in_key_line(index, kind, line, self.ctx.now, &why);
    }

    /// Puts the order in key `line`'s line, placed as if it had started
    /// waiting at `since` (or where it was, when taken from that line and
    /// put back), its step naming the key.
    fn wait_in_key_line(
        &mut self,
        index: usize,
        kind: StepKind,
        line: String,
        since: DateTime<Utc>,
        why: &str,
    ) {
        // Taken from a line (this key's, or its agent's) and put in this
        // one: it keeps its place, so that moving between two long lines
        // never sends it to the back.
        let from_a_line = self.snapshot.process.waiting_key.is_some()
            || self.snapshot.process.waiting_for.is_some();
        let place = self.snapshot.process.admit_key.filter(|_| from_a_line);
        self.leave_held(kind, since);
        if place.is_some() {
            self.process.admit_key = place;
        }
        self.change_step(index, |step| step.limit_key = Some(line.clone()));
        let name = self.steps[index].name.clone();
        let detail = format!("key {line} {why}");
        self.process.waiting_for = None;
        self.process.waiting_key = Some(line);
        self.log(HistoryEvent::Queued, Some(&name), None, Some(detail));
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
