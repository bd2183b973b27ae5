//! An order stopped in error by a step that says `on_failure = "stop"`,
//! resumed from that step once its remote is fixed: against real
//! processes and remote-sim's ledger, the completed steps are not called
//! again, the refused step is called with a fresh key, and the history
//! names the operator and the reason. A stopped order may also be
//! cancelled, which undoes it.

use std::time::Duration;

use reqwest::StatusCode;
use sas_store::ProcessState;
use sas_tests::console::As;
use sas_tests::process::System;
use sas_tests::TestEnv;

/// The order workflow whose `charge_payment` stops the order on failure.
fn stopping_workflow(env: &TestEnv) -> String {
    let mut text = String::from("name = \"order\"\nversion = 1\n\n");
    for step in [
        ("reserve_stock", "inventory", "reserve", "release"),
        ("charge_payment", "payment", "charge", "refund"),
        ("create_shipment", "shipping", "ship", "cancel"),
    ] {
        text.push_str(&env.call_step(step, None));
        if step.0 == "charge_payment" {
            text.push_str("on_failure = \"stop\"\n\n");
        }
    }
    text
}

/// remote-sim's faults: no latency, `refused` of the new keys refused for good.
fn faults(refused: f64) -> serde_json::Value {
    serde_json::json!({ "latency_ms": 0, "transient_fault_rate": 0.0,
                        "permanent_fault_rate": refused, "hang_rate": 0.0 })
}

/// The system the tests run: `workflow`, an agent per queue, a payment
/// provider that refuses every new key for good (422), a supervisor; and a
/// publisher.
async fn refusing_payments(
    env: &TestEnv,
    workflow: &str,
) -> (System, sas_broker::Publisher, sas_broker::lapin::Connection) {
    let (sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(Some("payment"), faults(1.0))
        .await
        .expect("set remote-sim's faults");
    let system = System {
        agents: env.agents(1, &sim, &[]),
        schedulers: vec![env.scheduler(0, &env.workflows(&[("order.toml", workflow)]))],
        supervisors: vec![env.supervisor(0, &[])],
        sim_process,
        sim,
    };
    let (connection, publisher) = env.broker().await;
    (system, publisher, connection)
}

#[tokio::test(flavor = "multi_thread")]
async fn orders_stopped_by_a_refusing_remote_resume_from_the_failed_step_once_it_is_fixed() {
    const ORDERS: usize = 50;
    let env = TestEnv::new().await;
    let (system, publisher, _connection) = refusing_payments(&env, &stopping_workflow(&env)).await;
    let sim = &system.sim;

    env.publish_orders(&publisher, "stop", ORDERS + 1).await;
    env.wait_for_count(
        ProcessState::Error,
        ORDERS as i64 + 1,
        Duration::from_secs(60),
    )
    .await;
    // Stopped, not undone: every reservation stands, no refund was sent.
    let effects = sim.side_effects().await.expect("the ledger");
    assert!(
        effects
            .iter()
            .all(|e| e.operation != "release" && e.operation != "refund"),
        "nothing is undone when a step says stop"
    );
    let detail = env.detail("stop-0").await;
    assert_eq!(detail.steps[0].state, sas_store::StepState::Completed);
    assert_eq!(detail.steps[1].state, sas_store::StepState::Failed);
    let (alerts,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM alerts WHERE kind = 'step_failed' AND resolved_at IS NULL",
    )
    .fetch_one(&env.db)
    .await
    .expect("count alerts");
    assert_eq!(alerts, ORDERS as i64 + 1);

    // Resuming while the cause is still there, or without a reason, is
    // answered as such; an order that is not stopped cannot be resumed.
    let (code, _) = env.sasctl(&["bulk", "resume", "--state", "error"]).await;
    assert_eq!(code, 0, "a preview needs no reason");
    let (code, _) = env.sasctl(&["resume", "stop-0", "--reason", " "]).await;
    assert_ne!(code, 0, "an empty reason is refused");

    // One order is cancelled instead: a stopped order is undone that way.
    let (code, out) = env
        .sasctl(&[
            "cancel",
            &format!("stop-{ORDERS}"),
            "--reason",
            "customer gave up",
        ])
        .await;
    assert_eq!(code, 0, "{out}");
    env.wait_for_state(
        &format!("stop-{ORDERS}"),
        ProcessState::Compensated,
        Duration::from_secs(30),
    )
    .await;

    // Fixed at the remote; the operator resumes the others in bulk.
    sim.set_faults(Some("payment"), faults(0.0))
        .await
        .expect("set remote-sim's faults");
    let before = sim.stats().await.expect("remote-sim's stats");
    let reason = "merchant account reinstated (ticket 4711)";
    // One from the console (a reason is required there too) ...
    let (_console_process, console) = env.console(&[]).await;
    let missing = console
        .act(
            "/api/orders/stop-0/resume",
            As::Operator,
            serde_json::json!({}),
        )
        .await;
    assert_eq!(missing.status(), StatusCode::BAD_REQUEST);
    let resumed = console
        .act(
            "/api/orders/stop-0/resume",
            As::Operator,
            serde_json::json!({ "reason": reason }),
        )
        .await;
    assert_eq!(resumed.status(), StatusCode::OK);
    let done: serde_json::Value = resumed.json().await.expect("the answer as JSON");
    assert!(
        done["message"]
            .as_str()
            .unwrap_or_default()
            .contains("a fresh key"),
        "{done}"
    );
    // ... the others in bulk, from sasctl.
    let rest = ORDERS - 1;
    let (code, out) = env
        .sasctl(&["bulk", "resume", "--state", "error", "-o", "json"])
        .await;
    assert_eq!(code, 0, "{out}");
    let preview: serde_json::Value = serde_json::from_str(&out).expect("the preview as JSON");
    assert_eq!(preview["count"], rest);
    let confirm = rest.to_string();
    let bulk = ["bulk", "resume", "--state", "error", "--confirm", &confirm];
    let (code, _) = env.sasctl(&bulk).await;
    assert_ne!(code, 0, "a bulk resume without a reason is refused");
    let (code, out) = env
        .sasctl(&[&bulk[..], &["--reason", reason, "--actor", "ops-kim"]].concat())
        .await;
    assert_eq!(code, 0, "{out}");
    env.wait_for_count(
        ProcessState::Processed,
        ORDERS as i64,
        Duration::from_secs(60),
    )
    .await;

    // The ledger: each resumed order charged once, with a fresh key (the
    // refused one stays refused), shipped once; no completed step called
    // again (every call since the fix is a charge or a shipment, none
    // answered from an earlier decision).
    let after = sim.stats().await.expect("remote-sim's stats");
    assert_eq!(
        after.calls - before.calls,
        2 * ORDERS as u64,
        "{before:?} {after:?}"
    );
    assert_eq!(after.deduplicated, before.deduplicated);
    let effects = sim.side_effects().await.expect("the ledger");
    for i in 0..ORDERS {
        let id = format!("stop-{i}");
        let mine: Vec<_> = effects
            .iter()
            .filter(|e| e.order_id.as_deref() == Some(id.as_str()))
            .map(|e| {
                (
                    e.key.as_str(),
                    matches!(e.decision, sas_tests::sim::Decision::Applied { .. }),
                )
            })
            .collect();
        assert_eq!(
            mine,
            [
                (format!("{id}:reserve_stock").as_str(), true),
                (format!("{id}:charge_payment").as_str(), false),
                (format!("{id}:charge_payment:r1").as_str(), true),
                (format!("{id}:create_shipment").as_str(), true),
            ],
            "{id}"
        );
    }
    // The history names the operator and the reason, once per order: the
    // console's user for the one, sasctl's for the others; the alerts are
    // resolved.
    let by_actor: Vec<(String, i64)> = sqlx::query_as(
        "SELECT actor, count(*) FROM history WHERE event = 'resumed' \
         AND step = 'charge_payment' AND detail LIKE '%' || $1 || '%' \
         GROUP BY actor ORDER BY actor",
    )
    .bind(reason)
    .fetch_all(&env.db)
    .await
    .expect("count history");
    assert_eq!(
        by_actor,
        [
            ("console:ann".to_owned(), 1),
            ("sasctl:ops-kim".to_owned(), ORDERS as i64 - 1)
        ]
    );
    let (open,): (i64,) = sqlx::query_as("SELECT count(*) FROM alerts WHERE resolved_at IS NULL")
        .fetch_one(&env.db)
        .await
        .expect("count alerts");
    assert_eq!(open, 0);
    // A processed order cannot be resumed.
    let (code, _) = env.sasctl(&["resume", "stop-0", "--reason", "again"]).await;
    assert_eq!(code, 1);
}

/// Resuming an order whose compensation began would send an action whose
/// undo is in doubt: sasctl, the console and a bulk resume each refuse it
/// with the reason, and send nothing.
#[tokio::test(flavor = "multi_thread")]
async fn an_order_whose_undo_began_is_not_resumed_and_each_tool_says_why() {
    let env = TestEnv::new().await;
    // The reservation's undo is misspelt: the remote answers 404, which
    // proves nothing undone.
    let workflow = stopping_workflow(&env).replacen("\"release\"", "\"relese\"", 1);
    assert!(workflow.contains("relese"), "{workflow}");
    let (system, publisher, _connection) = refusing_payments(&env, &workflow).await;
    let sim = &system.sim;
    env.publish_orders(&publisher, "doubt", 2).await;
    env.wait_for_count(ProcessState::Error, 2, Duration::from_secs(60))
        .await;
    // doubt-0 is cancelled: its compensation begins, and stops in error at
    // the reservation's undo.
    let (code, out) = env.sasctl(&["cancel", "doubt-0"]).await;
    assert_eq!(code, 0, "{out}");
    sas_tests::wait_until(
        "doubt-0's undo refused, in error",
        Duration::from_secs(60),
        || async {
            let detail = env.detail("doubt-0").await;
            (detail.summary.state == ProcessState::Error
                && detail.steps[0].state == sas_store::StepState::Compensating)
                .then_some(())
                .ok_or_else(|| format!("{} {:?}", detail.summary.state, detail.steps))
        },
    )
    .await;
    let (code, _, err) = env
        .sasctl_with_errors(&["resume", "doubt-0", "--reason", "fixed"])
        .await;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("its compensation began"), "{err}");
    let (_console_process, console) = env.console(&[]).await;
    let refused = console
        .act(
            "/api/orders/doubt-0/resume",
            As::Operator,
            serde_json::json!({ "reason": "fixed" }),
        )
        .await;
    assert_eq!(refused.status(), StatusCode::CONFLICT);
    let body = refused.text().await.expect("the answer");
    assert!(body.contains("its compensation began"), "{body}");
    // In bulk, it is skipped with the reason; the other is resumed.
    let (code, out) = env
        .sasctl(&[
            "bulk",
            "resume",
            "--state",
            "error",
            "--confirm",
            "2",
            "--reason",
            "fixed",
            "-o",
            "json",
        ])
        .await;
    assert_eq!(code, 0, "{out}");
    let outcome: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    assert_eq!(
        outcome["applied"],
        serde_json::json!(["doubt-1"]),
        "{outcome}"
    );
    let skipped = outcome["skipped"].to_string();
    assert!(
        skipped.contains("doubt-0") && skipped.contains("its compensation began"),
        "{outcome}"
    );
    // Nothing was sent for doubt-0: no call since, and its history has no
    // resume.
    let (resumed,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM history WHERE order_id = 'doubt-0' AND event = 'resumed'",
    )
    .fetch_one(&env.db)
    .await
    .expect("count history");
    assert_eq!(resumed, 0);
    let effects = sim.side_effects().await.expect("the ledger");
    assert!(
        !effects
            .iter()
            .any(|e| e.order_id.as_deref() == Some("doubt-0")
                && e.key.starts_with("doubt-0:charge_payment:")),
        "a charge was sent for the order whose undo began"
    );
}
