//! The rules: one function per event, sharing a [`Draft`] that collects
//! the changes and turns them into a [`Decision`].

use std::collections::BTreeSet;
use std::time::Duration;

use chrono::{DateTime, Utc};

use sas_messages::{AttemptId, StatusEvent, StepKind, StepOutcome, StepReply};

use super::dispatch::{attempt_detail, operation, payload, resubmitted_key};
use super::{
    admission_delta, admit_key, slot_held, status, to_micros, AlertKind, Context, Decision, Event,
    HistoryEvent, HistoryLine, NewAlert, ProcessRow, RecoveryPolicy, ResubmitAction, Snapshot,
    StepChange, StepRow, Verdict,
};
use crate::model::{Dispatch, ProcessState, Progress, StepState};

/// Decides what `event` does to the order in `snapshot`. Pure: the same
/// inputs always give the same decision.
pub fn decide(snapshot: &Snapshot, event: &Event<'_>, ctx: &Context<'_>) -> Decision {
    let mut draft = Draft::new(snapshot, ctx);
    match *event {
        Event::Submitted => submitted(&mut draft),
        Event::Claimed => claimed(&mut draft),
        Event::Reply(reply) => replied(&mut draft, reply),
        Event::DeadlineMissed { policy, jitter } => deadline_missed(&mut draft, policy, jitter),
        Event::DeadLettered { attempt_id, reason } => dead_lettered(&mut draft, attempt_id, reason),
        Event::Resubmitted { earlier } => resubmitted(&mut draft, earlier),
        Event::Cancelled { reason } => cancelled(&mut draft, reason),
    }
    draft.finish()
}

/// Intake: the order is held by the intake scheduler and its first step starts.
fn submitted(draft: &mut Draft<'_>) {
    if draft.process.state != ProcessState::Pending || draft.steps.iter().any(|s| s.attempt > 0) {
        return draft.unchanged("the order was already taken in");
    }
    draft.log(HistoryEvent::Received, None, None, None);
    draft.notify(StatusEvent::Received, None, None);
    draft.process.state = ProcessState::Processing;
    draft.advance();
}

/// A claim: a pending order runs forward again; a compensation nobody holds resumes.
fn claimed(draft: &mut Draft<'_>) {
    let process = &draft.process;
    let claimable = match process.state {
        ProcessState::Pending => true,
        ProcessState::Compensating => process.locked_by.is_none(),
        _ => false,
    };
    if !claimable || process.not_before > draft.ctx.now {
        return draft.unchanged("the order is not ready to be claimed");
    }
    draft.log(HistoryEvent::Claimed, None, None, None);
    draft.process.waiting_for = None;
    draft.process.admit_key = None;
    if draft.process.state == ProcessState::Pending {
        draft.process.state = ProcessState::Processing;
    }
    draft.advance();
}

/// An agent's reply: applied only to the step's current attempt of an
/// order that awaits one (fencing); anything else is stale.
fn replied(draft: &mut Draft<'_>, reply: &StepReply) {
    let state = draft.process.state;
    let expected = match state {
        ProcessState::Processing => StepState::Running,
        ProcessState::Compensating => StepState::Compensating,
        other => {
            return draft.stale(reply, format!("order is {other}, no attempt is awaited"));
        }
    };
    let Some(index) = draft
        .steps
        .iter()
        .position(|s| s.attempt_id == Some(reply.attempt_id) && s.state == expected)
    else {
        let reason = format!(
            "attempt {} is not the step's current attempt (order {state})",
            reply.attempt_id
        );
        return draft.stale(reply, reason);
    };
    answered(draft, index, reply);
}

/// A reply to the current attempt of step `index`: a success completes the
/// step (or its compensation) and moves on; a refusal of an action starts
/// compensation, of a compensation ends the order in error; a transient
/// failure leaves the decision to the supervisor's next scan; an attempt
/// that never started goes back to its agent's line.
fn answered(draft: &mut Draft<'_>, index: usize, reply: &StepReply) {
    let name = draft.steps[index].name.clone();
    let by = format!("by {}", reply.agent_id);
    let expected = draft.steps[index].state;
    // "Maybe applied" is never read as "not applied": an action whose
    // outcome this reply leaves open stays marked for undo for good.
    if let StepOutcome::Failed {
        maybe_applied: true,
        ..
    } = reply.outcome
    {
        if expected == StepState::Running {
            draft.change_step(index, |step| step.maybe_applied = true);
        }
    }
    match (&reply.outcome, expected) {
        (StepOutcome::Succeeded { result }, StepState::Running) => {
            draft.change_step(index, |step| {
                step.state = StepState::Completed;
                step.result = Some(storable(result));
                step.last_error = None;
            });
            draft.log(
                HistoryEvent::StepCompleted,
                Some(&name),
                Some(reply.attempt_id),
                Some(by),
            );
            draft.notify(StatusEvent::StepCompleted, Some(&name), None);
            draft.advance();
        }
        (StepOutcome::Succeeded { result }, _) => {
            // The action's answer stays in `result`, beside the undo's.
            draft.change_step(index, |step| {
                step.state = StepState::Compensated;
                step.undo_result = Some(storable(result));
                step.last_error = None;
            });
            draft.log(
                HistoryEvent::StepCompensated,
                Some(&name),
                Some(reply.attempt_id),
                Some(by),
            );
            draft.advance();
        }
        (
            StepOutcome::Failed {
                error,
                permanent: true,
                ..
            },
            StepState::Running,
        ) => {
            draft.change_step(index, |step| {
                step.state = StepState::Failed;
                step.last_error = Some(storable_text(error));
            });
            let reason = format!("step {name} failed: {}", storable_text(error));
            draft.start_compensation(Some(&name), Some(reply.attempt_id), &reason);
            draft.advance();
        }
        (
            StepOutcome::Failed {
                error,
                permanent: true,
                ..
            },
            _,
        ) => {
            // This undo key is decided at the remote: an operator's
            // resubmission retries with a fresh one.
            draft.change_step(index, |step| {
                step.last_error = Some(storable_text(error));
                step.undo_refused = true;
            });
            let reason = format!(
                "compensation of step {name} failed permanently: {}",
                storable_text(error)
            );
            draft.fail(Failure {
                step: Some(&name),
                attempt_id: Some(reply.attempt_id),
                kind: AlertKind::CompensationFailed,
                detail: reason.clone(),
                last_error: &reason,
                message: &reason,
            });
        }
        (
            StepOutcome::Failed {
                error,
                permanent: false,
                ..
            },
            _,
        ) => {
            // The supervisor decides at its next scan whether to retry or undo.
            draft.change_step(index, |step| step.last_error = Some(storable_text(error)));
            draft.process.complete_by = Some(draft.ctx.now);
            draft.log(
                HistoryEvent::TransientFailure,
                Some(&name),
                Some(reply.attempt_id),
                Some(storable_text(error)),
            );
        }
        (StepOutcome::NotStarted { reason }, _) => not_started(draft, index, reply, reason),
    }
}

/// Waiting is not failing: the agent made no call for this attempt, so
/// nothing was applied and no failure counts. The order goes back to its
/// agent's line, at the place it had when the attempt was dispatched (it has
/// waited since), and starts again as a slot frees.
fn not_started(draft: &mut Draft<'_>, index: usize, reply: &StepReply, reason: &str) {
    let step = &draft.steps[index];
    let (name, attempt) = (step.name.clone(), step.attempt);
    let since = step.started_at().unwrap_or(draft.ctx.now);
    let kind = if step.state == StepState::Running {
        StepKind::Action
    } else {
        StepKind::Compensation
    };
    let reason = storable_text(reason);
    draft.change_step(index, |step| {
        step.last_error = Some(format!("attempt {attempt} not started: {reason}"));
        // A forward step nothing may have reached needs no undo.
        if step.state == StepState::Running && !step.maybe_applied {
            step.state = StepState::NotStarted;
        }
    });
    draft.unstarted = true;
    draft.log(
        HistoryEvent::NotStarted,
        Some(&name),
        Some(reply.attempt_id),
        Some(format!("by {}: {reason}", reply.agent_id)),
    );
    draft.wait_in_line(
        index,
        kind,
        since,
        "back in its line: the attempt never started",
    );
}

/// The supervisor found the deadline passed: retry after a growing,
/// jittered wait, or past `max_failures` give up on the forward run
/// (compensate) or on the compensation (error, with an alert).
fn deadline_missed(draft: &mut Draft<'_>, policy: &RecoveryPolicy, jitter: f64) {
    let now = draft.ctx.now;
    let from = draft.process.state;
    let held = matches!(from, ProcessState::Processing | ProcessState::Compensating);
    let grace = chrono::Duration::from_std(policy.grace).unwrap_or_default();
    if !held || draft.process.complete_by.is_none_or(|by| by + grace >= now) {
        return draft.unchanged("no deadline of the order has passed");
    }
    let failures = draft.process.failure_count + 1;
    let (name, what) = mark_missed(draft);
    let reason = format!(
        "{what}; failure {failures} of {} allowed",
        policy.max_failures
    );
    let give_up = failures > policy.max_failures;
    let backoff = policy.backoff(failures);
    let (event, to, count, wait) = match (from, give_up) {
        (ProcessState::Processing, false) => (
            HistoryEvent::RetryScheduled,
            ProcessState::Pending,
            failures,
            backoff,
        ),
        (ProcessState::Processing, true) => (
            HistoryEvent::CompensationStarted,
            ProcessState::Compensating,
            0,
            Duration::ZERO,
        ),
        (_, false) => (
            HistoryEvent::CompensationRetryScheduled,
            ProcessState::Compensating,
            failures,
            backoff,
        ),
        (_, true) => {
            return draft.fail(Failure {
                step: name.as_deref(),
                attempt_id: None,
                kind: AlertKind::CompensationExhausted,
                detail: format!("{reason}; next attempt not before {now}"),
                last_error: &reason,
                message: &format!("compensation could not complete: {reason}"),
            });
        }
    };
    // Equal jitter: half the wait is fixed, half random.
    let wait = wait.mul_f64(0.5 + jitter.clamp(0.0, 1.0) / 2.0);
    let not_before = to_micros(now + chrono::Duration::from_std(wait).unwrap_or_default());
    draft.process = ProcessRow {
        state: to,
        locked_by: None,
        complete_by: None,
        failure_count: count,
        not_before,
        last_error: Some(reason.clone()),
        waiting_for: None,
        admit_key: None,
    };
    let detail = format!("{reason}; next attempt not before {not_before}");
    draft.log(event, name.as_deref(), None, Some(detail));
    if event == HistoryEvent::CompensationStarted {
        draft.notify(StatusEvent::Compensating, name.as_deref(), Some(&reason));
    }
}

/// A remote service's answer as Postgres can store it: `jsonb` refuses the
/// character U+0000 in strings and keys, and one such answer must not fail
/// the batch of replies it arrives in, so it becomes U+FFFD.
pub fn storable(value: &serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::String(text) => Value::String(storable_text(text)),
        Value::Array(items) => Value::Array(items.iter().map(storable).collect()),
        Value::Object(fields) => Value::Object(
            fields
                .iter()
                .map(|(key, value)| (storable_text(key), storable(value)))
                .collect(),
        ),
        other => other.clone(),
    }
}

/// Text as Postgres can store it (no U+0000).
pub fn storable_text(text: &str) -> String {
    if text.contains('\0') {
        text.replace('\0', "\u{fffd}")
    } else {
        text.to_owned()
    }
}

/// Records on the step in flight, if any, that its attempt missed its
/// deadline; returns its name and what happened, for the reason.
fn mark_missed(draft: &mut Draft<'_>) -> (Option<String>, String) {
    let in_flight = draft
        .steps
        .iter()
        .position(|s| matches!(s.state, StepState::Running | StepState::Compensating));
    let Some(index) = in_flight else {
        return (
            None,
            "held order made no progress before its deadline".to_owned(),
        );
    };
    let step = &draft.steps[index];
    let (name, attempt) = (step.name.clone(), step.attempt);
    let missed = step
        .complete_by
        .map_or_else(String::new, |by| by.to_rfc3339());
    draft.change_step(index, |step| {
        step.last_error = Some(format!("attempt {attempt} missed its deadline {missed}"));
        // Its call may have landed: undo it if the order is given up.
        if step.state == StepState::Running {
            step.maybe_applied = true;
        }
    });
    let what = format!("step {name} attempt {attempt} timed out");
    (Some(name), what)
}

/// A message of the current attempt was dead-lettered: it would fail again,
/// so the order is not retried. A forward run is compensated; a compensation
/// ends in error with an alert. A dead letter of an old attempt changes nothing.
fn dead_lettered(draft: &mut Draft<'_>, attempt_id: AttemptId, reason: &str) {
    let state = draft.process.state;
    let expected = if state == ProcessState::Compensating {
        StepState::Compensating
    } else {
        StepState::Running
    };
    let Some(step) = draft
        .steps
        .iter()
        .find(|s| s.attempt_id == Some(attempt_id) && s.state == expected)
    else {
        return draft.unchanged("the dead letter is not of the step's current attempt");
    };
    let name = step.name.clone();
    let why = format!("a message of step {name} was dead-lettered: {reason}");
    match state {
        ProcessState::Processing | ProcessState::Pending => {
            draft.process = ProcessRow {
                state: ProcessState::Compensating,
                locked_by: None,
                complete_by: None,
                failure_count: 0,
                not_before: draft.ctx.now,
                last_error: Some(why.clone()),
                waiting_for: None,
                admit_key: None,
            };
            draft.log(
                HistoryEvent::CompensationStarted,
                Some(&name),
                Some(attempt_id),
                Some(why.clone()),
            );
            draft.notify(StatusEvent::Compensating, Some(&name), Some(&why));
        }
        ProcessState::Compensating => {
            draft.fail(Failure {
                step: Some(&name),
                attempt_id: Some(attempt_id),
                kind: AlertKind::CompensationDeadLettered,
                detail: why.clone(),
                last_error: &why,
                message: &why,
            });
        }
        _ => draft.unchanged("the order is not running"),
    }
}

/// An operator put an order that ended `error` or `compensated` back: a
/// failed compensation resumes; otherwise the workflow restarts, every step
/// not completed with a fresh key (the old one is decided at the remote).
fn resubmitted(draft: &mut Draft<'_>, earlier: i64) {
    let state = draft.process.state;
    if !matches!(state, ProcessState::Error | ProcessState::Compensated) {
        draft.verdict = Verdict::Refused(state);
        return;
    }
    let compensation_underway = draft
        .steps
        .iter()
        .any(|s| s.state == StepState::Compensating);
    let (reopened, action) = if state == ProcessState::Error && compensation_underway {
        for index in 0..draft.steps.len() {
            if draft.steps[index].undo_refused {
                draft.change_step(index, |step| {
                    step.undo_generation += 1;
                    step.undo_refused = false;
                });
            }
        }
        (
            ProcessState::Compensating,
            ResubmitAction::CompensationResumed,
        )
    } else {
        let order_id = draft.snapshot.order_id.clone();
        for index in 0..draft.steps.len() {
            if draft.steps[index].state != StepState::Completed {
                draft.change_step(index, |step| {
                    step.state = StepState::NotStarted;
                    step.attempt_id = None;
                    step.complete_by = None;
                    step.result = None;
                    step.last_error = None;
                    step.maybe_applied = false;
                    step.undo_generation = 0;
                    step.undo_refused = false;
                    step.undo_result = None;
                    step.idempotency_key = resubmitted_key(&order_id, &step.name, earlier + 1);
                });
            }
        }
        (ProcessState::Pending, ResubmitAction::WorkflowRestarted)
    };
    // Held by nobody and due now: a scheduler claims it at its next claim.
    draft.process.state = reopened;
    draft.process.locked_by = None;
    draft.process.complete_by = None;
    draft.process.failure_count = 0;
    draft.process.not_before = draft.ctx.now;
    draft.resolve_alerts = true;
    draft.log(
        HistoryEvent::Resubmitted,
        None,
        None,
        Some(action.as_str().to_owned()),
    );
    draft.verdict = Verdict::Resubmitted(action);
}

/// An operator cancelled a running order: it is compensated. The undo of a
/// step in flight waits for that attempt's deadline, so it never reaches the
/// remote service before the action it undoes.
fn cancelled(draft: &mut Draft<'_>, reason: &str) {
    let state = draft.process.state;
    if !matches!(state, ProcessState::Pending | ProcessState::Processing) {
        draft.verdict = Verdict::Refused(state);
        return;
    }
    let now = draft.ctx.now;
    let in_flight = draft
        .steps
        .iter()
        .filter(|s| s.state == StepState::Running)
        .filter_map(|s| s.complete_by)
        .max();
    let why = format!("cancelled by {}: {reason}", draft.ctx.actor);
    draft.process = ProcessRow {
        state: ProcessState::Compensating,
        locked_by: None,
        complete_by: None,
        failure_count: 0,
        not_before: in_flight.map_or(now, |by| by.max(now)),
        last_error: Some(why.clone()),
        waiting_for: None,
        admit_key: None,
    };
    draft.log(HistoryEvent::Cancelled, None, None, Some(why.clone()));
    draft.notify(StatusEvent::Compensating, None, Some(&why));
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
    /// The attempt given back never started: its slot is no completion.
    unstarted: bool,
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
            unstarted: false,
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

    /// Starts the next thing the order needs: the first step not completed
    /// (forward), or the last step that had, or may have had, an effect
    /// (compensating: completed, or in flight when it was given up; a step
    /// that failed permanently applied nothing); or finishes the order.
    fn advance(&mut self) {
        let (next, kind) = match self.process.state {
            ProcessState::Processing => (
                self.steps
                    .iter()
                    .position(|s| s.state != StepState::Completed),
                StepKind::Action,
            ),
            ProcessState::Compensating => (
                self.steps.iter().rposition(StepRow::needs_undo),
                StepKind::Compensation,
            ),
            _ => return,
        };
        match next {
            Some(index) => self.start_attempt(index, kind),
            None => self.finish_order(),
        }
    }

    fn start_attempt(&mut self, index: usize, kind: StepKind) {
        if self.ctx.closed == Some(self.steps[index].agent.as_str()) {
            return self.wait_for_slot(index, kind);
        }
        let (now, attempt_id) = (self.ctx.now, self.ctx.next_attempt_id);
        self.change_step(index, |step| {
            step.state = match kind {
                StepKind::Action => StepState::Running,
                StepKind::Compensation => StepState::Compensating,
            };
            step.attempt += 1;
            step.attempt_id = Some(attempt_id);
            step.complete_by =
                Some(now + chrono::Duration::milliseconds(i64::from(step.timeout_ms)));
        });
        let step = &self.steps[index];
        self.process.complete_by = step.complete_by;
        self.process.locked_by = Some(self.ctx.actor.to_owned());
        let event = match kind {
            StepKind::Action => HistoryEvent::Dispatched,
            StepKind::Compensation => HistoryEvent::CompensationDispatched,
        };
        let detail = attempt_detail(step.attempt, &step.agent, operation(step, kind));
        let name = step.name.clone();
        let results = self
            .steps
            .iter()
            .filter_map(|s| s.result.as_ref().map(|r| (s.name.as_str(), r)));
        let payload = payload(&self.snapshot.body, results);
        let dispatch = Dispatch::for_step(
            &self.snapshot.order_id,
            &self.steps[index],
            kind,
            payload,
            self.ctx.start_margin,
        );
        self.progress.dispatch = Some(Box::new(dispatch));
        self.log(event, Some(&name), Some(attempt_id), Some(detail));
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
        let detail = format!("{agent} {why}");
        self.process.waiting_for = Some(agent);
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
        let applies = matches!(self.verdict, Verdict::Applied | Verdict::Resubmitted(_));
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
            };
        }
        let steps = self
            .changed
            .iter()
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
        if self.unstarted {
            let given_back = slot_held(&self.snapshot.process, &self.snapshot.steps);
            if let Some(delta) = admission
                .iter_mut()
                .find(|d| Some(d.agent.as_str()) == given_back)
            {
                delta.unstarted = 1;
            }
        }
        Decision {
            admission,
            verdict: self.verdict,
            process: (self.process != self.snapshot.process).then_some(self.process),
            steps,
            history: self.history,
            alert: self.alert,
            resolve_alerts: self.resolve_alerts,
            progress: self.progress,
        }
    }
}
