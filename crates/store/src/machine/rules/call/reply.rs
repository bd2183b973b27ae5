//! An agent's reply: fenced by attempt id, then a success, a failure or
//! an attempt that never started.

use sas_messages::{StatusEvent, StepKind, StepOutcome, StepReply};

use crate::machine::concurrency::{KeyPause, LONGEST_KEY_PAUSE};
use crate::machine::key_learning::{KeySample, KeySignal};
use crate::machine::rules::{Draft, Failure};
use crate::machine::StepRow;
use crate::machine::{storable, storable_text};
use crate::machine::{AlertKind, HistoryEvent};
use crate::model::{ProcessState, StepState};

/// An agent's reply: applied only to the step's current attempt of an
/// order that awaits one (fencing); anything else is stale.
pub(in crate::machine::rules) fn replied(draft: &mut Draft<'_>, reply: &StepReply) {
    let state = draft.process.state;
    let expected = match state {
        ProcessState::Processing => StepState::Running,
        ProcessState::Compensating => StepState::Compensating,
        other => {
            return draft.stale(reply, format!("order is {other}, no attempt is awaited"));
        }
    };
    // Only a step that calls an agent is answered by one: a parent waiting,
    // compensating, for its child's undo has an attempt too, which only the
    // child's end settles.
    let current = |expected: StepState| {
        draft.steps.iter().position(|s| {
            s.attempt_id == Some(reply.attempt_id) && s.state == expected && s.kind.calls_out()
        })
    };
    if let Some(index) = current(expected) {
        return answered(draft, index, reply);
    }
    // The answer to an action in flight when the order was given up: kept,
    // so that the undo knows what to undo, and when.
    if let Some(index) = (state == ProcessState::Compensating)
        .then(|| current(StepState::Running))
        .flatten()
    {
        return late_answer(draft, index, reply);
    }
    let reason = format!(
        "attempt {} is not the current attempt of a step that calls an agent (order {state})",
        reply.attempt_id
    );
    draft.stale(reply, reason);
}

/// An answer to action `index`, given up when the order's compensation
/// began (a cancel, a group member's refusal, a dead letter): its attempt
/// was still current. What it says is kept: a success completes the step
/// with its result (the undo may name what it undoes, and may go at once);
/// a refusal or a call never made leaves nothing to undo (unless an earlier
/// attempt may have applied it); an unknown outcome marks it maybe applied.
/// A compensation waiting for this step's deadline is then due as the
/// answer allows.
fn late_answer(draft: &mut Draft<'_>, index: usize, reply: &StepReply) {
    let name = draft.steps[index].name.clone();
    let by = format!(
        "by {}, after the order's compensation began",
        reply.agent_id
    );
    match &reply.outcome {
        StepOutcome::Succeeded { result } => {
            draft.change_step(index, |step| {
                step.state = StepState::Completed;
                step.result = Some(storable(result));
                step.last_error = None;
            });
            draft.log(
                HistoryEvent::StepCompleted,
                Some(&name),
                Some(reply.attempt_id),
                Some(format!("{by}: its result is kept for the undo")),
            );
        }
        StepOutcome::Failed {
            error,
            permanent,
            maybe_applied,
        } => {
            let error = storable_text(error);
            draft.change_step(index, |step| {
                step.maybe_applied |= *maybe_applied;
                if *permanent {
                    step.state = StepState::Failed;
                }
                step.last_error = Some(error.clone());
            });
            let what = if *permanent && !draft.steps[index].maybe_applied {
                "refused, nothing to undo"
            } else if *permanent {
                "refused after a call whose outcome is unknown: still undone"
            } else {
                "failed for now: still undone after its deadline"
            };
            draft.log(
                HistoryEvent::LateAnswer,
                Some(&name),
                Some(reply.attempt_id),
                Some(format!("{by}: {what}: {error}")),
            );
        }
        StepOutcome::NotStarted { reason } => {
            let reason = storable_text(reason);
            draft.change_step(index, |step| {
                if !step.maybe_applied {
                    step.state = StepState::NotStarted;
                }
                step.last_error = Some(format!("not started: {reason}"));
            });
            draft.log(
                HistoryEvent::LateAnswer,
                Some(&name),
                Some(reply.attempt_id),
                Some(format!("{by}: no call was made: {reason}")),
            );
        }
    }
    if draft.process.locked_by.is_none() {
        draft.compensate_later();
    }
}

/// A reply to the current attempt of step `index`: a success completes the
/// step (or its compensation) and moves on; a refusal of an action starts
/// compensation, of a compensation ends the order in error; a transient
/// failure leaves the decision to the supervisor's next scan; an attempt
/// that never started goes back to its agent's line.
fn answered(draft: &mut Draft<'_>, index: usize, reply: &StepReply) {
    let name = draft.steps[index].name.clone();
    let step = &draft.steps[index];
    let in_flight_ms = step.complete_by.map_or(0, |complete_by| {
        let dispatched = complete_by - chrono::TimeDelta::milliseconds(i64::from(step.timeout_ms));
        (draft.ctx.now - dispatched).num_milliseconds().max(0)
    });
    let reported = |ms: Option<u64>| {
        ms.map_or(0, |ms| i64::try_from(ms).unwrap_or(i64::MAX))
            .min(in_flight_ms)
    };
    let (queued_ms, slot_wait_ms) = (reported(reply.queued_ms), reported(reply.slot_wait_ms));
    draft.key_sample = key_sample(step, reply, in_flight_ms - queued_ms.max(slot_wait_ms));
    draft.answered = step
        .kind
        .agent()
        .map(|agent| (agent.to_owned(), in_flight_ms, queued_ms, slot_wait_ms));
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
    let forward = expected == StepState::Running;
    match &reply.outcome {
        StepOutcome::Succeeded { result } => succeeded(draft, index, reply, result, forward, by),
        StepOutcome::Failed {
            error,
            permanent: true,
            ..
        } => refused(draft, index, reply, error, forward),
        StepOutcome::Failed {
            error,
            permanent: false,
            ..
        } => {
            // The supervisor decides at its next scan whether to retry or
            // undo; in a group, once the other members' attempts are done.
            draft.change_step(index, |step| step.last_error = Some(storable_text(error)));
            if !crate::machine::rules::group::others_in_flight(draft, index) {
                draft.process.complete_by = Some(draft.ctx.now);
            }
            draft.log(
                HistoryEvent::TransientFailure,
                Some(&name),
                Some(reply.attempt_id),
                Some(storable_text(error)),
            );
        }
        StepOutcome::NotStarted { reason } => {
            not_started(draft, index, reply, reason, reply.retry_after_ms);
        }
    }
}

/// What a reply to an attempt in an adaptive key says of the key's remote
/// (see [`crate::machine::key_learning`]): a 429 with `Retry-After`, or the
/// time its last call took there (the agent's measure; from an agent that
/// does not report it, or an answer no call made, the attempt's time in
/// flight less what it queued). `None` for other steps, and for an
/// attempt that never started.
fn key_sample(step: &StepRow, reply: &StepReply, unqueued_ms: i64) -> Option<KeySample> {
    let key = step.limit_key.clone()?;
    let ceiling = step
        .kind
        .calls()?
        .concurrency
        .as_ref()
        .filter(|c| c.adaptive)?
        .limit;
    let signal = match reply.outcome {
        StepOutcome::NotStarted { .. } if reply.retry_after_ms.is_some() => KeySignal::Refused,
        StepOutcome::NotStarted { .. } => return None,
        StepOutcome::Succeeded { .. } | StepOutcome::Failed { .. } => KeySignal::Answered {
            ms: reply
                .call_ms
                .unwrap_or_else(|| u64::try_from(unqueued_ms).unwrap_or(0)),
        },
    };
    Some(KeySample {
        key,
        ceiling,
        signal,
    })
}

/// A success: the step completed (`forward`) or was compensated (its
/// action's answer stays in `result`, beside the undo's); the order moves on.
fn succeeded(
    draft: &mut Draft<'_>,
    index: usize,
    reply: &StepReply,
    result: &serde_json::Value,
    forward: bool,
    by: String,
) {
    let name = draft.steps[index].name.clone();
    let event = if forward {
        draft.change_step(index, |step| {
            step.state = StepState::Completed;
            step.result = Some(storable(result));
            step.last_error = None;
        });
        HistoryEvent::StepCompleted
    } else {
        draft.change_step(index, |step| {
            step.state = StepState::Compensated;
            step.undo_result = Some(storable(result));
            step.last_error = None;
        });
        HistoryEvent::StepCompensated
    };
    draft.log(event, Some(&name), Some(reply.attempt_id), Some(by));
    if forward {
        draft.notify(StatusEvent::StepCompleted, Some(&name), None);
        if crate::machine::rules::group::others_in_flight(draft, index) {
            // The order moves on when its whole group completed.
            return;
        }
    }
    draft.advance();
}

/// A permanent refusal: of an action (`forward`), compensation starts (or,
/// where its workflow says `on_failure = "stop"`, the order stops); of
/// a compensation, the order ends in error with an alert (this undo key is
/// decided at the remote: an operator's resubmission retries with a fresh
/// one).
fn refused(draft: &mut Draft<'_>, index: usize, reply: &StepReply, error: &str, forward: bool) {
    let name = draft.steps[index].name.clone();
    if forward {
        draft.change_step(index, |step| {
            step.state = StepState::Failed;
            step.last_error = Some(storable_text(error));
        });
        let reason = format!("step {name} failed: {}", storable_text(error));
        if draft.steps[index].stops_on_failure() {
            return draft.stop_at(index, Some(reply.attempt_id), &reason);
        }
        draft.start_compensation(Some(&name), Some(reply.attempt_id), &reason);
        // A member of its group still in flight is undone first, once its
        // call can no longer land: until then the order waits.
        draft.advance();
        return;
    }
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

/// Waiting is not failing: the agent made no call for this attempt, so
/// nothing was applied and no failure counts. The order goes back to its
/// agent's line, at the place it had when the attempt was dispatched (it has
/// waited since), and starts again as a slot frees; in a group whose other
/// members are in flight, once they are done.
fn not_started(
    draft: &mut Draft<'_>,
    index: usize,
    reply: &StepReply,
    reason: &str,
    retry_after_ms: Option<u64>,
) {
    // The remote asked the attempt's key to rest: the key pauses, and the
    // order waits in its line at its place (not its agent's: the agent is
    // not what is slow).
    let paused = retry_after_ms
        .zip(draft.steps[index].limit_key.clone())
        .map(|(ms, key)| key_pause(draft, key, ms));
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
    draft.unstarted = draft.steps[index].kind.agent().map(str::to_owned);
    draft.log(
        HistoryEvent::NotStarted,
        Some(&name),
        Some(reply.attempt_id),
        Some(format!("by {}: {reason}", reply.agent_id)),
    );
    if kind == StepKind::Action && crate::machine::rules::group::others_in_flight(draft, index) {
        return;
    }
    match paused {
        Some(pause) => {
            let why = format!(
                "was asked by the remote to rest until {}; back in its line: the attempt never started",
                pause.until
            );
            draft.wait_in_key_line(index, kind, pause.key, since, &why);
        }
        None => draft.wait_in_line(
            index,
            kind,
            since,
            "back in its line: the attempt never started",
        ),
    }
}

/// The pause of key `key` a remote's `Retry-After` of `ms` asks for (at
/// most [`LONGEST_KEY_PAUSE`]), recorded on the decision.
fn key_pause(draft: &mut Draft<'_>, key: String, ms: u64) -> KeyPause {
    let rest = std::time::Duration::from_millis(ms).min(LONGEST_KEY_PAUSE);
    let rest = chrono::Duration::from_std(rest).unwrap_or(chrono::Duration::zero());
    let until = crate::machine::to_micros(draft.ctx.now + rest);
    let pause = KeyPause { key, until };
    draft.key_pause = Some(pause.clone());
    pause
}
