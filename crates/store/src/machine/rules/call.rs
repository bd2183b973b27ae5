//! Call steps: a request to an agent, which calls the remote service with
//! the step's idempotency key, and what a call does on each event only a
//! call receives: its start here (a free slot of its agent and of its key's
//! line, then the request built and sent, or refused unsent), an agent's
//! reply ([`reply`]), a missed deadline ([`deadline`]) and a dead letter of
//! its request or reply ([`dead_letter`]). An undo is a call too (a
//! compensation attempt of the same step).

mod dead_letter;
mod deadline;
mod reply;

use chrono::{DateTime, Utc};
use sas_messages::{AttemptId, StepKind};

use super::{Draft, Failure};
use crate::machine::dispatch::{attempt_detail, operation, payload, Unbuilt};
use crate::machine::{admit_key, AlertKind, HistoryEvent, NewAlert, StepRow};
use crate::model::{Dispatch, ProcessState, StepState};
pub(super) use dead_letter::dead_lettered;
pub(super) use deadline::deadline_missed;
pub(super) use reply::replied;

/// Call step `index` starts an attempt of `kind`: it waits in its agent's
/// line when the store found no free slot, in its key's line when that
/// line has no room, and otherwise its request is sent (or refused unsent
/// when it cannot be built).
pub(super) fn start(draft: &mut Draft<'_>, index: usize, kind: StepKind) {
    if draft.agent_closed(index) {
        return draft.wait_for_slot(index, kind);
    }
    if let Some(line) = draft.closed_key_line(index) {
        return draft.wait_for_key(index, kind, line);
    }
    match draft.prepare_call(index, kind, draft.ctx.next_attempt_id) {
        Ok((started, dispatch)) => draft.start_call(index, kind, started, dispatch),
        Err(unbuilt) => draft.refuse_unbuilt(index, kind, &unbuilt),
    }
}

impl Draft<'_> {
    /// Attempt `attempt_id` of step `index`'s call as it would start now:
    /// the step in flight with its deadline, and the request to send; or
    /// why that request cannot be built (nothing may be sent then).
    pub(super) fn prepare_call(
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
    pub(super) fn start_call(
        &mut self,
        index: usize,
        kind: StepKind,
        started: StepRow,
        dispatch: Dispatch,
    ) {
        self.change_step(index, |step| *step = started);
        let step = &self.steps[index];
        self.process.complete_by = step.complete_by;
        self.process.locked_by = Some(self.ctx.actor.to_owned());
        let event = match kind {
            StepKind::Action => HistoryEvent::Dispatched,
            StepKind::Compensation => HistoryEvent::CompensationDispatched,
        };
        let detail = attempt_detail(
            step.attempt,
            step.kind.agent().unwrap_or_default(),
            operation(step, kind),
        );
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
    pub(super) fn refuse_unbuilt(&mut self, index: usize, kind: StepKind, unbuilt: &Unbuilt) {
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
    pub(super) fn wait_for_slot(&mut self, index: usize, kind: StepKind) {
        let now = self.ctx.now;
        self.wait_in_line(index, kind, now, "has no free slot; waiting in its line");
    }

    /// Puts the order in the line of step `index`'s agent, placed as if it
    /// had started waiting at `since`.
    pub(super) fn wait_in_line(
        &mut self,
        index: usize,
        kind: StepKind,
        since: DateTime<Utc>,
        why: &str,
    ) {
        let step = &self.steps[index];
        let agent = step.kind.agent().unwrap_or_default().to_owned();
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
    pub(super) fn keep_place_from_key_line(&mut self) {
        if self.snapshot.process.waiting_key.is_some() {
            if let Some(place) = self.snapshot.process.admit_key {
                self.process.admit_key = Some(place.min(self.process.admit_key.unwrap_or(place)));
            }
        }
    }

    /// The order held by nobody, with no deadline, pending (or
    /// compensating), placed in a line as if it had started waiting at
    /// `since`.
    pub(super) fn leave_held(&mut self, kind: StepKind, since: DateTime<Utc>) {
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
    /// limits it by key ([`crate::machine::concurrency`]).
    pub(super) fn key_line(&self, index: usize) -> Option<String> {
        let step = &self.steps[index];
        let calls = step.kind.calls()?;
        calls.key_limits()?;
        let results = self
            .steps
            .iter()
            .filter_map(|s| s.result.as_ref().map(|r| (s.name.as_str(), r)));
        let context = crate::machine::call::context_of(&payload(&self.snapshot.body, results));
        calls
            .key_line(step.kind.agent()?, &context)
            .map(|(line, _)| line)
    }

    /// Whether step `index` calls the agent the store found with no free
    /// slot for this decision.
    pub(super) fn agent_closed(&self, index: usize) -> bool {
        self.steps[index]
            .kind
            .agent()
            .is_some_and(|agent| self.ctx.closed == Some(agent))
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
            .kind
            .calls()
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
    pub(super) fn wait_in_key_line(
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
}
