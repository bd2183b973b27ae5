//! Every failure the pattern names, injected for real (kill -9, SIGTERM,
//! hanging and failing remote services, poison messages), with invariants
//! checked from the state store and from remote-sim's record of side effects.

use sas_store::machine::HistoryEvent;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use sas_broker::lapin::options::QueueDeclareOptions;
use sas_broker::lapin::types::FieldTable;
use sas_store::ProcessState;
use sas_tests::process::{free_port, metric, wait_for_metric};
use sas_tests::wait::wait_ready;
use sas_tests::Setting;
use sas_tests::{order, wait_until, TestEnv};
use serde_json::json;

fn faults(latency_ms: u64, transient: f64, hang: f64) -> serde_json::Value {
    json!({ "latency_ms": latency_ms, "transient_fault_rate": transient, "permanent_fault_rate": 0.0, "hang_rate": hang })
}

async fn wait_for_event(env: &TestEnv, order_id: &str, event: HistoryEvent, timeout: Duration) {
    wait_until(
        &format!("{order_id} to record {event}"),
        timeout,
        || async {
            let history = env
                .store
                .reads()
                .history(order_id)
                .await
                .map_err(|e| e.to_string())?;
            if history.iter().any(|h| h.event == event) {
                Ok(())
            } else {
                Err(format!(
                    "{:?}",
                    history.iter().map(|h| h.event.as_str()).collect::<Vec<_>>()
                ))
            }
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_declined_payment_is_undone_in_reverse_order_and_the_client_is_told() {
    let env = TestEnv::new().await;
    let system = env.system(1).await;
    let (connection, publisher) = env.broker().await;
    let (client_queue, channel) = env.client_queue(&connection, "client").await;

    let mut declined = order("declined-1");
    declined.amount_cents = 50_000_000;
    declined.reply_to = Some(client_queue.clone());
    env.publish_order(&publisher, &declined).await;
    env.wait_for_state(
        "declined-1",
        ProcessState::Compensated,
        Duration::from_secs(30),
    )
    .await;

    let detail = env.detail("declined-1").await;
    let states: Vec<_> = detail.steps.iter().map(|s| s.state.as_str()).collect();
    assert_eq!(states, ["compensated", "failed", "not_started"]);
    assert!(
        detail
            .summary
            .last_error
            .as_deref()
            .unwrap_or("")
            .contains("declined"),
        "{:?}",
        detail.summary.last_error
    );

    assert_eq!(
        system.sim.applied_keys("declined-1").await,
        ["declined-1:reserve_stock", "declined-1:reserve_stock:undo"],
        "reserve, then release; nothing else applied"
    );

    // The client's queue got the story in order.
    let mut consumer = sas_tests::consume(&channel, &client_queue, "t").await;
    use sas_messages::StatusEvent::{Compensated, Compensating, Received, StepCompleted};
    let seen = sas_tests::status_events(&mut consumer, Compensated).await;
    assert_eq!(seen, [Received, StepCompleted, Compensating, Compensated]);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_step_that_keeps_timing_out_is_retried_with_growing_waits_then_compensated() {
    let env = TestEnv::with_step_timeout(800).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(Some("payment"), faults(0, 1.0, 0.0))
        .await
        .unwrap();
    let _agents = env.agents(1, &sim, &[Setting::CircuitCoolDownMs(300)]);
    let _scheduler = env.scheduler(0, &[]);
    let supervisor_vars = [
        Setting::SupervisorMaxFailures(3),
        Setting::SupervisorBackoffBaseMs(200),
        Setting::SupervisorBackoffMaxMs(600),
    ];
    let _supervisor = env.supervisor(0, &supervisor_vars);
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("fails-1")).await;

    wait_for_event(
        &env,
        "fails-1",
        HistoryEvent::CompensationStarted,
        Duration::from_secs(40),
    )
    .await;
    // Let the refund through, so that the compensation can finish.
    sim.set_faults(Some("payment"), faults(0, 0.0, 0.0))
        .await
        .unwrap();
    env.wait_for_state(
        "fails-1",
        ProcessState::Compensated,
        Duration::from_secs(30),
    )
    .await;

    let history = env.store.reads().history("fails-1").await.unwrap();
    let retries: Vec<_> = history
        .iter()
        .filter(|h| h.event == HistoryEvent::RetryScheduled)
        .collect();
    assert_eq!(
        retries.len(),
        3,
        "three retries before giving up: {history:?}"
    );
    for (n, retry) in retries.iter().enumerate() {
        let detail = retry.detail.as_deref().unwrap();
        assert!(
            detail.contains(&format!("failure {} of 3", n + 1)),
            "{detail}"
        );
    }
    // Each wait is at least half its nominal value (equal jitter): 200, 400,
    // then 600 ms (the cap). The claims after the retries are the retries'.
    let claims: Vec<_> = history
        .iter()
        .filter(|h| h.event == HistoryEvent::Claimed)
        .collect();
    assert!(claims.len() >= 3, "{history:?}");
    for (n, (retry, claim)) in retries.iter().zip(&claims).enumerate() {
        let waited = (claim.at - retry.at).num_milliseconds();
        let nominal = (200 << n).min(600);
        assert!(
            waited >= nominal / 2,
            "retry {n} waited {waited} ms, less than half of {nominal} ms"
        );
    }
    // The charge's outcome was unknown, so it was refunded too (a refund of
    // nothing, for the remote service); shipping never ran.
    let detail = env.detail("fails-1").await;
    let states: Vec<_> = detail.steps.iter().map(|s| s.state.as_str()).collect();
    assert_eq!(states, ["compensated", "compensated", "not_started"]);
    let charges = history
        .iter()
        .filter(|h| {
            h.event == HistoryEvent::Dispatched && h.step.as_deref() == Some("charge_payment")
        })
        .count();
    assert_eq!(charges, 4, "the first attempt and three retries");
    let applied = sim.applied_per_key().await.unwrap();
    assert_eq!(
        applied.get("fails-1:charge_payment"),
        None,
        "every charge failed: {applied:?}"
    );
    assert_eq!(applied.get("fails-1:charge_payment:undo"), Some(&1));
    assert_eq!(applied.get("fails-1:reserve_stock:undo"), Some(&1));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_compensation_that_keeps_failing_ends_in_error_with_an_alert_until_an_operator_resubmits()
{
    let env = TestEnv::with_step_timeout(600).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[Setting::CircuitCoolDownMs(300)]);
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[Setting::SupervisorMaxFailures(2)]);
    let (_connection, publisher) = env.broker().await;

    // The payment is declined (slowly, so the test can break inventory in
    // the meantime), and the stock release then fails every time.
    sim.set_faults(Some("payment"), faults(1500, 0.0, 0.0))
        .await
        .unwrap();
    let mut declined = order("stuck-1");
    declined.amount_cents = 50_000_000;
    env.publish_order(&publisher, &declined).await;
    wait_for_event(
        &env,
        "stuck-1",
        HistoryEvent::StepCompleted,
        Duration::from_secs(20),
    )
    .await;
    sim.set_faults(Some("inventory"), faults(0, 1.0, 0.0))
        .await
        .unwrap();
    env.wait_for_state("stuck-1", ProcessState::Error, Duration::from_secs(40))
        .await;

    let (code, alerts) = env.sasctl(&["alerts"]).await;
    assert_eq!(code, 0);
    assert!(
        alerts.contains("stuck-1") && alerts.contains("compensation_exhausted"),
        "{alerts}"
    );

    // The operator fixes inventory and resubmits: the compensation resumes.
    sim.set_faults(Some("inventory"), faults(0, 0.0, 0.0))
        .await
        .unwrap();
    let (code, out) = env.sasctl(&["resubmit", "stuck-1"]).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("compensation resumed"), "{out}");
    env.wait_for_state(
        "stuck-1",
        ProcessState::Compensated,
        Duration::from_secs(30),
    )
    .await;
    let (_, alerts) = env.sasctl(&["alerts"]).await;
    assert!(
        !alerts.contains("stuck-1"),
        "the alert is resolved: {alerts}"
    );
    let applied = sim.applied_per_key().await.unwrap();
    assert_eq!(
        applied.get("stuck-1:reserve_stock:undo"),
        Some(&1),
        "released once across every attempt"
    );

    // An order still running cannot be resubmitted.
    env.publish_order(&publisher, &order("running-1")).await;
    wait_for_event(
        &env,
        "running-1",
        HistoryEvent::Received,
        Duration::from_secs(20),
    )
    .await;
    let (code, _) = env.sasctl(&["resubmit", "running-1"]).await;
    assert_eq!(code, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn several_supervisors_never_recover_the_same_step_twice() {
    let env = TestEnv::with_step_timeout(300).await;
    // No agents at all: every attempt times out, forward and backward.
    let _scheduler = env.scheduler(0, &[]);
    let vars = [
        Setting::SupervisorMaxFailures(2),
        Setting::SupervisorIntervalMs(50),
        Setting::SupervisorBackoffBaseMs(50),
        Setting::SupervisorBackoffMaxMs(100),
    ];
    let _supervisors: Vec<_> = (0..3).map(|i| env.supervisor(i, &vars)).collect();
    let (_connection, publisher) = env.broker().await;
    env.publish_orders(&publisher, "sup", 40).await;
    env.wait_for_count(ProcessState::Error, 40, Duration::from_secs(60))
        .await;

    let rows: Vec<(String, String, String, String)> = sqlx::query_as(
        "SELECT order_id, event, actor, COALESCE(detail, '') FROM history
          WHERE event IN ('retry_scheduled', 'compensation_started', 'compensation_retry_scheduled', 'error')
          ORDER BY id",
    )
    .fetch_all(&env.db)
    .await
    .unwrap();
    let mut decisions: HashMap<(String, String, String), usize> = HashMap::new();
    let mut actors = std::collections::HashSet::new();
    for (order_id, event, actor, detail) in rows {
        let failure = detail.split(';').next().unwrap_or("").to_owned();
        let failure = detail
            .split("; ")
            .find(|part| part.starts_with("failure "))
            .unwrap_or(&failure)
            .to_owned();
        *decisions.entry((order_id, event, failure)).or_default() += 1;
        actors.insert(actor);
    }
    for (decision, count) in &decisions {
        assert_eq!(*count, 1, "decision {decision:?} was taken {count} times");
    }
    for n in 0..40 {
        let id = format!("sup-{n}");
        let count = |event: &str| {
            decisions
                .keys()
                .filter(|(o, e, _)| *o == id && e == event)
                .count()
        };
        assert_eq!(count("retry_scheduled"), 2, "{id}");
        assert_eq!(count("compensation_started"), 1, "{id}");
        assert_eq!(count("compensation_retry_scheduled"), 2, "{id}");
        assert_eq!(count("error"), 1, "{id}");
    }
    assert!(
        actors.len() >= 2,
        "the supervisors shared the work: {actors:?}"
    );
    let alerts = env.store.reads().alerts(false, 1000).await.unwrap();
    assert_eq!(alerts.len(), 40, "one alert per order that ended in error");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_late_reply_for_an_old_attempt_changes_nothing_and_its_side_effect_happened_once() {
    let env = TestEnv::with_step_timeout(800).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(Some("payment"), faults(0, 0.0, 1.0))
        .await
        .unwrap();
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("late-1")).await;

    // The first charge is applied, but its answer never comes.
    wait_for_event(
        &env,
        "late-1",
        HistoryEvent::RetryScheduled,
        Duration::from_secs(20),
    )
    .await;
    sim.set_faults(Some("payment"), faults(0, 0.0, 0.0))
        .await
        .unwrap();
    env.wait_for_state("late-1", ProcessState::Processed, Duration::from_secs(30))
        .await;
    let stats = sim.stats().await.unwrap();
    assert!(
        stats.deduplicated >= 1,
        "the retry was answered from the first charge: {stats:?}"
    );
    assert_eq!(
        sim.applied_per_key()
            .await
            .unwrap()
            .get("late-1:charge_payment"),
        Some(&1)
    );

    // Now the first attempt's reply arrives, late.
    let history = env.store.reads().history("late-1").await.unwrap();
    let first = history
        .iter()
        .find(|h| {
            h.event == HistoryEvent::Dispatched && h.step.as_deref() == Some("charge_payment")
        })
        .and_then(|h| h.attempt_id)
        .unwrap();
    let reply = sas_messages::StepReply {
        queued_ms: None,
        slot_wait_ms: None,
        retry_after_ms: None,
        call_ms: None,
        schema_version: sas_messages::SCHEMA_VERSION,
        order_id: "late-1".into(),
        step: "charge_payment".into(),
        attempt_id: first.into(),
        agent_id: "payment-late".into(),
        outcome: sas_messages::StepOutcome::Succeeded {
            result: json!({"id": "late"}),
        },
    };
    let names = env.amqp().names();
    publisher
        .publish_json(
            "",
            &names.scheduler_replies(),
            &reply,
            sas_broker::publish::json_properties("late")
                .with_correlation_id(first.to_string().into()),
            true,
        )
        .await
        .unwrap();
    wait_for_event(
        &env,
        "late-1",
        HistoryEvent::StaleReply,
        Duration::from_secs(20),
    )
    .await;
    let detail = env.detail("late-1").await;
    assert_eq!(detail.summary.state, ProcessState::Processed);
    assert_ne!(
        detail.steps[1].result,
        Some(json!({"id": "late"})),
        "the late reply changed nothing"
    );
    assert_eq!(sim.applied_per_key().await.unwrap().len(), 3);
}

#[tokio::test(flavor = "multi_thread")]
async fn orders_held_by_a_killed_scheduler_finish_on_another_one_within_the_deadline() {
    let env = TestEnv::with_step_timeout(2000).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(None, faults(100, 0.0, 0.0)).await.unwrap();
    let _agents = env.agents(2, &sim, &[]);
    let mut doomed = env.scheduler(0, &[]);
    let _survivor = env.scheduler(1, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    env.publish_orders(&publisher, "sched", 150).await;
    env.wait_for_count(ProcessState::Processed, 20, Duration::from_secs(30))
        .await;
    doomed.kill9().await;
    let killed_at = Instant::now();
    env.wait_for_count(ProcessState::Processed, 150, Duration::from_secs(60))
        .await;
    // complete-by (2 s) + grace (0.4 s) + one supervisor interval (0.2 s) + backoff (at most 1 s) + the work left.
    let took = killed_at.elapsed();
    assert!(took < Duration::from_secs(20), "recovery took {took:?}");
    let by_order = sim.assert_every_order_done_once().await;
    assert_eq!(by_order.len(), 150);
    let held_by_dead: i64 = sqlx::query_scalar("SELECT count(DISTINCT order_id) FROM history WHERE actor = 'scheduler-0' AND event = 'dispatched'")
        .fetch_one(&env.db)
        .await
        .unwrap();
    assert!(held_by_dead > 0, "the killed scheduler had orders");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_killed_mid_call_is_redelivered_and_its_side_effect_happens_once() {
    let env = TestEnv::with_step_timeout(3000).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(Some("payment"), faults(400, 0.0, 0.0))
        .await
        .unwrap();
    let mut doomed = env.agent("payment", 0, &sim, &[]);
    let _others = [
        env.agent("inventory", 0, &sim, &[]),
        env.agent("shipping", 0, &sim, &[]),
        env.agent("payment", 1, &sim, &[]),
    ];
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    env.publish_orders(&publisher, "agent", 60).await;
    // Kill it while it has charges applied but not yet answered.
    wait_until(
        "payment-0 to be mid-call",
        Duration::from_secs(20),
        || async {
            let entries = sim.side_effects().await.map_err(|e| e.to_string())?;
            let charges = entries.iter().filter(|e| e.operation == "charge").count();
            if charges >= 10 {
                Ok(())
            } else {
                Err(charges.to_string())
            }
        },
    )
    .await;
    doomed.kill9().await;
    env.wait_for_count(ProcessState::Processed, 60, Duration::from_secs(60))
        .await;
    let stats = sim.stats().await.unwrap();
    assert!(
        stats.deduplicated >= 1,
        "requests of the killed agent were redelivered and deduplicated: {stats:?}"
    );
    sim.assert_every_order_done_once().await;
}

/// An agent frozen (SIGSTOP) while it holds more requests than it calls
/// (up to `amqp.prefetch`, 256 by default, so that a freed call slot goes
/// to the most urgent of them) delays their orders and loses none: their
/// deadlines send the orders back to the other replica, or the broker
/// hands it the requests once it drops the frozen one's connection. Thawed,
/// the agent settles what it held without doing any step twice, and no
/// order fails.
#[tokio::test(flavor = "multi_thread")]
async fn an_agent_frozen_holding_a_deep_window_of_requests_delays_its_orders_and_loses_none() {
    let env = TestEnv::with_step_timeout(8000).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(Some("inventory"), faults(100, 0.0, 0.0))
        .await
        .unwrap();
    let (ops, other_ops) = (free_port(), free_port());
    let frozen = env.agent(
        "inventory",
        0,
        &sim,
        &[Setting::AgentConcurrency(1), Setting::Listen(ops)],
    );
    let _others = [
        env.agent(
            "inventory",
            1,
            &sim,
            &[Setting::AgentConcurrency(1), Setting::Listen(other_ops)],
        ),
        env.agent("payment", 0, &sim, &[]),
        env.agent("shipping", 0, &sim, &[]),
    ];
    // Both consume before the first request: each is sent about half.
    for port in [ops, other_ops] {
        wait_ready("an inventory agent", &format!("http://127.0.0.1:{port}")).await;
    }
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    env.publish_orders(&publisher, "frozen", 100).await;
    // More than the 32 the window used to hold, one call at a time.
    let held = wait_for_metric(
        "the agent to hold a deep window of requests",
        ops,
        "sas_agent_requests_in_flight",
        Duration::from_secs(20),
        |held| held > 32.0,
    )
    .await;
    let pid = Pid::from_raw(frozen.pid() as i32);
    kill(pid, Signal::SIGSTOP).expect("freeze the agent");
    env.wait_for_count(ProcessState::Processed, 100, Duration::from_secs(90))
        .await;
    kill(pid, Signal::SIGCONT).expect("thaw the agent");
    // It settles what it held: answered as not started (their deadlines
    // passed), or given back with its connection.
    wait_for_metric(
        "the thawed agent to settle what it held",
        ops,
        "sas_agent_requests_in_flight",
        Duration::from_secs(30),
        |in_hand| in_hand == 0.0,
    )
    .await;
    for state in [ProcessState::Compensated, ProcessState::Error] {
        assert_eq!(
            env.count(state).await,
            0,
            "no order is {state} ({held} held)"
        );
    }
    sim.assert_every_order_done_once().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_poison_request_is_dead_lettered_recorded_and_its_order_undone() {
    let env = TestEnv::new().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    // No payment agent yet: the test plays a payment consumer that crashes on the request.
    let _others = [
        env.agent("inventory", 0, &sim, &[]),
        env.agent("shipping", 0, &sim, &[]),
    ];
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("poison-1")).await;

    // Delivery limit 3: the fourth return dead-letters it. Stop there, so the
    // compensation's refund reaches the real agent started below.
    let names = env.amqp().names();
    sas_tests::hand_back(&connection, &names.agent_requests("payment"), 4).await;

    // RabbitMQ dead-lettered it; the supervisor recorded it and had the order undone.
    let _payment = env.agent("payment", 0, &sim, &[]);
    env.wait_for_state(
        "poison-1",
        ProcessState::Compensated,
        Duration::from_secs(30),
    )
    .await;
    let letters = env.store.reads().dead_letters(10).await.unwrap();
    assert!(
        letters
            .iter()
            .any(|l| l.order_id.as_deref() == Some("poison-1")
                && l.reason.contains("delivery_limit")),
        "{letters:?}"
    );
    let applied = sim.applied_per_key().await.unwrap();
    assert_eq!(
        applied.get("poison-1:reserve_stock:undo"),
        Some(&1),
        "{applied:?}"
    );
    assert_eq!(applied.get("poison-1:charge_payment"), None);
}

#[tokio::test(flavor = "multi_thread")]
async fn the_agent_circuit_opens_after_repeated_faults_and_closes_after_a_probe() {
    let env = TestEnv::with_step_timeout(2000).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(Some("payment"), faults(0, 1.0, 0.0))
        .await
        .unwrap();
    let port = free_port();
    let payment = env.agent(
        "payment",
        0,
        &sim,
        &[
            Setting::Listen(port),
            Setting::CircuitFailureThreshold(3),
            Setting::CircuitCoolDownMs(1000),
        ],
    );
    let _others = [
        env.agent("inventory", 0, &sim, &[]),
        env.agent("shipping", 0, &sim, &[]),
    ];
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[Setting::SupervisorMaxFailures(50)]);
    let (_connection, publisher) = env.broker().await;
    env.publish_orders(&publisher, "circuit", 5).await;
    let gauge = r#"sas_circuit_state{agent="payment"}"#;
    wait_for_metric(
        "the circuit to open",
        port,
        gauge,
        Duration::from_secs(20),
        |n| n == 1.0,
    )
    .await;
    let rejected = metric(
        port,
        r#"sas_agent_circuit_rejections_total{agent="payment"}"#,
    )
    .await
    .unwrap_or(0.0);
    wait_until("calls to fail fast", Duration::from_secs(20), || async {
        let now = metric(
            port,
            r#"sas_agent_circuit_rejections_total{agent="payment"}"#,
        )
        .await
        .unwrap_or(0.0);
        if now > rejected {
            Ok(())
        } else {
            Err(now.to_string())
        }
    })
    .await;
    assert!(payment.log_text().contains("circuit breaker state changed"));

    sim.set_faults(Some("payment"), faults(0, 0.0, 0.0))
        .await
        .unwrap();
    env.wait_for_count(ProcessState::Processed, 5, Duration::from_secs(60))
        .await;
    assert_eq!(
        metric(port, gauge).await,
        Some(0.0),
        "closed again after a successful probe"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn every_binary_exits_zero_on_sigterm_and_hands_back_what_it_had_in_flight() {
    let env = TestEnv::with_step_timeout(3000).await;
    let drain = [
        Setting::SchedulerDrainMs(2000),
        Setting::AgentDrainMs(2000),
        Setting::SupervisorDrainMs(2000),
    ];
    let (mut sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(None, faults(300, 0.0, 0.0)).await.unwrap();
    let mut agents = env.agents(1, &sim, &drain);
    let mut scheduler = env.scheduler(0, &drain);
    let mut supervisor = env.supervisor(0, &drain);
    let (_connection, publisher) = env.broker().await;
    env.publish_orders(&publisher, "term", 40).await;
    wait_until("work in flight", Duration::from_secs(20), || async {
        let n = sim.side_effects().await.map_err(|e| e.to_string())?.len();
        if n >= 5 {
            Ok(())
        } else {
            Err(n.to_string())
        }
    })
    .await;
    for service in agents.iter_mut().chain([&mut scheduler, &mut supervisor]) {
        let status = service.terminate(Duration::from_secs(15)).await;
        assert!(
            status.success(),
            "{} exited with {status} (log {})",
            service.name,
            service.log.display()
        );
    }
    let status = sim_process.terminate(Duration::from_secs(15)).await;
    assert!(status.success(), "remote-sim exited with {status}");

    // Start again: everything handed back is finished, nothing twice.
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    env.wait_for_count(ProcessState::Processed, 40, Duration::from_secs(60))
        .await;
    let by_order = sim.assert_every_order_done_once().await;
    assert_eq!(by_order.len(), 40);
    assert_eq!(
        env.detail("term-0").await.summary.state,
        ProcessState::Processed
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_dead_letter_delivered_twice_settles_its_order_once() {
    let env = TestEnv::new().await;
    let trace = sas_messages::TraceParent::new_root().trace_id;
    env.store
        .writes()
        .insert_order(
            &order("dead-twice"),
            sas_store::Plan::new("order", 1, &env.steps()),
            &trace,
            "test",
        )
        .await
        .unwrap();
    let attempt = env.detail("dead-twice").await.steps[0].attempt_id.unwrap();

    let first = env
        .store
        .writes()
        .settle_dead_letter(
            "dead-twice",
            attempt,
            "delivery_limit",
            false,
            "supervisor-0",
        )
        .await
        .unwrap();
    assert!(first.is_some(), "the order is undone");
    assert_eq!(
        env.detail("dead-twice").await.summary.state,
        ProcessState::Compensating
    );
    // The same dead letter again (a redelivery after a supervisor crashed
    // before its ack): the step is not the one the compensation awaits.
    let second = env
        .store
        .writes()
        .settle_dead_letter(
            "dead-twice",
            attempt,
            "delivery_limit",
            false,
            "supervisor-1",
        )
        .await
        .unwrap();
    assert!(second.is_none(), "nothing changes twice");
    assert_eq!(
        env.detail("dead-twice").await.summary.state,
        ProcessState::Compensating
    );
    assert!(
        env.store.reads().alerts(true, 10).await.unwrap().is_empty(),
        "no alert: the compensation goes on"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_never_calls_the_remote_service_after_the_attempt_s_deadline() {
    let env = TestEnv::with_step_timeout(1000).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    // Inventory takes longer than a step may, and the agent makes one call
    // at a time: later requests wait for the call slot past their deadline.
    sim.set_faults(Some("inventory"), faults(1500, 0.0, 0.0))
        .await
        .unwrap();
    let one_at_a_time = [Setting::AgentConcurrency(1), Setting::AmqpPrefetch(10)];
    let _inventory = env.agent("inventory", 0, &sim, &one_at_a_time);
    let _others = [
        env.agent("payment", 0, &sim, &[]),
        env.agent("shipping", 0, &sim, &[]),
    ];
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[Setting::SupervisorMaxFailures(0)]);
    let (_connection, publisher) = env.broker().await;
    env.publish_orders(&publisher, "late-call", 5).await;
    // Every attempt, forward and backward, times out: the orders end in error.
    env.wait_for_count(ProcessState::Error, 5, Duration::from_secs(60))
        .await;

    let timeout = chrono::Duration::milliseconds(1000);
    let tolerance = chrono::Duration::milliseconds(50);
    for entry in sim.side_effects().await.unwrap() {
        if entry.service != "inventory" || entry.key.ends_with(":undo") {
            continue;
        }
        let order_id = entry.order_id.clone().unwrap();
        let windows: Vec<_> = env
            .store
            .reads()
            .history(&order_id)
            .await
            .unwrap()
            .into_iter()
            .filter(|h| {
                h.event == HistoryEvent::Dispatched && h.step.as_deref() == Some("reserve_stock")
            })
            .map(|h| (h.at, h.at + timeout))
            .collect();
        assert!(
            windows
                .iter()
                .any(|(start, end)| entry.at >= *start - tolerance && entry.at <= *end + tolerance),
            "{} was called at {}, outside every attempt's window {windows:?}",
            entry.key,
            entry.at
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_operator_cancels_a_running_order_and_everything_it_did_is_undone_after_its_call_in_flight(
) {
    let env = TestEnv::new().await;
    let system = env.system(1).await;
    // Charges take 1.5 s: the cancel lands while one is in flight.
    system
        .sim
        .set_faults(Some("payment"), faults(1500, 0.0, 0.0))
        .await
        .unwrap();
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("cancel-1")).await;
    wait_for_event(
        &env,
        "cancel-1",
        HistoryEvent::StepCompleted,
        Duration::from_secs(20),
    )
    .await;
    let (code, out) = env
        .sasctl(&["cancel", "cancel-1", "--reason", "customer asked"])
        .await;
    assert_eq!(code, 0, "{out}");
    env.wait_for_state(
        "cancel-1",
        ProcessState::Compensated,
        Duration::from_secs(30),
    )
    .await;
    let history = env.store.reads().history("cancel-1").await.unwrap();
    let cancelled = history
        .iter()
        .find(|h| h.event == HistoryEvent::Cancelled)
        .expect("the cancellation is in the history");
    assert!(
        cancelled.actor.starts_with("sasctl:") && cancelled.actor.len() > "sasctl:".len(),
        "sasctl records the operating-system user: {}",
        cancelled.actor
    );
    assert_eq!(
        cancelled.detail.as_deref(),
        Some(format!("cancelled by {}: customer asked", cancelled.actor).as_str())
    );
    // The charge in flight was undone only after its attempt's deadline.
    let charge = history
        .iter()
        .find(|h| {
            h.event == HistoryEvent::Dispatched && h.step.as_deref() == Some("charge_payment")
        })
        .expect("the charge was dispatched");
    let refund = history
        .iter()
        .find(|h| {
            h.event == HistoryEvent::CompensationDispatched
                && h.step.as_deref() == Some("charge_payment")
        })
        .expect("the charge was refunded");
    // The charge in flight was undone only once its answer came (kept, and
    // before its deadline: no need to wait for it then).
    let answered = history
        .iter()
        .find(|h| {
            h.event == HistoryEvent::StepCompleted
                && h.step.as_deref() == Some("charge_payment")
                && h.detail
                    .as_deref()
                    .is_some_and(|d| d.contains("after the order's compensation began"))
        })
        .expect("the charge's answer, after the cancel, is kept");
    assert!(
        refund.at >= answered.at,
        "refund at {} before the charge's answer ({})",
        refund.at,
        answered.at
    );
    let timeout = chrono::Duration::milliseconds(env.step_timeout_ms as i64);
    assert!(
        refund.at < charge.at + timeout,
        "the refund waited for the charge's deadline although its answer had come"
    );
    // Every effect applied was undone, each once.
    let effects = system.sim.effects_by_order().await;
    let (applied, undone) = effects.get("cancel-1").copied().unwrap_or_default();
    assert!(applied >= 1, "{effects:?}");
    assert_eq!(applied, undone, "{effects:?}");
    // Only running orders can be cancelled.
    let (code, out) = env.sasctl(&["cancel", "cancel-1"]).await;
    assert_eq!(code, 1, "{out}");
}

/// A cancel from sasctl says, and holds the order until, the time the undo
/// of an action in flight may go by the deployment's grace
/// (`SAS_DEADLINES__GRACE_MS`), as the services would. Before sasctl read
/// the deadlines it used its default 2 s whatever the services had: the
/// history named the wrong time, and the order waited for it (the
/// scheduler that claimed it then decided by its own grace).
#[tokio::test(flavor = "multi_thread")]
async fn a_cancel_from_sasctl_waits_for_an_action_in_flight_by_the_deployment_s_grace() {
    let env = TestEnv::new().await;
    let system = env.system(1).await;
    // Charges take 2 s of the 3 s deadline: the cancel lands while one is
    // in flight.
    system
        .sim
        .set_faults(Some("payment"), faults(2000, 0.0, 0.0))
        .await
        .unwrap();
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("grace-1")).await;
    wait_for_event(
        &env,
        "grace-1",
        HistoryEvent::Dispatched,
        Duration::from_secs(20),
    )
    .await;
    wait_until("the charge in flight", Duration::from_secs(20), || async {
        let running: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM steps WHERE order_id = 'grace-1'
                               AND name = 'charge_payment' AND state = 'running')",
        )
        .fetch_one(&env.db)
        .await
        .map_err(|e| e.to_string())?;
        running.then_some(()).ok_or_else(|| "not yet".to_owned())
    })
    .await;
    let (code, out) = env.sasctl(&["cancel", "grace-1"]).await;
    assert_eq!(code, 0, "{out}");

    // The undo waits until the charge's deadline plus the services' grace
    // (a fifth of the 3 s deadline here), not sasctl's default 2 s.
    let complete_by: chrono::DateTime<chrono::Utc> = sqlx::query_scalar(
        "SELECT complete_by FROM steps WHERE order_id = 'grace-1' AND name = 'charge_payment'",
    )
    .fetch_one(&env.db)
    .await
    .expect("the charge's deadline");
    let history = env.store.reads().history("grace-1").await.unwrap();
    let waits = history
        .iter()
        .find(|h| h.event == HistoryEvent::UndoWaits && h.actor.starts_with("sasctl:"))
        .unwrap_or_else(|| panic!("sasctl's cancel let no undo wait: {history:?}"));
    let detail = waits.detail.as_deref().unwrap_or_default();
    let until = detail
        .split("until ")
        .nth(1)
        .and_then(|rest| rest.split(" (").next())
        .and_then(|at| chrono::NaiveDateTime::parse_from_str(at, "%Y-%m-%d %H:%M:%S%.f UTC").ok())
        .unwrap_or_else(|| panic!("no time in {detail:?}"))
        .and_utc();
    let grace = chrono::Duration::milliseconds(env.step_timeout_ms as i64 / 5);
    assert_eq!(until, complete_by + grace, "{detail}");
    env.wait_for_state(
        "grace-1",
        ProcessState::Compensated,
        Duration::from_secs(30),
    )
    .await;
}

/// A channel the broker closes (a passive declare of a missing queue, as the
/// console's queue depths make) leaves the connection up. lapin 4 reports it
/// on the same event stream as a lost connection; the session must tell the
/// two apart, or every missing queue would cost the service a reconnect.
#[tokio::test(flavor = "multi_thread")]
async fn a_channel_the_broker_closes_does_not_cost_the_session_its_connection() {
    let env = TestEnv::new().await;
    let (_connection, _publisher) = env.broker().await;
    let orders = env.amqp().names().orders();
    let missing = format!("{}no-such-queue", env.prefix);
    let session = sas_broker::Session::new(env.amqp(), "channel-error-test");
    let shutdown = tokio_util::sync::CancellationToken::new();
    // Each run of the work reports its number, then what became of it.
    let (report, mut reports) = tokio::sync::mpsc::unbounded_channel::<(usize, String)>();
    let mut runs = 0;
    let stop = shutdown.clone();
    let running = session.run(shutdown.clone(), move |connection, _publisher| {
        runs += 1;
        let run = runs;
        let (report, stop) = (report.clone(), stop.clone());
        let (orders, missing) = (orders.clone(), missing.clone());
        async move {
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            let outcome: sas_broker::lapin::Result<()> = async {
                let channel = connection.create_channel().await?;
                let refused = channel
                    .queue_declare(missing.into(), passive, FieldTable::default())
                    .await;
                let _ = report.send((run, format!("missing queue: {refused:?}")));
                // Many round trips on the same connection after the refusal:
                // a session that took it for a lost connection drops this
                // work (or closes the connection under it) long before.
                for _ in 0..20 {
                    let channel = connection.create_channel().await?;
                    channel
                        .queue_declare(orders.as_str().into(), passive, FieldTable::default())
                        .await?;
                    channel.close(200, "read".into()).await?;
                }
                Ok(())
            }
            .await;
            let outcome =
                outcome.map_or_else(|e| format!("failed: {e}"), |()| "still connected".into());
            let _ = report.send((run, outcome));
            stop.cancelled().await;
            Ok(())
        }
    });
    let check = async {
        let deadline = Duration::from_secs(30);
        let (run, refused) = tokio::time::timeout(deadline, reports.recv())
            .await
            .expect("the work starts")
            .expect("a report");
        assert_eq!(run, 1);
        assert!(refused.contains("NOT_FOUND"), "{refused}");
        let (run, outcome) = tokio::time::timeout(deadline, reports.recv())
            .await
            .expect("the work goes on after the refusal")
            .expect("a report");
        assert_eq!(
            (run, outcome.as_str()),
            (1, "still connected"),
            "the session reconnected after one channel was closed"
        );
        assert!(session.is_connected());
        shutdown.cancel();
    };
    tokio::join!(running, check);
}

/// A charge of `order_id` for the payment agent, published straight to its
/// queue with `reply_to` the test's queue: no call starts after `start_in`
/// from now, none runs past `complete_in`.
pub(crate) async fn send_charge(
    env: &TestEnv,
    publisher: &sas_broker::Publisher,
    reply_to: &str,
    order_id: &str,
    (start_in, complete_in): (Duration, Duration),
) -> sas_messages::StepRequest {
    let now = chrono::Utc::now();
    let request = sas_messages::StepRequest {
        schema_version: sas_messages::SCHEMA_VERSION,
        order_id: order_id.into(),
        step: "charge_payment".into(),
        kind: sas_messages::StepKind::Action,
        action: "charge".into(),
        attempt_id: uuid::Uuid::now_v7().into(),
        attempt: 1,
        idempotency_key: format!("{order_id}:charge_payment"),
        complete_by: now + chrono::Duration::from_std(complete_in).unwrap(),
        start_by: Some(now + chrono::Duration::from_std(start_in).unwrap()),
        dispatched_at: Some(now),
        payload: json!({ "order": { "order_id": order_id, "amount_cents": 100 }, "results": {} }),
        method: None,
        path: None,
        limit_key: None,
    };
    let properties = sas_broker::publish::json_properties(&uuid::Uuid::now_v7().to_string())
        .with_correlation_id(request.attempt_id.to_string().as_str().into())
        .with_reply_to(reply_to.into());
    publisher
        .publish_json(
            "",
            &env.amqp().names().agent_requests("payment"),
            &request,
            properties,
            true,
        )
        .await
        .unwrap();
    request
}

/// Has the broker close the connection of the process whose connection
/// name holds `id` (as a network cut would).
async fn close_broker_connection_of(id: &str) {
    let listing = tokio::process::Command::new("rabbitmqctl")
        .args(["list_connections", "pid", "client_properties", "-q"])
        .output()
        .await
        .expect("rabbitmqctl");
    let listing = String::from_utf8_lossy(&listing.stdout).into_owned();
    let pid = listing
        .lines()
        .find(|line| line.contains(id))
        .and_then(|line| line.split_whitespace().next())
        .unwrap_or_else(|| panic!("the connection of {id} is listed: {listing}"))
        .to_owned();
    let closed = tokio::process::Command::new("rabbitmqctl")
        .args(["close_connection", &pid, "test: connection cut"])
        .status()
        .await
        .expect("rabbitmqctl");
    assert!(closed.success(), "rabbitmqctl close_connection failed");
}

/// The probe of a half-open circuit can end without an outcome: here the
/// broker drops the agent's connection while the probe's call hangs, so
/// the call is abandoned (its request goes back to the queue). That probe
/// is handed back, and the next call is the next probe: once the service
/// is back the circuit closes and orders are processed again. Before, the
/// circuit stayed half-open until the agent restarted: every request
/// waited for a probe that never came, and expired.
#[tokio::test(flavor = "multi_thread")]
async fn a_probe_abandoned_without_an_outcome_lets_the_next_call_probe_and_the_circuit_closes() {
    // Alone on the broker: rabbitmqctl closes a connection of its own.
    let env = TestEnv::exclusive(3000).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(Some("payment"), faults(0, 1.0, 0.0))
        .await
        .unwrap();
    let port = free_port();
    let agent_id = format!("{}-payment", env.id);
    let mut payment = env.agent(
        "payment",
        0,
        &sim,
        &[
            Setting::Listen(port),
            Setting::AgentId(agent_id.clone()),
            Setting::CircuitFailureThreshold(2),
            Setting::CircuitCoolDownMs(1000),
            // The hanging probe must not time out before its connection is cut.
            Setting::AgentCallTimeoutMs(60_000),
        ],
    );
    let (connection, publisher) = env.broker().await;
    let (reply_to, channel) = env.client_queue(&connection, "test-replies").await;
    let mut replies = sas_tests::consume(&channel, &reply_to, "test").await;
    // One charge with a long window: its calls fail (503), the circuit
    // opens, and the request waits in the agent for the probe.
    let charge = send_charge(
        &env,
        &publisher,
        &reply_to,
        "probe-1",
        (Duration::from_secs(50), Duration::from_secs(60)),
    )
    .await;
    let gauge = r#"sas_circuit_state{agent="payment"}"#;
    wait_for_metric(
        "the circuit to open",
        port,
        gauge,
        Duration::from_secs(20),
        |n| n == 1.0,
    )
    .await;
    // The service now applies the charge and answers two minutes later:
    // the probe's call hangs.
    sim.set_faults(Some("payment"), faults(120_000, 0.0, 0.0))
        .await
        .unwrap();
    wait_until(
        "the probe's call to hang at the remote",
        Duration::from_secs(20),
        || async {
            let state = metric(port, gauge).await;
            let applied = sim
                .side_effects()
                .await
                .map_err(|e| e.to_string())?
                .iter()
                .any(|entry| entry.key == charge.idempotency_key);
            if state == Some(2.0) && applied {
                Ok(())
            } else {
                Err(format!("circuit {state:?}, charge applied: {applied}"))
            }
        },
    )
    .await;
    // The service is healthy again (the hanging answer still hangs), and
    // the broker drops the agent's connection: the probe's call is
    // abandoned without an outcome.
    sim.set_faults(Some("payment"), faults(0, 0.0, 0.0))
        .await
        .unwrap();
    close_broker_connection_of(&agent_id).await;
    wait_for_metric(
        "the circuit to close again after the abandoned probe",
        port,
        gauge,
        Duration::from_secs(20),
        |n| n == 0.0,
    )
    .await;
    // The redelivered charge was the next probe: answered from the
    // remote's record of the key, applied once.
    let reply = tokio::time::timeout(Duration::from_secs(20), replies.next())
        .await
        .expect("a reply in time")
        .expect("the consumer is open")
        .expect("a delivery");
    let reply: sas_messages::StepReply = serde_json::from_slice(&reply.data).unwrap();
    assert_eq!(reply.attempt_id, charge.attempt_id);
    assert!(
        matches!(reply.outcome, sas_messages::StepOutcome::Succeeded { .. }),
        "{:?}",
        reply.outcome
    );
    let applied = sim.applied_per_key().await.unwrap();
    assert_eq!(
        applied.get(&charge.idempotency_key),
        Some(&1),
        "{applied:?}"
    );
    assert_eq!(
        metric(port, r#"sas_circuit_open_seconds{agent="payment"}"#).await,
        Some(0.0),
        "closed: no time out of closed"
    );
    // New orders go through.
    let _others = [
        env.agent("inventory", 0, &sim, &[]),
        env.agent("shipping", 0, &sim, &[]),
    ];
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    env.publish_orders(&publisher, "after-probe", 3).await;
    env.wait_for_count(ProcessState::Processed, 3, Duration::from_secs(60))
        .await;
    assert!(payment.is_running());
}

/// Publishes `orders` orders named `<prefix>-<n>` and waits until every one
/// is processed, within `within`.
async fn orders_go_through(env: &TestEnv, prefix: &str, orders: usize, within: Duration) {
    let (_connection, publisher) = env.broker().await;
    for n in 0..orders {
        env.publish_order(&publisher, &order(&format!("{prefix}-{n}")))
            .await;
    }
    for n in 0..orders {
        env.wait_for_state(&format!("{prefix}-{n}"), ProcessState::Processed, within)
            .await;
    }
}

/// An operator's session (psql, a tool) stopped inside a transaction that
/// holds every shard of the first agent's admission counters, as a stopped
/// service inside a fold would: every intake statement of that agent waits
/// for it. The database ends such a session after its idle timeout
/// (migration 0021 sets it on the database; the services set their own),
/// and intake goes on; before, it waited as long as the session stayed.
#[tokio::test(flavor = "multi_thread")]
async fn a_session_stopped_inside_a_transaction_on_the_admission_shards_stalls_intake_only_until_the_database_ends_it(
) {
    use sqlx::Connection as _;
    let env = TestEnv::new().await;
    let _system = env.system(1).await;
    orders_go_through(&env, "before", 1, Duration::from_secs(30)).await;
    // A session as psql opens it: no options of ours.
    let mut stopped = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    sqlx::query("BEGIN").execute(&mut stopped).await.unwrap();
    let held: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT 1 FROM admission_shard WHERE agent = 'inventory' FOR UPDATE) s",
    )
    .fetch_one(&mut stopped)
    .await
    .unwrap();
    assert_eq!(held, 8, "every shard of the first agent is held");
    let started = Instant::now();
    // 15 s of the database's idle timeout, and the orders' own time.
    orders_go_through(&env, "after", 5, Duration::from_secs(45)).await;
    eprintln!(
        "orders went through {:?} after the session stopped",
        started.elapsed()
    );
    // The database ended the stopped session: it holds nothing any more.
    let error = sqlx::query("SELECT 1")
        .execute(&mut stopped)
        .await
        .expect_err("the stopped session was ended");
    eprintln!("the stopped session's next statement: {error}");
}

/// A supervisor stopped (SIGSTOP) at any moment of its admission work never
/// holds the agents' admission rows or shards while it is stopped: its
/// adaptations and reconciliations are single statements (migration 0021),
/// which the server runs to their end whatever the client does. A proxy
/// slows each of its round trips to Postgres by 150 ms, so that it is
/// caught inside that work; each time, it is stopped and orders must go
/// through within 10 s. Before, it was caught between the statements of a
/// transaction holding the rows and shards, and intake waited for as long
/// as it stayed stopped.
#[tokio::test(flavor = "multi_thread")]
async fn a_supervisor_stopped_inside_its_admission_work_holds_nothing_and_orders_go_on() {
    let env = TestEnv::new().await;
    let proxy =
        sas_tests::tcp_delay::DelayProxy::start("127.0.0.1:5432", Duration::from_millis(150)).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &[]);
    let slow_url = proxy.postgres_url(&env.database_url);
    let supervisor = env.supervisor(
        0,
        &[
            Setting::DatabaseUrl(slow_url),
            Setting::SupervisorAdmissionWindowMs(300),
        ],
    );
    let pid = Pid::from_raw(supervisor.pid() as i32);
    orders_go_through(&env, "warm", 1, Duration::from_secs(30)).await;
    for round in 0..4 {
        // Caught while a statement of its admission work runs, or between
        // two of a transaction.
        let (state, query) = wait_until(
            "the supervisor inside its admission work",
            Duration::from_secs(30),
            || async {
                // Between two statements of a transaction that holds the
                // admission tables, or running a statement on them.
                let busy: Option<(String, String)> = sqlx::query_as(
                    "SELECT a.state, a.query FROM pg_stat_activity a
                      WHERE a.application_name LIKE 'supervisor-0%'
                        AND ((a.state = 'idle in transaction'
                              AND EXISTS (SELECT 1 FROM pg_locks l
                                           WHERE l.pid = a.pid
                                             AND l.relation IN ('admission'::regclass,
                                                                'admission_shard'::regclass)))
                             OR (a.state = 'active' AND a.query ILIKE '%admission%'))
                      LIMIT 1",
                )
                .fetch_optional(&env.db)
                .await
                .map_err(|e| e.to_string())?;
                busy.ok_or_else(|| "not yet".to_owned())
            },
        )
        .await;
        kill(pid, Signal::SIGSTOP).expect("stop the supervisor");
        eprintln!("round {round}: supervisor stopped while {state}: {query}");
        orders_go_through(
            &env,
            &format!("stopped-{round}"),
            3,
            Duration::from_secs(10),
        )
        .await;
        // While stopped it holds no lock on the admission tables.
        let held: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
              WHERE a.application_name LIKE 'supervisor-0%'
                AND l.relation IN ('admission'::regclass, 'admission_shard'::regclass)",
        )
        .fetch_one(&env.db)
        .await
        .unwrap();
        assert_eq!(
            held, 0,
            "round {round}: the stopped supervisor holds admission locks"
        );
        kill(pid, Signal::SIGCONT).expect("let the supervisor go on");
    }
}
