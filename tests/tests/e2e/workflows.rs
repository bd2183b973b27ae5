//! Orders of several shapes: the shipped workflows folder run by a real
//! scheduler, a submission naming its workflow and carrying attributes,
//! intake refusing an unknown workflow or attributes its schema refuses
//! (naming the path of the error), and a step whose request is shaped by
//! its template, as remote-sim receives it.

use std::time::Duration;

use futures_util::StreamExt;
use sas_messages::{OrderStatus, StatusEvent};
use sas_store::ProcessState;
use sas_tests::{order, repo_root, Setting, TestEnv};

/// The settings that make a scheduler read the shipped `workflows/` folder.
fn shipped_workflows() -> [Setting; 2] {
    [
        Setting::SchedulerWorkflowFile(String::new()),
        Setting::SchedulerWorkflowDir(repo_root().join("workflows").display().to_string()),
    ]
}

/// The next status message on `consumer`.
async fn next_status(consumer: &mut sas_broker::lapin::Consumer) -> OrderStatus {
    let delivery = tokio::time::timeout(Duration::from_secs(20), consumer.next())
        .await
        .expect("a status message within 20 s")
        .expect("the consumer is open")
        .expect("a delivery");
    serde_json::from_slice(&delivery.data).expect("a status message")
}

#[tokio::test(flavor = "multi_thread")]
async fn a_return_runs_beside_an_order_and_its_refund_is_called_as_its_template_says() {
    let env = TestEnv::new().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &shipped_workflows());
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;

    env.publish_order(&publisher, &order("buy-1")).await;
    let (code, out) = env
        .sasctl(&[
            "submit",
            "--order-id",
            "ret-1",
            "--customer-id",
            "cust-9",
            "--workflow",
            "return",
            "--attributes",
            r#"{"refund_cents": 1250, "reason": "damaged", "channel": "store"}"#,
        ])
        .await;
    assert_eq!(code, 0, "{out}");
    for id in ["buy-1", "ret-1"] {
        env.wait_for_state(id, ProcessState::Processed, Duration::from_secs(30))
            .await;
    }

    let bought = env.detail("buy-1").await;
    assert_eq!(
        (
            bought.summary.workflow.as_str(),
            bought.summary.workflow_version
        ),
        ("order", 1)
    );
    let returned = env.detail("ret-1").await;
    assert_eq!(
        (
            returned.summary.workflow.as_str(),
            returned.summary.workflow_version
        ),
        ("return", 1)
    );
    let steps: Vec<&str> = returned.steps.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(steps, ["receive_goods", "refund", "restock"]);

    let effects = sim.side_effects().await.unwrap();
    let effect = |key: &str| {
        effects
            .iter()
            .find(|e| e.key == key)
            .unwrap_or_else(|| panic!("no side effect {key}: {effects:?}"))
    };
    let received = effect("ret-1:receive_goods");
    assert_eq!(
        (received.service.as_str(), received.operation.as_str()),
        ("shipping", "receive")
    );
    // No template: the default call, POST with {order, results}, the
    // order's attributes in it.
    assert_eq!(received.method.as_deref(), Some("POST"));
    assert_eq!(received.body["order"]["attributes"]["channel"], "store");
    // The template: PUT /credit with the body built from the order, its
    // attributes and the earlier step's result.
    let refund = effect("ret-1:refund");
    assert_eq!(
        (refund.service.as_str(), refund.operation.as_str()),
        ("payment", "credit")
    );
    assert_eq!(refund.method.as_deref(), Some("PUT"));
    let receipt = received_result(received);
    assert_eq!(
        refund.body,
        serde_json::json!({
            "customer_id": "cust-9",
            "amount_cents": 1250,
            "currency": "EUR",
            "reference": "return ret-1 (damaged)",
            "receipt": receipt,
        })
    );
    let restock = effect("ret-1:restock");
    assert_eq!(
        (restock.service.as_str(), restock.operation.as_str()),
        ("inventory", "restock")
    );
    // The order beside it ran its own plan.
    for key in [
        "buy-1:reserve_stock",
        "buy-1:charge_payment",
        "buy-1:create_shipment",
    ] {
        assert_eq!(effect(key).method.as_deref(), Some("POST"));
    }
    sim.assert_every_order_done_once().await;
}

/// What remote-sim answered to an applied call.
fn received_result(entry: &sas_tests::sim::Entry) -> serde_json::Value {
    match &entry.decision {
        sas_tests::sim::Decision::Applied { result } => result.clone(),
        other => panic!("{} was not applied: {other:?}", entry.key),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_unknown_workflow_and_attributes_its_schema_refuses_are_rejected_with_the_reason() {
    let env = TestEnv::new().await;
    let _scheduler = env.scheduler(0, &shipped_workflows());
    // Records what the scheduler dead-lettered.
    let _supervisor = env.supervisor(0, &[]);
    let (connection, publisher) = env.broker().await;
    let (client_queue, mut client) =
        sas_broker::topology::status_consumer(&connection, &env.amqp(), &[])
            .await
            .unwrap();

    let cases = [
        (
            "exchange-1",
            Some("exchange"),
            serde_json::json!({}),
            r#"unknown workflow "exchange": this deployment runs large_order, order, return"#,
        ),
        (
            "ret-bad-1",
            Some("return"),
            serde_json::json!({"refund_cents": "ten", "reason": "damaged"}),
            r#"attributes do not match workflow "return" (version 1) at /refund_cents"#,
        ),
        (
            "ret-bad-2",
            Some("return"),
            serde_json::json!({"refund_cents": 100}),
            r#"attributes do not match workflow "return" (version 1) at /:"#,
        ),
        (
            "ret-bad-3",
            Some("return"),
            serde_json::json!({"refund_cents": 100_001, "reason": "damaged"}),
            r#"attributes do not match workflow "return" (version 1) at /refund_cents: 100001 is greater than the maximum of 100000"#,
        ),
    ];
    for (id, workflow, attributes, _) in &cases {
        let mut submitted = order(id);
        submitted.workflow = workflow.map(str::to_owned);
        submitted.attributes = attributes.as_object().cloned();
        submitted.reply_to = Some(client_queue.clone());
        env.publish_order(&publisher, &submitted).await;
    }
    // Answered as they are handled, side by side: in any order.
    let mut answers = Vec::new();
    for _ in &cases {
        answers.push(next_status(&mut client).await);
    }
    for (id, _, _, reason) in &cases {
        let status = answers
            .iter()
            .find(|status| status.order_id.as_str() == *id)
            .unwrap_or_else(|| panic!("no answer for {id}: {answers:?}"));
        assert_eq!(status.event, StatusEvent::Rejected, "{status:?}");
        let detail = status.detail.clone().unwrap_or_default();
        assert!(detail.contains(reason), "{id}: {detail}");
    }
    env.wait_for_dead_letters(cases.len(), Duration::from_secs(20))
        .await;
    for (id, _, _, _) in &cases {
        assert_eq!(env.state_of(id).await, None, "{id} was not stored");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_workflows_folder_with_one_name_twice_stops_the_scheduler_naming_both_files() {
    let env = TestEnv::new().await;
    let folder = env.dir.join("workflows");
    std::fs::create_dir_all(&folder).unwrap();
    let order_file = repo_root().join("workflows/order.toml");
    for name in ["a.toml", "b.toml"] {
        std::fs::copy(&order_file, folder.join(name)).unwrap();
    }
    let mut scheduler = env.scheduler(
        0,
        &[
            Setting::SchedulerWorkflowFile(String::new()),
            Setting::SchedulerWorkflowDir(folder.display().to_string()),
        ],
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while scheduler.is_running() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the scheduler still runs with an invalid workflows folder"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let log = scheduler.log_text();
    assert!(
        log.contains(r#"workflow "order" is defined twice"#)
            && log.contains("a.toml")
            && log.contains("b.toml"),
        "{log}"
    );
}

/// A workflow whose charge and shipment run side by side after the
/// reservation, then a confirmation; written to the test's workflows
/// folder, with the settings that make a scheduler run it.
fn side_by_side_workflow(env: &TestEnv) -> [Setting; 2] {
    let group = Some("pay_and_ship");
    let text = format!(
        "name = \"order\"\nversion = 1\n\n{}{}{}{}",
        env.call_step(("reserve_stock", "inventory", "reserve", "release"), None),
        env.call_step(("charge_payment", "payment", "charge", "refund"), group),
        env.call_step(("create_shipment", "shipping", "ship", "cancel"), group),
        env.call_step(("confirm_delivery", "shipping", "receive", "reject"), None),
    );
    env.workflows(&[("order.toml", &text)])
}

/// When `order_id`'s history first recorded `event` for `step`.
fn recorded(
    detail: &sas_store::reads::queries::OrderDetail,
    event: sas_store::machine::HistoryEvent,
    step: &str,
) -> chrono::DateTime<chrono::Utc> {
    detail
        .history
        .iter()
        .find(|h| h.event == event && h.step.as_deref() == Some(step))
        .unwrap_or_else(|| panic!("no {event} of {step}: {:#?}", detail.history))
        .at
}

#[tokio::test(flavor = "multi_thread")]
async fn a_group_runs_side_by_side_and_a_member_refused_has_the_others_undone_after_their_call() {
    use sas_store::machine::HistoryEvent::{CompensationDispatched, Dispatched, StepCompleted};
    let env = TestEnv::with_step_timeout(4000).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let slow = |ms: u64| {
        serde_json::json!({ "latency_ms": ms, "transient_fault_rate": 0.0,
                            "permanent_fault_rate": 0.0, "hang_rate": 0.0 })
    };
    for service in ["payment", "shipping"] {
        sim.set_faults(Some(service), slow(1500)).await.unwrap();
    }
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &side_by_side_workflow(&env));
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;

    // Both members are sent in one decision, and each takes 1.5 s at the
    // remote: side by side, they land together, not 1.5 s apart.
    env.publish_order(&publisher, &order("both-1")).await;
    env.wait_for_state("both-1", ProcessState::Processed, Duration::from_secs(30))
        .await;
    let detail = env.detail("both-1").await;
    assert_eq!(
        recorded(&detail, Dispatched, "charge_payment"),
        recorded(&detail, Dispatched, "create_shipment")
    );
    let effects = sim.side_effects().await.unwrap();
    let applied_at = |key: &str| {
        effects
            .iter()
            .find(|e| e.key == key)
            .and_then(|e| e.applied_at)
            .unwrap_or_else(|| panic!("{key} not applied: {effects:?}"))
    };
    let apart = applied_at("both-1:charge_payment") - applied_at("both-1:create_shipment");
    assert!(
        apart.num_milliseconds().abs() < 1000,
        "the charge and the shipment landed {apart} apart"
    );
    // The step after the group started once both had completed.
    assert!(
        recorded(&detail, Dispatched, "confirm_delivery")
            >= applied_at("both-1:charge_payment").max(applied_at("both-1:create_shipment"))
    );

    // The charge is declined at once while the shipment is still in flight:
    // the shipment is undone, but only once its answer came (or, without
    // one, after its attempt's deadline and the grace), and the
    // reservation after it.
    sim.set_faults(Some("payment"), slow(0)).await.unwrap();
    let mut declined = order("declined-1");
    declined.amount_cents = 50_000_000;
    env.publish_order(&publisher, &declined).await;
    env.wait_for_state(
        "declined-1",
        ProcessState::Compensated,
        Duration::from_secs(30),
    )
    .await;
    let detail = env.detail("declined-1").await;
    let states: Vec<&str> = detail.steps.iter().map(|s| s.state.as_str()).collect();
    assert_eq!(
        states,
        ["compensated", "failed", "compensated", "not_started"]
    );
    let shipped = recorded(&detail, StepCompleted, "create_shipment");
    let undo = recorded(&detail, CompensationDispatched, "create_shipment");
    assert!(
        undo >= shipped,
        "the cancel was sent at {undo}, before the shipment's answer came ({shipped})"
    );
    // That answer came after the compensation began, and was kept: the
    // cancel did not wait for the shipment's deadline.
    let answer = detail
        .history
        .iter()
        .find(|h| h.event == StepCompleted && h.step.as_deref() == Some("create_shipment"))
        .expect("the shipment's answer is in the history");
    assert!(
        answer
            .detail
            .as_deref()
            .is_some_and(|d| d.contains("after the order's compensation began")),
        "{answer:?}"
    );
    let dispatched = recorded(&detail, Dispatched, "create_shipment");
    assert!(
        undo < dispatched + chrono::Duration::milliseconds(4000),
        "the cancel waited for the deadline although the answer had come"
    );
    assert_eq!(
        sim.applied_keys("declined-1").await,
        [
            "declined-1:reserve_stock",
            "declined-1:create_shipment",
            "declined-1:create_shipment:undo",
            "declined-1:reserve_stock:undo"
        ],
        "reserved and shipped, then both undone in reverse; the declined charge applied nothing"
    );
    // Each call applied once (effects_by_order checks it).
    let by_order = sim.effects_by_order().await;
    assert_eq!(
        (by_order["both-1"], by_order["declined-1"]),
        ((4, 0), (2, 2))
    );
    // Every slot the group took was given back.
    let counters = env.store.admission().recount().await.unwrap();
    assert!(counters.is_empty(), "{counters:?}");
}

/// The operation a step's call reaches at remote-sim: its template's path's
/// last segment, or its action (or compensation) by default.
fn operation_called(step: &toml::Table, operation: &str, template: &str) -> Option<String> {
    let named = step.get(operation)?.as_str()?.to_owned();
    let path = step
        .get(template)
        .and_then(|t| t.get("path"))
        .and_then(toml::Value::as_str);
    Some(path.map_or(named, |path| {
        path.rsplit('/').next().unwrap_or_default().to_owned()
    }))
}

/// Every shipped workflow calls, for each step, an action remote-sim's
/// service has, and undoes it with that action's own compensation: a
/// misspelt compensation (`refnud`) would be answered 404 at the first
/// undo, which now ends the order in error; this finds it before any order
/// runs.
#[test]
fn every_shipped_workflow_calls_operations_the_simulated_services_have_in_pairs() {
    let folder = repo_root().join("workflows");
    let mut checked = 0;
    for file in std::fs::read_dir(&folder).unwrap() {
        let path = file.unwrap().path();
        let text = std::fs::read_to_string(&path).unwrap();
        let workflow: toml::Table = text.parse().unwrap();
        for step in workflow["steps"].as_array().unwrap() {
            let step = step.as_table().unwrap();
            let Some(agent) = step.get("agent").and_then(toml::Value::as_str) else {
                continue;
            };
            let action = operation_called(step, "action", "request").unwrap();
            let (_, pairs) = remote_sim::routes::SERVICES
                .iter()
                .find(|(service, _)| *service == agent)
                .unwrap_or_else(|| panic!("{}: no service {agent}", path.display()));
            let (_, undo) = pairs
                .iter()
                .find(|(known, _)| *known == action)
                .unwrap_or_else(|| panic!("{}: {agent} has no action {action}", path.display()));
            if let Some(compensation) =
                operation_called(step, "compensation", "compensation_request")
            {
                assert_eq!(
                    compensation,
                    *undo,
                    "{}: {agent}.{action} is undone by {undo}, not {compensation}",
                    path.display()
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 9, "the shipped workflows' call steps: {checked}");
}
