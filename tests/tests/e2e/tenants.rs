//! Tenants and trust against real processes (issue 47): two tenants'
//! clients over the gateway and over AMQP, each under a broker user of its
//! own made by deploy/rabbitmq/setup-users.sh, with the shipped workflows
//! (large_order's approval accepts only the role `approver`).
//!
//! - a client reads, probes, signals and squats none of another tenant's
//!   orders: each answer is as if the order did not exist, and an id it
//!   takes first is still free for the other tenant;
//! - a customer approving its own large order (over HTTP, over AMQP, and
//!   over AMQP with a forged sender header) is refused and the order still
//!   waits; the refusals are in its history, naming the sender; a
//!   manager's approval ends the wait, and the history names the manager;
//! - an approval from the customer before its order exists is refused at
//!   once, not kept for it;
//! - an order whose `reply_to` names another client's queue is refused,
//!   and that queue receives nothing;
//! - a workflow or priority the tenant may not use is refused at once over
//!   HTTP, and by intake over AMQP.

use std::time::Duration;

use reqwest::StatusCode;
use sas_broker::lapin::options::BasicGetOptions;
use sas_broker::lapin::types::{AMQPValue, FieldTable};
use sas_broker::lapin::BasicProperties;
use sas_broker::topology;
use sas_tests::process::free_port;
use sas_tests::{order, repo_root, wait_until, Setting, TestEnv};
use serde_json::{json, Value};
use sqlx::Connection as _;

use crate::security::{settings_as, try_declare, try_publish, BrokerUsers};

const SHOP: &str = "shop-secret-0123456789abcdef";
const RIVAL: &str = "rival-secret-0123456789abcdef";
const MANAGER: &str = "manager-secret-0123456789abcd";
const PLAIN: &str = "plain-secret-0123456789abcdef";

async fn call(
    method: reqwest::Method,
    url: String,
    secret: &str,
    body: Option<&Value>,
) -> (StatusCode, Value) {
    let mut request = sas_tests::http_client()
        .request(method, url)
        .bearer_auth(secret);
    if let Some(body) = body {
        request = request.json(body);
    }
    let response = request.send().await.expect("the gateway answers");
    (
        response.status(),
        response.json().await.unwrap_or(Value::Null),
    )
}

async fn history(env: &TestEnv, order_id: &str) -> Vec<(String, Option<String>)> {
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .expect("connect");
    sqlx::query_as("SELECT event, detail FROM history WHERE order_id = $1 ORDER BY id")
        .bind(order_id)
        .fetch_all(&mut db)
        .await
        .expect("read history")
}

pub(crate) async fn dead_letter_reasons(env: &TestEnv) -> Vec<String> {
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .expect("connect");
    sqlx::query_scalar("SELECT reason FROM dead_letters ORDER BY id")
        .fetch_all(&mut db)
        .await
        .expect("read dead_letters")
}

/// Waits until a dead letter's reason contains `text`.
async fn dead_lettered(env: &TestEnv, text: &str) -> String {
    wait_until(
        &format!("a dead letter saying {text:?}"),
        Duration::from_secs(20),
        || async {
            let reasons = dead_letter_reasons(env).await;
            reasons
                .iter()
                .find(|reason| reason.contains(text))
                .cloned()
                .ok_or_else(|| format!("{reasons:?}"))
        },
    )
    .await
}

/// Waits until `order_id`'s history holds a line `event` whose detail
/// contains `text`.
async fn in_history(env: &TestEnv, order_id: &str, event: &str, text: &str) -> String {
    wait_until(
        &format!("{order_id}'s history to hold {event} with {text:?}"),
        Duration::from_secs(20),
        || async {
            let lines = history(env, order_id).await;
            lines
                .iter()
                .find(|(e, detail)| {
                    e == event && detail.as_deref().is_some_and(|d| d.contains(text))
                })
                .and_then(|(_, detail)| detail.clone())
                .ok_or_else(|| format!("{lines:?}"))
        },
    )
    .await
}

fn event_body(order_id: &str, event_id: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({
        "schema_version": 1, "order_id": order_id, "name": "approved", "event_id": event_id,
    }))
    .unwrap()
}

fn as_user(user: &str) -> BasicProperties {
    BasicProperties::default()
        .with_delivery_mode(2)
        .with_user_id(user.into())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_sees_signals_and_squats_nothing_of_another_and_only_an_approver_approves() {
    // Alone on the broker while setup-users.sh runs rabbitmqctl.
    let env = TestEnv::exclusive(8000).await;
    let users = BrokerUsers::create(&env, &["gw", "shop", "mgr"]);
    let [gw_user, shop_user, mgr_user] = users.clients.clone().try_into().unwrap();
    let tenancy = std::env::temp_dir().join(format!("{}-tenants.toml", env.id));
    std::fs::write(
        &tenancy,
        format!(
            r#"
[tenants.shop]
members = ["gateway:shop", "gateway:manager", "amqp:{shop_user}", "amqp:{mgr_user}"]
workflows = ["order", "large_order"]
max_priority = 5

[tenants.rival]
members = ["gateway:rival"]

[tenants.default]
members = ["gateway:plain"]

[roles]
approver = ["gateway:manager", "amqp:{mgr_user}"]
"#
        ),
    )
    .unwrap();
    let tenancy_path = tenancy.display().to_string();
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(
        0,
        &[
            Setting::SchedulerWorkflowFile(String::new()),
            Setting::SchedulerWorkflowDir(repo_root().join("workflows").display().to_string()),
            Setting::SchedulerTenancyFile(tenancy_path.clone()),
            Setting::AmqpDelegatingUsers(gw_user.clone()),
        ],
    );
    let _supervisor = env.supervisor(0, &[Setting::AmqpDelegatingUsers(gw_user.clone())]);
    let port = free_port();
    let _gateway = env.spawn(
        "gateway",
        "gateway",
        &[
            Setting::Listen(port),
            Setting::GatewayClients(format!(
                "shop:{SHOP},rival:{RIVAL},manager:{MANAGER},plain:{PLAIN}"
            )),
            Setting::GatewayTenancyFile(tenancy_path),
            Setting::AmqpUrl(users.url(&gw_user)),
        ],
    );
    let base = format!("http://127.0.0.1:{port}");
    sas_tests::wait::wait_ready("the gateway", &base).await;
    let url = |path: &str| format!("{base}{path}");
    let post = reqwest::Method::POST;
    let get = reqwest::Method::GET;

    // shop submits a large order; it parks at the approval.
    let mut big = order("big-1");
    big.workflow = Some("large_order".into());
    let big = serde_json::to_value(&big).unwrap();
    let (status, body) = call(post.clone(), url("/v1/orders"), SHOP, Some(&big)).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    in_history(&env, "big-1@shop", "waiting", "waiting for event approved").await;
    let (status, body) = call(get.clone(), url("/v1/orders/big-1"), SHOP, None).await;
    assert_eq!(
        (status, body["order_id"].as_str()),
        (StatusCode::OK, Some("big-1")),
        "{body}"
    );
    assert!(
        history(&env, "big-1@shop").await[0]
            .1
            .as_deref()
            .is_some_and(|d| d == "submitted by gateway:shop"),
        "who submitted it is recorded"
    );

    // rival reads it, by its id and by the stored one: no such order.
    for path in ["/v1/orders/big-1", "/v1/orders/big-1@shop"] {
        let (status, body) = call(get.clone(), url(path), RIVAL, None).await;
        assert_eq!(status, StatusCode::NOT_FOUND, "{path}: {body}");
    }
    // rival "approves" it: taken (202, as for any id), and it reaches
    // rival's own id space, not shop's order.
    let (status, body) = call(
        post.clone(),
        url("/v1/orders/big-1/events"),
        RIVAL,
        Some(&json!({"schema_version": 1, "name": "approved", "event_id": "rival-1"})),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");

    // shop approves its own order, over HTTP: refused at once (the rule
    // the scheduler follows), and nothing is sent.
    let (status, body) = call(
        post.clone(),
        url("/v1/orders/big-1/events"),
        SHOP,
        Some(&json!({"schema_version": 1, "name": "approved", "event_id": "self-http"})),
    )
    .await;
    assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
    assert_eq!(
        body["error"],
        "the wait at step approval of order big-1 accepts approved only from role:approver, and gateway:shop is none of these: nothing was sent; send it as one of them (the tenancy file gives roles and tenants)",
        "{body}"
    );

    // Over AMQP as shop's broker user, and with a forged sender header
    // naming the manager: both are shop's, both refused.
    let shop = sas_broker::connect(&settings_as(&env, users.url(&shop_user)), "shop")
        .await
        .expect("shop logs in");
    let events = topology::events_exchange(&env.amqp());
    try_publish(
        &shop,
        &events,
        "",
        &event_body("big-1", "self-amqp"),
        as_user(&shop_user),
    )
    .await
    .expect("published");
    let mut forged = FieldTable::default();
    forged.insert(
        sas_messages::headers::SENDER.into(),
        AMQPValue::LongString("gateway:manager".into()),
    );
    try_publish(
        &shop,
        &events,
        "",
        &event_body("big-1", "self-forged"),
        as_user(&shop_user).with_headers(forged),
    )
    .await
    .expect("published");
    for id in ["self-amqp", "self-forged"] {
        let refused = in_history(&env, "big-1@shop", "event_refused", id).await;
        assert!(
            refused.contains(&format!("from amqp:{shop_user}")),
            "{refused}"
        );
    }
    let (_, body) = call(get.clone(), url("/v1/orders/big-1"), SHOP, None).await;
    assert_eq!(body["state"], "pending", "still waiting: {body}");
    assert!(!sim
        .applied_per_key()
        .await
        .unwrap()
        .contains_key("big-1@shop:charge_payment"));

    // An approval from shop for an order it has not submitted yet is
    // refused at once, not kept for it.
    try_publish(
        &shop,
        &events,
        "",
        &event_body("big-2", "early-self"),
        as_user(&shop_user),
    )
    .await
    .expect("published");
    let reason = dead_lettered(&env, "early-self").await;
    assert!(reason.contains("event refused"), "{reason}");

    // The manager approves: the order runs, and the history names them.
    let (status, body) = call(
        post.clone(),
        url("/v1/orders/big-1/events"),
        MANAGER,
        Some(&json!({"schema_version": 1, "name": "approved", "event_id": "mgr-1"})),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let (status, body) = call(get.clone(), url("/v1/orders/big-1?wait=30"), SHOP, None).await;
    assert_eq!(
        (status, body["outcome"].as_str()),
        (StatusCode::OK, Some("processed")),
        "{body}"
    );
    let ended = in_history(&env, "big-1@shop", "wait_ended", "mgr-1").await;
    assert!(ended.contains("from gateway:manager"), "{ended}");
    // rival's "approval" never reached shop's order, not even to be
    // refused there: not in its mailbox, not in its history.
    let (kept,): (i64,) = sqlx::query_as(
        "SELECT count(*) FROM order_events WHERE order_id = 'big-1@shop' AND event_id = 'rival-1'",
    )
    .fetch_one(&env.db)
    .await
    .unwrap();
    assert_eq!(kept, 0, "rival's event reached shop's mailbox");
    assert!(
        !history(&env, "big-1@shop")
            .await
            .iter()
            .any(|(_, detail)| detail.as_deref().is_some_and(|d| d.contains("rival-1"))),
        "rival's event reached shop's order"
    );

    // rival squats an id first: shop's order of that id is shop's own.
    let mut squat = order("ord-squat");
    squat.amount_cents = 1;
    let (status, body) = call(
        post.clone(),
        url("/v1/orders"),
        RIVAL,
        Some(&serde_json::to_value(&squat).unwrap()),
    )
    .await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let mine = serde_json::to_value(order("ord-squat")).unwrap();
    let (status, body) = call(post.clone(), url("/v1/orders"), SHOP, Some(&mine)).await;
    assert_eq!(
        status,
        StatusCode::ACCEPTED,
        "not a conflict with rival's: {body}"
    );
    for (secret, tenant) in [(SHOP, "shop"), (RIVAL, "rival")] {
        let (status, body) = call(
            get.clone(),
            url("/v1/orders/ord-squat?wait=30"),
            secret,
            None,
        )
        .await;
        assert_eq!(
            (status, body["outcome"].as_str()),
            (StatusCode::OK, Some("processed")),
            "{tenant}: {body}"
        );
    }
    let applied = sim.applied_per_key().await.unwrap();
    for key in [
        "ord-squat@shop:charge_payment",
        "ord-squat@rival:charge_payment",
    ] {
        assert_eq!(applied.get(key).copied(), Some(1), "{key}: {applied:?}");
    }

    // What the tenant may not start: refused at once over HTTP...
    let mut ret = order("ret-1");
    ret.workflow = Some("return".into());
    ret.attributes = json!({"refund_cents": 100, "reason": "damaged"})
        .as_object()
        .cloned();
    let mut urgent = order("urgent-1");
    urgent.priority = Some(9);
    for (refused, says) in [
        (&ret, "may not start workflow \"return\""),
        (&urgent, "priority 5 at most"),
    ] {
        let (status, body) = call(
            post.clone(),
            url("/v1/orders"),
            SHOP,
            Some(&serde_json::to_value(refused).unwrap()),
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{body}");
        assert!(body["error"].as_str().unwrap().contains(says), "{body}");
    }
    // A refund over the return workflow's maximum: refused at once (400),
    // naming the path, for a tenant that may start returns.
    let mut large_refund = ret.clone();
    large_refund.attributes = json!({"refund_cents": 100_001, "reason": "damaged"})
        .as_object()
        .cloned();
    let (status, body) = call(
        post.clone(),
        url("/v1/orders"),
        RIVAL,
        Some(&serde_json::to_value(&large_refund).unwrap()),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("at /refund_cents: 100001 is greater than the maximum of 100000"),
        "{body}"
    );
    // ...and by intake over AMQP.
    let orders = topology::orders_exchange(&env.amqp());
    try_publish(
        &shop,
        &orders,
        "",
        &serde_json::to_vec(&ret).unwrap(),
        as_user(&shop_user),
    )
    .await
    .expect("published");
    dead_lettered(&env, "may not start workflow \"return\"").await;
    // That refusal (of shop's ret-1) is not the default tenant's ret-1's:
    // its client hears of no order, not of shop's refusal.
    let (status, body) = call(get.clone(), url("/v1/orders/ret-1"), PLAIN, None).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");

    // A key naming another tenant ('@') is refused, over HTTP and AMQP.
    let (status, body) = call(
        post.clone(),
        url("/v1/correlation-keys/pay-7@rival/events"),
        SHOP,
        Some(&json!({"schema_version": 1, "name": "approved", "event_id": "key-1"})),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    let keyed = serde_json::to_vec(&json!({
        "schema_version": 1, "correlation_key": "pay-7@rival", "name": "approved", "event_id": "key-2",
    }))
    .unwrap();
    try_publish(&shop, &events, "", &keyed, as_user(&shop_user))
        .await
        .expect("published");
    let reason = dead_lettered(&env, "with '@'").await;
    assert!(reason.contains(&format!("amqp:{shop_user}")), "{reason}");

    // A reply_to naming the manager's queue: refused, and that queue
    // receives nothing, not even the refusal.
    let mgr = sas_broker::connect(&settings_as(&env, users.url(&mgr_user)), "mgr")
        .await
        .expect("the manager logs in");
    let mgr_queue = format!("{}sas.client.{mgr_user}.statuses", env.prefix);
    try_declare(&mgr, &mgr_queue).await.expect("its own queue");
    let mut misdirected = order("ord-misdirected");
    misdirected.reply_to = Some(mgr_queue.clone());
    try_publish(
        &shop,
        &orders,
        "",
        &serde_json::to_vec(&misdirected).unwrap(),
        as_user(&shop_user),
    )
    .await
    .expect("published");
    let reason = dead_lettered(&env, "is not one of your queues").await;
    assert!(reason.contains(&mgr_queue), "{reason}");
    let channel = mgr.create_channel().await.unwrap();
    let got = channel
        .basic_get(mgr_queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap();
    assert!(got.is_none(), "the manager's queue received a message");
    let _ = std::fs::remove_file(&tenancy);
}
