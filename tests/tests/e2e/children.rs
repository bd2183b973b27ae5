//! Child steps, against real processes and remote-sim's ledger: a parent
//! whose child step starts an order of another workflow takes the child's
//! results; a parent refused after its child undoes the child as a whole,
//! after it ended, before its own earlier steps; a parent cancelled while
//! its child runs cancels the child, and nothing is left undone.

use std::time::Duration;

use sas_store::machine::HistoryEvent;
use sas_store::writes::operator::Resume;
use sas_store::{ProcessState, StepState};
use sas_tests::console::As;
use sas_tests::process::System;
use sas_tests::sim::SimClient;
use sas_tests::{order, TestEnv};

/// A child workflow of three steps (on the inventory and shipping
/// services, so that the payment service's refusals reach only the
/// parent), and a parent that reserves, runs it (`fulfil`, its attributes
/// built from the parent's), then charges.
fn workflows(env: &TestEnv) -> [sas_tests::Setting; 2] {
    workflows_with(env, "", "")
}

/// [`workflows`], the child's workflow with `schema` (TOML tables after its
/// name and version: its `attributes_schema`) and its `pack` step with
/// `pack` (TOML keys: how it fails).
fn workflows_with(env: &TestEnv, schema: &str, pack: &str) -> [sas_tests::Setting; 2] {
    let mut fulfil = format!("name = \"fulfil\"\nversion = 3\n{schema}\n");
    for step in [
        ("hold", "inventory", "reserve", "release"),
        ("pack", "shipping", "ship", "cancel"),
        ("label", "inventory", "reserve", "release"),
    ] {
        let extra = if step.0 == "pack" { pack } else { "" };
        fulfil.push_str(&env.call_step(step, None).replacen(
            "timeout_ms",
            &format!("{extra}timeout_ms"),
            1,
        ));
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

/// The system the tests run: remote-sim with `latency_ms` on every call,
/// `agents` agents per queue, a scheduler running `workflows`, a
/// supervisor; and a publisher.
async fn start(
    env: &TestEnv,
    workflows: &[sas_tests::Setting],
    agents: usize,
    latency_ms: u64,
) -> (System, sas_broker::Publisher, sas_broker::lapin::Connection) {
    let (sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(None, faults(0.0, latency_ms))
        .await
        .expect("set remote-sim's faults");
    let system = System {
        agents: env.agents(agents, &sim, &[]),
        schedulers: vec![env.scheduler(0, workflows)],
        supervisors: vec![env.supervisor(0, &[])],
        sim_process,
        sim,
    };
    let (connection, publisher) = env.broker().await;
    (system, publisher, connection)
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
    let (system, publisher, _connection) = start(&env, &workflows(&env), 1, 0).await;
    let sim = &system.sim;

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
    // Each names the other, in the store's reads and in sasctl.
    let link = child.parent.as_ref().expect("the child's parent");
    assert_eq!(
        (link.order_id.as_str(), link.step.as_str()),
        ("ok-0", "fulfil")
    );
    assert_eq!(parent.children.len(), 1);
    assert_eq!(parent.children[0].order_id, "ok-0:fulfil");
    let (code, out) = env.sasctl(&["orders", "show", "ok-0"]).await;
    assert_eq!(code, 0, "{out}");
    assert!(
        out.contains("child       ok-0:fulfil (step fulfil)"),
        "{out}"
    );
    let (code, out) = env.sasctl(&["orders", "show", "ok-0:fulfil"]).await;
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("parent      ok-0 (its step fulfil)"), "{out}");
    // A parent's children are found by it, whatever their ids.
    let (code, out) = env
        .sasctl(&["orders", "list", "--parent", "ok-0", "-o", "json"])
        .await;
    assert_eq!(code, 0, "{out}");
    let page: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let found: Vec<&str> = page["orders"]
        .as_array()
        .expect("orders")
        .iter()
        .filter_map(|row| row["order_id"].as_str())
        .collect();
    assert_eq!(found, ["ok-0:fulfil"], "{page}");
    // And in the console: each page links to the other, and the parent's to
    // its children in the orders list, which the parent filter selects.
    let (_console, console) = env.console(&[]).await;
    let page = |path: String| {
        let console = &console;
        async move {
            let response = console.get(&path, As::Viewer).await;
            assert_eq!(response.status(), 200, "{path}");
            response.text().await.expect("the page")
        }
    };
    let parent_page = page("/orders/ok-0".into()).await;
    assert!(
        parent_page.contains(
            r#"<a href="/orders/ok-0:fulfil"><code>ok-0:fulfil</code></a> (step fulfil)"#
        ),
        "{parent_page}"
    );
    assert!(
        parent_page.contains(r#"id="children-list" href="/orders?parent=ok-0""#),
        "{parent_page}"
    );
    let child_page = page("/orders/ok-0:fulfil".into()).await;
    assert!(
        child_page.contains(r#"of order <a href="/orders/ok-0"><code>ok-0</code></a>"#),
        "{child_page}"
    );
    let listed = page("/orders?parent=ok-0".into()).await;
    assert!(listed.contains("/orders/ok-0:fulfil"), "{listed}");
    assert!(!listed.contains(r#"href="/orders/ok-0""#), "{listed}");
    // And over the gateway, for the tenant's client.
    let (_gateway, base) = super::gateway::gateway(&env, &[]).await;
    let read = |id: &'static str| {
        let base = base.clone();
        async move {
            sas_tests::http_client()
                .get(format!("{base}/v1/orders/{id}"))
                .bearer_auth(super::gateway::SECRET)
                .send()
                .await
                .expect("the gateway answers")
                .json::<serde_json::Value>()
                .await
                .expect("JSON")
        }
    };
    let view = read("ok-0").await;
    assert_eq!(view["steps"][1]["child_order_id"], "ok-0:fulfil", "{view}");
    assert!(view.get("parent_order_id").is_none(), "{view}");
    let view = read("ok-0:fulfil").await;
    assert_eq!(view["parent_order_id"], "ok-0", "{view}");
    assert_eq!(view["workflow"], "fulfil", "{view}");

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
        // The child ended, compensated, before the parent sent the undo of
        // its earlier step (the history's clock is the database's).
        let child = format!("{id}:fulfil");
        assert_eq!(env.state_of(&child).await, Some(ProcessState::Compensated));
        let (child_ended, parent_undo): (
            chrono::DateTime<chrono::Utc>,
            chrono::DateTime<chrono::Utc>,
        ) = sqlx::query_as(
            "SELECT (SELECT at FROM history WHERE order_id = $1 AND event = 'compensated'),
                        (SELECT min(at) FROM history WHERE order_id = $2
                            AND event = 'compensation_dispatched' AND step = 'reserve_stock')",
        )
        .bind(&child)
        .bind(&id)
        .fetch_one(&env.db)
        .await
        .expect("the child's end and the parent's undo");
        assert!(
            child_ended <= parent_undo,
            "{id} undid reserve_stock at {parent_undo}, before its child ended at {child_ended}"
        );
        let keys = applied(sim, &id).await;
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

    // A child its parent no longer waits for cannot be run again on its
    // own: its effects would belong to nobody.
    let (code, _, err) = env
        .sasctl_with_errors(&["resubmit", "refused-0:fulfil"])
        .await;
    assert_ne!(code, 0);
    assert!(
        err.contains("no longer waits for it") && err.contains("resubmit or resume refused-0"),
        "{err}"
    );

    // Retention keeps a child while its parent stays (a parent undone
    // later must find it), then takes it after its parent.
    let retire = || async {
        sqlx::query_scalar::<_, i32>("SELECT sas_retire_finished(interval '1 hour', 100)")
            .fetch_one(&env.db)
            .await
            .expect("retention")
    };
    sqlx::query(
        "UPDATE order_process SET updated_at = now() - interval '1 day',
                state = CASE WHEN order_id = 'ok-0' THEN 'processing'::process_state ELSE state END
          WHERE order_id IN ('ok-0', 'ok-0:fulfil')",
    )
    .execute(&env.db)
    .await
    .expect("age the orders");
    assert_eq!(retire().await, 0, "the child stays while its parent runs");
    sqlx::query("UPDATE order_process SET state = 'processed' WHERE order_id = 'ok-0'")
        .execute(&env.db)
        .await
        .expect("finish the parent");
    assert_eq!(retire().await, 1, "the parent goes first");
    assert_eq!(env.state_of("ok-0").await, None);
    assert_eq!(retire().await, 1, "then its child");
    assert_eq!(env.state_of("ok-0:fulfil").await, None);
}

/// Asserts that a compensated tree's applied `keys` (in the ledger's
/// order) undo its actions in the reverse of the order they were done,
/// across the levels: a child as a whole (its later steps first) before
/// its parent's earlier steps. An undo whose action never landed (sent
/// because the action's outcome was unknown at its deadline) has no place
/// in that order. Returns how many actions were done.
fn undone_in_reverse(top: &str, keys: &[String]) -> usize {
    let done: Vec<&str> = keys
        .iter()
        .filter(|k| !k.ends_with(":undo"))
        .map(String::as_str)
        .rev()
        .collect();
    let undone: Vec<&str> = keys
        .iter()
        .filter_map(|k| k.strip_suffix(":undo"))
        .filter(|action| done.contains(action))
        .collect();
    assert_eq!(undone, done, "{top}: {keys:?}");
    done.len()
}

/// Parent `id`'s child could not start: its `fulfil` step failed, it has
/// no child; the alert that says why.
async fn start_refused(env: &TestEnv, id: &str) -> String {
    let parent = env.detail(id).await;
    let fulfil = parent
        .steps
        .iter()
        .find(|s| s.name == "fulfil")
        .expect("fulfil");
    assert_eq!(fulfil.state, StepState::Failed);
    assert!(parent.children.is_empty(), "{:?}", parent.children);
    let (alert,): (String,) = sqlx::query_as("SELECT message FROM alerts WHERE order_id = $1")
        .bind(id)
        .fetch_one(&env.db)
        .await
        .expect("the alert");
    alert
}

#[tokio::test(flavor = "multi_thread")]
async fn an_order_holding_a_child_s_id_is_never_taken_for_the_child() {
    let env = TestEnv::new().await;
    let (system, publisher, _connection) = start(&env, &workflows(&env), 1, 0).await;
    let sim = &system.sim;
    // A client's own order, with the id parent sq-0's child would get.
    let mut squatter = order("sq-0:fulfil");
    squatter.workflow = Some("fulfil".into());
    env.publish_order(&publisher, &squatter).await;
    env.wait_for_state(
        "sq-0:fulfil",
        ProcessState::Processed,
        Duration::from_secs(30),
    )
    .await;
    env.publish_order(&publisher, &parent_order("sq-0")).await;
    env.wait_for_state("sq-0", ProcessState::Compensated, Duration::from_secs(30))
        .await;
    // The parent's step was refused and its reservation undone; the
    // client's order is untouched, and an alert says why.
    let alert = start_refused(&env, "sq-0").await;
    assert_eq!(
        env.state_of("sq-0:fulfil").await,
        Some(ProcessState::Processed)
    );
    assert!(env.detail("sq-0:fulfil").await.parent.is_none());
    let keys = sim.applied_keys("sq-0:fulfil").await;
    assert!(!keys.iter().any(|k| k.ends_with(":undo")), "{keys:?}");
    assert!(alert.contains("which this step did not start"), "{alert}");
    // No tool names the client's order the parent's child.
    let (code, out) = env.sasctl(&["orders", "show", "sq-0"]).await;
    assert_eq!(code, 0, "{out}");
    assert!(!out.contains("(child order sq-0:fulfil)"), "{out}");
    let (_gateway, base) = super::gateway::gateway(&env, &[]).await;
    let view: serde_json::Value = sas_tests::http_client()
        .get(format!("{base}/v1/orders/sq-0"))
        .bearer_auth(super::gateway::SECRET)
        .send()
        .await
        .expect("the gateway answers")
        .json()
        .await
        .expect("JSON");
    assert!(view["steps"][1].get("child_order_id").is_none(), "{view}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_child_its_workflow_s_schema_refuses_never_starts_and_its_parent_is_undone() {
    let env = TestEnv::new().await;
    // The child's workflow takes the shop's customers only; the parent
    // builds the child's `parent_customer` from its own order.
    let schema = "[attributes_schema]\ntype = \"object\"\nrequired = [\"parent_customer\"]\n\
                  [attributes_schema.properties.parent_customer]\ntype = \"string\"\npattern = \"^cust-\"\n";
    let (system, publisher, _connection) =
        start(&env, &workflows_with(&env, schema, ""), 1, 0).await;
    let sim = &system.sim;
    let mut refused = parent_order("as-bad");
    refused.customer_id = "mallory".into();
    env.publish_order(&publisher, &refused).await;
    env.publish_order(&publisher, &parent_order("as-ok")).await;
    env.wait_for_state("as-ok", ProcessState::Processed, Duration::from_secs(30))
        .await;
    env.wait_for_state("as-bad", ProcessState::Compensated, Duration::from_secs(30))
        .await;
    // As a client's order with those attributes would be refused at
    // intake: no child stored, the step failed with an alert saying why,
    // the parent's reservation undone, nothing else called.
    assert_eq!(env.state_of("as-bad:fulfil").await, None);
    let alert = start_refused(&env, "as-bad").await;
    assert!(
        alert.contains("child order as-bad:fulfil could not start: its attributes do not match workflow \"fulfil\" (version 3) at /parent_customer"),
        "{alert}"
    );
    let keys: Vec<String> = applied(sim, "as-bad")
        .await
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(keys, ["as-bad:reserve_stock", "as-bad:reserve_stock:undo"]);
    assert!(sim.applied_keys("as-bad:fulfil").await.is_empty());
    // The shop's customer's child started and ended.
    assert_eq!(
        env.state_of("as-ok:fulfil").await,
        Some(ProcessState::Processed)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_child_stopped_in_error_is_told_to_its_parent_at_once_and_resumed_the_parent_goes_on() {
    let env = TestEnv::new().await;
    // The child's `pack` stops its order when refused, for an operator.
    let settings = workflows_with(&env, "", "on_failure = \"stop\"\n");
    let (system, publisher, _connection) = start(&env, &settings, 1, 0).await;
    let sim = &system.sim;
    sim.set_faults(Some("shipping"), faults(1.0, 0))
        .await
        .expect("refuse the shipping calls");
    env.publish_order(&publisher, &parent_order("cs-0")).await;
    env.wait_for_state("cs-0:fulfil", ProcessState::Error, Duration::from_secs(30))
        .await;
    // The parent hears it in the transaction that stopped the child: a
    // history line saying what to do, and it waits on.
    let (detail,): (String,) = sqlx::query_as(
        "SELECT detail FROM history WHERE order_id = 'cs-0' AND event = 'child_stopped'",
    )
    .fetch_one(&env.db)
    .await
    .expect("the parent's child_stopped line, as soon as the child stopped");
    assert!(
        detail.contains("child order cs-0:fulfil stopped in error"),
        "{detail}"
    );
    assert!(detail.contains("resume or resubmit it"), "{detail}");
    assert_eq!(env.state_of("cs-0").await, Some(ProcessState::Pending));
    // The cause fixed, an operator resumes the child: it finishes, and so
    // does its parent.
    sim.set_faults(Some("shipping"), faults(0.0, 0))
        .await
        .expect("shipping fixed");
    let (code, out) = env
        .sasctl(&["resume", "cs-0:fulfil", "--reason", "shipping fixed"])
        .await;
    assert_eq!(code, 0, "{out}");
    env.wait_for_state("cs-0", ProcessState::Processed, Duration::from_secs(30))
        .await;
    assert_eq!(
        env.state_of("cs-0:fulfil").await,
        Some(ProcessState::Processed)
    );
    let counts = sim.applied_per_key().await.expect("the ledger");
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
    let keys = sim.applied_keys("cs-0").await;
    assert!(!keys.iter().any(|k| k.ends_with(":undo")), "{keys:?}");
}

/// A child is put back (here resumed) only while its parent waits for it,
/// and that is read under the child's lock: the transaction that ends a
/// child holds it, and may tell the parent in the same commit to stop
/// waiting. The test holds such a transaction open (the child's lock, the
/// parent's step failed) while an operator resumes the child. Checked
/// before the lock, as it once was, the parent's step still read
/// `running`, the child ran again, and its effects had nobody to undo them.
#[tokio::test(flavor = "multi_thread")]
async fn a_child_is_not_resumed_past_a_commit_that_ends_its_parent_s_wait() {
    let env = TestEnv::new().await;
    let settings = workflows_with(&env, "", "on_failure = \"stop\"\n");
    let (system, publisher, _connection) = start(&env, &settings, 1, 0).await;
    system
        .sim
        .set_faults(Some("shipping"), faults(1.0, 0))
        .await
        .expect("refuse the shipping calls");
    env.publish_order(&publisher, &parent_order("rc-0")).await;
    env.wait_for_state("rc-0:fulfil", ProcessState::Error, Duration::from_secs(30))
        .await;
    // What the child's last commit would do: hold the child's lock, and end
    // the parent's wait.
    let mut ending = env.db.begin().await.expect("a transaction");
    sqlx::query("SELECT 1 FROM order_process WHERE order_id = 'rc-0:fulfil' FOR UPDATE")
        .execute(&mut *ending)
        .await
        .expect("the child's lock");
    sqlx::query("UPDATE steps SET state = 'failed' WHERE order_id = 'rc-0' AND name = 'fulfil'")
        .execute(&mut *ending)
        .await
        .expect("the parent's step ends");
    let store = env.store.clone();
    let resume = tokio::spawn(async move {
        store
            .writes()
            .resume("rc-0:fulfil", "shipping fixed", "test:ops")
            .await
    });
    sas_tests::wait_until(
        "the resume to wait for the child's lock",
        Duration::from_secs(10),
        || async {
            let waiting: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM pg_stat_activity
                                 WHERE datname = current_database() AND wait_event_type = 'Lock')",
            )
            .fetch_one(&env.db)
            .await
            .map_err(|e| e.to_string())?;
            (waiting || resume.is_finished())
                .then_some(())
                .ok_or_else(|| "not yet".to_owned())
        },
    )
    .await;
    ending.commit().await.expect("commit");
    let outcome = resume.await.expect("the resume task").expect("the resume");
    match outcome {
        Resume::NotResumable(why) => assert!(why.contains("which no longer waits for it"), "{why}"),
        other => panic!("the child was put back after its parent stopped waiting: {other:?}"),
    }
    assert_eq!(env.state_of("rc-0:fulfil").await, Some(ProcessState::Error));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_parent_cancelled_while_its_child_runs_cancels_the_child_and_nothing_is_left_undone() {
    let env = TestEnv::new().await;
    let (system, publisher, _connection) = start(&env, &workflows(&env), 1, 0).await;
    let sim = &system.sim;
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
    let keys = applied(sim, "c-0").await;
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

/// The depth limit holds at run time, against the plans as stored, not
/// only in the catalog a scheduler checks as it starts: here the stored
/// plan of the child's workflow is changed behind the schedulers' back to
/// start itself (as two schedulers registering different files could
/// leave it). The chain stops at five children deep, the step that would
/// start a sixth fails with an alert saying why, and every order of the
/// chain is undone, deepest first, each action once and its undo after it.
#[tokio::test(flavor = "multi_thread")]
async fn a_loop_in_the_stored_plans_stops_at_the_depth_limit_and_is_undone_as_a_whole() {
    let env = TestEnv::new().await;
    let (system, publisher, _connection) = start(&env, &workflows(&env), 1, 0).await;
    let sim = &system.sim;
    sas_tests::wait_until("the plans registered", Duration::from_secs(30), || async {
        let plans: i64 = sqlx::query_scalar("SELECT count(*) FROM workflow_plans")
            .fetch_one(&env.db)
            .await
            .map_err(|e| e.to_string())?;
        (plans == 2)
            .then_some(())
            .ok_or_else(|| format!("{plans} plans"))
    })
    .await;
    // fulfil gains a last step `again`: the parent's child step, which
    // starts fulfil.
    let changed = sqlx::query(
        "UPDATE workflow_plans f
            SET steps = f.steps || jsonb_build_array(
                (SELECT s FROM workflow_plans p, jsonb_array_elements(p.steps) s
                  WHERE p.name = 'parent' AND s ->> 'name' = 'fulfil')
                || '{\"name\": \"again\"}'::jsonb)
          WHERE f.name = 'fulfil'",
    )
    .execute(&env.db)
    .await
    .expect("the stored plan changed");
    assert_eq!(changed.rows_affected(), 1);

    env.publish_order(&publisher, &parent_order("deep-0")).await;
    env.wait_for_state("deep-0", ProcessState::Compensated, Duration::from_secs(60))
        .await;
    let chain: Vec<(String, String)> = sqlx::query_as(
        "SELECT order_id, state::text FROM order_process WHERE order_id LIKE 'deep-0:%' ORDER BY order_id",
    )
    .fetch_all(&env.db)
    .await
    .expect("the chain");
    let deepest = format!("deep-0:fulfil{}", ":again".repeat(4));
    assert_eq!(
        chain.len(),
        sas_store::machine::child::MAX_DEPTH,
        "{chain:?}"
    );
    assert!(
        chain.iter().all(|(_, state)| state == "compensated"),
        "{chain:?}"
    );
    assert_eq!(
        chain.last().map(|(id, _)| id.as_str()),
        Some(deepest.as_str())
    );
    let (alert,): (String,) = sqlx::query_as("SELECT message FROM alerts WHERE order_id = $1")
        .bind(&deepest)
        .fetch_one(&env.db)
        .await
        .expect("the deepest child's alert");
    assert!(
        alert.contains("it would be 6 children deep, and at most 5 are allowed"),
        "{alert}"
    );
    // Every effect once, each undone after it, the deepest child's first.
    let keys = sim.applied_keys("deep-0").await;
    let done = undone_in_reverse("deep-0", &keys);
    assert_eq!(
        done,
        1 + 3 * sas_store::machine::child::MAX_DEPTH,
        "{keys:?}"
    );
    sim.assert_no_undo_before_its_action().await;
    let counts = sim.applied_per_key().await.expect("the ledger");
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tree_at_its_size_limit_starts_no_more_children_and_its_parent_is_undone() {
    use sas_store::machine::child::MAX_TREE_ORDERS;
    let env = TestEnv::new().await;
    let (system, publisher, _connection) = start(&env, &workflows(&env), 1, 0).await;
    let sim = &system.sim;
    // A first generation: refused at its charge, its child undone.
    sim.set_faults(Some("payment"), faults(1.0, 0))
        .await
        .expect("set remote-sim's faults");
    env.publish_order(&publisher, &parent_order("tree-0")).await;
    env.wait_for_state("tree-0", ProcessState::Compensated, Duration::from_secs(90))
        .await;
    // Earlier generations, as put-backs leave them: the tree now holds
    // its limit (the root, its first child and these).
    let earlier = i32::try_from(MAX_TREE_ORDERS - 2).unwrap();
    let linked = sqlx::query(
        "WITH made AS (
             INSERT INTO orders (order_id, body)
             SELECT 'tree-0:fulfil:old' || g, '{}' FROM generate_series(1, $1) g
             RETURNING order_id)
         INSERT INTO order_children (child_order_id, parent_order_id, step)
         SELECT order_id, 'tree-0', 'fulfil' FROM made",
    )
    .bind(earlier)
    .execute(&env.db)
    .await
    .expect("earlier generations linked");
    assert_eq!(linked.rows_affected(), u64::try_from(earlier).unwrap());

    // Put back once more, its payment fixed: the child step is refused
    // before its child starts, and the order is undone.
    sim.set_faults(Some("payment"), faults(0.0, 0))
        .await
        .expect("set remote-sim's faults");
    let (code, out) = env.sasctl(&["resubmit", "tree-0"]).await;
    assert_eq!(code, 0, "{out}");
    sas_tests::wait_until("tree-0 undone again", Duration::from_secs(90), || async {
        let ended: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM history WHERE order_id = 'tree-0' AND event = 'compensated'",
        )
        .fetch_one(&env.db)
        .await
        .map_err(|e| e.to_string())?;
        (ended == 2)
            .then_some(())
            .ok_or_else(|| format!("compensated {ended} times"))
    })
    .await;
    assert_eq!(
        env.state_of("tree-0").await,
        Some(ProcessState::Compensated)
    );
    let started: i64 =
        sqlx::query_scalar("SELECT count(*) FROM order_process WHERE order_id LIKE 'tree-0:%'")
            .fetch_one(&env.db)
            .await
            .expect("the children");
    assert_eq!(started, 1, "only the first generation's child ever ran");
    let alerts: Vec<String> =
        sqlx::query_scalar("SELECT message FROM alerts WHERE order_id = 'tree-0'")
            .fetch_all(&env.db)
            .await
            .expect("the alerts");
    let limit = format!(
        "the tree of order tree-0 holds {MAX_TREE_ORDERS} orders, and at most {MAX_TREE_ORDERS} are allowed"
    );
    assert!(alerts.iter().any(|a| a.contains(&limit)), "{alerts:?}");
    // Every effect once, each undone after it; nothing of the refused
    // start was sent.
    let keys = sim.applied_keys("tree-0").await;
    assert!(
        keys.iter().all(|key| !key.starts_with("tree-0:fulfil:r1")),
        "{keys:?}"
    );
    sim.assert_no_undo_before_its_action().await;
    let counts = sim.applied_per_key().await.expect("the ledger");
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn parents_run_across_kill_9_of_the_scheduler_with_one_child_each_and_every_effect_once() {
    const ORDERS: usize = 30;
    let env = TestEnv::new().await;
    let settings = workflows(&env);
    // Slow enough that the kill finds parents before, at and after their
    // child step.
    let (mut system, publisher, _connection) = start(&env, &settings, 1, 150).await;
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
    system.schedulers[0].kill9().await;
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
    let counts = system.sim.applied_per_key().await.expect("the ledger");
    assert_eq!(
        counts.len(),
        5 * ORDERS,
        "five effects per parent: {counts:?}"
    );
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
}

/// Three levels: `top` reserves, runs a `middle` child, charges; `middle`
/// reserves, runs a `leaf` child, ships; `leaf` holds and packs.
fn three_levels(env: &TestEnv) -> [sas_tests::Setting; 2] {
    let child = |name: &str, workflow: &str| {
        format!(
            "[[steps]]\nname = \"{name}\"\nkind = \"child\"\nworkflow = \"{workflow}\"\ntimeout_ms = 120000\n\n"
        )
    };
    let mut leaf = String::from("name = \"leaf\"\n\n");
    leaf.push_str(&env.call_step(("hold", "inventory", "reserve", "release"), None));
    leaf.push_str(&env.call_step(("pack", "shipping", "ship", "cancel"), None));
    let mut middle = String::from("name = \"middle\"\n\n");
    middle.push_str(&env.call_step(("reserve", "inventory", "reserve", "release"), None));
    middle.push_str(&child("inner", "leaf"));
    middle.push_str(&env.call_step(("ship", "shipping", "ship", "cancel"), None));
    let mut top = String::from("name = \"top\"\n\n");
    top.push_str(&env.call_step(("reserve", "inventory", "reserve", "release"), None));
    top.push_str(&child("outer", "middle"));
    top.push_str(&env.call_step(("charge", "payment", "charge", "refund"), None));
    env.workflows(&[
        ("leaf.toml", &leaf),
        ("middle.toml", &middle),
        ("top.toml", &top),
    ])
}

#[tokio::test(flavor = "multi_thread")]
async fn cancels_at_random_moments_reach_children_at_any_depth_and_leave_nothing_undone() {
    const ORDERS: usize = 100;
    let env = TestEnv::new().await;
    let (system, publisher, _connection) = start(&env, &three_levels(&env), 2, 100).await;
    let sim = &system.sim;
    // Each tree is cancelled at a random moment of a phase of its run,
    // chosen by turns: from its start (before its child, or as it starts
    // it), from its child's start (while the child runs or starts the
    // grandchild), or from the grandchild's start (mid-grandchild, or
    // after it all ended: then the cancel is refused and it stays
    // processed). One loop reads which orders exist and sends each cancel
    // its random time after its phase began.
    let tops: Vec<String> = (0..ORDERS).map(|i| format!("top-{i}")).collect();
    for top in &tops {
        let mut order = order(top);
        order.workflow = Some("top".into());
        env.publish_order(&publisher, &order).await;
    }
    let mut plan: Vec<(usize, Duration, Option<tokio::time::Instant>)> = (0..ORDERS)
        .map(|i| {
            let orders_started = [1, 2, 3][i % 3];
            let jitter = Duration::from_millis(rand::random_range(0..300));
            (orders_started, jitter, None)
        })
        .collect();
    let mut sent = [false; ORDERS];
    let mut cancels = futures_util::stream::FuturesUnordered::new();
    let mut outcomes = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    while sent.iter().any(|s| !s) || !cancels.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "trees never reached their phase: {plan:?}"
        );
        tokio::select! {
            Some(outcome) = futures_util::StreamExt::next(&mut cancels) => outcomes.push(outcome),
            () = tokio::time::sleep(Duration::from_millis(25)) => {
                let ids: std::collections::HashSet<String> =
                    sqlx::query_scalar("SELECT order_id FROM order_process")
                        .fetch_all(&env.db)
                        .await
                        .expect("the orders")
                        .into_iter()
                        .collect();
                let now = tokio::time::Instant::now();
                for (i, top) in tops.iter().enumerate() {
                    let (needed, jitter, began) = &mut plan[i];
                    if sent[i] {
                        continue;
                    }
                    let started = [top.clone(), format!("{top}:outer"), format!("{top}:outer:inner")]
                        .iter()
                        .filter(|id| ids.contains(*id))
                        .count();
                    if began.is_none() && started >= *needed {
                        *began = Some(now + *jitter);
                    }
                    if began.is_some_and(|at| at <= now) {
                        sent[i] = true;
                        let env = &env;
                        cancels.push(async move {
                            env.sasctl(&["cancel", top, "--reason", "changed their mind"]).await
                        });
                    }
                }
            }
        }
    }
    let cancelled = outcomes.iter().filter(|(code, _)| *code == 0).count();
    // Every order ends, and so does every child it started.
    sas_tests::wait_until("every order to end", Duration::from_secs(120), || async {
        let (open, tops): (i64, i64) = sqlx::query_as(
            "SELECT count(*) FILTER (WHERE state NOT IN ('processed', 'compensated')),
                    count(*) FILTER (WHERE workflow = 'top')
               FROM order_process",
        )
        .fetch_one(&env.db)
        .await
        .map_err(|e| e.to_string())?;
        // Every top stored too: none open also holds before the last is.
        (open == 0 && tops == ORDERS as i64)
            .then_some(())
            .ok_or_else(|| format!("{open} open, {tops} of {ORDERS} tops stored"))
    })
    .await;
    let states: Vec<(String, String)> =
        sqlx::query_as("SELECT order_id, state::text FROM order_process ORDER BY order_id")
            .fetch_all(&env.db)
            .await
            .expect("the states");
    let mut compensated = 0;
    // How many orders each compensated tree had started (1: cancelled
    // before its child, 3: down to the grandchild).
    let mut sizes = [0usize; 4];
    for i in 0..ORDERS {
        let top = format!("top-{i}");
        let tree: Vec<&(String, String)> = states
            .iter()
            .filter(|(id, _)| id == &top || id.starts_with(&format!("{top}:")))
            .collect();
        let own = &tree[0].1;
        compensated += usize::from(own == "compensated");
        // A tree ends as one: every order of it as its top did.
        assert!(tree.iter().all(|(_, state)| state == own), "{tree:?}");
        let keys = sim.applied_keys(&top).await;
        for action in keys.iter().filter(|k| !k.ends_with(":undo")) {
            let undone = keys.contains(&format!("{action}:undo"));
            assert_eq!(
                undone,
                own == "compensated",
                "{action} of {top} ({own}): {keys:?}"
            );
        }
        if own == "compensated" {
            sizes[tree.len().min(3)] += 1;
            undone_in_reverse(&top, &keys);
        }
    }
    println!("compensated trees of 1, 2 and 3 orders: {:?}", &sizes[1..]);
    // The cancels met every moment of a tree: before its child, while the
    // child ran (before its own child), and down to the grandchild.
    assert!(
        sizes[1] > 0 && sizes[2] > 0 && sizes[3] > 0,
        "compensated trees of 1, 2 and 3 orders: {:?}",
        &sizes[1..]
    );
    assert_eq!(
        compensated, cancelled,
        "each accepted cancel undid its tree, and only those"
    );
    assert!(cancelled > 0, "no cancel came while an order ran");
    sim.assert_no_undo_before_its_action().await;
    let counts = sim.applied_per_key().await.expect("the ledger");
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deadlock_is_told_apart_as_a_rollback_to_run_again() {
    // What an operator's action runs again (Writes::transition_one): two
    // transactions locking two rows the other way round, as a cascade to a
    // child and a child's end reaching its parent can.
    let env = TestEnv::new().await;
    for statement in [
        "CREATE TABLE deadlock_probe (id int PRIMARY KEY)",
        "INSERT INTO deadlock_probe VALUES (1), (2)",
    ] {
        sqlx::query(statement)
            .execute(&env.db)
            .await
            .expect("the probe table");
    }
    let lock = |first: i32, second: i32| {
        let pool = env.db.clone();
        async move {
            let mut tx = pool.begin().await?;
            sqlx::query("SELECT 1 FROM deadlock_probe WHERE id = $1 FOR UPDATE")
                .bind(first)
                .execute(&mut *tx)
                .await?;
            tokio::time::sleep(Duration::from_millis(300)).await;
            sqlx::query("SELECT 1 FROM deadlock_probe WHERE id = $1 FOR UPDATE")
                .bind(second)
                .execute(&mut *tx)
                .await?;
            tx.commit().await
        }
    };
    let (a, b) = tokio::join!(lock(1, 2), lock(2, 1));
    let error = a
        .err()
        .or(b.err())
        .expect("Postgres aborted one as a deadlock");
    let error = sas_store::StoreError::from(error);
    assert!(error.is_rolled_back(), "{error}");
    assert!(error.is_transient(), "{error}");
    let missing = sas_store::StoreError::from(
        sqlx::query("SELECT * FROM no_such_table")
            .execute(&env.db)
            .await
            .unwrap_err(),
    );
    assert!(!missing.is_rolled_back(), "{missing}");
}
