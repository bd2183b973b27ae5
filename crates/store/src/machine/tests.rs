//! The state machine without Postgres: every process state against every
//! event, then the rules one by one.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use sas_messages::{AttemptId, StatusEvent, StepKind, StepOutcome, StepReply, SCHEMA_VERSION};
use uuid::Uuid;

use super::*;
use crate::machine::kind::{CallStep, ChildStep, DelayStep, Kind, WaitStep};
use crate::model::{NewStep, ProcessState, StepState};

const SCHEDULER: &str = "scheduler-1";

fn t(seconds: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_800_000_000 + seconds, 0).unwrap()
}

/// The call of a step known to be one, to change how it is called.
fn call_mut(step: &mut NewStep) -> &mut CallStep {
    match &mut step.kind {
        Kind::Call(call) => call,
        Kind::Wait(_) | Kind::Delay(_) | Kind::Child(_) => panic!("{} is no call step", step.name),
    }
}

fn workflow() -> Vec<NewStep> {
    [
        ("reserve_stock", "inventory", "reserve", Some("release")),
        ("charge_payment", "payment", "charge", Some("refund")),
        ("create_shipment", "shipping", "ship", None),
    ]
    .into_iter()
    .map(|(name, agent, action, compensation)| NewStep {
        name: name.into(),
        kind: Kind::Call(CallStep::new(agent, action, compensation)),
        timeout: Duration::from_secs(5),
        group: None,
    })
    .collect()
}

fn attempt(n: u128) -> AttemptId {
    Uuid::from_u128(n).into()
}

fn policy() -> RecoveryPolicy {
    RecoveryPolicy {
        max_failures: 2,
        backoff: sas_runtime::Backoff::new(
            Duration::from_secs(1),
            Duration::from_secs(8),
            sas_runtime::Jitter::Equal,
        ),
        grace: Duration::from_secs(2),
    }
}

fn ctx(now: DateTime<Utc>) -> Context<'static> {
    Context {
        now,
        actor: SCHEDULER,
        next_attempt_id: attempt(99),
        start_margin: Duration::from_secs(1),
        grace: Duration::from_secs(2),
        max_request_bytes: crate::connect::DEFAULT_MAX_REQUEST_BYTES,
        closed: None,
        closed_key: None,
    }
}

fn fresh() -> Snapshot {
    Snapshot::new_order(
        "o-1",
        serde_json::json!({ "order_id": "o-1" }),
        Some("client-q".into()),
        Some("trace".into()),
        5,
        &workflow(),
        t(0),
    )
}

/// Sets step `index` to `state` with attempt `n` (deadline 5 s after `t(n)`).
fn step(snapshot: &mut Snapshot, index: usize, state: StepState, n: u128) {
    let step = &mut snapshot.steps[index];
    step.state = state;
    step.attempt = n as i32;
    step.attempt_id = Some(attempt(n));
    step.complete_by = Some(t(n as i64 + 5));
    if state == StepState::Completed || state == StepState::Compensated {
        step.result = Some(serde_json::json!({ "id": format!("r-{index}") }));
    }
}

/// A representative order in each state, and the attempt a reply to it would answer.
fn order_in(state: ProcessState) -> (Snapshot, AttemptId) {
    let mut s = fresh();
    s.process.state = state;
    let current = match state {
        // Sent back by the supervisor: its step still running, due now.
        ProcessState::Pending => {
            step(&mut s, 0, StepState::Running, 1);
            1
        }
        ProcessState::Processing => {
            step(&mut s, 0, StepState::Completed, 1);
            step(&mut s, 1, StepState::Running, 2);
            s.process.locked_by = Some(SCHEDULER.into());
            s.process.complete_by = s.steps[1].complete_by;
            2
        }
        ProcessState::Compensating => {
            step(&mut s, 0, StepState::Completed, 1);
            step(&mut s, 1, StepState::Compensating, 3);
            s.process.locked_by = Some(SCHEDULER.into());
            s.process.complete_by = s.steps[1].complete_by;
            3
        }
        ProcessState::Processed => {
            for index in 0..3 {
                step(&mut s, index, StepState::Completed, index as u128 + 1);
            }
            3
        }
        ProcessState::Compensated => {
            step(&mut s, 0, StepState::Compensated, 3);
            step(&mut s, 1, StepState::Failed, 2);
            3
        }
        ProcessState::Error => {
            step(&mut s, 0, StepState::Compensating, 3);
            step(&mut s, 1, StepState::Failed, 2);
            3
        }
    };
    (s, attempt(current))
}

fn reply(attempt_id: AttemptId, outcome: StepOutcome) -> StepReply {
    StepReply {
        queued_ms: None,
        slot_wait_ms: None,
        retry_after_ms: None,
        call_ms: None,
        schema_version: SCHEMA_VERSION,
        order_id: "o-1".into(),
        step: "charge_payment".into(),
        attempt_id,
        agent_id: "agent-1".into(),
        outcome,
    }
}

fn succeeded() -> StepOutcome {
    StepOutcome::Succeeded {
        result: serde_json::json!({ "id": "new" }),
    }
}

fn failed(permanent: bool) -> StepOutcome {
    StepOutcome::Failed {
        error: "no".into(),
        permanent,
        maybe_applied: false,
    }
}

/// What an event did, in one word: the state it led to, or why nothing changed.
fn outcome(decision: &Decision, before: ProcessState) -> String {
    match &decision.verdict {
        Verdict::Applied | Verdict::Resubmitted(_) | Verdict::Resumed { .. } => {
            let after = decision.process.as_ref().map_or(before, |p| p.state);
            after.as_str().to_owned()
        }
        Verdict::NotResumable(_) => "not resumable".into(),
        Verdict::NotPutBack(_) => "not put back".into(),
        Verdict::NotMovable(_) => "not movable".into(),
        Verdict::Stale(_) => "stale".into(),
        Verdict::Unchanged(_) => "-".into(),
        Verdict::Refused(_) => "refused".into(),
    }
}

#[test]
fn every_state_meets_every_event() {
    use ProcessState::*;
    // Columns: submitted, claimed, reply succeeded / failed for good /
    // failed transiently / for another attempt, deadline missed, dead
    // letter, resubmitted, cancelled, resumed.
    let table: [(ProcessState, [&str; 11]); 6] = [
        (
            Pending,
            [
                "-",
                "processing",
                "stale",
                "stale",
                "stale",
                "stale",
                "-",
                "compensating",
                "refused",
                "compensating",
                "refused",
            ],
        ),
        (
            Processing,
            [
                "-",
                "-",
                "processing",
                "compensating",
                "processing",
                "stale",
                "pending",
                "compensating",
                "refused",
                "compensating",
                "refused",
            ],
        ),
        (
            Compensating,
            [
                "-",
                "-",
                "compensating",
                "error",
                "compensating",
                "stale",
                "compensating",
                "error",
                "refused",
                "refused",
                "refused",
            ],
        ),
        (
            Processed,
            [
                "-", "-", "stale", "stale", "stale", "stale", "-", "-", "refused", "refused",
                "refused",
            ],
        ),
        (
            Compensated,
            [
                "-", "-", "stale", "stale", "stale", "stale", "-", "-", "pending", "refused",
                "refused",
            ],
        ),
        (
            Error,
            [
                "-",
                "-",
                "stale",
                "stale",
                "stale",
                "stale",
                "-",
                "-",
                "compensating",
                "refused",
                "not resumable",
            ],
        ),
    ];
    for (state, expected) in table {
        let (snapshot, current) = order_in(state);
        let (ok, permanent, transient, other) = (
            reply(current, succeeded()),
            reply(current, failed(true)),
            reply(current, failed(false)),
            reply(attempt(1234), succeeded()),
        );
        let policy = policy();
        let events = [
            Event::Submitted,
            Event::Claimed,
            Event::Reply(&ok),
            Event::Reply(&permanent),
            Event::Reply(&transient),
            Event::Reply(&other),
            Event::DeadlineMissed {
                policy: &policy,
                jitter: 0.5,
            },
            Event::DeadLettered {
                attempt_id: current,
                reason: "poison",
                no_call: false,
            },
            Event::Resubmitted { earlier: 0 },
            Event::Cancelled {
                reason: "customer asked",
            },
            Event::Resumed {
                reason: "fixed",
                earlier: 0,
            },
        ];
        // Late enough for every deadline and backoff to have passed.
        let ctx = ctx(t(60));
        for (event, want) in events.iter().zip(expected) {
            let decision = decide(&snapshot, event, &ctx);
            assert_eq!(
                outcome(&decision, state),
                want,
                "{state} + {event:?}: {decision:#?}"
            );
            if !matches!(
                decision.verdict,
                Verdict::Applied | Verdict::Resubmitted(_) | Verdict::Resumed { .. }
            ) {
                assert!(
                    decision.process.is_none() && decision.steps.is_empty(),
                    "{state} + {event:?} changed rows"
                );
                assert!(decision.alert.is_none() && decision.progress.statuses.is_empty());
                assert!(decision.progress.dispatches.is_empty());
                let stale_line = decision
                    .history
                    .iter()
                    .all(|h| h.event == HistoryEvent::StaleReply);
                assert!(
                    stale_line && decision.history.len() <= 1,
                    "{state} + {event:?}"
                );
            }
            for change in &decision.steps {
                let before = &snapshot.steps[change.row.position as usize];
                assert_eq!(
                    (change.expected_state, change.expected_attempt_id),
                    (before.state, before.attempt_id)
                );
            }
        }
    }
}

#[test]
fn a_submitted_order_is_held_and_its_first_step_dispatched() {
    let decision = decide(&fresh(), &Event::Submitted, &ctx(t(0)));
    let process = decision.process.unwrap();
    assert_eq!(process.state, ProcessState::Processing);
    assert_eq!(process.locked_by.as_deref(), Some(SCHEDULER));
    assert_eq!(process.complete_by, Some(t(5)));
    let events: Vec<_> = decision.history.iter().map(|h| h.event).collect();
    assert_eq!(events, [HistoryEvent::Received, HistoryEvent::Dispatched]);
    assert_eq!(
        decision.history[1].detail.as_deref(),
        Some("attempt 1: inventory.reserve")
    );
    let dispatch = decision.progress.dispatches.into_iter().next().unwrap();
    assert_eq!(dispatch.idempotency_key, "o-1:reserve_stock");
    assert_eq!((dispatch.attempt, dispatch.attempt_id), (1, attempt(99)));
    assert_eq!(dispatch.payload["results"], serde_json::json!({}));
    assert_eq!(decision.progress.statuses[0].event, StatusEvent::Received);
}

#[test]
fn an_order_its_quota_holds_back_is_received_and_claimed_when_its_time_comes() {
    let mut held = fresh();
    held.process.not_before = t(3);
    let decision = decide(&held, &Event::Submitted, &ctx(t(0)));
    assert_eq!(decision.verdict, Verdict::Applied);
    let events: Vec<_> = decision.history.iter().map(|h| h.event).collect();
    assert_eq!(
        events,
        [HistoryEvent::Received],
        "received, nothing started"
    );
    let detail = decision.history[0].detail.as_deref().unwrap_or_default();
    assert!(
        detail.contains("over its tenant's quota: starts at"),
        "{detail}"
    );
    assert!(decision.progress.dispatches.is_empty());
    assert_eq!(decision.progress.statuses[0].event, StatusEvent::Received);
    if let Some(process) = &decision.process {
        assert_eq!(process.state, ProcessState::Pending);
        assert_eq!(process.not_before, t(3));
    }
    let early = decide(&held, &Event::Claimed, &ctx(t(2)));
    assert!(early.progress.dispatches.is_empty(), "not before its time");
    let claimed = decide(&held, &Event::Claimed, &ctx(t(3)));
    assert_eq!(claimed.process.unwrap().state, ProcessState::Processing);
    let dispatch = claimed.progress.dispatches.into_iter().next().unwrap();
    assert_eq!(
        (dispatch.step.as_str(), dispatch.attempt),
        ("reserve_stock", 1)
    );
}

#[test]
fn a_success_starts_the_next_step_with_the_results_so_far() {
    let (snapshot, current) = order_in(ProcessState::Processing);
    let ok = reply(current, succeeded());
    let decision = decide(&snapshot, &Event::Reply(&ok), &ctx(t(3)));
    let dispatch = decision.progress.dispatches.into_iter().next().unwrap();
    assert_eq!(dispatch.step, "create_shipment");
    assert_eq!(
        dispatch.payload["results"]["charge_payment"],
        serde_json::json!({ "id": "new" })
    );
    assert_eq!(
        dispatch.payload["results"]["reserve_stock"],
        serde_json::json!({ "id": "r-0" })
    );
    let events: Vec<_> = decision.history.iter().map(|h| h.event).collect();
    assert_eq!(
        events,
        [HistoryEvent::StepCompleted, HistoryEvent::Dispatched]
    );
    assert_eq!(decision.history[0].detail.as_deref(), Some("by agent-1"));
}

#[test]
fn an_undo_carries_the_result_of_its_own_step_only() {
    let (mut snapshot, _) = order_in(ProcessState::Compensating);
    // The reservation and the charge completed; the charge is undone first.
    step(&mut snapshot, 1, StepState::Completed, 2);
    snapshot.process.locked_by = None;
    let decision = decide(&snapshot, &Event::Claimed, &ctx(t(60)));
    let undo = &decision.progress.dispatches[0];
    assert_eq!(undo.step, "charge_payment");
    assert_eq!(
        undo.payload["results"],
        serde_json::json!({ "charge_payment": { "id": "r-1" } })
    );
    assert_eq!(undo.payload["order"], snapshot.body);
}

/// The order whose charge refunds with `DELETE /charges/{id}`, the id
/// read from the charge's result.
fn refunding_by_id() -> Snapshot {
    charging_with(crate::machine::call::StepCalls {
        compensation: Some(crate::machine::call::CallTemplate {
            method: Some("DELETE".into()),
            path: Some("/charges/${/results/charge_payment/id}".into()),
            body: None,
        }),
        ..Default::default()
    })
}

#[test]
fn an_undo_whose_template_finds_no_value_is_never_sent_and_the_order_ends_in_error() {
    // The charge timed out: maybe applied, and no id came back.
    let mut snapshot = refunding_by_id();
    snapshot.process.state = ProcessState::Compensating;
    step(&mut snapshot, 0, StepState::Completed, 1);
    step(&mut snapshot, 1, StepState::Running, 2);
    snapshot.steps[1].maybe_applied = true;
    let decision = decide(&snapshot, &Event::Claimed, &ctx(t(60)));
    assert!(decision.progress.dispatches.is_empty(), "{decision:#?}");
    let alert = decision.alert.as_ref().expect("an alert");
    assert_eq!(alert.kind, AlertKind::RequestNotBuilt);
    assert!(
        alert
            .message
            .contains("the undo of step charge_payment was not sent")
            && alert.message.contains("${/results/charge_payment/id}"),
        "{}",
        alert.message
    );
    snapshot.apply(&decision);
    assert_eq!(snapshot.process.state, ProcessState::Error);
    // Resubmitting it resumes the compensation with a fresh undo key.
    assert_eq!(snapshot.steps[1].state, StepState::Compensating);
    assert!(snapshot.steps[1].undo_refused);
    let resubmitted = decide(&snapshot, &Event::Resubmitted { earlier: 0 }, &ctx(t(61)));
    assert_eq!(
        resubmitted.verdict,
        Verdict::Resubmitted(ResubmitAction::CompensationResumed)
    );
    // With its result known (an answer kept), the same undo names the charge.
    let mut snapshot = refunding_by_id();
    snapshot.process.state = ProcessState::Compensating;
    step(&mut snapshot, 0, StepState::Completed, 1);
    step(&mut snapshot, 1, StepState::Completed, 2);
    let decision = decide(&snapshot, &Event::Claimed, &ctx(t(60)));
    let undo = &decision.progress.dispatches[0];
    assert_eq!(
        (undo.method.as_deref(), undo.path.as_deref()),
        (Some("DELETE"), Some("/charges/r-1"))
    );
}

#[test]
fn an_action_whose_request_cannot_be_built_is_refused_unsent_and_the_order_undone() {
    let mut snapshot = charging_with(crate::machine::call::StepCalls {
        action: Some(crate::machine::call::CallTemplate {
            method: None,
            path: Some("/accounts/${/attributes/account}/charges".into()),
            body: None,
        }),
        ..Default::default()
    });
    snapshot.process.state = ProcessState::Processing;
    step(&mut snapshot, 0, StepState::Running, 1);
    snapshot.process.locked_by = Some(SCHEDULER.into());
    let ok = reply(attempt(1), succeeded());
    let decision = decide(&snapshot, &Event::Reply(&ok), &ctx(t(3)));
    let kinds: Vec<(&str, StepKind)> = decision
        .progress
        .dispatches
        .iter()
        .map(|d| (d.step.as_str(), d.kind))
        .collect();
    assert_eq!(kinds, [("reserve_stock", StepKind::Compensation)]);
    assert_eq!(
        decision.alert.as_ref().map(|a| a.kind),
        Some(AlertKind::RequestNotBuilt)
    );
    snapshot.apply(&decision);
    assert_eq!(snapshot.steps[1].state, StepState::Failed);
    assert_eq!(snapshot.steps[1].attempt, 0, "no attempt was started");
    assert!(!snapshot.steps[1].needs_undo());
}

#[test]
fn a_request_over_the_message_limit_is_refused_where_it_is_built() {
    let (mut snapshot, current) = order_in(ProcessState::Processing);
    // The reservation and the charge answered 9 kB each: the shipment's
    // request would carry both.
    snapshot.steps[0].result = Some(serde_json::json!({ "note": "r".repeat(9_000) }));
    let big = reply(
        current,
        StepOutcome::Succeeded {
            result: serde_json::json!({ "receipt": "x".repeat(9_000) }),
        },
    );
    let small = Context {
        max_request_bytes: 16_384,
        ..ctx(t(3))
    };
    let decision = decide(&snapshot, &Event::Reply(&big), &small);
    let alert = decision.alert.as_ref().expect("an alert");
    assert_eq!(alert.kind, AlertKind::RequestNotBuilt);
    assert!(
        alert.message.contains("over the 16384-byte limit")
            && alert
                .message
                .contains("the request of step create_shipment was not sent"),
        "{}",
        alert.message
    );
    // Nothing went to shipping; the charge's refund, carrying only its own
    // result, fits and goes.
    let sent: Vec<(&str, StepKind)> = decision
        .progress
        .dispatches
        .iter()
        .map(|d| (d.step.as_str(), d.kind))
        .collect();
    assert_eq!(sent, [("charge_payment", StepKind::Compensation)]);
}

#[test]
fn the_last_success_finishes_the_order() {
    let (mut snapshot, _) = order_in(ProcessState::Processing);
    step(&mut snapshot, 1, StepState::Completed, 2);
    step(&mut snapshot, 2, StepState::Running, 4);
    let ok = reply(attempt(4), succeeded());
    let decision = decide(&snapshot, &Event::Reply(&ok), &ctx(t(6)));
    let process = decision.process.unwrap();
    assert_eq!(
        (process.state, process.locked_by, process.complete_by),
        (ProcessState::Processed, None, None)
    );
    let statuses: Vec<_> = decision.progress.statuses.iter().map(|s| s.event).collect();
    assert_eq!(
        statuses,
        [StatusEvent::StepCompleted, StatusEvent::Processed]
    );
}

#[test]
fn a_refusal_undoes_the_completed_steps_from_the_last() {
    let (snapshot, current) = order_in(ProcessState::Processing);
    let refused = reply(current, failed(true));
    let decision = decide(&snapshot, &Event::Reply(&refused), &ctx(t(3)));
    let dispatch = decision.progress.dispatches.into_iter().next().unwrap();
    // The refused charge applied nothing: the reservation is released.
    assert_eq!(
        (dispatch.step.as_str(), dispatch.kind),
        ("reserve_stock", StepKind::Compensation)
    );
    assert_eq!(dispatch.idempotency_key, "o-1:reserve_stock:undo");
    assert_eq!(dispatch.action, "release");
    assert_eq!(decision.process.unwrap().failure_count, 0);
}

#[test]
fn a_step_without_compensation_is_not_undone() {
    let (mut snapshot, _) = order_in(ProcessState::Compensating);
    step(&mut snapshot, 1, StepState::Compensated, 3);
    step(&mut snapshot, 2, StepState::Completed, 4);
    snapshot.process.locked_by = None;
    let decision = decide(&snapshot, &Event::Claimed, &ctx(t(60)));
    assert_eq!(
        decision
            .progress
            .dispatches
            .into_iter()
            .next()
            .unwrap()
            .step,
        "reserve_stock"
    );
}

#[test]
fn missed_deadlines_back_off_then_give_up_then_fail_with_an_alert() {
    let policy = policy();
    let missed = Event::DeadlineMissed {
        policy: &policy,
        jitter: 0.0,
    };
    let (mut snapshot, _) = order_in(ProcessState::Processing);
    snapshot.process.failure_count = 1;
    let decision = decide(&snapshot, &missed, &ctx(t(60)));
    let process = decision.process.unwrap();
    // Second failure: 2 s backoff, half of it with jitter 0.
    assert_eq!(
        (process.state, process.failure_count),
        (ProcessState::Pending, 2)
    );
    assert_eq!(process.not_before, t(61));
    assert_eq!(decision.history[0].event, HistoryEvent::RetryScheduled);
    assert!(decision.steps[0]
        .row
        .last_error
        .as_deref()
        .unwrap()
        .contains("missed its deadline"));

    snapshot.process.failure_count = 2;
    let decision = decide(&snapshot, &missed, &ctx(t(60)));
    let process = decision.process.unwrap();
    assert_eq!(
        (process.state, process.failure_count),
        (ProcessState::Compensating, 0)
    );
    assert_eq!(
        decision.progress.statuses[0].event,
        StatusEvent::Compensating
    );

    let (mut snapshot, _) = order_in(ProcessState::Compensating);
    snapshot.process.failure_count = 2;
    let decision = decide(&snapshot, &missed, &ctx(t(60)));
    assert_eq!(decision.process.unwrap().state, ProcessState::Error);
    assert_eq!(
        decision.alert.unwrap().kind,
        AlertKind::CompensationExhausted
    );
    assert_eq!(decision.progress.statuses[0].event, StatusEvent::Failed);
}

#[test]
fn a_deadline_not_yet_passed_changes_nothing() {
    let policy = policy();
    let missed = Event::DeadlineMissed {
        policy: &policy,
        jitter: 0.5,
    };
    let (snapshot, _) = order_in(ProcessState::Processing);
    let decision = decide(&snapshot, &missed, &ctx(t(2)));
    assert!(matches!(decision.verdict, Verdict::Unchanged(_)));
}

#[test]
fn a_cancelled_order_waits_for_its_step_in_flight_before_undoing() {
    let (snapshot, _) = order_in(ProcessState::Processing);
    let decision = decide(&snapshot, &Event::Cancelled { reason: "fraud" }, &ctx(t(3)));
    let process = decision.process.unwrap();
    assert_eq!(process.state, ProcessState::Compensating);
    assert_eq!(process.locked_by, None);
    // The charge in flight may still land until its deadline plus the grace.
    assert_eq!(process.not_before, t(9));
    assert_eq!(decision.history[0].event, HistoryEvent::Cancelled);
    assert_eq!(
        decision.history[0].detail.as_deref(),
        Some("cancelled by scheduler-1: fraud")
    );
}

/// The order in `Processing` with its charge (attempt 2, deadline t(7)) in
/// flight, cancelled at t(3): compensating, held by nobody until t(9).
fn cancelled_during_the_charge() -> (Snapshot, AttemptId) {
    let (mut snapshot, charge) = order_in(ProcessState::Processing);
    let decision = decide(&snapshot, &Event::Cancelled { reason: "fraud" }, &ctx(t(3)));
    snapshot.apply(&decision);
    (snapshot, charge)
}

/// The order in `Processing` whose charge's request was dead-lettered at
/// t(3): refused unread by its agent (`no_call`) or not.
fn charge_dead_lettered(no_call: bool) -> Snapshot {
    let (mut snapshot, charge) = order_in(ProcessState::Processing);
    let dead = Event::DeadLettered {
        attempt_id: charge,
        reason: "dead-lettered",
        no_call,
    };
    snapshot.apply(&decide(&snapshot, &dead, &ctx(t(3))));
    snapshot
}

#[test]
fn a_dead_lettered_request_of_a_lone_step_is_undone_only_after_its_deadline_and_the_grace() {
    let snapshot = charge_dead_lettered(false);
    assert_eq!(snapshot.process.state, ProcessState::Compensating);
    // Its call may have left on a connection that then died: it may land
    // until its deadline (t(7)) plus the grace.
    assert_eq!(
        (
            snapshot.process.locked_by.as_deref(),
            snapshot.process.not_before
        ),
        (None, t(9))
    );
    assert!(snapshot.steps[1].maybe_applied);
    let early = decide(&snapshot, &Event::Claimed, &ctx(t(8)));
    assert!(matches!(early.verdict, Verdict::Unchanged(_)));
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(9)));
    let undo = claimed.progress.dispatches.first().expect("the refund");
    assert_eq!(
        (undo.step.as_str(), undo.kind),
        ("charge_payment", StepKind::Compensation)
    );
}

#[test]
fn a_request_its_agent_refused_unread_leaves_its_step_nothing_to_undo() {
    let snapshot = charge_dead_lettered(true);
    assert_eq!(snapshot.steps[1].state, StepState::Failed);
    assert!(!snapshot.steps[1].needs_undo());
    // The reservation's outcome is known: its undo may go at once.
    assert_eq!(snapshot.process.not_before, t(3));
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(3)));
    let undo = claimed.progress.dispatches.first().expect("the release");
    assert_eq!(undo.step, "reserve_stock");
}

#[test]
fn a_late_success_after_a_cancel_is_kept_and_its_undo_goes_at_once_with_its_result() {
    let (mut snapshot, charge) = cancelled_during_the_charge();
    assert_eq!(snapshot.process.not_before, t(9));
    let late = reply(
        charge,
        StepOutcome::Succeeded {
            result: serde_json::json!({ "id": "ch_1" }),
        },
    );
    let decision = decide(&snapshot, &Event::Reply(&late), &ctx(t(5)));
    assert_eq!(decision.verdict, Verdict::Applied, "{decision:#?}");
    assert!(
        decision.progress.dispatches.is_empty(),
        "held by nobody: a claim undoes it"
    );
    snapshot.apply(&decision);
    assert_eq!(snapshot.steps[1].state, StepState::Completed);
    assert_eq!(snapshot.process.not_before, t(5));
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(5)));
    let undo = claimed.progress.dispatches.first().expect("the refund");
    assert_eq!(
        (undo.step.as_str(), undo.kind),
        ("charge_payment", StepKind::Compensation)
    );
    assert_eq!(
        undo.payload["results"]["charge_payment"],
        serde_json::json!({ "id": "ch_1" }),
        "the refund names the charge it undoes"
    );
}

#[test]
fn a_late_refusal_after_a_cancel_leaves_nothing_to_undo_for_its_step() {
    let (mut snapshot, charge) = cancelled_during_the_charge();
    let late = reply(charge, failed(true));
    let decision = decide(&snapshot, &Event::Reply(&late), &ctx(t(5)));
    snapshot.apply(&decision);
    assert_eq!(snapshot.steps[1].state, StepState::Failed);
    assert!(decision
        .history
        .iter()
        .any(|line| line.event == HistoryEvent::LateAnswer));
    // Only the reservation is left to undo, and at once.
    assert_eq!(snapshot.process.not_before, t(5));
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(5)));
    assert_eq!(claimed.progress.dispatches[0].step, "reserve_stock");
    // A late outcome that stays unknown keeps the step to undo, after its
    // deadline and the grace.
    let (mut snapshot, charge) = cancelled_during_the_charge();
    let unknown = reply(
        charge,
        StepOutcome::Failed {
            error: "timed out".into(),
            permanent: false,
            maybe_applied: true,
        },
    );
    snapshot.apply(&decide(&snapshot, &Event::Reply(&unknown), &ctx(t(5))));
    assert!(snapshot.steps[1].maybe_applied);
    assert_eq!(snapshot.process.not_before, t(9));
}

#[test]
fn a_resubmitted_order_restarts_with_fresh_keys_of_a_new_generation() {
    let (snapshot, _) = order_in(ProcessState::Compensated);
    let decision = decide(&snapshot, &Event::Resubmitted { earlier: 1 }, &ctx(t(60)));
    assert_eq!(
        decision.verdict,
        Verdict::Resubmitted(ResubmitAction::WorkflowRestarted)
    );
    let keys: Vec<_> = decision
        .steps
        .iter()
        .map(|c| c.row.idempotency_key.as_str())
        .collect();
    assert_eq!(
        keys,
        [
            "o-1:reserve_stock:r2",
            "o-1:charge_payment:r2",
            "o-1:create_shipment:r2"
        ]
    );
    assert!(decision.resolve_alerts);

    let (snapshot, _) = order_in(ProcessState::Error);
    let decision = decide(&snapshot, &Event::Resubmitted { earlier: 0 }, &ctx(t(60)));
    assert_eq!(
        decision.verdict,
        Verdict::Resubmitted(ResubmitAction::CompensationResumed)
    );
    assert!(decision.steps.is_empty());
}

#[test]
fn applying_a_decision_in_memory_gives_the_rows_it_describes() {
    let (mut snapshot, current) = order_in(ProcessState::Processing);
    let ok = reply(current, succeeded());
    let decision = decide(&snapshot, &Event::Reply(&ok), &ctx(t(3)));
    snapshot.apply(&decision);
    let states: Vec<_> = snapshot.steps.iter().map(|s| s.state).collect();
    assert_eq!(
        states,
        [
            StepState::Completed,
            StepState::Completed,
            StepState::Running
        ]
    );
    assert_eq!(snapshot.process.complete_by, Some(t(8)));
    // The same reply again is stale now.
    let again = decide(&snapshot, &Event::Reply(&ok), &ctx(t(4)));
    assert!(matches!(again.verdict, Verdict::Stale(_)));
}

#[test]
fn a_refusal_after_an_unknown_outcome_is_still_undone() {
    let (snapshot, current) = order_in(ProcessState::Processing);
    // The charge timed out at the agent: maybe applied.
    let unknown = reply(
        current,
        StepOutcome::Failed {
            error: "no answer within 5s".into(),
            permanent: false,
            maybe_applied: true,
        },
    );
    let decision = decide(&snapshot, &Event::Reply(&unknown), &ctx(t(3)));
    let mut snapshot = snapshot;
    snapshot.apply(&decision);
    assert!(snapshot.steps[1].maybe_applied);
    // The retry of the same key is refused: the first call may still have
    // landed, and may land until the attempt's deadline (t(7)) plus the
    // grace: the refund waits until then.
    let refused = reply(current, failed(true));
    let decision = decide(&snapshot, &Event::Reply(&refused), &ctx(t(4)));
    assert!(decision.progress.dispatches.is_empty(), "{decision:#?}");
    snapshot.apply(&decision);
    assert_eq!(snapshot.process.state, ProcessState::Compensating);
    assert_eq!(
        (
            snapshot.process.locked_by.as_deref(),
            snapshot.process.not_before
        ),
        (None, t(9))
    );
    assert!(decision
        .history
        .iter()
        .any(|line| line.event == HistoryEvent::UndoWaits));
    let early = decide(&snapshot, &Event::Claimed, &ctx(t(8)));
    assert!(matches!(early.verdict, Verdict::Unchanged(_)));
    let decision = decide(&snapshot, &Event::Claimed, &ctx(t(9)));
    let dispatch = decision.progress.dispatches.into_iter().next().unwrap();
    assert_eq!(
        (dispatch.step.as_str(), dispatch.kind),
        ("charge_payment", StepKind::Compensation)
    );
    assert_eq!(dispatch.action, "refund");
}

#[test]
fn a_step_that_missed_its_deadline_counts_as_maybe_applied() {
    let policy = policy();
    let (snapshot, _) = order_in(ProcessState::Processing);
    let missed = Event::DeadlineMissed {
        policy: &policy,
        jitter: 0.5,
    };
    let decision = decide(&snapshot, &missed, &ctx(t(60)));
    assert!(decision.steps[0].row.maybe_applied);
}

#[test]
fn the_supervisor_waits_out_the_grace_period_after_a_deadline() {
    let policy = policy();
    let (snapshot, _) = order_in(ProcessState::Processing);
    let missed = Event::DeadlineMissed {
        policy: &policy,
        jitter: 0.5,
    };
    // complete_by is t(7); grace 2 s.
    assert!(matches!(
        decide(&snapshot, &missed, &ctx(t(8))).verdict,
        Verdict::Unchanged(_)
    ));
    assert_eq!(
        decide(&snapshot, &missed, &ctx(t(10))).verdict,
        Verdict::Applied
    );
}

#[test]
fn a_request_must_start_a_margin_before_its_deadline() {
    let decision = decide(&fresh(), &Event::Submitted, &ctx(t(0)));
    let dispatch = decision.progress.dispatches.into_iter().next().unwrap();
    assert_eq!(dispatch.dispatched_at, t(0));
    assert_eq!(dispatch.complete_by, t(5));
    assert_eq!(dispatch.start_by, t(4));
}

#[test]
fn an_undo_refused_for_good_is_retried_with_a_fresh_key_after_resubmission() {
    let (snapshot, current) = order_in(ProcessState::Compensating);
    let refused = reply(current, failed(true));
    let decision = decide(&snapshot, &Event::Reply(&refused), &ctx(t(4)));
    let mut snapshot = snapshot;
    snapshot.apply(&decision);
    assert_eq!(snapshot.process.state, ProcessState::Error);
    assert!(snapshot.steps[1].undo_refused);
    let decision = decide(&snapshot, &Event::Resubmitted { earlier: 0 }, &ctx(t(60)));
    assert_eq!(
        decision.verdict,
        Verdict::Resubmitted(ResubmitAction::CompensationResumed)
    );
    snapshot.apply(&decision);
    snapshot.process.not_before = t(0);
    let decision = decide(&snapshot, &Event::Claimed, &ctx(t(61)));
    let dispatch = decision.progress.dispatches.into_iter().next().unwrap();
    assert_eq!(dispatch.idempotency_key, "o-1:charge_payment:undo:r1");
}

#[test]
fn an_undone_step_keeps_its_action_result_beside_the_undo_result() {
    let (snapshot, current) = order_in(ProcessState::Compensating);
    let ok = reply(current, succeeded());
    let decision = decide(&snapshot, &Event::Reply(&ok), &ctx(t(4)));
    let row = &decision
        .steps
        .iter()
        .find(|c| c.row.position == 1)
        .unwrap()
        .row;
    assert_eq!(row.state, StepState::Compensated);
    assert_eq!(row.result, snapshot.steps[1].result);
    assert_eq!(row.undo_result, Some(serde_json::json!({ "id": "new" })));
}

#[test]
fn an_answer_with_a_nul_character_is_stored_without_it() {
    let (snapshot, current) = order_in(ProcessState::Processing);
    let odd = reply(
        current,
        StepOutcome::Succeeded {
            result: serde_json::json!({ "id\u{0}": ["a\u{0}b", 1] }),
        },
    );
    let decision = decide(&snapshot, &Event::Reply(&odd), &ctx(t(3)));
    let stored = decision.steps[0].row.result.clone().unwrap();
    assert_eq!(
        stored,
        serde_json::json!({ "id\u{fffd}": ["a\u{fffd}b", 1] })
    );
}

#[test]
fn an_order_whose_agent_has_no_free_slot_waits_in_its_line_without_a_deadline() {
    let closed = Context {
        closed: Some("inventory"),
        ..ctx(t(0))
    };
    let decision = decide(&fresh(), &Event::Submitted, &closed);
    let process = decision.process.clone().unwrap();
    assert_eq!(process.state, ProcessState::Pending);
    assert_eq!((process.locked_by, process.complete_by), (None, None));
    assert_eq!(process.waiting_for.as_deref(), Some("inventory"));
    // Priority 5: five steps of ten seconds ahead of a priority-0 order.
    assert_eq!(process.admit_key, Some(t(-50)));
    assert!(decision.progress.dispatches.is_empty());
    let events: Vec<_> = decision.history.iter().map(|h| h.event).collect();
    assert_eq!(events, [HistoryEvent::Received, HistoryEvent::Queued]);
    assert_eq!(
        decision.admission,
        [AdmissionDelta {
            agent: "inventory".into(),
            in_flight: 0,
            waiting: 1,
            ..AdmissionDelta::default()
        }]
    );
    // Its claim takes it out of the line and into a slot.
    let mut snapshot = fresh();
    snapshot.apply(&decision);
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(1)));
    assert_eq!(
        claimed.progress.dispatches.first().unwrap().step,
        "reserve_stock"
    );
    assert_eq!(claimed.process.as_ref().unwrap().waiting_for, None);
    assert_eq!(
        claimed.admission,
        [AdmissionDelta {
            agent: "inventory".into(),
            in_flight: 1,
            waiting: -1,
            ..AdmissionDelta::default()
        }]
    );
    assert_eq!(
        claimed
            .takes_slots()
            .into_iter()
            .map(|(agent, _)| agent)
            .collect::<Vec<_>>(),
        vec!["inventory"]
    );
}

#[test]
fn a_success_gives_its_slot_back_and_takes_the_next_agent_s() {
    let (snapshot, current) = order_in(ProcessState::Processing);
    let ok = StepReply {
        // Of its second in flight (dispatched at t(2)), 0.4 s queued, 0.3 s
        // of it for a call slot.
        queued_ms: Some(400),
        slot_wait_ms: Some(300),
        retry_after_ms: None,
        call_ms: None,
        ..reply(current, succeeded())
    };
    let decision = decide(&snapshot, &Event::Reply(&ok), &ctx(t(3)));
    assert_eq!(
        decision.admission,
        [
            AdmissionDelta {
                agent: "payment".into(),
                in_flight: -1,
                waiting: 0,
                unstarted: 0,
                in_flight_ms: 1000,
                queued_ms: 400,
                slot_wait_ms: 300,
            },
            AdmissionDelta {
                agent: "shipping".into(),
                in_flight: 1,
                ..AdmissionDelta::default()
            },
        ]
    );
    // With shipping full, the order waits for it, and payment's slot is free.
    let closed = Context {
        closed: Some("shipping"),
        ..ctx(t(3))
    };
    let decision = decide(&snapshot, &Event::Reply(&ok), &closed);
    assert_eq!(
        decision.process.unwrap().waiting_for.as_deref(),
        Some("shipping")
    );
    assert_eq!(
        decision.admission,
        [
            AdmissionDelta {
                agent: "payment".into(),
                in_flight: -1,
                waiting: 0,
                unstarted: 0,
                in_flight_ms: 1000,
                queued_ms: 400,
                slot_wait_ms: 300,
            },
            AdmissionDelta {
                agent: "shipping".into(),
                waiting: 1,
                ..AdmissionDelta::default()
            },
        ]
    );
}

#[test]
fn an_undo_waits_ahead_of_any_new_work() {
    let undo = admit_key(t(0), 0, true);
    let urgent_later = admit_key(t(3600), 9, false);
    assert!(undo < urgent_later);
    // A priority-9 order that started waiting 80 s after a priority-1 order goes first;
    // one 100 s after it does not: the low one waits at most 80 s behind it.
    assert!(admit_key(t(80), 9, false) <= admit_key(t(0), 1, false));
    assert!(admit_key(t(100), 9, false) > admit_key(t(0), 1, false));
}

fn not_started() -> StepOutcome {
    StepOutcome::NotStarted {
        reason: "start-by passed in the queue".into(),
    }
}

#[test]
fn an_attempt_that_never_started_goes_back_to_its_line_without_a_failure() {
    let (snapshot, current) = order_in(ProcessState::Processing);
    let decision = decide(
        &snapshot,
        &Event::Reply(&reply(current, not_started())),
        &ctx(t(9)),
    );
    assert_eq!(decision.verdict, Verdict::Applied);
    let process = decision.process.clone().unwrap();
    assert_eq!(process.state, ProcessState::Pending);
    assert_eq!(process.failure_count, 0);
    assert_eq!((process.locked_by, process.complete_by), (None, None));
    assert_eq!(process.waiting_for.as_deref(), Some("payment"));
    // Its place is when the attempt was dispatched (t(2)), not now: it has
    // waited since; priority 5 is worth 50 s.
    assert_eq!(process.admit_key, Some(t(2 - 50)));
    assert!(decision.progress.dispatches.is_empty());
    assert!(decision.progress.statuses.is_empty());
    let events: Vec<_> = decision.history.iter().map(|h| h.event).collect();
    assert_eq!(events, [HistoryEvent::NotStarted, HistoryEvent::Queued]);
    // Nothing can have reached the service: the step needs no undo.
    let step = &decision.steps[0].row;
    assert_eq!(
        (step.state, step.maybe_applied),
        (StepState::NotStarted, false)
    );
    assert!(!step.needs_undo());
    // The slot is given back, and it is no completion.
    assert_eq!(
        decision.admission,
        [AdmissionDelta {
            agent: "payment".into(),
            in_flight: -1,
            waiting: 1,
            unstarted: 1,
            // Dispatched at t(2), answered at t(9).
            in_flight_ms: 7000,
            queued_ms: 0,
            slot_wait_ms: 0,
        }]
    );
    // A claim starts a fresh attempt of the same step.
    let mut snapshot = snapshot;
    snapshot.apply(&decision);
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(10)));
    let dispatch = claimed.progress.dispatches.first().unwrap();
    assert_eq!(dispatch.step, "charge_payment");
    assert_eq!(claimed.steps[0].row.attempt, 3);
}

#[test]
fn an_undo_that_never_started_waits_ahead_of_new_work_and_stays_to_do() {
    let (snapshot, current) = order_in(ProcessState::Compensating);
    let decision = decide(
        &snapshot,
        &Event::Reply(&reply(current, not_started())),
        &ctx(t(9)),
    );
    let process = decision.process.clone().unwrap();
    assert_eq!(process.state, ProcessState::Compensating);
    assert_eq!(process.locked_by, None);
    assert_eq!(process.waiting_for.as_deref(), Some("payment"));
    assert_eq!(
        process.admit_key,
        Some(t(3 - 50) - chrono::TimeDelta::days(1))
    );
    assert_eq!(decision.steps[0].row.state, StepState::Compensating);
    assert!(decision.steps[0].row.needs_undo());
}

#[test]
fn an_attempt_that_never_started_keeps_an_earlier_maybe_applied_mark() {
    let (mut snapshot, current) = order_in(ProcessState::Processing);
    snapshot.steps[1].maybe_applied = true;
    let decision = decide(
        &snapshot,
        &Event::Reply(&reply(current, not_started())),
        &ctx(t(9)),
    );
    let step = &decision.steps[0].row;
    assert_eq!((step.state, step.maybe_applied), (StepState::Running, true));
    assert!(step.needs_undo());
    assert_eq!(decision.process.unwrap().failure_count, 0);
}

#[test]
fn a_not_started_reply_for_another_attempt_is_stale() {
    let (snapshot, _) = order_in(ProcessState::Processing);
    let decision = decide(
        &snapshot,
        &Event::Reply(&reply(attempt(1), not_started())),
        &ctx(t(9)),
    );
    assert!(matches!(decision.verdict, Verdict::Stale(_)));
    assert!(decision.admission.is_empty());
}

#[test]
fn an_event_changes_no_order_that_waits_for_none() {
    for state in [
        ProcessState::Pending,
        ProcessState::Processing,
        ProcessState::Compensating,
        ProcessState::Processed,
        ProcessState::Compensated,
        ProcessState::Error,
    ] {
        let (mut snapshot, _) = order_in(state);
        snapshot.mailbox.push(mail("approved", "m-1"));
        let decision = decide(&snapshot, &Event::EventArrived, &ctx(t(60)));
        assert!(
            matches!(decision.verdict, Verdict::Unchanged(_)),
            "{state}: {decision:#?}"
        );
        assert!(!decision.writes(), "{state}");
    }
}

/// Reserve, wait for `approved` (10 s, then `on_timeout`), a 2-second
/// delay, charge.
fn waiting_workflow(on_timeout: park::OnTimeout) -> Vec<NewStep> {
    let mut steps = workflow();
    steps.truncate(2);
    let wait = |name: &str, kind| NewStep {
        name: name.into(),
        kind,
        timeout: Duration::from_secs(10),
        group: None,
    };
    steps.insert(
        1,
        wait(
            "approval",
            Kind::Wait(WaitStep {
                event: "approved".into(),
                on_timeout,
                correlation_key: None,
                senders: Vec::new(),
            }),
        ),
    );
    steps.insert(
        2,
        wait(
            "cooling_off",
            Kind::Delay(DelayStep {
                delay_ms: 2000,
                not_before: None,
            }),
        ),
    );
    steps
}

fn mail(name: &str, id: &str) -> park::MailboxEvent {
    park::MailboxEvent {
        event_id: id.into(),
        name: name.into(),
        data: serde_json::json!({ "by": "ann" }),
        received_at: t(0),
        principals: Vec::new(),
        sender: None,
    }
}

/// An order of [`waiting_workflow`] whose reservation just succeeded.
fn reserved(on_timeout: park::OnTimeout) -> (Snapshot, StepReply) {
    reserved_in(
        &waiting_workflow(on_timeout),
        serde_json::json!({ "order_id": "o-1" }),
    )
}

/// An order `body` of `steps` whose first step (the reservation) is in
/// flight, and the reply that says it succeeded.
fn reserved_in(steps: &[NewStep], body: serde_json::Value) -> (Snapshot, StepReply) {
    let mut snapshot = Snapshot::new_order("o-1", body, None, None, 5, steps, t(0));
    snapshot.process.state = ProcessState::Processing;
    snapshot.process.locked_by = Some(SCHEDULER.into());
    step(&mut snapshot, 0, StepState::Running, 1);
    snapshot.process.complete_by = snapshot.steps[0].complete_by;
    (snapshot, reply(attempt(1), succeeded()))
}

#[test]
fn a_wait_parks_the_order_held_by_nobody_until_its_timeout() {
    let (mut snapshot, ok) = reserved(park::OnTimeout::Compensate);
    let decision = decide(&snapshot, &Event::Reply(&ok), &ctx(t(2)));
    let process = decision.process.clone().unwrap();
    assert_eq!(process.state, ProcessState::Pending);
    assert_eq!(process.locked_by, None);
    assert_eq!(process.complete_by, None);
    assert_eq!(process.not_before, t(12));
    assert_eq!(process.waiting_for, None);
    assert!(decision.progress.dispatches.is_empty());
    assert!(decision
        .progress
        .statuses
        .iter()
        .any(|s| s.event == StatusEvent::Waiting));
    // The inventory slot is given back; no slot is taken for the wait.
    assert_eq!(decision.admission.len(), 1);
    assert_eq!(decision.admission[0].in_flight, -1);
    snapshot.apply(&decision);
    assert!(slots_held(&snapshot.process, &snapshot.steps).is_empty());
    // Claimed before its time: nothing; an event of another name: nothing.
    let early = decide(&snapshot, &Event::Claimed, &ctx(t(5)));
    assert!(matches!(early.verdict, Verdict::Unchanged(_)));
    snapshot.mailbox.push(mail("rejected", "m-0"));
    let other = decide(&snapshot, &Event::EventArrived, &ctx(t(5)));
    assert!(matches!(other.verdict, Verdict::Unchanged(_)));
}

#[test]
fn an_event_during_the_wait_is_the_step_s_result_and_the_delay_parks_again() {
    let (mut snapshot, ok) = reserved(park::OnTimeout::Compensate);
    snapshot.apply(&decide(&snapshot, &Event::Reply(&ok), &ctx(t(2))));
    snapshot.mailbox.push(mail("approved", "m-1"));
    let decision = decide(&snapshot, &Event::EventArrived, &ctx(t(4)));
    assert_eq!(decision.used_event.as_deref(), Some("m-1"));
    snapshot.apply(&decision);
    assert_eq!(snapshot.steps[1].state, StepState::Completed);
    assert_eq!(
        snapshot.steps[1].result,
        Some(serde_json::json!({ "by": "ann" }))
    );
    // The cooling-off delay parks it until 2 s later.
    assert_eq!(snapshot.steps[2].state, StepState::Running);
    assert_eq!(snapshot.process.state, ProcessState::Pending);
    assert_eq!(snapshot.process.not_before, t(6));
    // Woken at its time, it charges the payment.
    let woken = decide(&snapshot, &Event::Claimed, &ctx(t(6)));
    snapshot.apply(&woken);
    assert_eq!(snapshot.steps[2].state, StepState::Completed);
    let dispatch = woken
        .progress
        .dispatches
        .into_iter()
        .next()
        .expect("the charge");
    assert_eq!(dispatch.step, "charge_payment");
    assert_eq!(dispatch.payload["results"]["approval"]["by"], "ann");
    assert_eq!(snapshot.process.state, ProcessState::Processing);
}

#[test]
fn an_event_already_in_the_mailbox_is_used_when_the_order_gets_there() {
    let (mut snapshot, ok) = reserved(park::OnTimeout::Compensate);
    snapshot.mailbox.push(mail("approved", "m-early"));
    let decision = decide(&snapshot, &Event::Reply(&ok), &ctx(t(2)));
    assert_eq!(decision.used_event.as_deref(), Some("m-early"));
    snapshot.apply(&decision);
    assert_eq!(snapshot.steps[1].state, StepState::Completed);
    // Straight on to the delay.
    assert_eq!(snapshot.steps[2].state, StepState::Running);
    assert_eq!(snapshot.process.not_before, t(4));
}

#[test]
fn what_an_event_becomes_is_one_rule_for_every_front_end() {
    use super::wait::{admission, EventAdmission};
    let anyone = vec!["amqp:x".to_owned(), "*".to_owned()];
    let kim = vec!["console:kim".to_owned()];
    let ann = vec!["console:ann".to_owned(), "role:approver".to_owned()];
    let (mut snapshot, ok) = reserved(park::OnTimeout::Compensate);
    let at = |snapshot: &Snapshot, event: &str, who: &[String]| {
        admission(
            snapshot.process.state,
            &snapshot.steps,
            event,
            who,
            "default",
        )
    };
    let kept = EventAdmission::Kept {
        step: "approval".into(),
    };
    // Before the wait: kept for it; an event no step waits for: unused,
    // naming what the order does wait for.
    assert_eq!(at(&snapshot, "approved", &anyone), kept);
    let EventAdmission::Unused { why } = at(&snapshot, "rejected", &anyone) else {
        panic!("no wait for rejected");
    };
    assert_eq!(why, "waits for approved, not for rejected");
    // A wait that names its senders refuses everyone else, before and at
    // the wait.
    snapshot.steps[1].kind = Kind::Wait(WaitStep {
        event: "approved".into(),
        on_timeout: park::OnTimeout::Compensate,
        correlation_key: None,
        senders: vec!["role:approver".into()],
    });
    let refused = EventAdmission::Refused {
        step: "approval".into(),
        senders: vec!["role:approver".into()],
    };
    assert_eq!(at(&snapshot, "approved", &kim), refused);
    assert_eq!(at(&snapshot, "approved", &ann), kept);
    assert!(!refused.sendable() && kept.sendable());
    // Parked at the wait: used.
    snapshot.apply(&decide(&snapshot, &Event::Reply(&ok), &ctx(t(2))));
    assert_eq!(
        at(&snapshot, "approved", &ann),
        EventAdmission::Used {
            step: "approval".into()
        }
    );
    assert_eq!(at(&snapshot, "approved", &kim), refused);
    // Past it: unused; ended: unused.
    let mut approval = mail("approved", "m-1");
    approval.principals.clone_from(&ann);
    snapshot.mailbox.push(approval);
    snapshot.apply(&decide(&snapshot, &Event::EventArrived, &ctx(t(4))));
    assert!(
        snapshot.mailbox.is_empty(),
        "the used event left the mailbox"
    );
    let EventAdmission::Unused { why } = at(&snapshot, "approved", &ann) else {
        panic!("past the wait");
    };
    assert_eq!(why, "is past its wait for approved (step approval)");
    snapshot.process.state = ProcessState::Processed;
    let EventAdmission::Unused { why } = at(&snapshot, "approved", &ann) else {
        panic!("ended");
    };
    assert_eq!(why, "is processed and waits for no event");
    // Stopped in error by the wait's timeout (`on_timeout = "fail"`): a
    // resume starts the wait again, so the event is kept for it; once an
    // undo began, nothing will use it.
    snapshot.process.state = ProcessState::Error;
    snapshot.steps[1].state = StepState::Failed;
    snapshot.steps[2].state = StepState::NotStarted;
    assert_eq!(at(&snapshot, "approved", &ann), kept);
    snapshot.steps[0].state = StepState::Compensating;
    assert!(matches!(
        at(&snapshot, "approved", &ann),
        EventAdmission::Unused { .. }
    ));
}

#[test]
fn an_event_the_parked_wait_refuses_from_its_sender_is_kept_for_a_later_wait_that_takes_it() {
    use super::wait::{admission, EventAdmission};
    let (mut snapshot, ok) = reserved(park::OnTimeout::Compensate);
    let wait = |senders: Vec<String>| WaitStep {
        event: "approved".into(),
        on_timeout: park::OnTimeout::Compensate,
        correlation_key: None,
        senders,
    };
    // A second wait for the same event, in place of the delay, from anyone.
    snapshot.steps[1].kind = Kind::Wait(wait(vec!["role:approver".into()]));
    snapshot.steps[2].kind = Kind::Wait(wait(Vec::new()));
    snapshot.apply(&decide(&snapshot, &Event::Reply(&ok), &ctx(t(2))));
    let kim = vec!["console:kim".to_owned()];
    let admitted = admission(
        snapshot.process.state,
        &snapshot.steps,
        "approved",
        &kim,
        "default",
    );
    assert_eq!(
        admitted,
        EventAdmission::Kept {
            step: snapshot.steps[2].name.clone()
        }
    );
}

#[test]
fn a_wait_that_times_out_compensates_fails_or_goes_on_as_its_step_says() {
    for (on_timeout, state) in [
        (park::OnTimeout::Compensate, ProcessState::Compensating),
        (park::OnTimeout::Fail, ProcessState::Error),
        (park::OnTimeout::Continue, ProcessState::Pending),
    ] {
        let (mut snapshot, ok) = reserved(on_timeout);
        snapshot.apply(&decide(&snapshot, &Event::Reply(&ok), &ctx(t(2))));
        let decision = decide(&snapshot, &Event::Claimed, &ctx(t(12)));
        assert_eq!(
            decision.process.as_ref().unwrap().state,
            state,
            "{on_timeout:?}"
        );
        assert!(decision
            .history
            .iter()
            .any(|h| h.event == HistoryEvent::WaitTimedOut));
        match on_timeout {
            // The reservation is undone.
            park::OnTimeout::Compensate => {
                let undo = decision
                    .progress
                    .dispatches
                    .into_iter()
                    .next()
                    .expect("the release");
                assert_eq!(
                    (undo.step.as_str(), undo.kind),
                    ("reserve_stock", StepKind::Compensation)
                );
            }
            park::OnTimeout::Fail => {
                assert_eq!(decision.alert.unwrap().kind, AlertKind::WaitTimedOut);
                assert!(decision.progress.dispatches.is_empty());
            }
            // On to the delay, the wait's result saying it timed out.
            park::OnTimeout::Continue => {
                snapshot.apply(&decision);
                assert_eq!(
                    snapshot.steps[1].result,
                    Some(serde_json::json!({ "timed_out": true }))
                );
                assert_eq!(snapshot.steps[2].state, StepState::Running);
            }
        }
    }
}

#[test]
fn a_cancelled_order_stops_waiting_and_its_undo_starts_at_once() {
    let (mut snapshot, ok) = reserved(park::OnTimeout::Compensate);
    snapshot.apply(&decide(&snapshot, &Event::Reply(&ok), &ctx(t(2))));
    let decision = decide(
        &snapshot,
        &Event::Cancelled {
            reason: "customer asked",
        },
        &ctx(t(3)),
    );
    snapshot.apply(&decision);
    assert_eq!(snapshot.steps[1].state, StepState::Failed);
    assert_eq!(snapshot.process.state, ProcessState::Compensating);
    // Not at the wait's timeout (t(12)): now.
    assert_eq!(snapshot.process.not_before, t(3));
}

/// The workflow with charge and a second, undoable step side by side: a
/// parallel group after the reservation.
fn grouped() -> Snapshot {
    let mut steps = workflow();
    call_mut(&mut steps[2]).compensation = Some("cancel_shipment".into());
    steps[2].timeout = Duration::from_secs(8);
    for step in &mut steps[1..] {
        step.group = Some("pay_and_ship".into());
    }
    Snapshot::new_order(
        "o-1",
        serde_json::json!({ "order_id": "o-1" }),
        Some("client-q".into()),
        Some("trace".into()),
        5,
        &steps,
        t(0),
    )
}

/// The grouped order with its reservation (attempt 1) in flight.
fn reserving() -> Snapshot {
    let mut snapshot = grouped();
    snapshot.process.state = ProcessState::Processing;
    step(&mut snapshot, 0, StepState::Running, 1);
    snapshot.process.locked_by = Some(SCHEDULER.into());
    snapshot.process.complete_by = snapshot.steps[0].complete_by;
    snapshot
}

/// The grouped order after its reservation succeeded at `t(3)`: both
/// members in flight.
fn group_in_flight() -> (Snapshot, Decision) {
    let mut snapshot = reserving();
    let ok = reply(attempt(1), succeeded());
    let decision = decide(&snapshot, &Event::Reply(&ok), &ctx(t(3)));
    snapshot.apply(&decision);
    (snapshot, decision)
}

#[test]
fn a_group_starts_whole_each_member_with_its_own_attempt_and_slot() {
    let (snapshot, decision) = group_in_flight();
    let steps: Vec<&str> = decision
        .progress
        .dispatches
        .iter()
        .map(|d| d.step.as_str())
        .collect();
    assert_eq!(steps, ["charge_payment", "create_shipment"]);
    let ids: Vec<AttemptId> = decision
        .progress
        .dispatches
        .iter()
        .map(|d| d.attempt_id)
        .collect();
    assert_ne!(ids[0], ids[1], "each member's attempt has its own id");
    assert_eq!(snapshot.steps[1].attempt_id, Some(ids[0]));
    assert_eq!(snapshot.steps[2].attempt_id, Some(ids[1]));
    // The order's deadline is its latest member's.
    assert_eq!(snapshot.process.complete_by, Some(t(3 + 8)));
    assert_eq!(
        slots_held(&snapshot.process, &snapshot.steps),
        ["payment", "shipping"]
    );
    let deltas: Vec<(&str, i32)> = decision
        .admission
        .iter()
        .map(|d| (d.agent.as_str(), d.in_flight))
        .collect();
    assert_eq!(deltas, [("inventory", -1), ("payment", 1), ("shipping", 1)]);
}

#[test]
fn a_group_whose_agent_has_no_slot_waits_whole_in_its_line() {
    let mut snapshot = reserving();
    let ok = reply(attempt(1), succeeded());
    let closed = Context {
        closed: Some("shipping"),
        ..ctx(t(3))
    };
    let decision = decide(&snapshot, &Event::Reply(&ok), &closed);
    assert!(decision.progress.dispatches.is_empty());
    let process = decision.process.clone().expect("the order waits");
    assert_eq!(process.state, ProcessState::Pending);
    assert_eq!(process.waiting_for.as_deref(), Some("shipping"));
    snapshot.apply(&decision);
    assert!(snapshot.steps[1..]
        .iter()
        .all(|s| s.state == StepState::NotStarted));
}

#[test]
fn the_order_moves_on_only_when_every_member_completed() {
    let (mut snapshot, started) = group_in_flight();
    let ship = started.progress.dispatches[1].attempt_id;
    let charge = started.progress.dispatches[0].attempt_id;
    let shipped = reply(ship, succeeded());
    let decision = decide(&snapshot, &Event::Reply(&shipped), &ctx(t(4)));
    assert!(decision.progress.dispatches.is_empty());
    snapshot.apply(&decision);
    assert_eq!(snapshot.process.state, ProcessState::Processing);
    assert_eq!(snapshot.process.locked_by.as_deref(), Some(SCHEDULER));
    assert_eq!(snapshot.steps[2].state, StepState::Completed);
    assert_eq!(slots_held(&snapshot.process, &snapshot.steps), ["payment"]);
    let charged = reply(charge, succeeded());
    let decision = decide(&snapshot, &Event::Reply(&charged), &ctx(t(5)));
    snapshot.apply(&decision);
    assert_eq!(snapshot.process.state, ProcessState::Processed);
}

#[test]
fn a_member_refused_beside_one_in_flight_undoes_it_only_after_its_deadline() {
    let (mut snapshot, started) = group_in_flight();
    let charge = started.progress.dispatches[0].attempt_id;
    let ship = started.progress.dispatches[1].attempt_id;
    let refused = reply(charge, failed(true));
    let decision = decide(&snapshot, &Event::Reply(&refused), &ctx(t(4)));
    assert!(
        decision.progress.dispatches.is_empty(),
        "no undo while a member is in flight"
    );
    snapshot.apply(&decision);
    assert_eq!(snapshot.process.state, ProcessState::Compensating);
    assert_eq!(snapshot.process.locked_by, None);
    // The shipment started at t(3) with 8 s, and 2 s of grace: nothing
    // before t(13).
    assert_eq!(snapshot.process.not_before, t(13));
    assert_eq!(snapshot.steps[1].state, StepState::Failed);
    let early = decide(&snapshot, &Event::Claimed, &ctx(t(12)));
    assert!(matches!(early.verdict, Verdict::Unchanged(_)));
    // Without an answer, the claim at t(13) undoes the shipment.
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(13)));
    let undo = claimed.progress.dispatches.first().expect("an undo");
    assert_eq!(
        (undo.step.as_str(), undo.kind),
        ("create_shipment", StepKind::Compensation)
    );
    // The shipment's late success is kept: its result is the undo's to
    // read, and the undo may go at once.
    let late = reply(ship, succeeded());
    let kept = decide(&snapshot, &Event::Reply(&late), &ctx(t(6)));
    assert_eq!(kept.verdict, Verdict::Applied, "{kept:#?}");
    snapshot.apply(&kept);
    assert_eq!(snapshot.steps[2].state, StepState::Completed);
    assert_eq!(
        snapshot.steps[2].result,
        Some(serde_json::json!({ "id": "new" }))
    );
    assert_eq!(snapshot.process.not_before, t(6));
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(6)));
    let undo = claimed.progress.dispatches.first().expect("an undo");
    assert_eq!(
        (undo.step.as_str(), undo.kind),
        ("create_shipment", StepKind::Compensation)
    );
    snapshot.apply(&claimed);
    let undone = reply(undo.attempt_id, succeeded());
    let decision = decide(&snapshot, &Event::Reply(&undone), &ctx(t(12)));
    let next = decision.progress.dispatches.first().expect("the next undo");
    assert_eq!(
        next.step, "reserve_stock",
        "the refused charge applied nothing"
    );
}

#[test]
fn a_member_that_never_started_runs_again_with_the_group_s_rest() {
    let (mut snapshot, started) = group_in_flight();
    let charge = started.progress.dispatches[0].attempt_id;
    let ship = started.progress.dispatches[1].attempt_id;
    let decision = decide(
        &snapshot,
        &Event::Reply(&reply(ship, not_started())),
        &ctx(t(4)),
    );
    assert!(decision.progress.dispatches.is_empty());
    assert_eq!(decision.admission[0].unstarted, 1);
    snapshot.apply(&decision);
    assert_eq!(snapshot.process.state, ProcessState::Processing);
    assert_eq!(snapshot.steps[2].state, StepState::NotStarted);
    let decision = decide(
        &snapshot,
        &Event::Reply(&reply(charge, succeeded())),
        &ctx(t(5)),
    );
    let again: Vec<&str> = decision
        .progress
        .dispatches
        .iter()
        .map(|d| d.step.as_str())
        .collect();
    assert_eq!(again, ["create_shipment"], "the charge is not sent again");
}

#[test]
fn a_group_past_its_deadline_marks_every_member_in_flight() {
    let (mut snapshot, _) = group_in_flight();
    let decision = decide(
        &snapshot,
        &Event::DeadlineMissed {
            policy: &policy(),
            jitter: 0.5,
        },
        &ctx(t(20)),
    );
    snapshot.apply(&decision);
    assert_eq!(snapshot.process.state, ProcessState::Pending);
    assert!(snapshot.steps[1..].iter().all(|s| s.maybe_applied));
    assert!(slots_held(&snapshot.process, &snapshot.steps).is_empty());
}

#[test]
fn a_wait_reads_its_correlation_key_from_an_earlier_result_when_it_parks() {
    let keyed = |pointer: &str| {
        let (mut snapshot, ok) = reserved(park::OnTimeout::Compensate);
        snapshot.steps[1].kind = Kind::Wait(WaitStep {
            event: "approved".into(),
            on_timeout: park::OnTimeout::Compensate,
            correlation_key: Some(pointer.into()),
            senders: Vec::new(),
        });
        // The reservation answers with its id, which the key reads.
        let ok = StepReply {
            queued_ms: None,
            slot_wait_ms: None,
            retry_after_ms: None,
            call_ms: None,
            outcome: StepOutcome::Succeeded {
                result: serde_json::json!({ "id": "res-77" }),
            },
            ..ok
        };
        decide(&snapshot, &Event::Reply(&ok), &ctx(t(3)))
    };
    let decision = keyed("/results/reserve_stock/id");
    assert_eq!(
        decision.wait_key,
        Some(park::WaitKey {
            step: "approval".into(),
            key: "res-77".into(),
        })
    );
    // Nothing there: the wait is reachable by order id only, and says so.
    let decision = keyed("/attributes/invoice");
    assert_eq!(decision.wait_key, None);
    let waiting = decision
        .history
        .iter()
        .find(|h| h.event == HistoryEvent::Waiting)
        .and_then(|h| h.detail.clone())
        .unwrap_or_default();
    assert!(
        waiting.contains("no correlation key at /attributes/invoice"),
        "{waiting}"
    );
}

/// A new order of the workflow whose `charge_payment` is called as `calls` say.
fn charging_with(calls: crate::machine::call::StepCalls) -> Snapshot {
    let mut steps = workflow();
    call_mut(&mut steps[1]).calls = Some(Box::new(calls));
    Snapshot::new_order(
        "o-1",
        serde_json::json!({ "order_id": "o-1" }),
        None,
        None,
        5,
        &steps,
        t(0),
    )
}

/// An order whose `charge_payment` says `on_failure = "stop"`, processing
/// that step (attempt 2) after `reserve_stock` completed.
fn charging_with_stop() -> Snapshot {
    let mut snapshot = charging_with(crate::machine::call::StepCalls {
        on_failure: crate::machine::call::OnFailure::Stop,
        ..Default::default()
    });
    snapshot.process.state = ProcessState::Processing;
    step(&mut snapshot, 0, StepState::Completed, 1);
    step(&mut snapshot, 1, StepState::Running, 2);
    snapshot.process.locked_by = Some(SCHEDULER.into());
    snapshot.process.complete_by = snapshot.steps[1].complete_by;
    snapshot
}

#[test]
fn a_step_that_says_stop_ends_its_order_in_error_undoing_nothing_and_resumes_with_a_fresh_key() {
    let mut snapshot = charging_with_stop();
    let refused = reply(attempt(2), failed(true));
    let decision = decide(&snapshot, &Event::Reply(&refused), &ctx(t(3)));
    let process = decision.process.as_ref().unwrap();
    assert_eq!(process.state, ProcessState::Error);
    assert!(decision.progress.dispatches.is_empty(), "nothing undone");
    assert_eq!(decision.alert.as_ref().unwrap().kind, AlertKind::StepFailed);
    assert!(decision
        .alert
        .as_ref()
        .unwrap()
        .message
        .contains("sasctl resume"));
    snapshot.apply(&decision);
    assert_eq!(snapshot.steps[0].state, StepState::Completed);
    assert_eq!(snapshot.steps[1].state, StepState::Failed);

    // Resumed by an operator: from the failed step, refused before, so
    // with a key of a new generation; the completed step is untouched.
    let mut operator = ctx(t(60));
    operator.actor = "sasctl:ann";
    let event = Event::Resumed {
        reason: "merchant account reinstated",
        earlier: 0,
    };
    let decision = decide(&snapshot, &event, &operator);
    assert_eq!(
        decision.verdict,
        Verdict::Resumed {
            from: "charge_payment".into(),
            key_kept: false
        }
    );
    assert!(decision.resolve_alerts);
    assert_eq!(decision.steps.len(), 1, "only the failed step changes");
    let line = &decision.history[0];
    assert_eq!(line.event, HistoryEvent::Resumed);
    let detail = line.detail.as_deref().unwrap();
    assert!(detail.contains("sasctl:ann") && detail.contains("merchant account reinstated"));
    snapshot.apply(&decision);
    assert_eq!(snapshot.process.state, ProcessState::Pending);
    assert_eq!(snapshot.steps[1].idempotency_key, "o-1:charge_payment:r1");
    // A claim sends the failed step, not the completed one.
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(61)));
    let sent = &claimed.progress.dispatches[0];
    assert_eq!(
        (sent.step.as_str(), sent.kind),
        ("charge_payment", StepKind::Action)
    );
    assert_eq!(claimed.progress.dispatches.len(), 1);
}

#[test]
fn a_child_its_parent_no_longer_waits_for_is_not_put_back_and_one_it_waits_for_is() {
    let mut snapshot = charging_with_stop();
    let refused = reply(attempt(2), failed(true));
    snapshot.apply(&decide(&snapshot, &Event::Reply(&refused), &ctx(t(3))));
    assert_eq!(snapshot.process.state, ProcessState::Error);
    let resume = Event::Resumed {
        reason: "fixed",
        earlier: 0,
    };
    let resubmit = Event::Resubmitted { earlier: 0 };
    for waits in [false, true] {
        snapshot.parent = Some(child::ParentLink {
            order_id: "p-1".into(),
            step: "fulfil".into(),
            waits,
        });
        for event in [&resume, &resubmit] {
            let decision = decide(&snapshot, event, &ctx(t(60)));
            match (&decision.verdict, waits) {
                (Verdict::NotPutBack(why), false) => {
                    assert!(!decision.writes(), "{event:?}");
                    assert!(
                        why.contains("step fulfil of order p-1, which no longer waits for it"),
                        "{why}"
                    );
                }
                (Verdict::Resumed { .. } | Verdict::Resubmitted(_), true) => {}
                (other, _) => panic!("{event:?}, parent waits {waits}: {other:?}"),
            }
        }
    }
    // The parent's step waits for the child its current key starts, while
    // it runs or undoes it.
    let parent: sas_messages::OrderId = "p-1".into();
    for (key, state, waits) in [
        ("p-1:fulfil", StepState::Running, true),
        ("p-1:fulfil", StepState::Compensating, true),
        ("p-1:fulfil", StepState::Completed, false),
        ("p-1:fulfil", StepState::Failed, false),
        ("p-1:fulfil:r1", StepState::Running, false),
    ] {
        assert_eq!(
            child::parent_waits(&parent, "fulfil", key, state, "p-1:fulfil"),
            waits,
            "{key} {state}"
        );
    }
}

#[test]
fn a_step_that_says_stop_out_of_retries_resumes_with_its_key_kept_and_stays_to_undo() {
    let mut snapshot = charging_with_stop();
    snapshot.process.failure_count = policy().max_failures;
    let event = Event::DeadlineMissed {
        policy: &policy(),
        jitter: 0.5,
    };
    let decision = decide(&snapshot, &event, &ctx(t(60)));
    assert_eq!(
        decision.process.as_ref().unwrap().state,
        ProcessState::Error
    );
    assert!(decision.progress.dispatches.is_empty());
    snapshot.apply(&decision);
    assert!(snapshot.steps[1].maybe_applied);
    let key = snapshot.steps[1].idempotency_key.clone();

    // Resubmitted instead, it keeps that key too (a fresh one could charge
    // twice), and the step stays to be undone.
    let resubmitted = decide(&snapshot, &Event::Resubmitted { earlier: 0 }, &ctx(t(90)));
    let mut again = snapshot.clone();
    again.apply(&resubmitted);
    assert_eq!(again.steps[1].idempotency_key, key);
    assert!(again.steps[1].needs_undo());
    assert_eq!(again.steps[0].state, StepState::Completed);

    let event = Event::Resumed {
        reason: "the payment provider is back",
        earlier: 0,
    };
    let decision = decide(&snapshot, &event, &ctx(t(90)));
    assert_eq!(
        decision.verdict,
        Verdict::Resumed {
            from: "charge_payment".into(),
            key_kept: true
        }
    );
    snapshot.apply(&decision);
    assert_eq!(
        snapshot.steps[1].idempotency_key, key,
        "the same key: the remote answers it once"
    );
    // Cancelled before its new attempt ran: the charge that may have landed
    // is still undone.
    assert!(snapshot.steps[1].needs_undo());
    let cancelled = decide(
        &snapshot,
        &Event::Cancelled {
            reason: "customer gave up",
        },
        &ctx(t(91)),
    );
    assert_eq!(
        cancelled.process.as_ref().unwrap().state,
        ProcessState::Compensating
    );
}

#[test]
fn an_order_stopped_in_error_may_be_cancelled_and_one_whose_undo_began_may_not_be_resumed() {
    let mut snapshot = charging_with_stop();
    let refused = reply(attempt(2), failed(true));
    snapshot.apply(&decide(&snapshot, &Event::Reply(&refused), &ctx(t(3))));
    let cancel = Event::Cancelled {
        reason: "customer gave up",
    };
    let decision = decide(&snapshot, &cancel, &ctx(t(60)));
    assert_eq!(
        decision.process.as_ref().unwrap().state,
        ProcessState::Compensating
    );
    assert!(decision.resolve_alerts);
    snapshot.apply(&decision);
    // The claim undoes the completed reservation.
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(61)));
    let undo = &claimed.progress.dispatches[0];
    assert_eq!(
        (undo.step.as_str(), undo.kind),
        ("reserve_stock", StepKind::Compensation)
    );

    // An order in error whose compensation began: resuming is refused with
    // why, and so is cancelling again.
    let (in_error, _) = order_in(ProcessState::Error);
    let resumed = decide(
        &in_error,
        &Event::Resumed {
            reason: "fixed",
            earlier: 0,
        },
        &ctx(t(60)),
    );
    let Verdict::NotResumable(why) = &resumed.verdict else {
        panic!("{:?}", resumed.verdict)
    };
    assert!(
        why.contains("reserve_stock") && why.contains("resubmit"),
        "{why}"
    );
    assert_eq!(
        decide(&in_error, &cancel, &ctx(t(60))).verdict,
        Verdict::Refused(ProcessState::Error)
    );
}

#[test]
fn an_order_stopped_while_in_a_line_leaves_the_line() {
    // Sent back by a not-started reply, the charge waits in payment's line;
    // its request is dead-lettered: the step says stop.
    let mut snapshot = charging_with_stop();
    snapshot.process.state = ProcessState::Pending;
    snapshot.process.locked_by = None;
    snapshot.process.waiting_for = Some("payment".into());
    snapshot.process.admit_key = Some(t(1));
    let decision = decide(
        &snapshot,
        &Event::DeadLettered {
            attempt_id: attempt(2),
            reason: "delivery limit",
            no_call: false,
        },
        &ctx(t(4)),
    );
    let process = decision.process.as_ref().unwrap();
    assert_eq!(process.state, ProcessState::Error);
    assert_eq!((&process.waiting_for, process.admit_key), (&None, None));
    assert!(
        decision
            .admission
            .iter()
            .any(|delta| delta.agent == "payment" && delta.waiting == -1),
        "{:?}",
        decision.admission
    );
}

/// `fresh()` with its first step limited to 2 attempts at once per
/// merchant, for merchant `m-7`.
fn limited_by_merchant() -> Snapshot {
    limited_by_merchant_learning(false)
}

/// [`limited_by_merchant`], its limit `adaptive` or not.
fn limited_by_merchant_learning(adaptive: bool) -> Snapshot {
    let mut steps = workflow();
    call_mut(&mut steps[0]).calls = Some(Box::new(crate::StepCalls {
        concurrency: Some(crate::Concurrency {
            key: "/attributes/merchant_id".into(),
            limit: 2,
            default: None,
            adaptive,
        }),
        ..crate::StepCalls::default()
    }));
    Snapshot::new_order(
        "o-1",
        serde_json::json!({ "order_id": "o-1", "attributes": { "merchant_id": "m-7" } }),
        None,
        None,
        5,
        &steps,
        t(0),
    )
}

#[test]
fn an_attempt_limited_by_key_names_its_key_and_waits_in_its_line_when_full() {
    // Room: the attempt starts, and its step names the key it holds.
    let open = decide(&limited_by_merchant(), &Event::Submitted, &ctx(t(0)));
    assert_eq!(open.progress.dispatches.len(), 1);
    assert_eq!(
        open.takes_keys(),
        [(
            "inventory:m-7",
            crate::machine::concurrency::KeyLimits {
                in_flight: Some(2),
                adaptive: false,
                rate: None
            },
            sas_messages::StepKind::Action
        )]
    );
    assert_eq!(
        open.steps[0].row.limit_key.as_deref(),
        Some("inventory:m-7")
    );

    // No room: no attempt, no deadline, no slot of the agent; the order
    // waits in the key's line with the step naming the key.
    let closed = Context {
        closed_key: Some("inventory:m-7"),
        ..ctx(t(0))
    };
    let full = decide(&limited_by_merchant(), &Event::Submitted, &closed);
    assert!(full.progress.dispatches.is_empty());
    assert!(full.takes_keys().is_empty());
    let process = full.process.clone().unwrap();
    assert_eq!(process.state, ProcessState::Pending);
    assert_eq!((process.locked_by, process.complete_by), (None, None));
    assert_eq!(
        (
            process.waiting_for.as_deref(),
            process.waiting_key.as_deref()
        ),
        (None, Some("inventory:m-7"))
    );
    assert_eq!(process.admit_key, Some(t(-50)), "placed by priority");
    assert!(full.admission.is_empty(), "no agent slot or place taken");
    let queued = full.history.last().unwrap();
    assert_eq!(queued.event, HistoryEvent::Queued);
    assert!(queued.detail.as_deref().unwrap().contains("limit of 2"));

    // Taken from the line and put back (the key filled again): it keeps
    // its place.
    let mut waiting = limited_by_merchant();
    waiting.apply(&full);
    let back = decide(
        &waiting,
        &Event::Claimed,
        &Context {
            closed_key: Some("inventory:m-7"),
            ..ctx(t(30))
        },
    );
    assert_eq!(back.process.as_ref().unwrap().admit_key, Some(t(-50)));

    // Claimed with room: out of the line, the attempt starts.
    let claimed = decide(&waiting, &Event::Claimed, &ctx(t(30)));
    let process = claimed.process.clone().unwrap();
    assert_eq!(process.waiting_key, None);
    assert_eq!(claimed.progress.dispatches[0].step, "reserve_stock");
    assert_eq!(
        claimed.takes_keys(),
        [(
            "inventory:m-7",
            crate::machine::concurrency::KeyLimits {
                in_flight: Some(2),
                adaptive: false,
                rate: None
            },
            sas_messages::StepKind::Action
        )]
    );

    // A closed key of another merchant, or a closed agent's line, is
    // not this order's.
    let other = decide(
        &limited_by_merchant(),
        &Event::Submitted,
        &Context {
            closed_key: Some("inventory:m-8"),
            ..ctx(t(0))
        },
    );
    assert_eq!(other.progress.dispatches.len(), 1);
}

#[test]
fn a_cancel_takes_an_order_out_of_its_key_line() {
    let closed = Context {
        closed_key: Some("inventory:m-7"),
        ..ctx(t(0))
    };
    let mut waiting = limited_by_merchant();
    waiting.apply(&decide(&waiting.clone(), &Event::Submitted, &closed));
    assert!(waiting.process.waiting_key.is_some());
    let cancelled = decide(&waiting, &Event::Cancelled { reason: "test" }, &ctx(t(1)));
    let process = cancelled.process.unwrap();
    assert_eq!(process.waiting_key, None, "{process:?}");
}

#[test]
fn a_key_its_remote_asks_to_rest_pauses_and_its_order_waits_in_the_key_s_line_at_its_place() {
    let mut order = limited_by_merchant();
    let started = decide(&order.clone(), &Event::Submitted, &ctx(t(0)));
    order.apply(&started);
    let attempt_id = started.progress.dispatches[0].attempt_id;
    let rest = |ms: u64| StepReply {
        retry_after_ms: Some(ms),
        call_ms: None,
        ..reply(
            attempt_id,
            StepOutcome::NotStarted {
                reason: "429".into(),
            },
        )
    };
    let decision = decide(&order, &Event::Reply(&rest(2_000)), &ctx(t(1)));
    let pause = decision.key_pause.clone().expect("the key pauses");
    assert_eq!((pause.key.as_str(), pause.until), ("inventory:m-7", t(3)));
    let process = decision.process.clone().unwrap();
    assert_eq!(
        (
            process.waiting_for.as_deref(),
            process.waiting_key.as_deref()
        ),
        (None, Some("inventory:m-7")),
        "the key's line, not the agent's"
    );
    // Placed as if it had waited since its dispatch, by priority.
    assert_eq!(process.admit_key, Some(t(-50)));
    assert_eq!(process.failure_count, 0, "no failure counted");
    assert_eq!(decision.steps[0].row.state, StepState::NotStarted);
    assert!(decision
        .admission
        .iter()
        .all(|d| d.in_flight == -1 && d.unstarted == 1));

    // A day's Retry-After rests an hour at most.
    let long = decide(&order, &Event::Reply(&rest(86_400_000)), &ctx(t(1)));
    assert_eq!(long.key_pause.unwrap().until, t(3601));

    // Without a key (or without Retry-After) the agent's line, as before.
    let plain = decide(
        &order,
        &Event::Reply(&reply(attempt_id, not_started())),
        &ctx(t(1)),
    );
    assert!(plain.key_pause.is_none());
    assert_eq!(
        plain.process.unwrap().waiting_for.as_deref(),
        Some("inventory")
    );
}

#[test]
fn a_reply_in_an_adaptive_key_says_what_its_remote_took_or_that_it_refused() {
    use crate::machine::key_learning::{KeySample, KeySignal};
    let sample_of = |adaptive: bool, reply: &dyn Fn(AttemptId) -> StepReply| {
        let mut order = limited_by_merchant_learning(adaptive);
        let started = decide(&order.clone(), &Event::Submitted, &ctx(t(0)));
        order.apply(&started);
        let attempt_id = started.progress.dispatches[0].attempt_id;
        decide(&order, &Event::Reply(&reply(attempt_id)), &ctx(t(1))).key_sample
    };
    let answered = |attempt_id| StepReply {
        call_ms: Some(420),
        ..reply(attempt_id, succeeded())
    };
    assert_eq!(
        sample_of(true, &answered),
        Some(KeySample {
            key: "inventory:m-7".into(),
            ceiling: 2,
            signal: KeySignal::Answered { ms: 420 }
        })
    );
    assert_eq!(
        sample_of(false, &answered),
        None,
        "a fixed limit learns nothing"
    );
    // An agent that does not say: the attempt's time in flight, less what
    // it queued (dispatched at 0, answered at 1 s, 300 ms queued).
    let unsaid = |attempt_id| StepReply {
        queued_ms: Some(300),
        ..reply(attempt_id, succeeded())
    };
    assert_eq!(
        sample_of(true, &unsaid).map(|s| s.signal),
        Some(KeySignal::Answered { ms: 700 })
    );
    let refused = |attempt_id| StepReply {
        retry_after_ms: Some(2_000),
        ..reply(
            attempt_id,
            StepOutcome::NotStarted {
                reason: "429".into(),
            },
        )
    };
    assert_eq!(
        sample_of(true, &refused).map(|s| s.signal),
        Some(KeySignal::Refused)
    );
    // Never met the remote (no call slot in time): nothing to learn.
    assert_eq!(
        sample_of(true, &|attempt_id| reply(attempt_id, not_started())),
        None
    );
}

/// Reserve, then a child step starting an order of `fulfil`, then charge;
/// the reservation just succeeded.
fn reserved_before_a_child() -> (Snapshot, StepReply) {
    let mut steps = workflow();
    steps.truncate(2);
    steps.insert(
        1,
        NewStep {
            name: "fulfil".into(),
            kind: Kind::Child(ChildStep {
                workflow: "fulfil".into(),
                version: 3,
                attributes: Some(serde_json::json!({ "who": "${/order/order_id}" })),
                on_failure: crate::OnFailure::Compensate,
            }),
            timeout: Duration::from_secs(60),
            group: None,
        },
    );
    reserved_in(
        &steps,
        serde_json::json!({ "order_id": "o-1", "reply_to": "q" }),
    )
}

#[test]
fn a_child_step_starts_its_child_with_the_decision_and_parks_the_parent() {
    let (snapshot, ok) = reserved_before_a_child();
    let decision = decide(&snapshot, &Event::Reply(&ok), &ctx(t(2)));
    let process = decision.process.clone().unwrap();
    assert_eq!(process.state, ProcessState::Pending);
    assert_eq!((process.locked_by, process.complete_by), (None, None));
    assert_eq!(
        process.not_before,
        t(62),
        "looks again at the step's timeout"
    );
    assert!(
        decision.progress.dispatches.is_empty(),
        "no agent is called"
    );
    match decision.child {
        Some(child::ChildCommand::Start {
            child,
            workflow,
            version,
            body,
            ..
        }) => {
            assert_eq!(child.as_str(), "o-1:fulfil");
            assert_eq!((workflow.as_str(), version), ("fulfil", 3));
            assert_eq!(body["attributes"]["who"], "o-1");
            assert!(body.get("reply_to").is_none());
        }
        other => panic!("no start: {other:?}"),
    }
}

#[test]
fn a_child_stopped_in_error_is_recorded_by_a_parent_that_waits_on_with_what_to_do() {
    let (mut snapshot, ok) = reserved_before_a_child();
    let started = decide(&snapshot, &Event::Reply(&ok), &ctx(t(2)));
    snapshot.apply(&started);
    let stopped = Event::ChildStopped {
        step: "fulfil",
        child: "o-1:fulfil",
        reason: "child order o-1:fulfil stopped in error: step pack failed: refused",
    };
    // Forward: a history line saying what to do, and the parent waits on.
    let decision = decide(&snapshot, &stopped, &ctx(t(3)));
    assert_eq!(decision.verdict, Verdict::Applied);
    assert!(decision.process.is_none(), "{:?}", decision.process);
    assert!(decision.steps.is_empty());
    let line = &decision.history[0];
    assert_eq!(line.event, HistoryEvent::ChildStopped);
    let detail = line.detail.as_deref().unwrap();
    assert!(detail.contains("step pack failed: refused"), "{detail}");
    assert!(
        detail.contains("then undoes itself and the child"),
        "{detail}"
    );
    // An earlier child of the step changes nothing.
    let earlier = Event::ChildStopped {
        step: "fulfil",
        child: "o-1:fulfil:r1",
        reason: "old",
    };
    assert!(!decide(&snapshot, &earlier, &ctx(t(3))).writes());
    // Waiting for the child's undo, nothing changes: the stop may be older
    // than the ask (the same transaction), and the next ask hears whether
    // the child can still be undone.
    let cancelled = decide(&snapshot, &Event::Cancelled { reason: "gone" }, &ctx(t(3)));
    snapshot.apply(&cancelled);
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(4)));
    snapshot.apply(&claimed);
    assert!(!decide(&snapshot, &stopped, &ctx(t(5))).writes());
    // What a child's stop tells its parent: why, from its last error, and
    // what an operator can do, as it stopped going forward or undoing.
    let mut child = fresh();
    child.parent = Some(child::ParentLink {
        order_id: "o-1".into(),
        step: "fulfil".into(),
        waits: true,
    });
    child.process.state = ProcessState::Processing;
    let mut stop = decide(&child, &Event::Claimed, &ctx(t(6)));
    let mut process = child.process.clone();
    process.state = ProcessState::Error;
    process.last_error = Some("step pack failed: refused".into());
    stop.process = Some(process);
    let told = |child: &Snapshot| match child::end_told(child, &stop) {
        Some((parent, child::ToParent::Stopped(why))) if parent.order_id == "o-1" => why,
        other => panic!("{other:?}"),
    };
    let why = told(&child);
    assert!(
        why.contains("stopped in error: step pack failed: refused; resume or resubmit it"),
        "{why}"
    );
    child.process.state = ProcessState::Compensating;
    let why = told(&child);
    assert!(
        why.contains("while undoing itself: step pack failed: refused; resubmit it"),
        "{why}"
    );
}

#[test]
fn a_child_s_end_completes_the_step_or_undoes_the_parent_and_its_undo_waits_for_the_child() {
    let (mut snapshot, ok) = reserved_before_a_child();
    let started = decide(&snapshot, &Event::Reply(&ok), &ctx(t(2)));
    snapshot.apply(&started);
    let results = serde_json::json!({ "hold": { "ok": true } });
    let processed = Event::ChildEnded {
        step: "fulfil",
        child: "o-1:fulfil",
        state: ProcessState::Processed,
        results: &results,
    };
    // Processed: the step holds its results and the charge starts.
    let decision = decide(&snapshot, &processed, &ctx(t(3)));
    let change = decision
        .steps
        .iter()
        .find(|c| c.row.name == "fulfil")
        .unwrap();
    assert_eq!(change.row.state, StepState::Completed);
    assert_eq!(change.row.result.as_ref().unwrap()["results"], results);
    assert_eq!(decision.progress.dispatches[0].step, "charge_payment");
    // Compensated (it failed and undid itself): nothing of it to undo,
    // the parent undoes its reservation.
    let empty = serde_json::json!({});
    let compensated = Event::ChildEnded {
        step: "fulfil",
        child: "o-1:fulfil",
        state: ProcessState::Compensated,
        results: &empty,
    };
    // An earlier child of the step (before an operator restarted it)
    // changes nothing.
    let earlier = Event::ChildEnded {
        step: "fulfil",
        child: "o-1:fulfil:r1",
        state: ProcessState::Compensated,
        results: &empty,
    };
    assert!(!decide(&snapshot, &earlier, &ctx(t(3))).writes());
    let decision = decide(&snapshot, &compensated, &ctx(t(3)));
    let change = decision
        .steps
        .iter()
        .find(|c| c.row.name == "fulfil")
        .unwrap();
    assert_eq!(change.row.state, StepState::Failed);
    assert_eq!(
        decision.process.as_ref().unwrap().state,
        ProcessState::Compensating
    );
    // Cancelled while the child runs: a claim asks the child to undo
    // itself, and the parent waits for it, held by nobody.
    let cancelled = decide(&snapshot, &Event::Cancelled { reason: "gone" }, &ctx(t(3)));
    assert!(cancelled.child.is_none(), "the claim asks, not the cancel");
    snapshot.apply(&cancelled);
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(4)));
    assert!(
        matches!(&claimed.child, Some(child::ChildCommand::Undo { child, .. }) if child.as_str() == "o-1:fulfil"),
        "{:?}",
        claimed.child
    );
    let process = claimed.process.clone().unwrap();
    assert_eq!(process.state, ProcessState::Compensating);
    assert_eq!(process.locked_by, None);
    snapshot.apply(&claimed);
    // No agent's reply settles the wait for the child's undo, not even
    // one carrying the step's attempt id: only the child's end does.
    let parked = snapshot.steps.iter().find(|s| s.name == "fulfil").unwrap();
    let forged = StepReply {
        step: "fulfil".into(),
        attempt_id: parked.attempt_id.unwrap(),
        ..ok.clone()
    };
    let stale = decide(&snapshot, &Event::Reply(&forged), &ctx(t(5)));
    assert!(
        matches!(stale.verdict, Verdict::Stale(_)),
        "{:?}",
        stale.verdict
    );
    // The child ends compensated: the step is undone, then the reservation.
    let decision = decide(&snapshot, &compensated, &ctx(t(5)));
    let change = decision
        .steps
        .iter()
        .find(|c| c.row.name == "fulfil")
        .unwrap();
    assert_eq!(change.row.state, StepState::Compensated);
    assert_eq!(decision.progress.dispatches[0].step, "reserve_stock");
    assert_eq!(decision.progress.dispatches[0].kind, StepKind::Compensation);
    // A processed child its parent undoes is compensated as a whole.
    let mut child = fresh();
    child.process.state = ProcessState::Processed;
    for index in 0..child.steps.len() {
        step(&mut child, index, StepState::Completed, 1);
    }
    let undone = decide(
        &child,
        &Event::UndoneForParent {
            reason: "parent undone",
        },
        &ctx(t(6)),
    );
    assert_eq!(
        undone.process.as_ref().unwrap().state,
        ProcessState::Compensating
    );
    assert!(undone
        .history
        .iter()
        .any(|h| h.event == HistoryEvent::UndoneForParent));
}
