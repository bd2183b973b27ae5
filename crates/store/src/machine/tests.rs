//! The state machine without Postgres: every process state against every
//! event, then the rules one by one.

use std::time::Duration;

use chrono::{DateTime, TimeZone, Utc};
use sas_messages::{AttemptId, StatusEvent, StepKind, StepOutcome, StepReply, SCHEMA_VERSION};
use uuid::Uuid;

use super::*;
use crate::model::{NewStep, ProcessState, StepState};

const SCHEDULER: &str = "scheduler-1";

fn t(seconds: i64) -> DateTime<Utc> {
    Utc.timestamp_opt(1_800_000_000 + seconds, 0).unwrap()
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
        agent: agent.into(),
        action: action.into(),
        compensation: compensation.map(str::to_owned),
        timeout: Duration::from_secs(5),
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
        closed: None,
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
        Verdict::Applied | Verdict::Resubmitted(_) => {
            let after = decision.process.as_ref().map_or(before, |p| p.state);
            after.as_str().to_owned()
        }
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
    // letter, resubmitted, cancelled.
    let table: [(ProcessState, [&str; 10]); 6] = [
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
            ],
        ),
        (
            Processed,
            [
                "-", "-", "stale", "stale", "stale", "stale", "-", "-", "refused", "refused",
            ],
        ),
        (
            Compensated,
            [
                "-", "-", "stale", "stale", "stale", "stale", "-", "-", "pending", "refused",
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
            },
            Event::Resubmitted { earlier: 0 },
            Event::Cancelled {
                reason: "customer asked",
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
            if !matches!(decision.verdict, Verdict::Applied | Verdict::Resubmitted(_)) {
                assert!(
                    decision.process.is_none() && decision.steps.is_empty(),
                    "{state} + {event:?} changed rows"
                );
                assert!(decision.alert.is_none() && decision.progress.statuses.is_empty());
                assert!(decision.progress.dispatch.is_none());
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
    let dispatch = decision.progress.dispatch.unwrap();
    assert_eq!(dispatch.idempotency_key, "o-1:reserve_stock");
    assert_eq!((dispatch.attempt, dispatch.attempt_id), (1, attempt(99)));
    assert_eq!(dispatch.payload["results"], serde_json::json!({}));
    assert_eq!(decision.progress.statuses[0].event, StatusEvent::Received);
}

#[test]
fn a_success_starts_the_next_step_with_the_results_so_far() {
    let (snapshot, current) = order_in(ProcessState::Processing);
    let ok = reply(current, succeeded());
    let decision = decide(&snapshot, &Event::Reply(&ok), &ctx(t(3)));
    let dispatch = decision.progress.dispatch.unwrap();
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
    let dispatch = decision.progress.dispatch.unwrap();
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
    assert_eq!(decision.progress.dispatch.unwrap().step, "reserve_stock");
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
    // The charge in flight may still land until its deadline.
    assert_eq!(process.not_before, t(7));
    assert_eq!(decision.history[0].event, HistoryEvent::Cancelled);
    assert_eq!(
        decision.history[0].detail.as_deref(),
        Some("cancelled by scheduler-1: fraud")
    );
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
    // The retry of the same key is refused: the first call may still have landed.
    let refused = reply(current, failed(true));
    let decision = decide(&snapshot, &Event::Reply(&refused), &ctx(t(4)));
    let dispatch = decision.progress.dispatch.unwrap();
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
    let dispatch = decision.progress.dispatch.unwrap();
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
    let dispatch = decision.progress.dispatch.unwrap();
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
    assert!(decision.progress.dispatch.is_none());
    let events: Vec<_> = decision.history.iter().map(|h| h.event).collect();
    assert_eq!(events, [HistoryEvent::Received, HistoryEvent::Queued]);
    assert_eq!(
        decision.admission,
        [AdmissionDelta {
            agent: "inventory".into(),
            in_flight: 0,
            waiting: 1,
            unstarted: 0,
        }]
    );
    // Its claim takes it out of the line and into a slot.
    let mut snapshot = fresh();
    snapshot.apply(&decision);
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(1)));
    assert_eq!(
        claimed.progress.dispatch.as_ref().unwrap().step,
        "reserve_stock"
    );
    assert_eq!(claimed.process.as_ref().unwrap().waiting_for, None);
    assert_eq!(
        claimed.admission,
        [AdmissionDelta {
            agent: "inventory".into(),
            in_flight: 1,
            waiting: -1,
            unstarted: 0,
        }]
    );
    assert_eq!(
        claimed.takes_slot().map(|(agent, _)| agent),
        Some("inventory")
    );
}

#[test]
fn a_success_gives_its_slot_back_and_takes_the_next_agent_s() {
    let (snapshot, current) = order_in(ProcessState::Processing);
    let ok = reply(current, succeeded());
    let decision = decide(&snapshot, &Event::Reply(&ok), &ctx(t(3)));
    assert_eq!(
        decision.admission,
        [
            AdmissionDelta {
                agent: "payment".into(),
                in_flight: -1,
                waiting: 0,
                unstarted: 0,
            },
            AdmissionDelta {
                agent: "shipping".into(),
                in_flight: 1,
                waiting: 0,
                unstarted: 0,
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
            },
            AdmissionDelta {
                agent: "shipping".into(),
                in_flight: 0,
                waiting: 1,
                unstarted: 0,
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
    assert!(decision.progress.dispatch.is_none());
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
        }]
    );
    // A claim starts a fresh attempt of the same step.
    let mut snapshot = snapshot;
    snapshot.apply(&decision);
    let claimed = decide(&snapshot, &Event::Claimed, &ctx(t(10)));
    let dispatch = claimed.progress.dispatch.as_ref().unwrap();
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
