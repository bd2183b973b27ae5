//! The contract between agents and real remote services: HTTPS with a CA of
//! the deployment's own, credentials, answers that are too large, not JSON or
//! hold U+0000, and an agent whose clock runs behind the database's.
//!
//! Also the order in which an agent serves the requests waiting for its
//! call slots.
//!
//! Most tests publish a `StepRequest` straight to the agent's queue, with
//! `reply_to` a queue of the test's own, and read the agent's `StepReply`
//! there: the agent's decision, without a scheduler in between.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::StreamExt;
use sas_broker::lapin::{Connection, Consumer};
use sas_broker::Publisher;
use sas_messages::{StepKind, StepOutcome, StepReply, StepRequest};
use sas_store::ProcessState;
use sas_tests::process::{free_port, wait_for_metric};
use sas_tests::sim::SimClient;
use sas_tests::Setting;
use sas_tests::{order, wait_until, Service, TestEnv};

/// A CA and a certificate it signed for 127.0.0.1, as PEM files in the
/// test's folder.
struct Pki {
    ca: std::path::PathBuf,
    ca_pem: String,
    cert: std::path::PathBuf,
    key: std::path::PathBuf,
}

fn make_ca(name: &str) -> (rcgen::Certificate, rcgen::KeyPair) {
    let key = rcgen::KeyPair::generate().expect("CA key");
    let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("CA params");
    params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    params
        .distinguished_name
        .push(rcgen::DnType::CommonName, name);
    params.key_usages = vec![
        rcgen::KeyUsagePurpose::KeyCertSign,
        rcgen::KeyUsagePurpose::CrlSign,
    ];
    (params.self_signed(&key).expect("CA certificate"), key)
}

fn pki(env: &TestEnv) -> Pki {
    let (ca, ca_key) = make_ca("sas test CA");
    let key = rcgen::KeyPair::generate().expect("server key");
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".into()])
        .expect("server params");
    let cert = params.signed_by(&key, &ca, &ca_key).expect("server cert");
    let files = Pki {
        ca: env.dir.join("ca.pem"),
        ca_pem: ca.pem(),
        cert: env.dir.join("server.pem"),
        key: env.dir.join("server-key.pem"),
    };
    std::fs::write(&files.ca, ca.pem()).unwrap();
    std::fs::write(&files.cert, cert.pem()).unwrap();
    std::fs::write(&files.key, key.serialize_pem()).unwrap();
    files
}

/// Starts remote-sim over HTTPS with `pki`, requiring the bearer tokens, and
/// waits until it answers.
async fn https_sim(env: &TestEnv, pki: &Pki, vars: &[Setting]) -> (Service, SimClient, u16) {
    let port = free_port();
    let mut all = vec![
        Setting::Listen(port),
        Setting::SimTlsCertFile(pki.cert.display().to_string()),
        Setting::SimTlsKeyFile(pki.key.display().to_string()),
        Setting::SimAuthToken("service-secret".to_owned()),
        Setting::SimAdminToken("admin-secret".to_owned()),
    ];
    all.extend(vars.iter().cloned());
    let service = env.spawn("remote-sim", "remote-sim", &all);
    let sim = SimClient::https(port, &pki.ca_pem).with_admin_token("admin-secret");
    wait_until(
        "remote-sim to answer over HTTPS",
        Duration::from_secs(10),
        || async { sim.stats().await.map(|_| ()).map_err(|e| format!("{e:#}")) },
    )
    .await;
    (service, sim, port)
}

/// Writes the `Authorization` value to a secret file for `_FILE`.
fn auth_file(env: &TestEnv, name: &str, value: &str) -> String {
    let path = env.dir.join(name);
    std::fs::write(&path, format!("{value}\n")).unwrap();
    path.display().to_string()
}

/// Starts one agent process serving `names`, with its ops endpoint on a
/// known port.
async fn agent(env: &TestEnv, names: &str, remote_url: &str, vars: &[Setting]) -> (Service, u16) {
    let ops = free_port();
    let mut all = vec![
        Setting::AgentName(names.to_owned()),
        Setting::AgentId("agent-0".to_owned()),
        Setting::AgentRemoteUrl(remote_url.to_owned()),
        Setting::Listen(ops),
    ];
    all.extend(vars.iter().cloned());
    let agent = env.spawn("agent", "agent-0", &all);
    // Ready before a test measures it: a request's start-by, and the lag
    // of a skewed clock, count from its dispatch, and an agent still
    // starting on a slow machine would spend them in the queue.
    sas_tests::wait::wait_ready("the agent", &format!("http://127.0.0.1:{ops}")).await;
    (agent, ops)
}

/// The test's reply queue (exclusive: it goes with the connection) and a
/// consumer of it.
async fn reply_queue(env: &TestEnv, connection: &Connection) -> (String, Consumer) {
    let (queue, channel) = env.client_queue(connection, "test-replies").await;
    let consumer = sas_tests::consume(&channel, &queue, "test").await;
    (queue, consumer)
}

/// A step request for `action` with deadlines `start_in` and `complete_in`
/// from now (the test's clock stands for the database's).
/// Waits until the agent serving metrics on `ops` has let a request's
/// deadline pass without an answer (`sas_agent_deadline_expired_total`).
async fn wait_expired(ops: u16, what: &str) {
    wait_for_metric(
        what,
        ops,
        "sas_agent_deadline_expired_total",
        Duration::from_secs(20),
        |n| n >= 1.0,
    )
    .await;
}

fn request(
    order_id: &str,
    kind: StepKind,
    action: &str,
    start_in: Duration,
    complete_in: Duration,
) -> StepRequest {
    let now = Utc::now();
    StepRequest {
        schema_version: sas_messages::SCHEMA_VERSION,
        order_id: order_id.into(),
        step: "charge_payment".into(),
        kind,
        action: action.into(),
        attempt_id: uuid::Uuid::now_v7().into(),
        attempt: 1,
        idempotency_key: format!("{order_id}:charge_payment"),
        complete_by: now + chrono::Duration::from_std(complete_in).unwrap(),
        start_by: Some(now + chrono::Duration::from_std(start_in).unwrap()),
        dispatched_at: Some(now),
        payload: serde_json::json!({ "order": { "order_id": order_id, "amount_cents": 100 }, "results": {} }),
        method: None,
        path: None,
        limit_key: None,
    }
}

async fn send(
    env: &TestEnv,
    publisher: &Publisher,
    agent: &str,
    reply_to: &str,
    request: &StepRequest,
) {
    send_with_priority(env, publisher, agent, reply_to, request, None).await;
}

/// [`send`], with the message's `priority` property set as a scheduler
/// sets it to the order's priority (none: as an older scheduler sends it).
async fn send_with_priority(
    env: &TestEnv,
    publisher: &Publisher,
    agent: &str,
    reply_to: &str,
    request: &StepRequest,
    priority: Option<u8>,
) {
    let names = env.amqp().names();
    let mut properties = sas_broker::publish::json_properties(&uuid::Uuid::now_v7().to_string())
        .with_correlation_id(request.attempt_id.to_string().as_str().into())
        .with_reply_to(reply_to.into());
    if let Some(priority) = priority {
        properties = properties.with_priority(priority);
    }
    publisher
        .publish_json("", &names.agent_requests(agent), request, properties, true)
        .await
        .unwrap();
}

/// The next reply on `consumer`, within `timeout`, with the queue times of
/// its headers, as a scheduler reads it.
async fn next_reply(consumer: &mut Consumer, timeout: Duration) -> StepReply {
    let delivery = tokio::time::timeout(timeout, consumer.next())
        .await
        .expect("a reply in time")
        .expect("the consumer is open")
        .expect("a delivery");
    let mut reply: StepReply = serde_json::from_slice(&delivery.data).expect("a StepReply");
    // The body never carries them: an older scheduler would refuse it.
    let body: serde_json::Value = serde_json::from_slice(&delivery.data).unwrap();
    assert!(body.get("queued_ms").is_none() && body.get("slot_wait_ms").is_none());
    let number = |key| sas_broker::publish::header_u64(&delivery.properties, key);
    reply.queued_ms = number(sas_messages::headers::QUEUED_MS);
    reply.slot_wait_ms = number(sas_messages::headers::SLOT_WAIT_MS);
    reply
}

/// Waits until the agent's log contains `needle`, and returns the log.
async fn wait_for_log(service: &Service, needle: &str, timeout: Duration) -> String {
    wait_until(
        &format!("{needle:?} in {}", service.log.display()),
        timeout,
        || async {
            let log = service.log_text();
            if log.contains(needle) {
                Ok(log)
            } else {
                Err(log.lines().rev().take(5).collect::<Vec<_>>().join(" | "))
            }
        },
    )
    .await
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_calls_remote_sim_over_https_with_a_ca_made_in_the_test_and_the_order_is_processed(
) {
    let env = TestEnv::new().await;
    let pki = pki(&env);
    let (_sim_process, sim, port) = https_sim(&env, &pki, &[]).await;
    let (_connection, publisher) = env.broker().await;
    let (mut agent, ops) = agent(
        &env,
        "inventory,payment,shipping",
        &format!("https://127.0.0.1:{port}/{{agent}}"),
        &[
            Setting::AgentRemoteCaFile(pki.ca.display().to_string()),
            Setting::AgentRemoteAuthHeaderFile(auth_file(&env, "auth", "Bearer service-secret")),
        ],
    )
    .await;
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);

    env.publish_order(&publisher, &order("tls-1")).await;
    env.wait_for_count(ProcessState::Processed, 1, Duration::from_secs(30))
        .await;
    let applied = sim.applied_per_key().await.unwrap();
    assert_eq!(applied.len(), 3, "{applied:?}");
    assert!(applied.values().all(|&n| n == 1));
    assert!(agent.is_running());
    // The secret never reaches the log.
    assert!(!agent.log_text().contains("service-secret"));
    let healthz = sas_tests::http_get(format!("http://127.0.0.1:{ops}/healthz")).await;
    assert_eq!(healthz.unwrap().status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_wrong_ca_the_agent_says_certificate_stays_up_and_applies_nothing() {
    let env = TestEnv::new().await;
    let pki = pki(&env);
    let (_sim_process, sim, port) = https_sim(&env, &pki, &[]).await;
    let (other_ca, _) = make_ca("some other CA");
    let wrong_ca = env.dir.join("wrong-ca.pem");
    std::fs::write(&wrong_ca, other_ca.pem()).unwrap();
    let (connection, publisher) = env.broker().await;
    let (reply_to, mut replies) = reply_queue(&env, &connection).await;
    let url = format!("https://127.0.0.1:{port}/payment");
    let (mut agent, ops) = agent(
        &env,
        "payment",
        &url,
        &[
            Setting::AgentRemoteCaFile(wrong_ca.display().to_string()),
            Setting::AgentRemoteAuthHeaderFile(auth_file(&env, "auth", "Bearer service-secret")),
        ],
    )
    .await;

    let request = request(
        "wrong-ca-1",
        StepKind::Action,
        "charge",
        Duration::from_millis(2500),
        Duration::from_secs(4),
    );
    send(&env, &publisher, "payment", &reply_to, &request).await;
    let log = wait_for_log(&agent, "TLS certificate", Duration::from_secs(20)).await;
    let line = log
        .lines()
        .find(|line| line.contains("TLS certificate"))
        .unwrap();
    assert!(line.contains(&url), "the line names the URL: {line}");
    assert!(line.contains("certificate"), "{line}");
    wait_for_metric(
        "the failure to be counted",
        ops,
        "sas_agent_certificate_failures_total{agent=\"payment\"}",
        Duration::from_secs(10),
        |n| n >= 1.0,
    )
    .await;
    // The request ends at its start deadline without any call having reached
    // the service: no reply (the supervisor owns the step), nothing applied.
    wait_expired(ops, "the request to expire").await;
    assert!(
        tokio::time::timeout(Duration::from_millis(500), replies.next())
            .await
            .is_err(),
        "no reply for a call that never reached the service"
    );
    assert!(sim.side_effects().await.unwrap().is_empty());
    assert!(agent.is_running(), "no crash loop");
    let healthz = sas_tests::http_get(format!("http://127.0.0.1:{ops}/healthz")).await;
    assert_eq!(healthz.unwrap().status().as_u16(), 200);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_wrong_bearer_token_is_refused_clearly_and_nothing_is_applied() {
    let env = TestEnv::new().await;
    let pki = pki(&env);
    let (_sim_process, sim, port) = https_sim(&env, &pki, &[]).await;
    let (connection, publisher) = env.broker().await;
    let (reply_to, mut replies) = reply_queue(&env, &connection).await;
    let (mut agent, _ops) = agent(
        &env,
        "payment",
        &format!("https://127.0.0.1:{port}/payment"),
        &[
            Setting::AgentRemoteCaFile(pki.ca.display().to_string()),
            Setting::AgentRemoteAuthHeaderFile(auth_file(&env, "auth", "Bearer not-the-token")),
        ],
    )
    .await;
    let mut request = request(
        "token-1",
        StepKind::Action,
        "charge",
        Duration::from_secs(8),
        Duration::from_secs(10),
    );
    // A request that does not say when it was dispatched (an older
    // scheduler's) gets no queue times.
    request.dispatched_at = None;
    send(&env, &publisher, "payment", &reply_to, &request).await;
    let reply = next_reply(&mut replies, Duration::from_secs(20)).await;
    assert_eq!(reply.attempt_id, request.attempt_id);
    assert_eq!((reply.queued_ms, reply.slot_wait_ms), (None, None));
    match &reply.outcome {
        StepOutcome::Failed {
            error,
            permanent: true,
            maybe_applied: false,
        } => assert!(error.contains("401"), "{error}"),
        other => panic!("expected a permanent refusal, got {other:?}"),
    }
    wait_for_log(&agent, "401", Duration::from_secs(5)).await;
    assert!(
        !agent.log_text().contains("not-the-token"),
        "the secret is never logged"
    );
    assert!(sim.side_effects().await.unwrap().is_empty());
    assert!(agent.is_running());
}

/// What the bad remote saw: (path, when) of every call.
type Calls = Arc<Mutex<Vec<(String, DateTime<Utc>)>>>;

/// A remote that answers badly, on a free port: `/bad/oversized` (200 with
/// 100 KB), `/bad/binary` (200 with bytes that are not JSON), `/bad/nul`
/// (200 with a JSON string holding U+0000), `/bad/empty` (200, no body),
/// `/bad/busy` (429 always); any other path is recorded as `other`.
async fn bad_remote() -> (u16, Calls) {
    use axum::http::StatusCode;
    use axum::routing::post;
    let calls: Calls = Arc::default();
    let record = |calls: &Calls, path: &str| {
        calls.lock().unwrap().push((path.to_owned(), Utc::now()));
    };
    let (c0, c1, c2, c3, c4, c5) = (
        calls.clone(),
        calls.clone(),
        calls.clone(),
        calls.clone(),
        calls.clone(),
        calls.clone(),
    );
    let app = axum::Router::new()
        .route(
            "/bad/oversized",
            post(move || async move {
                record(&c1, "oversized");
                (
                    StatusCode::OK,
                    format!("{{\"id\":\"{}\"}}", "x".repeat(100_000)),
                )
            }),
        )
        .route(
            "/bad/binary",
            post(move || async move {
                record(&c2, "binary");
                (StatusCode::OK, vec![0xffu8, 0x00, 0xfe, 0x81, 0x7b])
            }),
        )
        .route(
            "/bad/nul",
            post(move || async move {
                record(&c3, "nul");
                (
                    StatusCode::OK,
                    [("content-type", "application/json")],
                    r#"{"id":"ch\u0000-1","note\u0000":"a\u0000"}"#,
                )
            }),
        )
        .route(
            "/bad/empty",
            post(move || async move {
                record(&c4, "empty");
                StatusCode::OK
            }),
        )
        .route(
            "/bad/busy",
            post(move || async move {
                record(&c5, "busy");
                // 429: busy, and certainly nothing applied (a 503 may have been).
                StatusCode::TOO_MANY_REQUESTS
            }),
        )
        .fallback(move |uri: axum::http::Uri| async move {
            record(&c0, &format!("other {uri}"));
            StatusCode::NOT_FOUND
        });
    let (port, _) = sas_tests::serve_locally(app).await;
    (port, calls)
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_answers_each_get_a_clear_decision_and_nothing_crashes() {
    let env = TestEnv::new().await;
    let (port, calls) = bad_remote().await;
    let (connection, publisher) = env.broker().await;
    let (reply_to, mut replies) = reply_queue(&env, &connection).await;
    let (mut agent, _ops) = agent(
        &env,
        "payment",
        &format!("http://127.0.0.1:{port}/bad"),
        &[Setting::AgentRetryBaseMs(100)],
    )
    .await;

    let mut sent = std::collections::HashMap::new();
    for action in ["oversized", "binary", "nul", "empty"] {
        let request = request(
            &format!("bad-{action}"),
            StepKind::Action,
            action,
            Duration::from_millis(2000),
            Duration::from_secs(4),
        );
        send(&env, &publisher, "payment", &reply_to, &request).await;
        sent.insert(request.attempt_id, action);
    }
    // An action that is not an operation name: dead-lettered, never called.
    let evil = request(
        "bad-path",
        StepKind::Action,
        "../admin",
        Duration::from_secs(2),
        Duration::from_secs(4),
    );
    send(&env, &publisher, "payment", &reply_to, &evil).await;

    let mut outcomes = std::collections::HashMap::new();
    while outcomes.len() < 4 {
        let reply = next_reply(&mut replies, Duration::from_secs(20)).await;
        let action = sent[&reply.attempt_id];
        outcomes.insert(action, reply.outcome);
    }
    let maybe_applied = |action: &str, needle: &str| match &outcomes[action] {
        StepOutcome::Failed {
            error,
            permanent: false,
            maybe_applied: true,
        } => assert!(error.contains(needle), "{action}: {error}"),
        other => panic!("{action}: expected an unknown outcome, got {other:?}"),
    };
    match &outcomes["oversized"] {
        StepOutcome::Failed {
            error,
            permanent: true,
            maybe_applied: true,
        } => assert!(
            error.contains("agent.max_answer_bytes"),
            "oversized: {error}"
        ),
        other => panic!(
            "oversized: expected a permanent failure that may have been applied, got {other:?}"
        ),
    }
    maybe_applied("binary", "not JSON");
    maybe_applied("empty", "empty body");
    match &outcomes["nul"] {
        StepOutcome::Succeeded { result } => {
            assert_eq!(result["id"], "ch\u{FFFD}-1");
            assert!(!result.to_string().contains("\\u0000"), "{result}");
            assert!(result["sas_note"].as_str().unwrap().contains("U+0000"));
        }
        other => panic!("nul: expected success with U+0000 replaced, got {other:?}"),
    }
    for outcome in outcomes.values() {
        if let StepOutcome::Failed { error, .. } = outcome {
            assert!(error.chars().count() <= 501, "bounded: {}", error.len());
        }
    }
    wait_for_log(&agent, "not an operation name", Duration::from_secs(10)).await;
    assert!(
        calls
            .lock()
            .unwrap()
            .iter()
            .all(|(path, _)| !path.starts_with("other")),
        "no call for a bad action"
    );
    assert!(agent.is_running(), "nothing crashed");
}

#[tokio::test(flavor = "multi_thread")]
async fn an_agent_whose_clock_runs_two_seconds_behind_never_starts_a_call_after_start_by() {
    let env = TestEnv::new().await;
    let (port, calls) = bad_remote().await;
    let (connection, publisher) = env.broker().await;
    let (reply_to, _replies) = reply_queue(&env, &connection).await;
    let (mut agent, ops) = agent(
        &env,
        "payment",
        &format!("http://127.0.0.1:{port}/bad"),
        &[
            Setting::AgentClockOffsetMs(-2000),
            Setting::AgentRetryBaseMs(20),
            Setting::AgentRetryMaxMs(100),
            // Keep calling through the 429s: the breaker is not under test.
            Setting::CircuitFailureThreshold(1000),
        ],
    )
    .await;
    // The service keeps answering 429 (nothing applied), so the agent
    // retries until it must stop.
    let request = request(
        "skew-1",
        StepKind::Action,
        "busy",
        Duration::from_millis(1500),
        Duration::from_secs(5),
    );
    let start_by = request.start_by.unwrap();
    send(&env, &publisher, "payment", &reply_to, &request).await;
    wait_expired(ops, "the agent to stop calling").await;
    let calls = calls.lock().unwrap().clone();
    assert!(!calls.is_empty(), "the agent called before start_by");
    let behind = sas_tests::process::metric(ops, "sas_agent_clock_behind_seconds")
        .await
        .unwrap_or(0.0);
    assert!(behind > 1.5, "the lag was measured: {behind}");
    // `dispatched_at - received` is a lower bound of the lag: short of the
    // true 2 s by the time the request took from being stamped to reaching
    // the agent. A call leaves before start_by by that estimate, and arrives
    // a few milliseconds later.
    let shortfall = chrono::Duration::milliseconds(((2.0 - behind).max(0.0) * 1000.0) as i64);
    let last = calls.iter().map(|(_, at)| *at).max().unwrap();
    assert!(
        last <= start_by + shortfall + chrono::Duration::milliseconds(100),
        "a call started {} ms after start_by ({} calls, lag measured {behind} s)",
        (last - start_by).num_milliseconds(),
        calls.len()
    );
    assert!(agent.is_running());
}

#[tokio::test(flavor = "multi_thread")]
async fn check_config_refuses_a_url_it_cannot_serve_and_unreadable_tls_files() {
    let env = TestEnv::new().await;
    let missing = env.dir.join("missing.pem").display().to_string();
    for (vars, key) in [
        (
            vec![Setting::AgentRemoteUrl("ftp://127.0.0.1/x".to_owned())],
            "agent.remote_url",
        ),
        (
            vec![Setting::AgentRemoteCaFile(missing.clone())],
            "agent.remote_ca_file",
        ),
        (
            vec![
                Setting::AgentRemoteClientCertFile(missing.clone()),
                Setting::AgentRemoteClientKeyFile(missing.clone()),
            ],
            "agent.remote_client_cert_file",
        ),
    ] {
        let output = tokio::process::Command::new(sas_tests::process::bin_dir().join("agent"))
            .arg("--check-config")
            .env_clear()
            .envs(vars.iter().map(Setting::var))
            .env_remove("SAS_AGENT__NAME")
            .output()
            .await
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{vars:?}: {stderr}");
        assert!(stderr.contains(key), "{key}: {stderr}");
    }
}

/// The failing sequence of a real payment API: a charge applied at once but
/// answered only after the agent gave up on it, and the retries of the same
/// key answered 409 "in progress" meanwhile. Then the order is undone as a
/// whole (shipping refuses it): every customer charged must be refunded, and
/// every undo must land after the action it undoes.
#[tokio::test(flavor = "multi_thread")]
async fn a_charge_answered_after_the_agent_gave_up_is_refunded_when_its_order_is_undone() {
    let env = TestEnv::with_step_timeout(2000).await;
    // Three calls in ten are applied at once and answered after 3 s, longer
    // than a step's whole deadline.
    let (_sim_process, sim) = env
        .remote_sim(&[
            Setting::SimMode("strict".to_owned()),
            Setting::SimLateAnswerRate(0.3),
            Setting::SimLateAnswerMs(3000),
        ])
        .await;
    let refuse = serde_json::json!({ "latency_ms": 0, "transient_fault_rate": 0.0, "permanent_fault_rate": 1.0, "hang_rate": 0.0 });
    sim.set_faults(Some("shipping"), refuse).await.unwrap();
    let _agents = env.agents(1, &sim, &[Setting::AgentCallTimeoutMs(500)]);
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    env.publish_orders(&publisher, "dup", 40).await;
    wait_until_all_ended(&env, 40).await;
    assert_eq!(env.count(ProcessState::Compensated).await, 40);
    // The sequence happened: some charges' outcome was unknown for a while.
    let unknown: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM steps WHERE name = 'charge_payment' AND maybe_applied",
    )
    .fetch_one(&env.db)
    .await
    .unwrap();
    let stats = sim.stats().await.unwrap();
    assert!(unknown > 0, "no charge was answered late: {stats:?}");
    // The remote's own record: when each key was applied.
    let applied = sim.applied_at().await;
    let mut refunded = 0;
    for n in 0..40 {
        for step in ["reserve_stock", "charge_payment"] {
            let action = format!("dup-{n}:{step}");
            let done = applied
                .get(&action)
                .unwrap_or_else(|| panic!("{action} was never applied"));
            let undone = applied
                .get(&format!("{action}:undo"))
                .unwrap_or_else(|| panic!("{action} was applied and never undone"));
            assert!(undone > done, "the undo of {action} landed before it");
            refunded += usize::from(step == "charge_payment");
        }
    }
    assert_eq!(refunded, 40, "every customer charged was refunded");
}

/// Every undo the remote applied landed after its action, and every action
/// of a compensated order was undone.
async fn assert_every_effect_undone_after_it(env: &TestEnv, sim: &SimClient) -> usize {
    sim.assert_no_undo_before_its_action().await;
    let applied = sim.applied_at().await;
    let compensated: Vec<String> =
        sqlx::query_scalar("SELECT order_id FROM order_process WHERE state = 'compensated'")
            .fetch_all(&env.db)
            .await
            .unwrap();
    for order_id in &compensated {
        for step in ["reserve_stock", "charge_payment", "create_shipment"] {
            let action = format!("{order_id}:{step}");
            if applied.contains_key(&action) {
                assert!(
                    applied.contains_key(&format!("{action}:undo")),
                    "{action} was applied and never undone"
                );
            }
        }
    }
    compensated.len()
}

/// A payment agent whose clock runs 2 s behind the database's, in a run
/// where one charge in ten hangs, one in five is answered late, and
/// shipping refuses every order, so each is undone: no refund reaches the
/// remote before its charge, and no charge of an undone order is left
/// standing.
#[tokio::test(flavor = "multi_thread")]
async fn an_agent_clock_two_seconds_behind_never_lets_an_undo_land_before_its_action() {
    let env = TestEnv::with_step_timeout(2000).await;
    let (_sim_process, sim) = env
        .remote_sim(&[
            Setting::SimMode("strict".to_owned()),
            Setting::SimLateAnswerRate(0.2),
            Setting::SimLateAnswerMs(1500),
        ])
        .await;
    let hangs = serde_json::json!({ "latency_ms": 0, "transient_fault_rate": 0.0, "permanent_fault_rate": 0.0, "hang_rate": 0.1 });
    sim.set_faults(Some("payment"), hangs).await.unwrap();
    let refuse = serde_json::json!({ "latency_ms": 0, "transient_fault_rate": 0.0, "permanent_fault_rate": 1.0, "hang_rate": 0.0 });
    sim.set_faults(Some("shipping"), refuse).await.unwrap();
    // The breaker is not under test: with one call in three hanging or
    // answered late it would open, and an order whose refunds all meet an
    // open circuit ends in error (rightly), not compensated.
    let quick = [
        Setting::AgentCallTimeoutMs(500),
        Setting::CircuitFailureThreshold(1000),
    ];
    let mut skewed = quick.to_vec();
    skewed.push(Setting::AgentClockOffsetMs(-2000));
    let _agents = [
        env.agent("inventory", 0, &sim, &quick),
        env.agent("payment", 0, &sim, &skewed),
        env.agent("shipping", 0, &sim, &quick),
    ];
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[Setting::SupervisorMaxFailures(3)]);
    let (_connection, publisher) = env.broker().await;
    env.publish_orders(&publisher, "skew", 40).await;
    wait_until_all_ended(&env, 40).await;
    let compensated = assert_every_effect_undone_after_it(&env, &sim).await;
    assert_eq!(compensated, 40, "every order was undone");
}

/// Waits until `n` orders exist and every one has ended.
async fn wait_until_all_ended(env: &TestEnv, n: i64) {
    wait_until(&format!("all {n} orders ended"), Duration::from_secs(120), || async {
        let (all, open): (i64, i64) = sqlx::query_as(
            "SELECT count(*), count(*) FILTER (WHERE state NOT IN ('processed', 'compensated', 'error'))
               FROM order_process",
        )
        .fetch_one(&env.db)
        .await
        .map_err(|e| e.to_string())?;
        if all == n && open == 0 {
            Ok(())
        } else {
            Err(format!("{open} of {all} open"))
        }
    })
    .await;
}

/// An agent that loses its broker connection cancels the calls it started
/// for that connection's requests: the redelivered request is the only one
/// still calling, so the remote never sees the same request twice at once.
#[tokio::test(flavor = "multi_thread")]
async fn an_agent_that_loses_its_broker_connection_drops_the_calls_it_started_for_it() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // Alone on the broker: rabbitmqctl closes a connection of its own.
    let env = TestEnv::exclusive(3000).await;
    // A remote that never answers, counting the calls open at once.
    let open = Arc::new(AtomicUsize::new(0));
    let (most, calls) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    struct Open(Arc<AtomicUsize>);
    impl Drop for Open {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    let app = {
        let (open, most, calls) = (open.clone(), most.clone(), calls.clone());
        axum::Router::new().route(
            "/hang/{action}",
            axum::routing::post(move || {
                let (open, most, calls) = (open.clone(), most.clone(), calls.clone());
                async move {
                    calls.fetch_add(1, Ordering::SeqCst);
                    let now = open.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    let _open = Open(open);
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    axum::http::StatusCode::OK
                }
            }),
        )
    };
    let (port, _) = sas_tests::serve_locally(app).await;

    let agent_id = format!("{}-cut", env.id);
    let (mut agent_process, _ops) = agent(
        &env,
        "payment",
        &format!("http://127.0.0.1:{port}/hang"),
        &[
            Setting::AgentId(agent_id.clone()),
            Setting::AgentCallTimeoutMs(30000),
        ],
    )
    .await;
    let (connection, publisher) = env.broker().await;
    let (reply_to, _replies) = reply_queue(&env, &connection).await;
    let request = request(
        "cut-1",
        StepKind::Action,
        "charge",
        Duration::from_secs(25),
        Duration::from_secs(30),
    );
    send(&env, &publisher, "payment", &reply_to, &request).await;
    wait_until("the first call", Duration::from_secs(20), || async {
        if open.load(Ordering::SeqCst) == 1 {
            Ok(())
        } else {
            Err("no call yet".to_owned())
        }
    })
    .await;
    // The broker drops the agent's connection (as a network cut would).
    let listing = tokio::process::Command::new("rabbitmqctl")
        .args(["list_connections", "pid", "client_properties", "-q"])
        .output()
        .await
        .expect("rabbitmqctl");
    let listing = String::from_utf8_lossy(&listing.stdout).into_owned();
    let pid = listing
        .lines()
        .find(|line| line.contains(&agent_id))
        .and_then(|line| line.split_whitespace().next())
        .unwrap_or_else(|| panic!("the agent's connection is listed: {listing}"))
        .to_owned();
    let closed = tokio::process::Command::new("rabbitmqctl")
        .args(["close_connection", &pid, "test: connection cut"])
        .status()
        .await
        .expect("rabbitmqctl");
    assert!(closed.success());
    // The request comes back on the new connection and is called again...
    wait_until(
        "the redelivered request's call",
        Duration::from_secs(30),
        || async {
            let (calls, open) = (calls.load(Ordering::SeqCst), open.load(Ordering::SeqCst));
            if calls >= 2 && open == 1 {
                Ok(())
            } else {
                Err(format!("{calls} calls, {open} open"))
            }
        },
    )
    .await;
    // ...while the call of the lost connection was dropped first.
    assert_eq!(
        most.load(Ordering::SeqCst),
        1,
        "two calls of one request were open at once"
    );
    assert!(agent_process.is_running());
}

/// Publishes to the payment agent's queue a request whose start-by passed
/// 200 ms ago (its 5 s deadline has not), as one that waited in line.
async fn send_late(
    env: &TestEnv,
    publisher: &Publisher,
    reply_to: &str,
    order_id: &str,
) -> StepRequest {
    let mut late = request(
        order_id,
        StepKind::Action,
        "busy",
        Duration::from_millis(300),
        Duration::from_secs(5),
    );
    late.start_by = Some(Utc::now() - chrono::Duration::milliseconds(200));
    send(env, publisher, "payment", reply_to, &late).await;
    late
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_whose_start_by_passed_in_the_queue_is_answered_not_started_without_a_call() {
    let env = TestEnv::new().await;
    let (port, calls) = bad_remote().await;
    let (connection, publisher) = env.broker().await;
    let (reply_to, mut replies) = reply_queue(&env, &connection).await;
    // Published before the agent runs: it waits in the queue past start-by.
    let late = send_late(&env, &publisher, &reply_to, "queued-1").await;
    let dispatched_at = late.dispatched_at.unwrap();
    let queued_before_the_agent_ran = (Utc::now() - dispatched_at).num_milliseconds();
    let (mut agent, _ops) = agent(
        &env,
        "payment",
        &format!("http://127.0.0.1:{port}/bad"),
        &[],
    )
    .await;
    let reply = next_reply(&mut replies, Duration::from_secs(20)).await;
    assert_eq!(reply.attempt_id, late.attempt_id);
    match &reply.outcome {
        StepOutcome::NotStarted { reason } => {
            assert!(reason.contains("start-by"), "{reason}");
        }
        other => panic!("expected not_started, got {other:?}"),
    }
    // It says how long the request queued: from its dispatch to its answer
    // (no call was made), on this machine's one clock, give or take the
    // agent's estimate of it.
    let queued = i64::try_from(reply.queued_ms.expect("asked for, so said")).unwrap();
    // It never waited for a call slot: its start-by had passed when the
    // agent took it.
    assert_eq!(reply.slot_wait_ms, Some(0));
    let since_dispatch = (Utc::now() - dispatched_at).num_milliseconds();
    assert!(
        (queued_before_the_agent_ran - 50..=since_dispatch + 50).contains(&queued),
        "queued {queued} ms, outside {queued_before_the_agent_ran}..={since_dispatch}"
    );
    assert!(
        calls.lock().unwrap().is_empty(),
        "the agent called the service for a request it should not start"
    );
    assert!(agent.is_running());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_redelivered_request_past_its_start_by_is_never_answered_not_started() {
    use sas_broker::lapin::options::{BasicGetOptions, BasicRejectOptions};
    let env = TestEnv::new().await;
    let (port, calls) = bad_remote().await;
    let (connection, publisher) = env.broker().await;
    let (reply_to, mut replies) = reply_queue(&env, &connection).await;
    send_late(&env, &publisher, &reply_to, "redelivered-1").await;
    // An agent took it and died (here: handed it back), so the broker marks
    // it redelivered: that earlier delivery may have called the service.
    let channel = connection.create_channel().await.unwrap();
    let queue = env.amqp().names().agent_requests("payment");
    let taken = channel
        .basic_get(queue.as_str().into(), BasicGetOptions::default())
        .await
        .unwrap()
        .expect("the request is in the queue");
    let rejected = taken
        .delivery
        .reject(BasicRejectOptions { requeue: true })
        .await
        .unwrap();
    assert!(rejected, "the request was not handed back to the queue");
    let (mut agent, ops) = agent(
        &env,
        "payment",
        &format!("http://127.0.0.1:{port}/bad"),
        &[],
    )
    .await;
    wait_expired(ops, "the agent to drop the request").await;
    // Silence: the supervisor counts a failure and marks the step maybe
    // applied, so an undo covers the earlier delivery's call.
    let reply = tokio::time::timeout(Duration::from_millis(500), replies.next()).await;
    assert!(
        reply.is_err(),
        "the agent answered a redelivered request: {reply:?}"
    );
    assert!(calls.lock().unwrap().is_empty());
    assert!(agent.is_running());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_request_without_start_by_is_never_answered_not_started() {
    // A scheduler that sends no start_by predates the not_started answer
    // (docs/messages.md, Upgrades): it would dead-letter the reply. So the
    // agent says nothing, as agents did before that answer existed.
    let env = TestEnv::new().await;
    let (port, calls) = bad_remote().await;
    let (connection, publisher) = env.broker().await;
    let (reply_to, mut replies) = reply_queue(&env, &connection).await;
    let mut old = request(
        "old-scheduler-1",
        StepKind::Action,
        "busy",
        Duration::ZERO,
        Duration::from_millis(100),
    );
    // Its deadline passed while it waited in the queue.
    (old.start_by, old.dispatched_at) = (None, None);
    old.complete_by = Utc::now() - chrono::Duration::milliseconds(200);
    send(&env, &publisher, "payment", &reply_to, &old).await;
    let (mut agent, ops) = agent(
        &env,
        "payment",
        &format!("http://127.0.0.1:{port}/bad"),
        &[],
    )
    .await;
    wait_expired(ops, "the agent to drop the request").await;
    let reply = tokio::time::timeout(Duration::from_millis(500), replies.next()).await;
    assert!(
        reply.is_err(),
        "the agent answered a request without start_by: {reply:?}"
    );
    assert!(calls.lock().unwrap().is_empty());
    assert!(agent.is_running());
}

/// A remote on a free port whose calls (`/gated/<action>`) record their
/// order id in the order they arrive, then each wait for a permit of the
/// returned gate before answering 200 with an empty object.
async fn gated_remote() -> (u16, Arc<Mutex<Vec<String>>>, Arc<tokio::sync::Semaphore>) {
    let calls: Arc<Mutex<Vec<String>>> = Arc::default();
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let app = {
        let (calls, gate) = (calls.clone(), gate.clone());
        axum::Router::new().route(
            "/gated/{action}",
            axum::routing::post(move |body: axum::Json<serde_json::Value>| {
                let (calls, gate) = (calls.clone(), gate.clone());
                async move {
                    let order_id = body["order"]["order_id"].as_str().unwrap_or("?").to_owned();
                    calls.lock().unwrap().push(order_id);
                    gate.acquire().await.unwrap().forget();
                    axum::Json(serde_json::json!({}))
                }
            }),
        )
    };
    let (port, _) = sas_tests::serve_locally(app).await;
    (port, calls, gate)
}

/// The order in which an agent of one call slot calls the remote: a
/// request `first` takes the slot and holds it while `waiting` arrive, one
/// by one (each delivered and waiting before the next is sent, so that
/// requests of the same place reach the slot in the order they were sent).
async fn call_order(waiting: &[(&str, StepKind, &str, Option<u8>)]) -> Vec<String> {
    let env = TestEnv::new().await;
    let (port, calls, gate) = gated_remote().await;
    let (_agent, ops) = agent(
        &env,
        "payment",
        &format!("http://127.0.0.1:{port}/gated"),
        // The first call is held until every request waits: no timeout.
        &[
            Setting::AgentConcurrency(1),
            Setting::AgentCallTimeoutMs(30_000),
        ],
    )
    .await;
    let (connection, publisher) = env.broker().await;
    let (reply_to, mut replies) = reply_queue(&env, &connection).await;
    let step = |order_id: &str, kind: StepKind, action: &str| {
        request(
            order_id,
            kind,
            action,
            Duration::from_secs(25),
            Duration::from_secs(30),
        )
    };
    send_with_priority(
        &env,
        &publisher,
        "payment",
        &reply_to,
        &step("first", StepKind::Action, "charge"),
        Some(5),
    )
    .await;
    wait_until("the first call", Duration::from_secs(20), || async {
        let seen = calls.lock().unwrap().clone();
        if seen.is_empty() {
            Err("no call yet".to_owned())
        } else {
            Ok(())
        }
    })
    .await;
    let mut in_flight = 1.0;
    for &(order_id, kind, action, priority) in waiting {
        let request = step(order_id, kind, action);
        send_with_priority(&env, &publisher, "payment", &reply_to, &request, priority).await;
        in_flight += 1.0;
        wait_for_metric(
            &format!("{order_id} delivered and waiting for the call slot"),
            ops,
            "sas_agent_requests_in_flight",
            Duration::from_secs(20),
            |n| n >= in_flight,
        )
        .await;
    }
    assert_eq!(calls.lock().unwrap().len(), 1, "one call slot, still held");
    gate.add_permits(waiting.len() + 1);
    for _ in 0..=waiting.len() {
        let reply = next_reply(&mut replies, Duration::from_secs(20)).await;
        assert!(
            matches!(reply.outcome, StepOutcome::Succeeded { .. }),
            "{reply:?}"
        );
    }
    let order = calls.lock().unwrap().clone();
    order
}

/// An agent's queue is first come, first served, so its call slots are
/// where priority can still count: a freed slot goes to a compensation
/// first, then to the request of the most urgent order (the message's
/// `priority` property; none counts as the default, 5), and to the first
/// delivered among equals.
#[tokio::test(flavor = "multi_thread")]
async fn a_freed_call_slot_goes_to_a_compensation_then_to_the_most_urgent_request() {
    // The most urgent arrive last.
    let order = call_order(&[
        ("low-0", StepKind::Action, "charge", Some(0)),
        ("low-1", StepKind::Action, "charge", Some(0)),
        ("plain", StepKind::Action, "charge", None),
        ("low-2", StepKind::Action, "charge", Some(0)),
        ("urgent", StepKind::Action, "charge", Some(9)),
        ("undo", StepKind::Compensation, "refund", Some(0)),
    ])
    .await;
    assert_eq!(
        order,
        ["first", "undo", "urgent", "plain", "low-0", "low-1", "low-2"],
        "the order of the calls"
    );
}

/// Tenants take turns for the call slots too (crates/agent/src/turns.rs):
/// a request of tenant `b`, arriving after three of tenant `a`, goes right
/// after `a`'s first, not after all three (first come, first served, it
/// went last).
#[tokio::test(flavor = "multi_thread")]
async fn a_quiet_tenants_request_passes_a_busy_tenants_for_the_call_slot() {
    let order = call_order(&[
        ("a-0@a", StepKind::Action, "charge", Some(5)),
        ("a-1@a", StepKind::Action, "charge", Some(5)),
        ("a-2@a", StepKind::Action, "charge", Some(5)),
        ("b-0@b", StepKind::Action, "charge", Some(5)),
    ])
    .await;
    assert_eq!(
        order,
        ["first", "a-0@a", "b-0@b", "a-1@a", "a-2@a"],
        "the order of the calls"
    );
}

/// A remote on a free port whose calls (`/big/<action>`) are counted and
/// answered 200 with a JSON object of exactly `size` bytes (with its
/// Content-Length).
async fn big_answer_remote(size: usize) -> (u16, Arc<std::sync::atomic::AtomicUsize>) {
    let (head, tail) = (r#"{"id":""#, r#""}"#);
    let body = format!("{head}{}{tail}", "x".repeat(size - head.len() - tail.len()));
    assert_eq!(body.len(), size);
    let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let app = {
        let calls = calls.clone();
        axum::Router::new().route(
            "/big/{action}",
            axum::routing::post(move || {
                let (calls, body) = (calls.clone(), body.clone());
                async move {
                    calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    ([("content-type", "application/json")], body)
                }
            }),
        )
    };
    let (port, _) = sas_tests::serve_locally(app).await;
    (port, calls)
}

/// The first characters of an outcome, for a failure message (a success
/// may carry 65,000 bytes).
fn outline(outcome: &StepOutcome) -> String {
    format!("{outcome:?}").chars().take(300).collect()
}

/// 65,000 bytes of valid JSON fit under the broker's 64 KiB message limit,
/// but the reply carrying them would not, and neither would the later
/// requests that carry them beside the order: the scheduler would
/// dead-letter them and the result would be lost. So an action answered
/// 2xx with a body over `agent.max_answer_bytes` (16 KiB by default) fails
/// for good at once, saying it may have been applied (the order is
/// undone), instead of being retried until start-by.
#[tokio::test(flavor = "multi_thread")]
async fn an_action_answered_with_65000_bytes_of_json_fails_for_good_at_once_as_maybe_applied() {
    let env = TestEnv::new().await;
    let (port, calls) = big_answer_remote(65_000).await;
    let (connection, publisher) = env.broker().await;
    let (reply_to, mut replies) = reply_queue(&env, &connection).await;
    let (mut agent, _ops) = agent(
        &env,
        "payment",
        &format!("http://127.0.0.1:{port}/big"),
        &[Setting::AgentRetryBaseMs(100)],
    )
    .await;
    let request = request(
        "big-1",
        StepKind::Action,
        "charge",
        Duration::from_secs(15),
        Duration::from_secs(20),
    );
    let sent = std::time::Instant::now();
    send(&env, &publisher, "payment", &reply_to, &request).await;
    let reply = next_reply(&mut replies, Duration::from_secs(30)).await;
    let took = sent.elapsed();
    assert_eq!(reply.attempt_id, request.attempt_id);
    match &reply.outcome {
        StepOutcome::Failed {
            error,
            permanent: true,
            maybe_applied: true,
        } => {
            assert!(error.contains("agent.max_answer_bytes"), "{error}");
            assert!(error.contains("may have been applied"), "{error}");
        }
        other => panic!(
            "expected a permanent failure that may have been applied, got {}",
            outline(other)
        ),
    }
    // At once: one call, answered long before start-by (15 s), not
    // retried until then.
    assert_eq!(
        calls.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "the answer was called for again"
    );
    assert!(
        took < Duration::from_secs(8),
        "the reply took {took:?}: retried until start-by?"
    );
    assert!(agent.is_running());
}

/// A 404 to an undo proves only that the route answered 404 (a misspelt
/// or renamed route, an ingress), not that the action was undone: it is a
/// refusal for good, whose text names the URL, the status and the answer,
/// never "nothing to undo".
#[tokio::test(flavor = "multi_thread")]
async fn a_404_to_an_undo_is_a_refusal_naming_the_route_never_nothing_to_undo() {
    let env = TestEnv::new().await;
    let (port, calls) = bad_remote().await;
    let (connection, publisher) = env.broker().await;
    let (reply_to, mut replies) = reply_queue(&env, &connection).await;
    let (mut agent, _ops) = agent(
        &env,
        "payment",
        &format!("http://127.0.0.1:{port}/bad"),
        &[],
    )
    .await;
    // The bad remote has no such route: its fallback answers 404.
    let undo = request(
        "undo-404",
        StepKind::Compensation,
        "refnud",
        Duration::from_secs(8),
        Duration::from_secs(10),
    );
    send(&env, &publisher, "payment", &reply_to, &undo).await;
    let reply = next_reply(&mut replies, Duration::from_secs(20)).await;
    assert_eq!(reply.attempt_id, undo.attempt_id);
    match &reply.outcome {
        StepOutcome::Failed {
            error,
            permanent: true,
            ..
        } => {
            let url = format!("http://127.0.0.1:{port}/bad/refnud");
            assert!(error.contains(&url), "names the route: {error}");
            assert!(error.contains("404"), "{error}");
            assert!(
                error.contains("does not prove the action was undone"),
                "{error}"
            );
        }
        other => panic!("expected a refusal for good, got {}", outline(other)),
    }
    assert_eq!(calls.lock().unwrap().len(), 1, "refused at once");
    assert!(agent.is_running());
}
