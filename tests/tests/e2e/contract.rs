//! The published contract, as clients in other languages meet it: the
//! Python (pika) and Node (amqplib) examples against a running system, every
//! kind of refused order answered `rejected` through pika, a refusal
//! answered once however often it comes back, the README's program being
//! the tested example, and the AsyncAPI document valid against the
//! AsyncAPI 3.0 specification's own schema.
//!
//! The clients' packages come from `scripts/client-deps.sh` (run by
//! `scripts/test.sh`); a test without them fails saying so.

use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use sas_broker::lapin::options::QueueDeclareOptions;
use sas_broker::lapin::types::FieldTable;
use sas_store::ProcessState;
use sas_tests::process::{free_port, metric, wait_for_metric};
use sas_tests::Setting;
use sas_tests::{order, repo_root, Service, TestEnv};
use serde_json::{json, Value};

/// `PYTHONPATH` with the folder `scripts/client-deps.sh` installs pika into.
fn python_path() -> String {
    let keep = repo_root().join("target/client-deps/python");
    match std::env::var("PYTHONPATH") {
        Ok(path) if !path.is_empty() => format!("{}:{path}", keep.display()),
        _ => keep.display().to_string(),
    }
}

/// Fails unless python3 imports pika and the Node example's packages are in.
async fn require_clients() {
    let pika = tokio::process::Command::new("python3")
        .args(["-c", "import pika"])
        .env("PYTHONPATH", python_path())
        .status()
        .await;
    assert!(
        pika.is_ok_and(|status| status.success()),
        "python3 cannot import pika: run scripts/client-deps.sh (scripts/test.sh does)"
    );
    assert!(
        repo_root()
            .join("examples/node/node_modules/amqplib")
            .is_dir(),
        "examples/node has no node_modules: run scripts/client-deps.sh (scripts/test.sh does)"
    );
}

/// Runs a client program (`python3 <file>` or `node <file>`) against the
/// test's deployment and returns its exit code and output.
async fn run_client(
    env: &TestEnv,
    program: &str,
    file: &Path,
    stdin: Option<&str>,
) -> (i32, String) {
    use tokio::io::AsyncWriteExt as _;
    let mut child = tokio::process::Command::new(program)
        .arg(file)
        .env("AMQP_URL", &env.amqp_url)
        .env("AMQP_PREFIX", &env.prefix)
        .env("PYTHONPATH", python_path())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap_or_else(|e| panic!("start {program}: {e}"));
    let mut input = child.stdin.take().expect("stdin");
    input
        .write_all(stdin.unwrap_or_default().as_bytes())
        .await
        .unwrap();
    drop(input);
    let output = tokio::time::timeout(Duration::from_secs(120), child.wait_with_output())
        .await
        .unwrap_or_else(|_| panic!("{} did not finish within 120 s", file.display()))
        .expect("the client ran");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    );
    eprintln!("{} printed:\n{stdout}{stderr}", file.display());
    (output.status.code().unwrap_or(-1), stdout)
}

/// A whole system whose scheduler serves its metrics on the returned port.
async fn system(env: &TestEnv) -> (Vec<Service>, u16) {
    let (sim_process, sim) = env.remote_sim(&[]).await;
    let mut services = env.agents(1, &sim, &[]);
    services.push(sim_process);
    services.push(env.supervisor(0, &[]));
    let ops = free_port();
    services.push(env.scheduler(0, &[Setting::Listen(ops)]));
    (services, ops)
}

fn assert_running(services: &mut [Service]) {
    for service in services {
        assert!(
            service.is_running(),
            "{} exited (log {})",
            service.name,
            service.log.display()
        );
    }
}

#[test]
fn the_readmes_python_program_is_the_tested_example() {
    let readme = std::fs::read_to_string(repo_root().join("README.md")).unwrap();
    let start = readme
        .find("```python\n")
        .expect("the README has a Python block")
        + 10;
    let length = readme[start..].find("```").expect("a closed block");
    let example =
        std::fs::read_to_string(repo_root().join("examples/python/first_order.py")).unwrap();
    assert_eq!(
        &readme[start..start + length],
        example,
        "README.md's Python program differs from examples/python/first_order.py, which the tests run: copy one over the other"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_python_and_node_clients_read_their_order_to_processed() {
    require_clients().await;
    let env = TestEnv::new().await;
    let (mut services, _) = system(&env).await;
    // The topology, as the services declare it (they may not have yet).
    let (_connection, _publisher) = env.broker().await;
    let python = repo_root().join("examples/python/first_order.py");
    let node = repo_root().join("examples/node/first-order.js");
    let ((python_code, python_out), (node_code, node_out)) = tokio::join!(
        run_client(&env, "python3", &python, None),
        run_client(&env, "node", &node, None)
    );
    for (client, code, out) in [
        ("python", python_code, python_out),
        ("node", node_code, node_out),
    ] {
        let events: Vec<&str> = out
            .lines()
            .filter_map(|line| line.split(' ').next())
            .collect();
        assert_eq!(
            events,
            sas_tests::PROCESSED_EVENTS,
            "{client} client's output"
        );
        assert_eq!(code, 0, "{client} client's exit code");
    }
    env.wait_for_count(ProcessState::Processed, 2, Duration::from_secs(10))
        .await;
    assert_running(&mut services);
}

/// One refused order of the matrix: its correlation id, where its answer
/// must go, the order id it must echo and words of its reason.
struct Refused {
    correlation_id: &'static str,
    body: String,
    reply_to: Option<String>,
    answer_on: String,
    order_id: &'static str,
    reason: &'static str,
}

fn valid_order(id: &str) -> Value {
    serde_json::to_value(order(id)).unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn every_kind_of_refused_order_is_answered_rejected_through_pika_and_dead_lettered() {
    require_clients().await;
    let env = TestEnv::new().await;
    let (mut services, ops) = system(&env).await;
    let (_connection, publisher) = env.broker().await;
    // The order a conflicting submission will collide with.
    env.publish_order(&publisher, &order("conflict-1")).await;
    env.wait_for_count(ProcessState::Processed, 1, Duration::from_secs(30))
        .await;

    // The plain example first: an unknown field, answered with the reason.
    let (code, out) = run_client(
        &env,
        "python3",
        &repo_root().join("examples/python/rejected.py"),
        None,
    )
    .await;
    assert_eq!(code, 0, "{out}");
    assert!(out.starts_with("rejected my-request-1 ord-"), "{out}");
    assert!(out.contains("unknown field `colour`"), "{out}");

    let names = env.amqp().names();
    let (property_queue, body_queue) = (
        format!("{}sas.client.guest.property", env.prefix),
        format!("{}sas.client.guest.body", env.prefix),
    );
    let with = |mut value: Value, fields: &[(&str, Value)]| {
        for (key, field) in fields {
            value[*key] = field.clone();
        }
        value.to_string()
    };
    let mut unknown = valid_order("unknown-1");
    unknown["colour"] = json!("red");
    let mut invalid = valid_order("invalid-1");
    invalid["items"][0]["quantity"] = json!(0);
    invalid["reply_to"] = json!(body_queue);
    let mut conflicting = valid_order("conflict-1");
    conflicting["amount_cents"] = json!(1);
    let refused = [
        Refused {
            correlation_id: "c-malformed",
            body: "{\"order_id\": ".into(),
            reply_to: Some(property_queue.clone()),
            answer_on: property_queue.clone(),
            order_id: "",
            reason: "malformed JSON",
        },
        Refused {
            // No property: the body's reply_to is all there is.
            correlation_id: "c-version",
            body: with(
                valid_order("version-1"),
                &[
                    ("schema_version", json!(99)),
                    ("reply_to", json!(body_queue)),
                ],
            ),
            reply_to: None,
            answer_on: body_queue.clone(),
            order_id: "version-1",
            reason: "unsupported schema_version 99",
        },
        Refused {
            correlation_id: "c-unknown",
            body: unknown.to_string(),
            reply_to: Some(property_queue.clone()),
            answer_on: property_queue.clone(),
            order_id: "unknown-1",
            reason: "unknown field `colour`",
        },
        Refused {
            // Both: the body's wins.
            correlation_id: "c-invalid",
            body: invalid.to_string(),
            reply_to: Some(property_queue.clone()),
            answer_on: body_queue.clone(),
            order_id: "invalid-1",
            reason: "items[0].quantity must be at least 1",
        },
        Refused {
            // Over amqp.max_message_bytes (64 KiB): refused unread, so the
            // property is the only way back.
            correlation_id: "c-oversized",
            body: with(
                valid_order("big-1"),
                &[
                    ("customer_id", json!("x".repeat(70_000))),
                    ("reply_to", json!(body_queue)),
                ],
            ),
            reply_to: Some(property_queue.clone()),
            answer_on: property_queue.clone(),
            order_id: "",
            reason: "over the limit of 65536 bytes",
        },
        Refused {
            correlation_id: "c-conflict",
            body: conflicting.to_string(),
            reply_to: Some(property_queue.clone()),
            answer_on: property_queue.clone(),
            order_id: "conflict-1",
            reason: "already used by an order with different content",
        },
        Refused {
            // Postgres would refuse the NUL byte: refused up front.
            correlation_id: "c-control",
            body: with(
                valid_order("control-1"),
                &[("reply_to", json!("client\u{0}queue"))],
            ),
            reply_to: Some(property_queue.clone()),
            answer_on: property_queue.clone(),
            order_id: "control-1",
            reason: "without control characters",
        },
        Refused {
            // Statuses may not go to the system's own queues: refused, and
            // answered on the property instead.
            correlation_id: "c-own-queue",
            body: with(
                valid_order("own-1"),
                &[("reply_to", json!(names.agent_requests("payment")))],
            ),
            reply_to: Some(property_queue.clone()),
            answer_on: property_queue.clone(),
            order_id: "own-1",
            reason: "one of the system's own queues",
        },
    ];
    let mut publish: Vec<Value> = refused
        .iter()
        .map(|r| json!({ "body": r.body, "reply_to": r.reply_to, "correlation_id": r.correlation_id }))
        .collect();
    // A refused order whose reply_to queue does not exist: dropped by the
    // broker, and intake goes on: the good order after it is processed.
    publish.push(json!({ "body": "[]", "reply_to": format!("{}sas.client.guest.nobody", env.prefix), "correlation_id": "c-missing" }));
    publish.push(json!({ "body": valid_order("after-1").to_string(), "reply_to": property_queue, "correlation_id": "c-after" }));
    let spec = json!({
        "url": env.amqp_url, "exchange": names.orders(), "listen": [property_queue, body_queue],
        "publish": publish, "expect": refused.len() + 5, "timeout": 60, "linger": 1,
    });
    let (code, out) = run_client(
        &env,
        "python3",
        &repo_root().join("tests/clients/pika_driver.py"),
        Some(&spec.to_string()),
    )
    .await;
    assert_eq!(code, 0, "the pika driver failed");
    let received: Vec<Value> = out
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();

    for case in &refused {
        let answers: Vec<&Value> = received
            .iter()
            .filter(|m| m["correlation_id"] == case.correlation_id)
            .collect();
        assert_eq!(
            answers.len(),
            1,
            "{}: one answer, got {answers:?}",
            case.correlation_id
        );
        let answer = answers[0];
        let status: sas_messages::OrderStatus =
            serde_json::from_value(answer["status"].clone()).unwrap();
        assert_eq!(
            status.event,
            sas_messages::StatusEvent::Rejected,
            "{answer}"
        );
        assert_eq!(answer["queue"], case.answer_on.as_str(), "{answer}");
        assert_eq!(status.order_id, case.order_id, "{answer}");
        let detail = status.detail.unwrap_or_default();
        assert!(
            detail.contains(case.reason),
            "{}: {detail}",
            case.correlation_id
        );
        assert!(
            detail.len() <= 1024,
            "the detail is bounded: {}",
            detail.len()
        );
        assert!(
            answer["message_id"]
                .as_str()
                .unwrap_or_default()
                .starts_with("rejected-"),
            "{answer}"
        );
    }
    assert!(!received.iter().any(|m| m["correlation_id"] == "c-missing"));
    let after: Vec<&str> = received
        .iter()
        .filter(|m| m["correlation_id"] == "c-after")
        .map(|m| m["status"]["event"].as_str().unwrap())
        .collect();
    assert_eq!(after, sas_tests::PROCESSED_EVENTS);

    // Each refused message was dead-lettered as before, and recorded.
    let dead = refused.len() + 2; // with rejected.py's and c-missing
    env.wait_for_dead_letters(dead, Duration::from_secs(20))
        .await;
    let counted = |outcome: &str| format!("sas_rejected_answers_total{{outcome=\"{outcome}\"}}");
    assert_eq!(
        metric(ops, &counted("sent")).await,
        Some((refused.len() + 1) as f64)
    );
    assert_eq!(metric(ops, &counted("unroutable")).await, Some(1.0));
    assert_running(&mut services);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_order_that_comes_back_is_answered_once() {
    let env = TestEnv::new().await;
    let (connection, publisher) = env.broker().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let ops = free_port();
    let mut scheduler = env.scheduler(0, &[Setting::Listen(ops)]);
    let names = env.amqp().names();
    let channel = connection.create_channel().await.unwrap();
    wait_for_metric(
        "the scheduler to consume orders",
        ops,
        &format!("sas_consumers{{queue=\"{}\"}}", names.orders()),
        Duration::from_secs(20),
        |n| n >= 1.0,
    )
    .await;
    // Dead-lettering now fails (nothing is bound to the dead-letter
    // exchange: the publish comes back), so the scheduler hands the refused
    // message back and it is delivered again, up to the delivery limit.
    for queue in [names.dead_letters(), names.dead_letter_records()] {
        channel
            .queue_unbind(
                queue.as_str().into(),
                names.dead_letter_exchange().as_str().into(),
                "".into(),
                FieldTable::default(),
            )
            .await
            .unwrap();
    }
    let client_queue = format!("{}sas.client.test.once", env.prefix);
    channel
        .queue_declare(
            client_queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    publisher
        .publish(
            "",
            &names.orders(),
            b"{\"not\": \"an order\"}",
            sas_broker::lapin::BasicProperties::default()
                .with_delivery_mode(2)
                .with_reply_to(client_queue.as_str().into())
                .with_correlation_id("once-1".into()),
            true,
        )
        .await
        .unwrap();
    // Every delivery is refused (counted before any answer is decided);
    // the queue's delivery limit (3) gives the message four.
    wait_for_metric(
        "the refused message to be delivered four times",
        ops,
        "sas_orders_rejected_total",
        Duration::from_secs(30),
        |n| n >= 4.0,
    )
    .await;
    let answers = channel
        .queue_declare(
            client_queue.as_str().into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .unwrap()
        .message_count();
    assert_eq!(
        answers, 1,
        "the client heard the same refusal {answers} times"
    );
    assert!(scheduler.is_running());
}

#[test]
fn the_asyncapi_document_is_valid_against_the_asyncapi_3_schema() {
    let specs = repo_root()
        .join("examples/node/node_modules/@asyncapi/specs/schemas/3.0.0-without-$id.json");
    let schema: Value =
        serde_json::from_str(&std::fs::read_to_string(&specs).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; run scripts/client-deps.sh (scripts/test.sh does)",
                specs.display()
            )
        }))
        .unwrap();
    let document: Value = serde_norway::from_str(
        &std::fs::read_to_string(repo_root().join("contract/asyncapi.yaml")).unwrap(),
    )
    .unwrap();
    let validator = jsonschema::validator_for(&schema).expect("the AsyncAPI schema compiles");
    let errors: Vec<String> = validator
        .iter_errors(&document)
        .map(|error| format!("{error} at {}", error.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "contract/asyncapi.yaml is not valid AsyncAPI 3.0.0:\n{}",
        errors.join("\n")
    );
    // And the check has teeth: a wrong action is caught.
    let mut broken = document.clone();
    broken["operations"]["submitOrder"]["action"] = json!("shout");
    assert!(!validator.is_valid(&broken));
}
