//! Undone only after it was done, and "undone" only with proof: every road
//! to an undo against remotes whose late actions are real.
//!
//! remote-sim applies a call when it arrives. To show an action landing
//! after the agent gave up on it, the payment agent calls through a proxy
//! ([`sas_tests::http_proxy::HoldProxy`]) that holds every charge longer
//! than its step's deadline and forwards it even after the agent hung up;
//! remote-sim runs as a strict provider without tombstones (an undo of what
//! it never applied is answered 404, and an action that arrives later is
//! applied all the same). A second fake ([`sas_tests::strict_remote`])
//! charges at once, answers after the agent's call timeout, and refunds
//! only by the charge's real id.

use std::time::Duration;

use sas_store::machine::{AlertKind, HistoryEvent};
use sas_store::ProcessState;
use sas_tests::http_proxy::HoldProxy;
use sas_tests::sim::SimClient;
use sas_tests::strict_remote::StrictPayments;
use sas_tests::{order, wait_until, Service, Setting, TestEnv};
use serde_json::json;

/// Every fault rate zero, `latency_ms` of latency; with `refusing`, every
/// action refused for good.
fn faults(latency_ms: u64, refusing: bool) -> serde_json::Value {
    json!({ "latency_ms": latency_ms, "transient_fault_rate": 0.0,
            "permanent_fault_rate": if refusing { 1.0 } else { 0.0 }, "hang_rate": 0.0 })
}

/// remote-sim as a strict provider without tombstones: 409 while a key is
/// in flight, 404 to the undo of what it never applied, and an action that
/// arrives after its undo applied all the same (most payment APIs).
async fn strict_sim(env: &TestEnv) -> (Service, SimClient) {
    let (process, sim) = env.remote_sim(&[]).await;
    sim.set_provider(json!({ "mode": "strict", "late_action": "apply" }))
        .await
        .unwrap();
    (process, sim)
}

/// The payment agent calling `sim` through `proxy`, with `settings`.
fn payment_through(
    env: &TestEnv,
    sim: &SimClient,
    proxy: &HoldProxy,
    settings: &[Setting],
) -> Service {
    let mut all = vec![Setting::AgentRemoteUrl(format!("{}/payment", proxy.url()))];
    all.extend_from_slice(settings);
    env.agent("payment", 0, sim, &all)
}

/// The inventory and shipping agents, straight to `sim`.
fn other_agents(env: &TestEnv, sim: &SimClient, settings: &[Setting]) -> Vec<Service> {
    ["inventory", "shipping"]
        .into_iter()
        .map(|agent| env.agent(agent, 0, sim, settings))
        .collect()
}

/// Waits until `order_id` has ended, and returns how.
async fn ended(env: &TestEnv, order_id: &str, within: Duration) -> ProcessState {
    wait_until(&format!("{order_id} to end"), within, || async {
        match env.state_of(order_id).await {
            Some(state) if state.is_terminal() => Ok(state),
            other => Err(format!("{other:?}")),
        }
    })
    .await
}

/// Waits until the proxy has received `n` charges.
async fn charges_arrived(proxy: &HoldProxy, n: usize) {
    wait_until(
        &format!("{n} charges at the proxy"),
        Duration::from_secs(20),
        || async {
            let arrived = proxy
                .journal()
                .iter()
                .filter(|p| p.path == "/payment/charge")
                .count();
            if arrived >= n {
                Ok(())
            } else {
                Err(format!("{arrived}"))
            }
        },
    )
    .await;
}

/// remote-sim's ledger: the charge of `order_id` was applied, and refunded
/// after it (and no undo of the order landed before its action).
async fn charged_then_refunded(sim: &SimClient, order_id: &str) {
    sim.assert_no_undo_before_its_action().await;
    let applied = sim.applied_at().await;
    let charge = format!("{order_id}:charge_payment");
    let charged = applied
        .get(&charge)
        .unwrap_or_else(|| panic!("{charge} never applied: {applied:?}"));
    let refunded = applied
        .get(&format!("{charge}:undo"))
        .unwrap_or_else(|| panic!("{charge} applied at {charged} and never refunded"));
    assert!(
        refunded > charged,
        "refunded at {refunded}, before the charge at {charged}"
    );
}

/// An operator cancels an order while its charge is held on the way to the
/// remote, past the step's deadline (4 s of a 3 s step). The refund waits
/// for the charge's deadline plus the grace (5 s): the charge landed at 4 s,
/// and the refund undoes it. Before, the refund went at the deadline (3 s),
/// was answered 404 "never applied", counted as undone, and the charge that
/// landed a second later was never refunded.
#[tokio::test(flavor = "multi_thread")]
async fn an_operators_cancel_while_the_charge_is_held_refunds_it_only_after_it_landed() {
    let env = TestEnv::with_step_timeout(3000).await;
    let grace = [Setting::DeadlinesGraceMs(2000)];
    let (_sim_process, sim) = strict_sim(&env).await;
    let proxy = HoldProxy::start(sim.base_url()).await;
    proxy.hold("POST", "/payment/charge", Duration::from_secs(4));
    let _payment = payment_through(&env, &sim, &proxy, &[]);
    let _others = other_agents(&env, &sim, &[]);
    let _scheduler = env.scheduler(0, &grace);
    let _supervisor = env.supervisor(0, &grace);
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("held-cancel")).await;
    charges_arrived(&proxy, 1).await;
    let (code, out) = env
        .sasctl(&["cancel", "held-cancel", "--reason", "customer asked"])
        .await;
    assert_eq!(code, 0, "{out}");
    let state = ended(&env, "held-cancel", Duration::from_secs(30)).await;
    // The held charge has landed before the ledger is read.
    proxy.wait_forwarded(1, Duration::from_secs(10)).await;
    assert_eq!(state, ProcessState::Compensated);
    charged_then_refunded(&sim, "held-cancel").await;
    let history = env.store.reads().history("held-cancel").await.unwrap();
    assert!(
        history.iter().any(|h| h.event == HistoryEvent::UndoWaits),
        "the cancel said the refund waits for the charge: {history:#?}"
    );
    let at = |event: HistoryEvent| {
        history
            .iter()
            .find(|h| h.event == event && h.step.as_deref() == Some("charge_payment"))
            .unwrap_or_else(|| panic!("no {event} of the charge: {history:#?}"))
            .at
    };
    let (charged, refunded) = (
        at(HistoryEvent::Dispatched),
        at(HistoryEvent::CompensationDispatched),
    );
    assert!(
        refunded >= charged + chrono::Duration::milliseconds(5000),
        "the refund was sent at {refunded}, before the charge's deadline and the grace (dispatched {charged})"
    );
}

/// The same held charge, and its request dead-lettered by RabbitMQ's
/// delivery limit (1 here): the payment agent is killed -9 while its call
/// is held, twice, so the request comes back past the limit. A call of it
/// may have left on the dead connection: the refund waits for the
/// deadline plus the grace, and undoes the charge that landed. Before, the
/// dead-lettered step itself was left out of the wait and refunded at once.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_lettered_request_whose_call_is_held_is_refunded_only_after_it_landed() {
    let env = TestEnv::with_step_timeout(3000).await;
    let limit = Setting::AmqpDeliveryLimit(1);
    let common = [limit.clone(), Setting::DeadlinesGraceMs(2000)];
    let (_sim_process, sim) = strict_sim(&env).await;
    let proxy = HoldProxy::start(sim.base_url()).await;
    proxy.hold("POST", "/payment/charge", Duration::from_secs(4));
    let _others = other_agents(&env, &sim, std::slice::from_ref(&limit));
    let _scheduler = env.scheduler(0, &common);
    let _supervisor = env.supervisor(0, &common);
    let (_connection, publisher) = env
        .broker_with(sas_broker::AmqpSettings {
            delivery_limit: 1,
            ..env.amqp()
        })
        .await;
    env.publish_order(&publisher, &order("held-dead")).await;
    for n in 1..=2 {
        let mut payment = payment_through(&env, &sim, &proxy, std::slice::from_ref(&limit));
        charges_arrived(&proxy, n).await;
        payment.kill9().await;
    }
    env.wait_for_dead_letters(1, Duration::from_secs(20)).await;
    // An agent for the refund (the charge is held no more).
    proxy.clear_holds();
    let _payment = payment_through(&env, &sim, &proxy, &[limit]);
    let state = ended(&env, "held-dead", Duration::from_secs(30)).await;
    proxy.wait_forwarded(2, Duration::from_secs(10)).await;
    assert_eq!(state, ProcessState::Compensated);
    charged_then_refunded(&sim, "held-dead").await;
    let letters = env.store.reads().dead_letters(10).await.unwrap();
    assert!(
        letters
            .iter()
            .any(|l| l.order_id.as_deref() == Some("held-dead")
                && l.reason.contains("delivery_limit")),
        "{letters:?}"
    );
}

/// A workflow whose charge and shipment run side by side: the shipment is
/// refused at once while the charge is held on its way (4 s of a 3 s
/// step). The refund waits for the charge's deadline plus the grace, and
/// undoes the charge that landed; the reservation is released after it.
#[tokio::test(flavor = "multi_thread")]
async fn a_group_member_refused_while_the_charge_is_held_has_it_refunded_only_after_it_landed() {
    let env = TestEnv::with_step_timeout(3000).await;
    let mut workflow = String::from("name = \"order\"\nversion = 1\n");
    workflow.push_str(&env.call_step(("reserve_stock", "inventory", "reserve", "release"), None));
    workflow.push_str(&env.call_step(
        ("charge_payment", "payment", "charge", "refund"),
        Some("pay_and_ship"),
    ));
    workflow.push_str(&env.call_step(
        ("create_shipment", "shipping", "ship", "cancel"),
        Some("pay_and_ship"),
    ));
    let mut scheduler_settings = env.workflows(&[("order.toml", &workflow)]).to_vec();
    scheduler_settings.push(Setting::DeadlinesGraceMs(2000));
    let (_sim_process, sim) = strict_sim(&env).await;
    sim.set_faults(Some("shipping"), faults(0, true))
        .await
        .unwrap();
    let proxy = HoldProxy::start(sim.base_url()).await;
    proxy.hold("POST", "/payment/charge", Duration::from_secs(4));
    let _payment = payment_through(&env, &sim, &proxy, &[]);
    let _others = other_agents(&env, &sim, &[]);
    let _scheduler = env.scheduler(0, &scheduler_settings);
    let _supervisor = env.supervisor(0, &[Setting::DeadlinesGraceMs(2000)]);
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("held-group")).await;
    let state = ended(&env, "held-group", Duration::from_secs(30)).await;
    proxy.wait_forwarded(1, Duration::from_secs(10)).await;
    assert_eq!(state, ProcessState::Compensated);
    charged_then_refunded(&sim, "held-group").await;
    assert_eq!(
        sim.applied_keys("held-group").await,
        [
            "held-group:reserve_stock",
            "held-group:charge_payment",
            "held-group:charge_payment:undo",
            "held-group:reserve_stock:undo"
        ]
    );
}

/// A charge held past its deadline and the grace (6 s of a 3 s step, 0.6 s
/// of grace): the refund goes at 3.6 s, before the charge lands, and is
/// answered 404. A 404 proves nothing was undone, so the order ends in
/// `error` with an alert naming the step, the route and the answer, never
/// `compensated`; the operator learns of the charge that landed at 6 s.
/// Before, the 404 counted as "nothing to undo".
#[tokio::test(flavor = "multi_thread")]
async fn a_404_to_a_refund_is_no_proof_and_the_order_ends_in_error_with_an_alert() {
    let env = TestEnv::with_step_timeout(3000).await;
    let (_sim_process, sim) = strict_sim(&env).await;
    let proxy = HoldProxy::start(sim.base_url()).await;
    proxy.hold("POST", "/payment/charge", Duration::from_secs(6));
    let _payment = payment_through(&env, &sim, &proxy, &[]);
    let _others = other_agents(&env, &sim, &[]);
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("held-long")).await;
    charges_arrived(&proxy, 1).await;
    let (code, out) = env.sasctl(&["cancel", "held-long"]).await;
    assert_eq!(code, 0, "{out}");
    let state = ended(&env, "held-long", Duration::from_secs(30)).await;
    assert_eq!(
        state,
        ProcessState::Error,
        "a 404 to the refund is no proof"
    );
    let alerts = env.store.reads().alerts(false, 10).await.unwrap();
    let alert = alerts
        .iter()
        .find(|a| a.order_id.as_deref() == Some("held-long"))
        .expect("an alert for the order");
    assert_eq!(alert.kind, AlertKind::CompensationFailed);
    assert!(
        alert.message.contains("charge_payment")
            && alert.message.contains("/payment/refund")
            && alert.message.contains("404"),
        "{}",
        alert.message
    );
}

/// A compensation misspelt in the workflow (`refnud`): remote-sim answers
/// 404 "payment has no operation refnud". The order ends in `error` with an
/// alert naming the route, never `compensated` with the charge standing.
#[tokio::test(flavor = "multi_thread")]
async fn a_misspelt_compensation_leaves_the_order_in_error_with_an_alert_never_compensated() {
    let env = TestEnv::new().await;
    let mut workflow = String::from("name = \"order\"\nversion = 1\n");
    workflow.push_str(&env.call_step(("reserve_stock", "inventory", "reserve", "release"), None));
    workflow.push_str(&env.call_step(("charge_payment", "payment", "charge", "refnud"), None));
    workflow.push_str(&env.call_step(("create_shipment", "shipping", "ship", "cancel"), None));
    let scheduler_settings = env.workflows(&[("order.toml", &workflow)]);
    let (_sim_process, sim) = strict_sim(&env).await;
    sim.set_faults(Some("shipping"), faults(0, true))
        .await
        .unwrap();
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &scheduler_settings);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("misspelt")).await;
    let state = ended(&env, "misspelt", Duration::from_secs(30)).await;
    assert_eq!(state, ProcessState::Error);
    let alerts = env.store.reads().alerts(false, 10).await.unwrap();
    let alert = alerts
        .iter()
        .find(|a| a.order_id.as_deref() == Some("misspelt"))
        .expect("an alert for the order");
    assert!(
        alert.message.contains("refnud") && alert.message.contains("404"),
        "{}",
        alert.message
    );
    // The charge stands, and the alert says so: nothing claimed it undone.
    let applied = sim.applied_at().await;
    assert!(applied.contains_key("misspelt:charge_payment"));
    assert!(!applied.contains_key("misspelt:charge_payment:undo"));
}

/// A strict payment API that charges at once and answers only after the
/// agent's call timeout (retries meanwhile get 409), refunding by the
/// charge's id (`DELETE /charges/{id}`, known ids only). The charge and a
/// shipment run side by side; the shipment is refused at once, so the
/// order compensates while the charge's answer is still to come. The
/// answer, when the agent's retry gets it, is kept: the refund names the
/// real charge. Before, it was dropped as stale, and the refund had no id.
#[tokio::test(flavor = "multi_thread")]
async fn a_charge_answered_after_compensation_began_is_refunded_by_its_real_id() {
    let env = TestEnv::with_step_timeout(4000).await;
    let stub = StrictPayments::start(Duration::from_millis(1500)).await;
    let charge = format!(
        "{}[steps.request]\npath = \"/charges\"\n[steps.request.body]\namount_cents = \"${{/order/amount_cents}}\"\n\
         [steps.compensation_request]\nmethod = \"DELETE\"\npath = \"/charges/${{/results/charge_payment/id}}\"\n\n",
        env.call_step(("charge_payment", "payment", "charge", "refund"), Some("pay_and_ship"))
    );
    let workflow = format!(
        "name = \"order\"\nversion = 1\n{}{charge}{}",
        env.call_step(("reserve_stock", "inventory", "reserve", "release"), None),
        env.call_step(
            ("create_shipment", "shipping", "ship", "cancel"),
            Some("pay_and_ship")
        ),
    );
    let scheduler_settings = env.workflows(&[("order.toml", &workflow)]);
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(Some("shipping"), faults(0, true))
        .await
        .unwrap();
    let _payment = env.agent(
        "payment",
        0,
        &sim,
        &[
            Setting::AgentRemoteUrl(stub.url()),
            Setting::AgentCallTimeoutMs(500),
        ],
    );
    let _others = other_agents(&env, &sim, &[]);
    let _scheduler = env.scheduler(0, &scheduler_settings);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("late-id")).await;
    let state = ended(&env, "late-id", Duration::from_secs(30)).await;
    assert_eq!(state, ProcessState::Compensated);
    stub.assert_every_charge_refunded_after_it();
    let ledger = stub.ledger();
    assert_eq!(ledger.charges.len(), 1, "{ledger:?}");
    assert!(
        ledger.refusals.iter().all(|r| r.status != 404),
        "{ledger:?}"
    );
    let history = env.store.reads().history("late-id").await.unwrap();
    assert!(
        history
            .iter()
            .any(|h| h.event == HistoryEvent::StepCompleted
                && h.step.as_deref() == Some("charge_payment")
                && h.detail
                    .as_deref()
                    .is_some_and(|d| d.contains("after the order's compensation began"))),
        "the charge's answer came after compensation began and was kept: {history:#?}"
    );
}

/// A success reply that goes round the reply queue past its delivery limit
/// (here: no scheduler is up, and a consumer hands it back four times, as
/// schedulers stopping or waiting out a database outage do) is
/// dead-lettered by RabbitMQ. The supervisor reads it before it judges it:
/// a reply of the order's current attempt, from an agent, is applied as the
/// reply it is, its result kept, and the order runs on to `processed`.
/// Before, any dead-lettered reply compensated its order and lost the
/// result of the step that had succeeded.
#[tokio::test(flavor = "multi_thread")]
async fn a_dead_lettered_success_reply_is_applied_and_the_order_runs_on() {
    let env = TestEnv::new().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    // The reservation takes 1.5 s: time to stop the scheduler first.
    sim.set_faults(Some("inventory"), faults(1500, false))
        .await
        .unwrap();
    let _agents = env.agents(1, &sim, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let mut scheduler = env.scheduler(0, &[]);
    let (connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("dead-reply")).await;
    // The reservation reached the remote (applied at once, answered 1.5 s
    // later): its request was published. The order's row alone is stored
    // before that, and a kill then would lose the request, not the reply.
    sim.wait_applied("dead-reply:reserve_stock").await;
    scheduler.kill9().await;
    // A consumer of the reply queue that hands the reply back each time:
    // with a delivery limit of 3, the fourth return dead-letters it.
    let names = env.amqp().names();
    sas_tests::hand_back(&connection, &names.scheduler_replies(), 4).await;
    // The supervisor applied it and sent the charge; a scheduler takes the
    // replies again from here.
    let applied_by = wait_until(
        "the supervisor to apply the dead-lettered reply",
        Duration::from_secs(20),
        || async {
            let history = env
                .store
                .reads()
                .history("dead-reply")
                .await
                .map_err(|e| e.to_string())?;
            history
                .iter()
                .find(|h| {
                    h.event == HistoryEvent::StepCompleted
                        && h.step.as_deref() == Some("reserve_stock")
                })
                .map(|h| h.actor.clone())
                .ok_or_else(|| format!("{:?}", history.iter().map(|h| h.event).collect::<Vec<_>>()))
        },
    )
    .await;
    assert_eq!(applied_by, "supervisor-0");
    let _scheduler = env.scheduler(1, &[]);
    env.wait_for_state(
        "dead-reply",
        ProcessState::Processed,
        Duration::from_secs(30),
    )
    .await;
    let detail = env.detail("dead-reply").await;
    assert!(
        detail.steps[0].result.is_some(),
        "the reservation's result is kept"
    );
    let letters = env.store.reads().dead_letters(10).await.unwrap();
    assert!(
        letters
            .iter()
            .any(|l| l.order_id.as_deref() == Some("dead-reply")
                && l.reason.contains("delivery_limit")),
        "{letters:?}"
    );
    sim.assert_every_order_done_once().await;
}

/// A remote whose reservation and charge each answer 30 kB of JSON
/// (`/inventory/*`, `/payment/*`, `/shipping/*`, every operation applied),
/// counting the calls by path.
async fn wordy_remote() -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
    use axum::extract::Path;
    let calls = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let seen = calls.clone();
    let app = axum::Router::new().route(
        "/{service}/{operation}",
        axum::routing::post(move |Path((service, operation)): Path<(String, String)>| {
            let seen = seen.clone();
            async move {
                seen.lock().unwrap().push(format!("{service}/{operation}"));
                let pad = if matches!(operation.as_str(), "reserve" | "charge") {
                    "x".repeat(30_000)
                } else {
                    String::new()
                };
                axum::Json(json!({ "id": format!("{operation}-1"), "pad": pad }))
            }
        }),
    );
    let (port, _) = sas_tests::serve_locally(app).await;
    (format!("http://127.0.0.1:{port}"), calls)
}

/// Good answers too large to carry (30 kB, over `agent.max_answer_bytes`)
/// end the order cleanly: the agent refuses the reservation's answer for
/// good as maybe applied, the order is compensated, the reservation is
/// released once, nothing is dead-lettered. Before, two such answers made
/// the shipment's request, and every undo, too large for the broker: the
/// order ended in error, and a resubmission failed the same way.
#[tokio::test(flavor = "multi_thread")]
async fn answers_too_large_to_carry_end_the_order_undone_not_broken() {
    let env = TestEnv::new().await;
    let (url, calls) = wordy_remote().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents: Vec<Service> = ["inventory", "payment", "shipping"]
        .into_iter()
        .map(|agent| {
            env.agent(
                agent,
                0,
                &sim,
                &[Setting::AgentRemoteUrl(format!("{url}/{agent}"))],
            )
        })
        .collect();
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("wordy")).await;
    let state = ended(&env, "wordy", Duration::from_secs(30)).await;
    assert_eq!(state, ProcessState::Compensated);
    assert_eq!(
        *calls.lock().unwrap(),
        ["inventory/reserve", "inventory/release"],
        "the reservation answered too much, and was undone once"
    );
    let history = env.store.reads().history("wordy").await.unwrap();
    assert!(
        history
            .iter()
            .any(|h| h.event == HistoryEvent::CompensationStarted
                && h.detail
                    .as_deref()
                    .is_some_and(|d| d.contains("agent.max_answer_bytes"))),
        "the compensation says why: {history:#?}"
    );
    assert!(env.store.reads().dead_letters(10).await.unwrap().is_empty());
}

/// An order whose first step's request cannot be built (its template reads
/// an attribute the order does not have) is refused by the machine at
/// intake: nothing is sent, the order ends compensated at once with a
/// `request_not_built` alert naming the placeholder, and an order that has
/// the attribute, in the same batch, runs. Before, the intake statement
/// started the step the machine would not send, and the order waited for
/// its deadline.
#[tokio::test(flavor = "multi_thread")]
async fn an_order_whose_first_request_has_a_hole_is_refused_at_intake_with_an_alert() {
    let env = TestEnv::with_step_timeout(10_000).await;
    let reserve = format!(
        "{}[steps.request.body]\nwarehouse = \"${{/attributes/warehouse}}\"\n\n",
        env.call_step(("reserve_stock", "inventory", "reserve", "release"), None)
    );
    let workflow = format!(
        "name = \"order\"\nversion = 1\n{reserve}{}{}",
        env.call_step(("charge_payment", "payment", "charge", "refund"), None),
        env.call_step(("create_shipment", "shipping", "ship", "cancel"), None),
    );
    let scheduler_settings = env.workflows(&[("order.toml", &workflow)]);
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    let mut with = order("with-warehouse");
    with.attributes = Some(serde_json::from_value(json!({ "warehouse": "lyon" })).unwrap());
    env.publish_order(&publisher, &order("no-warehouse")).await;
    env.publish_order(&publisher, &with).await;
    // Both in one intake batch: the scheduler starts with them waiting.
    let _scheduler = env.scheduler(0, &scheduler_settings);
    let started = std::time::Instant::now();
    let state = ended(&env, "no-warehouse", Duration::from_secs(20)).await;
    assert_eq!(state, ProcessState::Compensated);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "refused at once, not at its deadline"
    );
    let history = env.store.reads().history("no-warehouse").await.unwrap();
    assert!(
        !history.iter().any(|h| h.event == HistoryEvent::Dispatched),
        "nothing was sent: {history:#?}"
    );
    let alerts = env.store.reads().alerts(false, 10).await.unwrap();
    let alert = alerts
        .iter()
        .find(|a| a.order_id.as_deref() == Some("no-warehouse"))
        .expect("an alert");
    assert_eq!(alert.kind, AlertKind::RequestNotBuilt);
    assert!(
        alert.message.contains("${/attributes/warehouse}"),
        "{}",
        alert.message
    );
    env.wait_for_state(
        "with-warehouse",
        ProcessState::Processed,
        Duration::from_secs(30),
    )
    .await;
    assert!(sim.applied_keys("no-warehouse").await.is_empty());
}
