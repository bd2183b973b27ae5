//! Steps that wait for the outside world, against real processes: an
//! approval that comes before the order reaches its wait, during it, or
//! never (then the order is undone); an event for an order submitted
//! later, one whose order never comes (dead-lettered), and one sent twice;
//! a delay between two steps; and orders parked across kill -9 of the
//! scheduler and the supervisor.

use std::time::Duration;

use sas_store::machine::kind::{CallStep, Kind};
use sas_store::machine::HistoryEvent;
use sas_store::reads::queries::HistoryEntry;
use sas_store::ProcessState;
use sas_tests::process::Service;
use sas_tests::{event, order, wait_until, Setting, TestEnv};

/// Version `version` of a workflow with a wait for `approved` (timing out
/// after `wait_ms` into compensation) after reserving, a charge whose body
/// carries who approved, and a one-second cooling-off delay before
/// shipping, written to the test's workflows folder; the settings that
/// make a scheduler run it.
fn approval_workflow(env: &TestEnv, version: i32, wait_ms: u64) -> [Setting; 2] {
    let timeout = env.step_timeout_ms;
    let text = order_version(
        env,
        version,
        wait_ms,
        &format!(
            r#"
[[steps]]
name = "charge_payment"
agent = "payment"
action = "charge"
compensation = "refund"
timeout_ms = {timeout}
[steps.request.body]
order = "${{/order}}"
approved_by = "${{/results/approval/by}}"

[[steps]]
name = "cooling_off"
kind = "delay"
delay_ms = 1000

[[steps]]
name = "create_shipment"
agent = "shipping"
action = "ship"
compensation = "cancel"
timeout_ms = {timeout}
"#
        ),
    );
    env.workflows(&[("order.toml", &text)])
}

/// Waits until `order_id` is parked at its `approval` step.
pub(crate) async fn wait_for_approval(env: &TestEnv, order_id: &str) {
    wait_parked_at(env, order_id, "approval").await;
}

/// Waits until `order_id` is parked at its wait step `step`.
async fn wait_parked_at(env: &TestEnv, order_id: &str, step: &str) {
    wait_until(
        &format!("{order_id} to wait at {step}"),
        Duration::from_secs(30),
        || async {
            let detail = env
                .store
                .reads()
                .order_detail(order_id)
                .await
                .map_err(|e| e.to_string())?
                .ok_or("not stored yet")?;
            let approval = detail
                .steps
                .iter()
                .find(|s| s.name == step)
                .ok_or_else(|| format!("no step {step}"))?;
            (detail.summary.state == ProcessState::Pending
                && approval.state == sas_store::StepState::Running)
                .then_some(())
                .ok_or_else(|| format!("{} / {}", detail.summary.state, approval.state))
        },
    )
    .await;
}

/// The order's history events for `step`, in order.
async fn step_history(env: &TestEnv, order_id: &str, step: &str) -> Vec<HistoryEvent> {
    env.detail(order_id)
        .await
        .history
        .iter()
        .filter(|h| h.step.as_deref() == Some(step))
        .map(|h| h.event)
        .collect()
}

/// Mailbox rows of an order: (event id, used by which step).
async fn mailbox(env: &TestEnv, order_id: &str) -> Vec<(String, Option<String>)> {
    sqlx::query_as(
        "SELECT event_id, used_by FROM order_events WHERE order_id = $1 ORDER BY received_at",
    )
    .bind(order_id)
    .fetch_all(&env.db)
    .await
    .unwrap()
}

fn approved_by(order_id: &str, id: &str, by: &str) -> sas_messages::OrderEvent {
    let mut approved = event(order_id, "approved", id);
    approved.data = serde_json::json!({ "by": by }).as_object().cloned();
    approved
}

#[tokio::test(flavor = "multi_thread")]
async fn an_approval_before_the_wait_during_it_and_never_and_a_cooling_off_delay() {
    let env = TestEnv::new().await;
    let workflows = approval_workflow(&env, 2, 3000);
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _others = [
        env.agent("payment", 0, &sim, &[]),
        env.agent("shipping", 0, &sim, &[]),
    ];
    let _scheduler = env.scheduler(0, &workflows);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;

    // Before: no inventory agent yet, so the order stays at its first step
    // while its approval arrives and is kept in its mailbox.
    env.publish_order(&publisher, &order("early-1")).await;
    env.wait_stored("early-1", Duration::from_secs(20)).await;
    env.publish_event(&publisher, &approved_by("early-1", "mail-1", "ann"))
        .await;
    wait_until(
        "the early approval to be kept",
        Duration::from_secs(20),
        || async {
            (mailbox(&env, "early-1").await == [("mail-1".to_owned(), None)])
                .then_some(())
                .ok_or_else(|| "not kept yet".to_owned())
        },
    )
    .await;
    let _inventory = env.agent("inventory", 0, &sim, &[]);

    // During, and never.
    env.publish_order(&publisher, &order("during-1")).await;
    env.publish_order(&publisher, &order("never-1")).await;
    wait_for_approval(&env, "during-1").await;
    let (code, shown) = env.sasctl(&["orders", "show", "during-1"]).await;
    assert_eq!(code, 0, "{shown}");
    assert!(shown.contains("workflow    order (version 2)"), "{shown}");
    let approval = shown
        .lines()
        .find(|line| line.contains(" approval "))
        .unwrap_or_else(|| panic!("no approval step: {shown}"));
    assert!(
        approval.contains("wait:approved")
            && approval.contains("running")
            && approval.contains("(until "),
        "{approval}"
    );
    env.publish_event(&publisher, &approved_by("during-1", "mail-2", "bo"))
        .await;

    for id in ["early-1", "during-1"] {
        env.wait_for_state(id, ProcessState::Processed, Duration::from_secs(30))
            .await;
    }
    env.wait_for_state(
        "never-1",
        ProcessState::Compensated,
        Duration::from_secs(30),
    )
    .await;

    use HistoryEvent::{CompensationStarted, WaitEnded, WaitTimedOut, Waiting};
    assert_eq!(step_history(&env, "early-1", "approval").await, [WaitEnded]);
    assert_eq!(
        step_history(&env, "during-1", "approval").await,
        [Waiting, WaitEnded]
    );
    assert_eq!(
        step_history(&env, "never-1", "approval").await,
        [Waiting, WaitTimedOut, CompensationStarted]
    );
    for (id, mail) in [("early-1", "mail-1"), ("during-1", "mail-2")] {
        assert_eq!(
            mailbox(&env, id).await,
            [(mail.to_owned(), Some("approval".to_owned()))]
        );
    }

    // The approval's data reached the charge; the order that was never
    // approved was charged nothing and its reservation was released.
    let effects = sim.side_effects().await.unwrap();
    let body_of = |key: &str| {
        effects
            .iter()
            .find(|e| e.key == key)
            .map(|e| e.body.clone())
            .unwrap_or_else(|| panic!("no side effect {key}"))
    };
    assert_eq!(body_of("early-1:charge_payment")["approved_by"], "ann");
    assert_eq!(body_of("during-1:charge_payment")["approved_by"], "bo");
    let keys: Vec<&str> = effects
        .iter()
        .filter(|e| e.key.starts_with("never-1:"))
        .map(|e| e.key.as_str())
        .collect();
    assert_eq!(keys.len(), 2, "{keys:?}");
    assert!(
        keys.contains(&"never-1:reserve_stock") && keys.contains(&"never-1:reserve_stock:undo"),
        "{keys:?}"
    );

    // The cooling-off delay held the order at least its second.
    let history = env.detail("during-1").await.history;
    let at = |event: HistoryEvent| {
        history
            .iter()
            .find(|h| h.step.as_deref() == Some("cooling_off") && h.event == event)
            .map(|h| h.at)
            .unwrap_or_else(|| panic!("no {event} for cooling_off: {history:?}"))
    };
    let held = at(WaitEnded) - at(Waiting);
    assert!(held >= chrono::Duration::seconds(1), "held {held}");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_event_for_a_later_order_waits_for_it_a_repeat_is_used_once_and_one_for_no_order_is_dead_lettered(
) {
    let env = TestEnv::new().await;
    let workflows = approval_workflow(&env, 2, 30_000);
    let mut settings = workflows.to_vec();
    settings.push(Setting::SchedulerEventTtlSecs(3));
    let _system = system(&env, &settings).await;
    let (_connection, publisher) = env.broker().await;

    // Twice, as a redelivery or a client's retry would send it.
    for _ in 0..2 {
        env.publish_event(&publisher, &approved_by("later-1", "mail-9", "cy"))
            .await;
    }
    env.publish_event(&publisher, &approved_by("ghost-1", "mail-0", "cy"))
        .await;
    wait_until(
        "both events to be kept",
        Duration::from_secs(20),
        || async {
            let kept = (
                mailbox(&env, "later-1").await.len(),
                mailbox(&env, "ghost-1").await.len(),
            );
            (kept == (1, 1)).then_some(()).ok_or(format!("{kept:?}"))
        },
    )
    .await;
    env.publish_order(&publisher, &order("later-1")).await;
    env.wait_for_state("later-1", ProcessState::Processed, Duration::from_secs(30))
        .await;
    assert_eq!(
        mailbox(&env, "later-1").await,
        [("mail-9".to_owned(), Some("approval".to_owned()))]
    );
    // The same event once more, after it was used: nothing changes.
    env.publish_event(&publisher, &approved_by("later-1", "mail-9", "cy"))
        .await;

    // The event whose order never came is dead-lettered with the reason.
    wait_for_dead_letter(&env, "mail-0", "no order ghost-1 came").await;
    assert_eq!(
        step_history(&env, "later-1", "approval").await,
        [HistoryEvent::WaitEnded]
    );
    assert_eq!(env.state_of("later-1").await, Some(ProcessState::Processed));
}

/// Waits until event `event_id` was dead-lettered once, with a reason
/// that says `reason`.
async fn wait_for_dead_letter(env: &TestEnv, event_id: &str, reason: &str) {
    wait_until(
        &format!("event {event_id} to be dead-lettered"),
        Duration::from_secs(30),
        || async {
            let reasons: Vec<String> =
                sqlx::query_scalar("SELECT reason FROM dead_letters WHERE message_id = $1")
                    .bind(event_id)
                    .fetch_all(&env.db)
                    .await
                    .map_err(|e| e.to_string())?;
            match reasons.as_slice() {
                [found] if found.contains(reason) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
}

/// Remote-sim, one agent per queue, a scheduler and a supervisor.
async fn system(env: &TestEnv, scheduler: &[Setting]) -> (Service, Vec<Service>, Service, Service) {
    let (sim_process, sim) = env.remote_sim(&[]).await;
    let agents = env.agents(1, &sim, &[]);
    (
        sim_process,
        agents,
        env.scheduler(0, scheduler),
        env.supervisor(0, &[]),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn orders_parked_at_a_wait_survive_kill_9_of_the_scheduler_and_the_supervisor() {
    let env = TestEnv::new().await;
    let workflows = approval_workflow(&env, 2, 60_000);
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let mut scheduler = env.scheduler(0, &workflows);
    let mut supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    let ids: Vec<String> = (0..5).map(|n| format!("parked-{n}")).collect();
    for id in &ids {
        env.publish_order(&publisher, &order(id)).await;
    }
    for id in &ids {
        wait_for_approval(&env, id).await;
    }
    scheduler.kill9().await;
    supervisor.kill9().await;
    let _scheduler = env.scheduler(1, &workflows);
    let _supervisor = env.supervisor(1, &[]);
    for (n, id) in ids.iter().enumerate() {
        env.publish_event(&publisher, &approved_by(id, &format!("mail-{n}"), "di"))
            .await;
    }
    for id in &ids {
        env.wait_for_state(id, ProcessState::Processed, Duration::from_secs(30))
            .await;
    }
    sim.assert_every_order_done_once().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_webhook_over_the_gateway_approves_a_waiting_order_once() {
    let env = TestEnv::new().await;
    let workflows = approval_workflow(&env, 2, 60_000);
    let _system = system(&env, &workflows).await;
    let (_gateway, base) = super::gateway::gateway(&env, &[]).await;
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("hook-1")).await;
    wait_for_approval(&env, "hook-1").await;
    let send = |body: serde_json::Value| {
        let base = base.clone();
        async move {
            sas_tests::http_client()
                .post(format!("{base}/v1/orders/hook-1/events"))
                .bearer_auth(super::gateway::SECRET)
                .json(&body)
                .send()
                .await
                .expect("the gateway answers")
        }
    };
    let bad =
        send(serde_json::json!({ "schema_version": 1, "name": "ap proved", "event_id": "w-1" }))
            .await;
    assert_eq!(bad.status(), reqwest::StatusCode::BAD_REQUEST);
    // An event the order will not use is refused alike by the gateway (409)
    // and sasctl (exit 1), in the same words, before anything is sent.
    let refused_alike = |name: &'static str, event_id: &'static str, words: &'static str| {
        let send = &send;
        let env = &env;
        async move {
            let answer = send(
                serde_json::json!({ "schema_version": 1, "name": name, "event_id": event_id }),
            )
            .await;
            assert_eq!(answer.status(), reqwest::StatusCode::CONFLICT);
            let answer: serde_json::Value = answer.json().await.unwrap();
            assert_eq!(answer["error"], words, "{answer}");
            let (code, _, said) = env.sasctl_with_errors(&["signal", "hook-1", name]).await;
            assert_eq!(code, 1, "{said}");
            assert!(said.contains(words), "{said}");
        }
    };
    // An event no wait of the order is for.
    refused_alike(
        "rejected",
        "w-2",
        "order hook-1 waits for approved, not for rejected: nothing was sent",
    )
    .await;
    let body = serde_json::json!({ "schema_version": 1, "name": "approved", "event_id": "psp-77", "data": { "by": "psp" } });
    // The provider retries its webhook: the order uses the event once.
    for _ in 0..2 {
        let answer = send(body.clone()).await;
        assert_eq!(answer.status(), reqwest::StatusCode::ACCEPTED);
    }
    env.wait_for_state("hook-1", ProcessState::Processed, Duration::from_secs(30))
        .await;
    let detail = env.detail("hook-1").await;
    assert_eq!(
        detail.steps[1].result,
        Some(serde_json::json!({ "by": "psp" }))
    );
    // Retried once more after the order ended: still taken (the same
    // event); a new one is refused: nothing will use it.
    assert_eq!(send(body).await.status(), reqwest::StatusCode::ACCEPTED);
    refused_alike(
        "approved",
        "psp-78",
        "order hook-1 is processed and waits for no event: nothing was sent",
    )
    .await;
    assert_eq!(
        mailbox(&env, "hook-1").await,
        [("psp-77".to_owned(), Some("approval".to_owned()))]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_webhook_the_gateway_cannot_check_against_the_store_is_a_503_and_nothing_is_sent() {
    let env = TestEnv::new().await;
    let workflows = approval_workflow(&env, 2, 60_000);
    let _system = system(&env, &workflows).await;
    // The gateway reaches Postgres through a route the test cuts.
    let route = sas_tests::tcp_delay::DelayProxy::start("127.0.0.1:5432", Duration::ZERO).await;
    let (_gateway, base) = super::gateway::gateway(
        &env,
        &[Setting::DatabaseUrl(route.postgres_url(&env.database_url))],
    )
    .await;
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("hook-9")).await;
    wait_for_approval(&env, "hook-9").await;
    let send = |event_id: &'static str| {
        let base = base.clone();
        async move {
            sas_tests::http_client()
                .post(format!("{base}/v1/orders/hook-9/events"))
                .bearer_auth(super::gateway::SECRET)
                .json(&serde_json::json!({ "schema_version": 1, "name": "approved", "event_id": event_id, "data": { "by": "psp" } }))
                .send()
                .await
                .expect("the gateway answers")
        }
    };
    // Postgres out of the gateway's reach: its connections cut, new ones
    // refused.
    route.point_at(&format!("127.0.0.1:{}", sas_tests::process::free_port()));
    route.cut();
    let down = send("down-1").await;
    assert_eq!(down.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
    assert!(down.headers().contains_key("retry-after"));
    // Back in reach: the webhook sent again is taken.
    route.point_at("127.0.0.1:5432");
    wait_until(
        "the gateway to take the event",
        Duration::from_secs(30),
        || async {
            let status = send("up-1").await.status();
            (status == reqwest::StatusCode::ACCEPTED)
                .then_some(())
                .ok_or_else(|| format!("answered {status}"))
        },
    )
    .await;
    env.wait_for_state("hook-9", ProcessState::Processed, Duration::from_secs(30))
        .await;
    // The order used the event sent after the outage; the one refused
    // during it never reached the order (sent first, it would have been
    // the one used).
    assert_eq!(
        mailbox(&env, "hook-9").await,
        [("up-1".to_owned(), Some("approval".to_owned()))]
    );
}

/// Version `version` of the order workflow: reserve, a wait for approval
/// of `wait_ms` at most (then compensation), then `rest` (TOML of the
/// remaining steps).
pub(crate) fn order_version(env: &TestEnv, version: i32, wait_ms: u64, rest: &str) -> String {
    let reserve = env.call_step(("reserve_stock", "inventory", "reserve", "release"), None);
    format!(
        r#"
name = "order"
version = {version}

{reserve}
[[steps]]
name = "approval"
kind = "wait"
event = "approved"
timeout_ms = {wait_ms}
on_timeout = "compensate"
{rest}"#
    )
}

/// What the move of version 1 to 2 writes in each order's history.
pub(crate) const MOVED_1_TO_2: &str =
    "from version 1 to 2; dropped cooling_off; renamed charge_payment as charge";

/// Asserts that order `id` runs [`version_2`] now, with the steps the
/// move's mapping gives it, and that its history records the move from
/// version 1; returns that history line.
pub(crate) async fn assert_moved_to_version_2(env: &TestEnv, id: &str) -> HistoryEntry {
    let detail = env.detail(id).await;
    assert_eq!(detail.summary.workflow_version, 2, "{id}");
    let names: Vec<&str> = detail.steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(
        names,
        ["reserve_stock", "approval", "charge", "create_shipment"],
        "{id}"
    );
    let moved = detail
        .history
        .into_iter()
        .find(|h| h.event == HistoryEvent::Moved)
        .expect("the move is in the history");
    assert_eq!(moved.detail.as_deref(), Some(MOVED_1_TO_2), "{id}");
    moved
}

/// Version 2 of the order workflow of [`order_version`]: the charge renamed
/// `charge` (its request body says `plan = "version 2"`), no cooling-off.
pub(crate) fn version_2(env: &TestEnv) -> String {
    let timeout = env.step_timeout_ms;
    order_version(
        env,
        2,
        60_000,
        &format!(
            r#"
[[steps]]
name = "charge"
agent = "payment"
action = "charge"
compensation = "refund"
timeout_ms = {timeout}
[steps.request.body]
order = "${{/order}}"
plan = "version 2"

[[steps]]
name = "create_shipment"
agent = "shipping"
action = "ship"
compensation = "cancel"
timeout_ms = {timeout}
"#
        ),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn waiting_orders_move_to_a_new_version_and_an_unsafe_move_is_refused() {
    let env = TestEnv::new().await;
    // Version 2 renames the charge and shapes its request, and drops the
    // ten-minute cooling-off.
    let v2 = version_2(&env);
    let settings = approval_workflow(&env, 1, 60_000);
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let mut first = env.scheduler(0, &settings);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    let ids: Vec<String> = (0..3).map(|n| format!("move-{n}")).collect();
    for id in &ids {
        env.publish_order(&publisher, &order(id)).await;
    }
    for id in &ids {
        wait_for_approval(&env, id).await;
    }
    // The new file is deployed: a scheduler restarted on it registers it.
    env.workflows(&[("order.toml", &v2)]);
    first.terminate(Duration::from_secs(20)).await;
    let _second = env.scheduler(1, &settings);
    let move_args = [
        "orders",
        "move",
        "--workflow",
        "order",
        "--from",
        "1",
        "--to",
        "2",
        "--map",
        "charge_payment=charge",
    ];
    let look = wait_until(
        "version 2 to be registered",
        Duration::from_secs(20),
        || async {
            let (code, out) = env.sasctl(&move_args).await;
            (code == 0)
                .then_some(out)
                .ok_or_else(|| format!("exit {code}"))
        },
    )
    .await;
    assert!(look.contains("3 would move, 0 refused"), "{look}");
    assert!(look.contains("--confirm 3"), "{look}");
    assert_eq!(
        env.detail("move-0").await.summary.workflow_version,
        1,
        "a look changes nothing"
    );
    let mut confirmed = move_args.to_vec();
    confirmed.extend(["--confirm", "3"]);
    let (code, out) = env.sasctl(&confirmed).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("3 moved"), "{out}");

    // Unsafe moves: version 3 has no reservation, which completed; 4 keeps
    // it without its undo, 5 gives it to another service: the stock it
    // reserved would never be released.
    let approval = sas_store::NewStep {
        name: "approval".into(),
        kind: Kind::Wait(sas_store::machine::kind::WaitStep {
            event: "approved".into(),
            on_timeout: sas_store::machine::park::OnTimeout::Compensate,
            correlation_key: None,
            senders: Vec::new(),
        }),
        timeout: Duration::from_secs(60),
        group: None,
    };
    let kept = |agent: &str, compensation: Option<&str>| {
        let mut plan = env.steps();
        plan[0].kind = Kind::Call(CallStep::new(agent, "reserve", compensation));
        plan[1].name = "charge".into();
        plan.insert(1, approval.clone());
        plan
    };
    for (version, plan, what) in [
        (
            3,
            env.steps().into_iter().skip(1).collect(),
            "\"reserve_stock\" did (or may have done) its action",
        ),
        (4, kept("inventory", None), "would lose its undo"),
        (
            5,
            kept("warehouse", Some("release")),
            "gives it to warehouse",
        ),
    ] {
        env.store
            .writes()
            .register_plans(&[sas_store::Plan::new("order", version, &plan)])
            .await
            .unwrap();
        let to = version.to_string();
        let (code, out) = env
            .sasctl(&[
                "orders",
                "move",
                "--workflow",
                "order",
                "--from",
                "2",
                "--to",
                &to,
                "--confirm",
                "0",
            ])
            .await;
        assert_eq!(code, 0, "{out}");
        assert!(
            out.contains("0 moved, 3 refused") && out.contains(what),
            "version {version}: {out}"
        );
    }

    for (n, id) in ids.iter().enumerate() {
        assert_moved_to_version_2(&env, id).await;
        env.publish_event(&publisher, &approved_by(id, &format!("mail-{n}"), "ed"))
            .await;
    }
    for id in &ids {
        env.wait_for_state(id, ProcessState::Processed, Duration::from_secs(30))
            .await;
    }
    // The moved orders ran version 2's charge, under the key they had.
    let effects = sim.side_effects().await.unwrap();
    for id in &ids {
        let charge = effects
            .iter()
            .find(|e| e.key == format!("{id}:charge_payment"))
            .unwrap_or_else(|| panic!("no charge for {id}"));
        assert_eq!(charge.body["plan"], "version 2");
    }
    sim.assert_every_order_done_once().await;
}

/// A wait step `settlement` for `settled`, found by the invoice number the
/// order carries.
const SETTLEMENT_BY_INVOICE: &str = r#"[[steps]]
name = "settlement"
kind = "wait"
event = "settled"
correlation_key = "/attributes/invoice"
timeout_ms = 60000
"#;

/// A workflow whose settlement waits for `settled`, found by the invoice
/// number the order carries (`correlation_key = "/attributes/invoice"`),
/// with the settings that make a scheduler run it and keep unclaimed
/// events 3 s.
fn keyed_workflow(env: &TestEnv) -> Vec<Setting> {
    let text = format!(
        r#"name = "order"
version = 1

{}
{SETTLEMENT_BY_INVOICE}
{}[steps.request.body]
order = "${{/order}}"
settled_by = "${{/results/settlement/by}}"
"#,
        env.call_step(("reserve_stock", "inventory", "reserve", "release"), None),
        env.call_step(("create_shipment", "shipping", "ship", "cancel"), None),
    );
    let mut settings = env.workflows(&[("order.toml", &text)]).to_vec();
    settings.push(Setting::SchedulerEventTtlSecs(3));
    settings
}

/// An order carrying invoice number `invoice` in its attributes.
fn invoiced(order_id: &str, invoice: &str) -> sas_messages::SubmitOrder {
    let mut invoiced = order(order_id);
    invoiced.attributes = serde_json::json!({ "invoice": invoice })
        .as_object()
        .cloned();
    invoiced
}

/// An event `settled` for the orders waiting with invoice number `key`.
fn settled(key: &str, id: &str) -> sas_messages::OrderEvent {
    let mut settled = sas_tests::keyed_event(key, "settled", id);
    settled.data = serde_json::json!({ "by": "psp" }).as_object().cloned();
    settled
}

#[tokio::test(flavor = "multi_thread")]
async fn events_by_business_key_reach_the_order_waiting_with_it_before_or_after_it_parks() {
    let env = TestEnv::new().await;
    let (_sim, _agents, scheduler, _supervisor) = system(&env, &keyed_workflow(&env)).await;
    let (_gateway, base) = super::gateway::gateway(&env, &[]).await;
    let (_connection, publisher) = env.broker().await;

    // Order 1 parks at its settlement; its event comes by key, twice.
    env.publish_order(&publisher, &invoiced("key-1", "INV-1"))
        .await;
    wait_parked_at(&env, "key-1", "settlement").await;
    let (code, out) = env
        .sasctl(&[
            "signal",
            "--key",
            "INV-1",
            "settled",
            "--data",
            r#"{"by": "psp"}"#,
            "--event-id",
            "psp-1",
        ])
        .await;
    assert_eq!(code, 0, "{out}");
    env.wait_for_state("key-1", ProcessState::Processed, Duration::from_secs(30))
        .await;
    // The same event again, once order 1 is done: a repeat, not kept.
    env.publish_event(&publisher, &settled("INV-1", "psp-1"))
        .await;
    wait_until(
        "the repeat to be seen as one",
        Duration::from_secs(20),
        || async {
            let log = std::fs::read_to_string(&scheduler.log).map_err(|e| e.to_string())?;
            log.lines()
                .any(|l| l.contains("event_id=psp-1") && l.contains("outcome=\"duplicate\""))
                .then_some(())
                .ok_or_else(|| "not yet".to_owned())
        },
    )
    .await;
    // Before any order has invoice INV-2, a provider's webhook through the
    // gateway: kept by key (for the 3 s this test's schedulers keep an
    // event nobody waits for: sent just before order 2, whose intake,
    // reservation and parking fit in them, not before order 1's whole run).
    let answer = sas_tests::http_client()
        .post(format!("{base}/v1/correlation-keys/INV-2/events"))
        .bearer_auth(super::gateway::SECRET)
        .json(&serde_json::json!({ "schema_version": 1, "name": "settled", "event_id": "psp-2", "data": { "by": "psp" } }))
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(answer.status(), reqwest::StatusCode::ACCEPTED);
    let accepted: serde_json::Value = answer.json().await.unwrap();
    assert_eq!(
        accepted,
        serde_json::json!({ "correlation_key": "INV-2", "event_id": "psp-2" })
    );
    // Order 2 parks after its event came: the next claim gives it over.
    env.publish_order(&publisher, &invoiced("key-2", "INV-2"))
        .await;
    env.wait_for_state("key-2", ProcessState::Processed, Duration::from_secs(30))
        .await;
    for (id, event) in [("key-1", "psp-1"), ("key-2", "psp-2")] {
        assert_eq!(
            mailbox(&env, id).await,
            [(event.to_owned(), Some("settlement".to_owned()))]
        );
        assert_eq!(
            step_history(&env, id, "settlement").await,
            [HistoryEvent::Waiting, HistoryEvent::WaitEnded]
        );
        let detail = env.detail(id).await;
        assert_eq!(
            detail.steps[1].result,
            Some(serde_json::json!({ "by": "psp" }))
        );
    }

    // An event for a key no order waits with is dead-lettered after its
    // time to live, naming the key; the repeat was never kept.
    env.publish_event(&publisher, &settled("INV-404", "psp-404"))
        .await;
    wait_for_dead_letter(&env, "psp-404", "correlation key INV-404").await;
    assert_eq!(
        kept_by_key(&env).await,
        [
            (
                "INV-2".to_owned(),
                "psp-2".to_owned(),
                Some("key-2".to_owned())
            ),
            ("INV-404".to_owned(), "psp-404".to_owned(), None),
        ]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_workflow_may_start_with_a_wait_or_a_delay() {
    let env = TestEnv::new().await;
    let call = env.call_step(("reserve_stock", "inventory", "reserve", "release"), None);
    let settings = env.workflows(&[
        (
            "order.toml",
            &format!(
                "name = \"order\"\n[[steps]]\nname = \"approval\"\nkind = \"wait\"\nevent = \"approved\"\ntimeout_ms = 60000\n{call}"
            ),
        ),
        (
            "cooled.toml",
            &format!("name = \"cooled\"\n[[steps]]\nname = \"cooling_off\"\nkind = \"delay\"\ndelay_ms = 1000\n{call}"),
        ),
    ]);
    let _system = system(&env, &settings).await;
    let (_connection, publisher) = env.broker().await;

    // An approval that came before its order: used at intake.
    env.publish_event(&publisher, &approved_by("first-1", "mail-1", "ann"))
        .await;
    wait_until(
        "the approval to be kept",
        Duration::from_secs(20),
        || async {
            let kept = mailbox(&env, "first-1").await.len();
            (kept == 1).then_some(()).ok_or(format!("{kept}"))
        },
    )
    .await;
    env.publish_order(&publisher, &order("first-1")).await;
    env.wait_for_state("first-1", ProcessState::Processed, Duration::from_secs(30))
        .await;
    assert_eq!(
        step_history(&env, "first-1", "approval").await,
        [HistoryEvent::WaitEnded]
    );

    // Without one, the order parks at intake, nothing started.
    env.publish_order(&publisher, &order("first-2")).await;
    wait_until("first-2 to park", Duration::from_secs(20), || async {
        let Some(detail) = env
            .store
            .reads()
            .order_detail("first-2")
            .await
            .map_err(|e| e.to_string())?
        else {
            return Err("not stored yet".into());
        };
        let states: Vec<&str> = detail.steps.iter().map(|s| s.state.as_str()).collect();
        (detail.summary.state == ProcessState::Pending && states == ["running", "not_started"])
            .then_some(())
            .ok_or_else(|| format!("{} {states:?}", detail.summary.state))
    })
    .await;
    env.publish_event(&publisher, &approved_by("first-2", "mail-2", "bo"))
        .await;
    env.wait_for_state("first-2", ProcessState::Processed, Duration::from_secs(30))
        .await;

    // A delay first: the reservation starts a second after intake.
    let mut cooled = order("cool-1");
    cooled.workflow = Some("cooled".into());
    env.publish_order(&publisher, &cooled).await;
    env.wait_for_state("cool-1", ProcessState::Processed, Duration::from_secs(30))
        .await;
    let detail = env.detail("cool-1").await;
    let at = |event: HistoryEvent| {
        detail
            .history
            .iter()
            .find(|h| h.event == event)
            .map(|h| h.at)
            .unwrap_or_else(|| panic!("no {event}: {:#?}", detail.history))
    };
    assert!(
        at(HistoryEvent::Dispatched) >= at(HistoryEvent::Received) + chrono::Duration::seconds(1)
    );
}

/// A workflow that starts waiting for `settled` by invoice number, then
/// reserves stock; no supervisor runs beside it, so events kept by key are
/// given over only when the test calls the adoption itself.
fn keyed_first_workflow(env: &TestEnv) -> Vec<Setting> {
    let text = format!(
        r#"name = "order"
version = 1

{SETTLEMENT_BY_INVOICE}
{}"#,
        env.call_step(("reserve_stock", "inventory", "reserve", "release"), None),
    );
    let mut settings = env.workflows(&[("order.toml", &text)]).to_vec();
    settings.push(Setting::SchedulerEventTtlSecs(600));
    settings
}

/// The keyed events' rows: (key, event id, adopted by).
async fn kept_by_key(env: &TestEnv) -> Vec<(String, String, Option<String>)> {
    sqlx::query_as(
        "SELECT correlation_key, event_id, adopted_by FROM keyed_events ORDER BY correlation_key, event_id",
    )
    .fetch_all(&env.db)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn an_event_kept_by_key_goes_to_every_order_parked_with_it_and_to_no_later_one() {
    let env = TestEnv::new().await;
    let _scheduler = env.scheduler(0, &keyed_first_workflow(&env));
    let (_connection, publisher) = env.broker().await;

    // Two events come before any order has their keys: kept by key.
    env.publish_event(&publisher, &settled("INV-5", "psp-5"))
        .await;
    env.publish_event(&publisher, &settled("INV-1", "psp-1"))
        .await;
    wait_until(
        "both to be kept by key",
        Duration::from_secs(20),
        || async {
            let kept = kept_by_key(&env).await.len();
            (kept == 2).then_some(()).ok_or(format!("{kept} kept"))
        },
    )
    .await;

    // Five orders park with INV-5, more than one adoption batch of two.
    let five: Vec<String> = (0..5).map(|n| format!("inv5-{n}")).collect();
    for id in &five {
        env.publish_order(&publisher, &invoiced(id, "INV-5")).await;
    }
    for id in &five {
        wait_parked_at(&env, id, "settlement").await;
    }
    // The batch counts events, not their orders: all five get INV-5's.
    let mut moved = 0;
    loop {
        let progress = env
            .store
            .writes()
            .adopt_keyed_events("test", 2)
            .await
            .unwrap();
        if progress.is_empty() {
            break;
        }
        moved += progress.len();
    }
    assert_eq!(moved, 5, "every order parked with INV-5 moves on");
    for id in &five {
        assert_eq!(
            mailbox(&env, id).await,
            [("psp-5".to_owned(), Some("settlement".to_owned()))],
            "{id}"
        );
    }

    // An order parks with INV-1, and INV-1's event comes again (its ack
    // was lost): that order uses it, and the key's row is closed with it.
    env.publish_order(&publisher, &invoiced("inv1-a", "INV-1"))
        .await;
    wait_parked_at(&env, "inv1-a", "settlement").await;
    env.publish_event(&publisher, &settled("INV-1", "psp-1"))
        .await;
    wait_until(
        "inv1-a to use the redelivered event",
        Duration::from_secs(20),
        || async {
            let used = mailbox(&env, "inv1-a").await;
            (used == [("psp-1".to_owned(), Some("settlement".to_owned()))])
                .then_some(())
                .ok_or(format!("{used:?}"))
        },
    )
    .await;
    assert_eq!(
        kept_by_key(&env).await,
        [
            (
                "INV-1".to_owned(),
                "psp-1".to_owned(),
                Some("inv1-a".to_owned())
            ),
            (
                "INV-5".to_owned(),
                "psp-5".to_owned(),
                Some("inv5-0".to_owned())
            ),
        ]
    );
    // A later order with INV-1 does not get the event a second time.
    env.publish_order(&publisher, &invoiced("inv1-b", "INV-1"))
        .await;
    wait_parked_at(&env, "inv1-b", "settlement").await;
    assert!(env
        .store
        .writes()
        .adopt_keyed_events("test", 2)
        .await
        .unwrap()
        .is_empty());
    assert!(mailbox(&env, "inv1-b").await.is_empty());
}
