//! What operators rely on: readiness that follows the dependencies, metrics
//! under their Prometheus names, JSON logs that carry the order id, the
//! correlation id and the W3C trace id, and trace context carried across
//! services in AMQP headers.

use std::time::Duration;

use sas_broker::lapin::BasicProperties;
use sas_broker::publish::string_headers;
use sas_messages::headers;
use sas_store::ProcessState;
use sas_tests::process::{bin_dir, free_port, metric, wait_for_metric};
use sas_tests::Setting;
use sas_tests::{order, wait_until, TestEnv};

#[tokio::test(flavor = "multi_thread")]
async fn readiness_follows_the_broker_and_the_database_while_liveness_does_not() {
    let env = TestEnv::new().await;
    let closed = free_port();
    let (good, no_broker, no_database) = (free_port(), free_port(), free_port());
    let _ready = env.scheduler(0, &[Setting::Listen(good)]);
    let _without_broker = env.scheduler(
        1,
        &[
            Setting::Listen(no_broker),
            Setting::AmqpUrl(format!("amqp://guest:guest@127.0.0.1:{closed}/%2f")),
        ],
    );
    let _without_database = env.supervisor(
        0,
        &[
            Setting::Listen(no_database),
            Setting::DatabaseUrl(format!("postgres://postgres@127.0.0.1:{closed}/nothing")),
            Setting::DatabaseMigrate(false),
        ],
    );
    wait_until(
        "the healthy scheduler to be ready",
        Duration::from_secs(20),
        || async {
            match sas_tests::local_status(good, "/readyz").await {
                Some((200, _)) => Ok(()),
                other => Err(format!("{other:?}")),
            }
        },
    )
    .await;
    for (port, missing) in [(no_broker, "RabbitMQ"), (no_database, "Postgres")] {
        // Not ready, naming what is missing (once whatever else it needs is up).
        wait_until(
            &format!("/readyz to name {missing}"),
            Duration::from_secs(20),
            || async {
                match sas_tests::local_status(port, "/readyz").await {
                    Some((503, body)) if body.contains(missing) => Ok(()),
                    other => Err(format!("{other:?}")),
                }
            },
        )
        .await;
        assert_eq!(
            sas_tests::local_status(port, "/healthz")
                .await
                .map(|(s, _)| s),
            Some(200),
            "alive all the same"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_order_s_trace_id_and_ids_appear_in_every_service_s_json_logs_and_metrics_are_exported()
{
    let env = TestEnv::new().await;
    let json = [Setting::LogFormat("json".to_owned())];
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let agent_port = free_port();
    let agent = env.agent(
        "payment",
        0,
        &sim,
        &[json[0].clone(), Setting::Listen(agent_port)],
    );
    let _others = [
        env.agent("inventory", 0, &sim, &json),
        env.agent("shipping", 0, &sim, &json),
    ];
    let scheduler_port = free_port();
    let scheduler = env.scheduler(0, &[json[0].clone(), Setting::Listen(scheduler_port)]);
    let supervisor_port = free_port();
    let _supervisor = env.supervisor(0, &[Setting::Listen(supervisor_port)]);
    let (_connection, publisher) = env.broker().await;

    // A client that traces publishes the order with its traceparent.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let body = serde_json::to_vec(&order("traced-1")).unwrap();
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_headers(string_headers([(
            headers::TRACEPARENT,
            format!("00-{trace_id}-00f067aa0ba902b7-01").as_str(),
        )]));
    publisher
        .publish("", &env.amqp().names().orders(), &body, properties, true)
        .await
        .unwrap();
    env.wait_for_count(ProcessState::Processed, 1, Duration::from_secs(30))
        .await;

    // Every JSON log line about the order carries its id, and the trace id.
    let lines = |text: String| -> Vec<serde_json::Value> {
        text.lines()
            .filter_map(|line| serde_json::from_str(line).ok())
            .filter(|v: &serde_json::Value| v.to_string().contains("traced-1"))
            .collect()
    };
    // The last reply's line is written after its commit, which the wait
    // above may see first: read the logs once all three are there.
    let applied_lines = |lines: &[serde_json::Value]| {
        lines
            .iter()
            .filter(|l| l["message"] == "reply applied")
            .count()
    };
    let scheduler_lines = wait_until(
        "the scheduler's three reply lines",
        Duration::from_secs(10),
        || async {
            let found = lines(scheduler.log_text());
            match applied_lines(&found) {
                3.. => Ok(found),
                n => Err(format!("{n} of 3")),
            }
        },
    )
    .await;
    let agent_lines = wait_until(
        "the agent's reply line",
        Duration::from_secs(10),
        || async {
            let found = lines(agent.log_text());
            if found.iter().any(|l| l["message"] == "replied") {
                Ok(found)
            } else {
                Err(format!("{} lines about the order", found.len()))
            }
        },
    )
    .await;
    let replied = agent_lines
        .iter()
        .find(|l| l["message"] == "replied")
        .expect("the agent's reply line");
    assert_eq!(replied["span"]["trace_id"], trace_id, "{replied}");
    assert!(replied["span"]["correlation_id"].is_string(), "{replied}");
    let applied = scheduler_lines
        .iter()
        .filter(|l| l["message"] == "reply applied")
        .collect::<Vec<_>>();
    assert_eq!(applied.len(), 3);
    for line in applied {
        assert_eq!(line["trace_id"], trace_id, "{line}");
        assert!(line["correlation_id"].is_string(), "{line}");
        assert_eq!(line["order_id"], "traced-1");
    }

    // Prometheus names, with units in the name.
    assert_eq!(
        metric(scheduler_port, "sas_orders_received_total").await,
        Some(1.0)
    );
    assert_eq!(
        metric(
            scheduler_port,
            r#"sas_step_latency_seconds_count{step="charge_payment"}"#
        )
        .await,
        Some(1.0)
    );
    assert!(metric(
        agent_port,
        r#"sas_agent_step_duration_seconds_count{action="charge",outcome="succeeded"}"#
    )
    .await
    .is_some());
    assert_eq!(
        metric(agent_port, r#"sas_circuit_state{agent="payment"}"#).await,
        Some(0.0)
    );
    assert_eq!(
        metric(
            scheduler_port,
            r#"sas_orders_finished_total{event="processed"}"#
        )
        .await,
        Some(1.0)
    );
    wait_for_metric(
        "the open orders gauge",
        supervisor_port,
        r#"sas_orders{state="processing"}"#,
        Duration::from_secs(10),
        |n| n == 0.0,
    )
    .await;
    assert_eq!(
        metric(supervisor_port, r#"sas_orders{state="processed"}"#).await,
        None,
        "finished orders are counted where they finish, not by a scan of every order"
    );
    // What the alert rules in deploy/prometheus read: who consumes the
    // scheduler's queues, orders stuck past complete-by, open alerts.
    let names = env.amqp().names();
    for queue in [names.orders(), names.scheduler_replies()] {
        assert_eq!(
            metric(
                scheduler_port,
                &format!(r#"sas_consumers{{queue="{queue}"}}"#)
            )
            .await,
            Some(1.0),
            "the scheduler's consumer on {queue}"
        );
    }
    assert_eq!(
        metric(
            agent_port,
            &format!(
                r#"sas_consumers{{queue="{}"}}"#,
                names.agent_requests("payment")
            )
        )
        .await,
        Some(1.0)
    );
    for gauge in ["sas_orders_overdue", "sas_alerts_open"] {
        wait_for_metric(
            gauge,
            supervisor_port,
            gauge,
            Duration::from_secs(10),
            |n| n == 0.0,
        )
        .await;
    }
}

/// The gauges the alert rules read (deploy/prometheus) count what they say:
/// an order held past complete-by + grace that no scan can take (its row
/// locked, as by a stuck transaction) is overdue until a scan recovers it,
/// and an unresolved operator alert is open until it is resolved.
#[tokio::test(flavor = "multi_thread")]
async fn the_supervisor_exports_orders_stuck_past_their_deadline_and_open_alerts() {
    let env = TestEnv::new().await;
    let pool = &env.db;
    env.store
        .writes()
        .insert_order(
            &order("stuck-1"),
            sas_store::Plan::new("order", 1, &env.steps()),
            &sas_messages::TraceParent::new_root().trace_id,
            "test",
        )
        .await
        .unwrap();
    sqlx::query(
        "UPDATE order_process SET complete_by = now() - interval '1 hour' WHERE order_id = 'stuck-1'",
    )
    .execute(pool)
    .await
    .unwrap();
    let mut holder = pool.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM order_process WHERE order_id = 'stuck-1' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO alerts (order_id, kind, message) VALUES ('stuck-1', 'compensation_failed', 'test')",
    )
    .execute(pool)
    .await
    .unwrap();
    let port = free_port();
    let _supervisor = env.supervisor(
        0,
        &[Setting::Listen(port), Setting::SupervisorIntervalMs(100)],
    );
    let gauge_reads = |gauge: &'static str, expected: f64| async move {
        wait_for_metric(
            &format!("{gauge} = {expected}"),
            port,
            gauge,
            Duration::from_secs(20),
            |value| value == expected,
        )
        .await;
    };
    gauge_reads("sas_orders_overdue", 1.0).await;
    gauge_reads("sas_alerts_open", 1.0).await;
    // Once the row is free, a scan recovers the order.
    holder.rollback().await.unwrap();
    gauge_reads("sas_orders_overdue", 0.0).await;
    sqlx::query("UPDATE alerts SET resolved_at = now()")
        .execute(pool)
        .await
        .unwrap();
    gauge_reads("sas_alerts_open", 0.0).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sasctl_submits_and_watches_an_order_and_shows_it_from_the_state_store() {
    let env = TestEnv::new().await;
    let _system = env.system(1).await;
    let (code, out) = env
        .sasctl(&["submit", "--order-id", "cli-1", "--watch"])
        .await;
    assert_eq!(code, 0, "processed: exit 0");
    let events: Vec<&str> = out
        .lines()
        .filter_map(|line| line.split_whitespace().nth(2))
        .collect();
    assert_eq!(events, sas_tests::PROCESSED_EVENTS, "{out}");

    let (code, out) = env
        .sasctl(&[
            "submit",
            "--order-id",
            "cli-2",
            "--amount-cents",
            "50000000",
            "--watch",
        ])
        .await;
    assert_eq!(code, 3, "compensated: exit 3");
    assert!(
        out.contains("compensating") && out.contains("declined"),
        "{out}"
    );

    let (code, out) = env.sasctl(&["orders", "show", "cli-2"]).await;
    assert_eq!(code, 0);
    assert!(
        out.contains("compensated") && out.contains("cli-2:reserve_stock"),
        "{out}"
    );
    let (code, out) = env
        .sasctl(&["orders", "list", "--state", "processed"])
        .await;
    assert_eq!(code, 0);
    assert!(out.contains("cli-1") && !out.contains("cli-2"), "{out}");
    // Watching an order that already ended replays its history and exits at once.
    let (code, out) = env.sasctl(&["watch", "cli-1"]).await;
    assert_eq!(code, 0);
    assert!(out.contains("order cli-1 is processed"), "{out}");
    let (code, _) = env.sasctl(&["orders", "show", "no-such-order"]).await;
    assert_eq!(code, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn with_the_status_exchange_off_status_messages_still_reach_the_order_s_reply_to() {
    let env = TestEnv::new().await;
    let off = [Setting::AmqpStatusExchange(false)];
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _scheduler = env.scheduler(0, &off);
    let _supervisor = env.supervisor(0, &off);
    let (connection, publisher) = env.broker().await;
    let settings = env.amqp();
    let (_, mut watched) =
        sas_broker::topology::status_consumer(&connection, &settings, &["order.*"])
            .await
            .unwrap();
    let (client_queue, mut client) =
        sas_broker::topology::status_consumer(&connection, &settings, &[])
            .await
            .unwrap();

    let mut submitted = order("quiet-1");
    submitted.reply_to = Some(client_queue);
    env.publish_order(&publisher, &submitted).await;
    let events = sas_tests::status_events(&mut client, sas_messages::StatusEvent::Processed).await;
    assert_eq!(events.len(), 5, "{events:?}");
    // Published in order on one channel: had the exchange copies been sent,
    // they would be here by now.
    let stray = tokio::time::timeout(
        Duration::from_millis(300),
        futures_util::StreamExt::next(&mut watched),
    )
    .await;
    assert!(stray.is_err(), "nothing went to the status exchange");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_migration_the_database_refuses_stops_scheduler_migrate_at_once_naming_it() {
    let env = TestEnv::unmigrated(3000).await;
    // A table by the name the first migration creates, as in a database
    // shared with another application, or pointed at by mistake.
    sqlx::query("CREATE TABLE orders (x int)")
        .execute(&env.db)
        .await
        .expect("create the conflicting table");
    let log = env.dir.join("migrate.log");
    let file = std::fs::File::create(&log).expect("log file");
    let mut command = tokio::process::Command::new(bin_dir().join("scheduler"));
    for (key, _) in std::env::vars() {
        if key.starts_with("SAS_") {
            command.env_remove(key);
        }
    }
    let mut migrate = command
        .arg("migrate")
        .env("SAS_DATABASE__URL", &env.database_url)
        .env("SAS_LOG__FILTER", "info")
        .env("NO_COLOR", "1")
        .stdin(std::process::Stdio::null())
        .stdout(file.try_clone().expect("log file"))
        .stderr(file)
        .kill_on_drop(true)
        .spawn()
        .expect("start scheduler migrate");

    // Not retried as if the database were away (that would take a minute):
    // the same SQL fails the same way every time.
    let status = wait_until("scheduler migrate to exit", Duration::from_secs(15), || {
        let exited = migrate.try_wait();
        async move {
            match exited {
                Ok(Some(status)) => Ok(status),
                Ok(None) => Err("still running".to_owned()),
                Err(error) => Err(error.to_string()),
            }
        }
    })
    .await;
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(!status.success(), "{status}: {output}");
    assert!(
        output.contains("migration 1 (initial)") && output.contains("already exists"),
        "names the migration and the database's reason: {output}"
    );
    assert!(
        !output.contains("retrying"),
        "a failing migration is not retried: {output}"
    );
    // Each migration runs in one transaction: nothing of it is left behind.
    let applied: bool = sqlx::query_scalar("SELECT to_regclass('order_process') IS NOT NULL")
        .fetch_one(&env.db)
        .await
        .expect("query the catalog");
    assert!(!applied, "the failed migration left nothing behind");
}

/// A client following RabbitMQ's request/reply convention sets `reply_to`
/// and `correlation_id` as message properties and names no `reply_to` in the
/// body: its status messages come to that queue, each with its correlation id.
#[tokio::test(flavor = "multi_thread")]
async fn a_client_s_reply_to_and_correlation_id_properties_are_honoured() {
    use futures_util::StreamExt;

    let env = TestEnv::new().await;
    let _system = env.system(1).await;
    let (connection, publisher) = env.broker().await;
    let (client_queue, channel) = env.client_queue(&connection, "rpc-client").await;
    let mut consumer = sas_tests::consume(&channel, &client_queue, "rpc").await;
    let body = serde_json::to_vec(&order("rpc-1")).unwrap();
    assert!(!String::from_utf8_lossy(&body).contains("reply_to"));
    publisher
        .publish(
            "",
            &env.amqp().names().orders(),
            &body,
            BasicProperties::default()
                .with_delivery_mode(2)
                .with_content_type("application/json".into())
                .with_reply_to(client_queue.as_str().into())
                .with_correlation_id("client-corr-42".into()),
            true,
        )
        .await
        .unwrap();
    let mut events = Vec::new();
    while events.last() != Some(&sas_messages::StatusEvent::Processed) {
        let delivery = tokio::time::timeout(Duration::from_secs(20), consumer.next())
            .await
            .expect("a status message within 20 s")
            .expect("the consumer is open")
            .expect("a delivery");
        assert_eq!(
            delivery
                .properties
                .correlation_id()
                .as_ref()
                .map(|id| id.as_str()),
            Some("client-corr-42"),
            "every status message carries the client's correlation id"
        );
        let status: sas_messages::OrderStatus = serde_json::from_slice(&delivery.data).unwrap();
        assert_eq!(status.order_id, "rpc-1");
        events.push(status.event);
    }
    use sas_messages::StatusEvent::*;
    assert_eq!(
        events,
        [
            Received,
            StepCompleted,
            StepCompleted,
            StepCompleted,
            Processed
        ]
    );
}
