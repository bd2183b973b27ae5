//! A missed deadline: retry after a growing, jittered wait, or give up.

use std::time::Duration;

use sas_messages::StatusEvent;

use crate::machine::rules::{Draft, Failure};
use crate::machine::{to_micros, AlertKind, HistoryEvent, ProcessRow, RecoveryPolicy};
use crate::model::{ProcessState, StepState};

/// The supervisor found the deadline passed: retry after a growing,
/// jittered wait, or past `max_failures` give up on the forward run
/// (compensate, or stop where the step says `on_failure = "stop"`) or on the compensation (error, with an alert).
pub(in crate::machine::rules) fn deadline_missed(
    draft: &mut Draft<'_>,
    policy: &RecoveryPolicy,
    jitter: f64,
) {
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
    if give_up && from == ProcessState::Processing {
        // Out of retries at a step whose workflow says to stop there: its
        // outcome is unknown (maybe applied), and a resume keeps its key.
        if let Some(index) = draft
            .steps
            .iter()
            .position(|s| s.state == StepState::Running && s.stops_on_failure())
        {
            return draft.stop_at(index, None, &format!("{reason}: out of retries"));
        }
    }
    let tries = u32::try_from(failures).unwrap_or(1);
    let (event, to, count, wait) = match (from, give_up) {
        (ProcessState::Processing, false) => (
            HistoryEvent::RetryScheduled,
            ProcessState::Pending,
            failures,
            policy.backoff.wait_with(tries, jitter),
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
            policy.backoff.wait_with(tries, jitter),
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
        waiting_key: None,
    };
    let detail = format!("{reason}; next attempt not before {not_before}");
    draft.log(event, name.as_deref(), None, Some(detail));
    if event == HistoryEvent::CompensationStarted {
        draft.notify(StatusEvent::Compensating, name.as_deref(), Some(&reason));
    }
}

/// Records on each step in flight (one, or the members of a parallel
/// group) that its attempt missed its deadline; returns their names and
/// what happened, for the reason.
fn mark_missed(draft: &mut Draft<'_>) -> (Option<String>, String) {
    let in_flight: Vec<usize> = (0..draft.steps.len())
        .filter(|&i| {
            matches!(
                draft.steps[i].state,
                StepState::Running | StepState::Compensating
            )
        })
        .collect();
    if in_flight.is_empty() {
        return (
            None,
            "held order made no progress before its deadline".to_owned(),
        );
    }
    let (mut names, mut whats) = (Vec::new(), Vec::new());
    for index in in_flight {
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
        whats.push(format!("step {name} attempt {attempt} timed out"));
        names.push(name);
    }
    (Some(names.join(",")), whats.join("; "))
}
