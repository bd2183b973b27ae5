//! The HTTP gateway end to end, against a running system: a client with a
//! hashed secret submits an order over HTTP, waits for its outcome and
//! reads it; the same order again is answered where to look, another order
//! under the same id is a conflict, a bad order names its field, a client
//! without its secret or with a wrong one is refused (and slowed down), and
//! the OpenAPI document is served as checked in. A broker that does not
//! confirm makes a submission answer 503, and the same submission sent
//! again, once it does, runs the order once.

use std::time::Duration;

use reqwest::StatusCode;
use sas_tests::process::{bin_dir, free_port, hash_secret, wait_for_metric, Service};
use sas_tests::proxy::AmqpProxy;
use sas_tests::Setting;
use sas_tests::{order, TestEnv};
use serde_json::{json, Value};

pub(crate) const SECRET: &str = "shop-client-secret-0123456789";

/// Starts the gateway with the client `shop` (its secret hashed) plus
/// `vars`; returns it and its base URL once it is ready.
pub(crate) async fn gateway(env: &TestEnv, vars: &[Setting]) -> (Service, String) {
    let port = free_port();
    let mut all = vec![
        Setting::Listen(port),
        Setting::GatewayClients(format!("shop:{}", hash_secret("gateway", SECRET).unwrap())),
    ];
    all.extend(vars.iter().cloned());
    let service = env.spawn("gateway", "gateway", &all);
    let base = format!("http://127.0.0.1:{port}");
    sas_tests::wait::wait_ready("the gateway", &base).await;
    (service, base)
}

async fn post(
    base: &str,
    secret: Option<&str>,
    body: &Value,
) -> (StatusCode, Option<String>, Value) {
    let mut request = sas_tests::http_client()
        .post(format!("{base}/v1/orders"))
        .json(body);
    if let Some(secret) = secret {
        request = request.bearer_auth(secret);
    }
    let response = request.send().await.expect("the gateway answers");
    let status = response.status();
    let location = response
        .headers()
        .get("location")
        .map(|value| value.to_str().unwrap().to_owned());
    (
        status,
        location,
        response.json().await.unwrap_or(Value::Null),
    )
}

async fn get(base: &str, path: &str) -> (StatusCode, Value) {
    let response = sas_tests::http_client()
        .get(format!("{base}{path}"))
        .bearer_auth(SECRET)
        .send()
        .await
        .expect("the gateway answers");
    (
        response.status(),
        response.json().await.unwrap_or(Value::Null),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn an_order_submitted_over_http_runs_once_and_its_outcome_is_read_back() {
    let env = TestEnv::new().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (_gateway, base) = gateway(&env, &[Setting::GatewayLoginFailuresPerMinute(3)]).await;
    let submitted = serde_json::to_value(order("ord-http-1")).unwrap();

    // Accepted, with where to look.
    let (status, location, body) = post(&base, Some(SECRET), &submitted).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    assert_eq!(location.as_deref(), Some("/v1/orders/ord-http-1"));
    assert_eq!(body["status"], "accepted");
    assert_eq!(body["status_url"], "/v1/orders/ord-http-1");

    // Its outcome, waited for.
    let (status, outcome) = get(&base, "/v1/orders/ord-http-1?wait=30").await;
    assert_eq!(status, StatusCode::OK, "{outcome}");
    assert_eq!(outcome["outcome"], "processed", "{outcome}");
    let steps: Vec<_> = outcome["steps"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| {
            (
                s["state"].as_str().unwrap().to_owned(),
                s["attempts"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(steps.len(), 3);
    assert!(
        steps
            .iter()
            .all(|(state, attempts)| state == "completed" && *attempts == 1),
        "{steps:?}"
    );

    // The same order again: where to look, nothing run twice.
    let (status, location, body) = post(&base, Some(SECRET), &submitted).await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["status"], "already_accepted");
    assert_eq!(location.as_deref(), Some("/v1/orders/ord-http-1"));
    let applied = sim.applied_per_key().await.unwrap();
    for step in ["reserve_stock", "charge_payment", "create_shipment"] {
        assert_eq!(
            applied.get(&format!("ord-http-1:{step}")).copied(),
            Some(1),
            "{applied:?}"
        );
    }

    // Another order under the same id.
    let mut other = submitted.clone();
    other["amount_cents"] = json!(1);
    let (status, _, body) = post(&base, Some(SECRET), &other).await;
    assert_eq!(status, StatusCode::CONFLICT, "{body}");
    assert!(
        body["error"].as_str().unwrap().contains("other content"),
        "{body}"
    );

    // Bad orders name what is wrong, as intake does.
    let mut zero = serde_json::to_value(order("ord-http-bad")).unwrap();
    zero["items"][0]["quantity"] = json!(0);
    let (status, _, body) = post(&base, Some(SECRET), &zero).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("items[0].quantity"),
        "{body}"
    );
    let mut unknown = serde_json::to_value(order("ord-http-bad")).unwrap();
    unknown["shipping_adress"] = json!("typo");
    let (status, _, body) = post(&base, Some(SECRET), &unknown).await;
    assert_eq!(status, StatusCode::BAD_REQUEST);
    assert!(
        body["error"].as_str().unwrap().contains("shipping_adress"),
        "{body}"
    );
    let (status, body) = get(&base, "/v1/orders/ord-http-bad").await;
    assert_eq!(
        status,
        StatusCode::NOT_FOUND,
        "a refused order is not stored: {body}"
    );

    // A workflow no scheduler runs: refused at once, as intake would.
    let mut no_such_workflow = serde_json::to_value(order("ord-http-nowhere")).unwrap();
    no_such_workflow["workflow"] = json!("no_such_workflow");
    let (status, _, body) = post(&base, Some(SECRET), &no_such_workflow).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("unknown workflow \"no_such_workflow\": this deployment runs order"),
        "{body}"
    );

    // One only intake can refuse (attributes the state store cannot keep)
    // is accepted, and then read back as rejected, with intake's reason,
    // rather than "not stored yet" for ever.
    let mut unstorable = serde_json::to_value(order("ord-http-nul")).unwrap();
    unstorable["attributes"] = json!({ "note": "a\u{0}b" });
    let (status, _, body) = post(&base, Some(SECRET), &unstorable).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let (status, body) = get(&base, "/v1/orders/ord-http-nul?wait=30").await;
    assert_eq!(status, StatusCode::UNPROCESSABLE_ENTITY, "{body}");
    assert_eq!(body["state"], "rejected", "{body}");
    assert!(
        body["reason"]
            .as_str()
            .unwrap()
            .contains("attributes hold a NUL character"),
        "{body}"
    );

    // The OpenAPI document, open to all, is the one checked in.
    let served: Value = sas_tests::http_client()
        .get(format!("{base}/v1/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let checked_in: Value = serde_json::from_str(
        &std::fs::read_to_string(bin_dir().join("../../contract/openapi.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(served, checked_in);

    // No secret, a wrong one: 401; three wrong ones: 429 even for the right one.
    let (status, _, _) = post(&base, None, &submitted).await;
    assert_eq!(status, StatusCode::UNAUTHORIZED);
    for _ in 0..3 {
        let (status, _, _) = post(&base, Some("not-the-client-secret-0123"), &submitted).await;
        assert_eq!(status, StatusCode::UNAUTHORIZED);
    }
    let (status, _, body) = post(&base, Some(SECRET), &submitted).await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_submission_the_broker_does_not_confirm_is_a_503_and_safe_to_send_again() {
    let env = TestEnv::new().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &[]);
    let proxy = AmqpProxy::start(&env.amqp_url).await;
    let (_gateway, base) = gateway(
        &env,
        &[
            Setting::AmqpUrl(proxy.url(&env.amqp_url)),
            Setting::GatewayPublishTimeoutMs(1500),
        ],
    )
    .await;
    let submitted = serde_json::to_value(order("ord-http-unconfirmed")).unwrap();
    proxy.swallow_confirms(true);
    let (status, _, body) = post(&base, Some(SECRET), &submitted).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("send the same order again"),
        "{body}"
    );
    assert!(proxy.confirms_swallowed() > 0);
    // The order may have reached its queue all the same: sending it again
    // once the broker confirms is safe.
    proxy.swallow_confirms(false);
    let (status, _, body) = post(&base, Some(SECRET), &submitted).await;
    assert!(
        status == StatusCode::ACCEPTED || status == StatusCode::OK,
        "{status} {body}"
    );
    let (status, outcome) = get(&base, "/v1/orders/ord-http-unconfirmed?wait=30").await;
    assert_eq!(status, StatusCode::OK, "{outcome}");
    assert_eq!(outcome["outcome"], "processed", "{outcome}");
    let applied = sim.applied_per_key().await.unwrap();
    assert_eq!(
        applied.get("ord-http-unconfirmed:charge_payment").copied(),
        Some(1),
        "charged once: {applied:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_gateway_started_before_the_scheduler_declared_the_orders_exchange_takes_orders_once_it_is_there(
) {
    let env = TestEnv::new().await;
    // No scheduler yet: the orders exchange does not exist, and RabbitMQ
    // closes the channel of a publish to it.
    let (_gateway, base) = gateway(&env, &[Setting::GatewayPublishTimeoutMs(1500)]).await;
    let submitted = serde_json::to_value(order("ord-http-early")).unwrap();
    let (status, _, body) = post(&base, Some(SECRET), &submitted).await;
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
    let error = body["error"].as_str().unwrap();
    assert!(
        error.contains("no exchange"),
        "says what is missing: {body}"
    );
    assert!(error.contains("send the same order again"), "{body}");

    // The topology declared (as the scheduler does when it starts), the
    // same gateway takes the order: its closed channel was replaced.
    let (_connection, _publisher) = env.broker().await;
    let (status, _, body) = post(&base, Some(SECRET), &submitted).await;
    assert_eq!(status, StatusCode::ACCEPTED, "{body}");
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &[]);
    let (status, outcome) = get(&base, "/v1/orders/ord-http-early?wait=30").await;
    assert_eq!(status, StatusCode::OK, "{outcome}");
    assert_eq!(outcome["outcome"], "processed", "{outcome}");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_client_holds_at_most_its_share_of_waiting_reads() {
    let env = TestEnv::new().await;
    let (_gateway, base) = gateway(&env, &[Setting::GatewayMaxLongPollsPerClient(1)]).await;
    let port: u16 = base.rsplit(':').next().unwrap().parse().unwrap();
    // One waiting read of an order that never comes holds the one place.
    let holding = tokio::spawn({
        let base = base.clone();
        async move { get(&base, "/v1/orders/ord-poll-never?wait=4").await }
    });
    wait_for_metric(
        "one waiting read open",
        port,
        r#"sas_gateway_long_polls{client="shop"}"#,
        Duration::from_secs(10),
        |open| open == 1.0,
    )
    .await;
    // A second waiting read is refused at once; a plain read is not counted.
    let (status, body) = get(&base, "/v1/orders/ord-poll-never?wait=4").await;
    assert_eq!(status, StatusCode::TOO_MANY_REQUESTS, "{body}");
    assert!(
        body["error"]
            .as_str()
            .unwrap()
            .contains("gateway.max_long_polls_per_client"),
        "{body}"
    );
    let (status, _) = get(&base, "/v1/orders/ord-poll-never").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // Answered, the first frees its place.
    let (status, _) = holding.await.unwrap();
    assert_eq!(status, StatusCode::NOT_FOUND);
    let (status, body) = get(&base, "/v1/orders/ord-poll-never?wait=1").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{body}");
}

/// Sends `head` on a raw connection and returns what the server answers
/// before it closes the connection, and how long it took (at most 30 s).
async fn raw_exchange(port: u16, head: &[u8]) -> (String, Duration) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let started = std::time::Instant::now();
    let mut stream = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .expect("connect");
    stream.write_all(head).await.expect("write");
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer)).await;
    assert!(
        read.is_ok(),
        "the gateway kept a trickling connection open for 30 s"
    );
    (
        String::from_utf8_lossy(&answer).into_owned(),
        started.elapsed(),
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn the_gateway_holds_under_abuse_without_locking_out_other_clients() {
    let env = TestEnv::new().await;
    let (port, ops_port) = (free_port(), free_port());
    let rival = "rival-client-secret-0123456789";
    let _gateway = env.spawn(
        "gateway",
        "gateway",
        &[
            Setting::Listen(port),
            Setting::GatewayClients(format!("shop:{SECRET},rival:{rival}")),
            Setting::GatewayLoginFailuresPerMinute(3),
            Setting::GatewayOpsListen(format!("127.0.0.1:{ops_port}")),
        ],
    );
    let ops = format!("http://127.0.0.1:{ops_port}");
    sas_tests::wait::wait_ready("the gateway", &ops).await;
    let base = format!("http://127.0.0.1:{port}");
    let read = |secret: String| {
        let base = base.clone();
        async move {
            sas_tests::http_client()
                .get(format!("{base}/v1/orders/nothing-here"))
                .bearer_auth(secret)
                .send()
                .await
                .expect("the gateway answers")
                .status()
        }
    };

    // /metrics and /readyz live on the operators' port only.
    for path in ["/metrics", "/readyz"] {
        let status = sas_tests::http_client()
            .get(format!("{base}{path}"))
            .send()
            .await
            .unwrap()
            .status();
        assert_eq!(status, StatusCode::NOT_FOUND, "{path} on the clients' port");
    }
    let metrics = sas_tests::http_client()
        .get(format!("{ops}/metrics"))
        .send()
        .await
        .unwrap();
    assert_eq!(metrics.status(), StatusCode::OK);

    // Someone guesses shop's secret from this address, by name: shop is
    // blocked from here, rival (same address) is not, nor is a bare secret.
    for _ in 0..3 {
        assert_eq!(read("shop:guess".into()).await, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(
        read(format!("shop:{SECRET}")).await,
        StatusCode::TOO_MANY_REQUESTS,
        "shop is blocked from this address"
    );
    assert_eq!(read(format!("rival:{rival}")).await, StatusCode::NOT_FOUND);
    assert_eq!(read(rival.to_owned()).await, StatusCode::NOT_FOUND);
    // Bare wrong secrets block bare secrets from this address; rival, by
    // name, still gets in.
    for _ in 0..3 {
        assert_eq!(read("guess".into()).await, StatusCode::UNAUTHORIZED);
    }
    assert_eq!(read(rival.to_owned()).await, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(read(format!("rival:{rival}")).await, StatusCode::NOT_FOUND);

    // Headers that trickle: the connection is closed, not held.
    let (answer, took) = raw_exchange(port, b"GET /v1/orders/x HTTP/1.1\r\nHost: a\r\n").await;
    assert!(
        took >= Duration::from_secs(9),
        "closed after {took:?}: {answer}"
    );
    // A body that trickles: 408.
    let head = format!(
        "POST /v1/orders HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer rival:{rival}\r\n\
         Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{{\"schema"
    );
    let (answer, _) = raw_exchange(port, head.as_bytes()).await;
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
}
