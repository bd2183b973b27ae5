//! Child steps, against real processes and remote-sim's ledger: a parent
//! whose child step starts an order of another workflow takes the child's
//! results; a parent refused after its child undoes the child as a whole,
//! after it ended, before its own earlier steps; a parent cancelled while
//! its child runs cancels the child, and nothing is left undone.

use std::time::Duration;

use sas_store::machine::HistoryEvent;
use sas_store::{ProcessState, StepState};
use sas_tests::sim::SimClient;
use sas_tests::{order, TestEnv};

/// A child workflow of three steps (on the inventory and shipping
/// services, so that the payment service's refusals reach only the
/// parent), and a parent that reserves, runs it (`fulfil`, its attributes
/// built from the parent's), then charges.
fn workflows(env: &TestEnv) -> [sas_tests::Setting; 2] {
    let mut fulfil = String::from("name = \"fulfil\"\nversion = 3\n\n");
    for step in [
        ("hold", "inventory", "reserve", "release"),
        ("pack", "shipping", "ship", "cancel"),
        ("label", "inventory", "reserve", "release"),
    ] {
        fulfil.push_str(&env.call_step(step, None));
    }
    let mut parent = String::from("name = \"parent\"\nversion = 1\n\n");
    parent.push_str(&env.call_step(("reserve_stock", "inventory", "reserve", "release"), None));
    parent.push_str(
        r#"[[steps]]
name = "fulfil"
kind = "child"
workflow = "fulfil"
timeout_ms = 60000
[steps.attributes]
parent_customer = "${/order/customer_id}"

"#,
    );
    parent.push_str(&env.call_step(("charge_payment", "payment", "charge", "refund"), None));
    env.workflows(&[("fulfil.toml", &fulfil), ("parent.toml", &parent)])
}

/// An order of the parent workflow.
fn parent_order(id: &str) -> sas_messages::SubmitOrder {
    let mut order = order(id);
    order.workflow = Some("parent".into());
    order
}

/// remote-sim's faults: no latency, `refused` of the new keys refused for good.
fn faults(refused: f64, latency_ms: u64) -> serde_json::Value {
    serde_json::json!({ "latency_ms": latency_ms, "transient_fault_rate": 0.0,
                        "permanent_fault_rate": refused, "hang_rate": 0.0 })
}

/// The applied keys of `order_id` and its child, with when each applied.
async fn applied(sim: &SimClient, order_id: &str) -> Vec<(String, chrono::DateTime<chrono::Utc>)> {
    let at = sim.applied_at().await;
    let mut keys: Vec<_> = sim
        .applied_keys(order_id)
        .await
        .into_iter()
        .map(|key| {
            let when = at[&key];
            (key, when)
        })
        .collect();
    keys.sort_by_key(|(_, at)| *at);
    keys
}

#[tokio::test(flavor = "multi_thread")]
async fn a_parent_takes_its_child_s_results_and_undoes_the_child_as_a_whole_when_refused_after_it()
{
    const ORDERS: usize = 5;
    let env = TestEnv::new().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &workflows(&env));
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;

    // Processed: the parent's fulfil step holds its child's results.
    env.publish_order(&publisher, &parent_order("ok-0")).await;
    env.wait_for_state("ok-0", ProcessState::Processed, Duration::from_secs(60))
        .await;
    env.wait_for_state(
        "ok-0:fulfil",
        ProcessState::Processed,
        Duration::from_secs(5),
    )
    .await;
    let parent = env.detail("ok-0").await;
    let fulfil = parent
        .steps
        .iter()
        .find(|s| s.name == "fulfil")
        .expect("fulfil");
    let result = fulfil.result.as_ref().expect("the child's results");
    assert_eq!(result["order_id"], "ok-0:fulfil");
    for step in ["hold", "pack", "label"] {
        assert!(result["results"][step].is_object(), "{result}");
    }
    let child = env.detail("ok-0:fulfil").await;
    assert_eq!(child.summary.workflow, "fulfil");
    assert_eq!(child.summary.workflow_version, 3);
    assert_eq!(
        child.body["attributes"]["parent_customer"], "cust-1",
        "the child's attributes are built from the parent's template"
    );

    // Refused after its child: the child is undone as a whole, then the
    // parent's reservation.
    sim.set_faults(Some("payment"), faults(1.0, 0))
        .await
        .expect("set remote-sim's faults");
    for i in 0..ORDERS {
        env.publish_order(&publisher, &parent_order(&format!("refused-{i}")))
            .await;
    }
    for i in 0..ORDERS {
        let id = format!("refused-{i}");
        env.wait_for_state(&id, ProcessState::Compensated, Duration::from_secs(90))
            .await;
        // The child ended before the parent did.
        env.wait_for_state(
            &format!("{id}:fulfil"),
            ProcessState::Compensated,
            Duration::from_secs(1),
        )
        .await;
        let keys = applied(&sim, &id).await;
        let names: Vec<&str> = keys.iter().map(|(k, _)| k.as_str()).collect();
        let expected = [
            format!("{id}:reserve_stock"),
            format!("{id}:fulfil:hold"),
            format!("{id}:fulfil:pack"),
            format!("{id}:fulfil:label"),
            format!("{id}:fulfil:label:undo"),
            format!("{id}:fulfil:pack:undo"),
            format!("{id}:fulfil:hold:undo"),
            format!("{id}:reserve_stock:undo"),
        ];
        assert_eq!(
            names,
            expected.iter().map(String::as_str).collect::<Vec<_>>(),
            "every effect once, the child's undone in reverse after it ended, then the parent's"
        );
        let parent = env.detail(&id).await;
        let fulfil = parent
            .steps
            .iter()
            .find(|s| s.name == "fulfil")
            .expect("fulfil");
        assert_eq!(fulfil.state, StepState::Compensated);
        let history = env.detail(&format!("{id}:fulfil")).await.history;
        assert!(
            history
                .iter()
                .any(|h| h.event == HistoryEvent::UndoneForParent),
            "the child's history says its parent undid it: {history:?}"
        );
    }
    sim.assert_no_undo_before_its_action().await;
    let counts = sim.applied_per_key().await.expect("the ledger");
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_parent_cancelled_while_its_child_runs_cancels_the_child_and_nothing_is_left_undone() {
    let env = TestEnv::new().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &workflows(&env));
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    // The shipping service is slow: the child is mid-run when the parent
    // is cancelled.
    sim.set_faults(Some("shipping"), faults(0.0, 1500))
        .await
        .expect("set remote-sim's faults");
    env.publish_order(&publisher, &parent_order("c-0")).await;
    sas_tests::wait_until(
        "the child to be shipping",
        Duration::from_secs(30),
        || async {
            let detail = env
                .store
                .reads()
                .order_detail("c-0:fulfil")
                .await
                .map_err(|e| e.to_string())?
                .ok_or("the child is not stored yet")?;
            let pack = detail
                .steps
                .iter()
                .find(|s| s.name == "pack")
                .ok_or("no pack")?;
            (pack.state == StepState::Running)
                .then_some(())
                .ok_or_else(|| format!("pack is {}", pack.state))
        },
    )
    .await;
    let (code, out) = env
        .sasctl(&["cancel", "c-0", "--reason", "customer gave up"])
        .await;
    assert_eq!(code, 0, "{out}");
    env.wait_for_state("c-0", ProcessState::Compensated, Duration::from_secs(60))
        .await;
    env.wait_for_state(
        "c-0:fulfil",
        ProcessState::Compensated,
        Duration::from_secs(1),
    )
    .await;
    // Whatever the child had applied is undone, each undo after its action;
    // what it never reached was never called.
    let keys = applied(&sim, "c-0").await;
    let names: Vec<&str> = keys.iter().map(|(k, _)| k.as_str()).collect();
    for action in names.iter().filter(|k| !k.ends_with(":undo")) {
        assert!(
            names.contains(&format!("{action}:undo").as_str()),
            "{action} is left undone: {names:?}"
        );
    }
    assert!(!names.iter().any(|k| k.contains("label")), "{names:?}");
    assert!(!names.iter().any(|k| k.contains("charge")), "{names:?}");
    sim.assert_no_undo_before_its_action().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn parents_run_across_kill_9_of_the_scheduler_with_one_child_each_and_every_effect_once() {
    const ORDERS: usize = 30;
    let env = TestEnv::new().await;
    let settings = workflows(&env);
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    // Slow enough that the kill finds parents before, at and after their
    // child step.
    sim.set_faults(None, faults(0.0, 150))
        .await
        .expect("set remote-sim's faults");
    let _agents = env.agents(1, &sim, &[]);
    let mut scheduler = env.scheduler(0, &settings);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    for i in 0..ORDERS {
        env.publish_order(&publisher, &parent_order(&format!("k-{i}")))
            .await;
    }
    // Killed once some children exist and not every parent has ended.
    sas_tests::wait_until("children started", Duration::from_secs(60), || async {
        let (children,): (i64,) = sqlx::query_as("SELECT count(*) FROM order_children")
            .fetch_one(&env.db)
            .await
            .map_err(|e| e.to_string())?;
        (children >= 3)
            .then_some(())
            .ok_or_else(|| format!("{children} children"))
    })
    .await;
    scheduler.kill9().await;
    let (processed,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM order_process WHERE state = 'processed' AND workflow = 'parent'",
    )
    .fetch_one(&env.db)
    .await
    .expect("count");
    assert!(
        processed < ORDERS as i64,
        "the kill came after every parent ended"
    );
    let _scheduler = env.scheduler(1, &settings);
    for i in 0..ORDERS {
        env.wait_for_state(
            &format!("k-{i}"),
            ProcessState::Processed,
            Duration::from_secs(90),
        )
        .await;
    }
    let children: Vec<(String, String)> =
        sqlx::query_as("SELECT parent_order_id, child_order_id FROM order_children ORDER BY 1")
            .fetch_all(&env.db)
            .await
            .expect("the links");
    assert_eq!(children.len(), ORDERS, "one child per parent: {children:?}");
    for (parent, child) in &children {
        assert_eq!(child, &format!("{parent}:fulfil"));
        assert_eq!(env.state_of(child).await, Some(ProcessState::Processed));
    }
    let (orders,): (i64,) = sqlx::query_as("SELECT count(*) FROM orders")
        .fetch_one(&env.db)
        .await
        .expect("count");
    assert_eq!(
        orders,
        2 * ORDERS as i64,
        "no order but the parents and their children"
    );
    let counts = sim.applied_per_key().await.expect("the ledger");
    assert_eq!(
        counts.len(),
        5 * ORDERS,
        "five effects per parent: {counts:?}"
    );
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
}
