//! The end-to-end path: orders published to RabbitMQ run through scheduler,
//! agents and supervisor processes against real RabbitMQ and Postgres.

use sas_store::machine::HistoryEvent;
use std::collections::{HashMap, HashSet};
use std::time::Duration;

use sas_broker::lapin::options::BasicGetOptions;
use sas_broker::publish::header_str;
use sas_messages::headers;
use sas_store::ProcessState;
use sas_tests::Setting;
use sas_tests::{order, wait_until, TestEnv};

const STEPS: [&str; 3] = ["reserve_stock", "charge_payment", "create_shipment"];

#[tokio::test(flavor = "multi_thread")]
async fn two_hundred_orders_with_three_agents_per_queue_are_each_processed_once() {
    let env = TestEnv::new().await;
    let mut system = env.system(3).await;
    let (_connection, publisher) = env.broker().await;

    let ids: Vec<String> = (0..200).map(|n| format!("bulk-{n}")).collect();
    for id in &ids {
        env.publish_order(&publisher, &order(id)).await;
    }
    env.wait_for_count(ProcessState::Processed, 200, Duration::from_secs(90))
        .await;
    system.assert_all_running();

    // Every agent process took part: replies name the replica that answered.
    let rows: Vec<(String,)> =
        sqlx::query_as("SELECT detail FROM history WHERE event = 'step_completed'")
            .fetch_all(&env.db)
            .await
            .unwrap();
    let mut per_agent: HashMap<String, usize> = HashMap::new();
    for (detail,) in rows {
        *per_agent
            .entry(detail.trim_start_matches("by ").to_owned())
            .or_default() += 1;
    }
    for agent in ["inventory", "payment", "shipping"] {
        for index in 0..3 {
            let id = format!("{agent}-{index}");
            assert!(
                per_agent.get(&id).copied().unwrap_or(0) > 0,
                "{id} handled no request: {per_agent:?}"
            );
        }
    }

    // Exactly one side effect per step per order, under the step's stable key.
    let applied = system.sim.applied_per_key().await.unwrap();
    assert_eq!(applied.len(), 600, "one side effect per step per order");
    for id in &ids {
        for step in STEPS {
            assert_eq!(
                applied.get(&format!("{id}:{step}")),
                Some(&1),
                "{id} {step}"
            );
        }
    }
    // And no step needed a second attempt, so nothing was repeated.
    let attempts: i64 = sqlx::query_scalar("SELECT max(attempt)::int8 FROM steps")
        .fetch_one(&env.db)
        .await
        .unwrap();
    assert_eq!(attempts, 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn an_order_published_twice_and_a_redelivered_request_change_nothing_twice() {
    let env = TestEnv::new().await;
    let system = env.system(1).await;
    let (connection, publisher) = env.broker().await;

    let twice = order("twice-1");
    env.publish_order(&publisher, &twice).await;
    env.publish_order(&publisher, &twice).await;
    env.wait_for_count(ProcessState::Processed, 1, Duration::from_secs(30))
        .await;

    // Replay a request the agent already answered, as a redelivery would:
    // same attempt id, same idempotency key.
    let detail = env.detail("twice-1").await;
    let step = &detail.steps[0];
    let request = sas_messages::StepRequest {
        schema_version: sas_messages::SCHEMA_VERSION,
        order_id: "twice-1".into(),
        step: step.name.clone(),
        kind: sas_messages::StepKind::Action,
        action: "reserve".into(),
        attempt_id: step.attempt_id.unwrap(),
        attempt: 1,
        idempotency_key: step.idempotency_key.clone(),
        complete_by: chrono::Utc::now() + chrono::Duration::seconds(30),
        start_by: None,
        dispatched_at: None,
        payload: serde_json::json!({ "order": detail.body, "results": {} }),
        method: None,
        path: None,
        limit_key: None,
    };
    let names = env.amqp().names();
    let attempt_id = step.attempt_id.unwrap().to_string();
    publisher
        .publish_json(
            "",
            &names.agent_requests("inventory"),
            &request,
            sas_broker::publish::json_properties("replayed")
                .with_correlation_id(attempt_id.as_str().into())
                .with_reply_to(names.scheduler_replies().into()),
            true,
        )
        .await
        .unwrap();

    // The replayed reply reaches the scheduler and is fenced off as stale.
    wait_until(
        "the replayed reply to be ignored as stale",
        Duration::from_secs(20),
        || async {
            let history = env
                .store
                .reads()
                .history("twice-1")
                .await
                .map_err(|e| e.to_string())?;
            if history.iter().any(|h| h.event == HistoryEvent::StaleReply) {
                Ok(())
            } else {
                Err(format!(
                    "{:?}",
                    history.iter().map(|h| &h.event).collect::<Vec<_>>()
                ))
            }
        },
    )
    .await;

    let history = env.store.reads().history("twice-1").await.unwrap();
    let count = |event: HistoryEvent| history.iter().filter(|h| h.event == event).count();
    assert_eq!(
        count(HistoryEvent::Received),
        1,
        "the second submission was a no-op"
    );
    assert_eq!(count(HistoryEvent::StepCompleted), 3);
    assert_eq!(count(HistoryEvent::Processed), 1);
    let applied = system.sim.applied_per_key().await.unwrap();
    assert_eq!(applied.len(), 3, "{applied:?}");
    let stats = system.sim.stats().await.unwrap();
    assert_eq!(
        stats.deduplicated, 1,
        "the replayed call was answered from the first decision"
    );
    assert_eq!(
        env.detail("twice-1").await.summary.state,
        ProcessState::Processed
    );

    // The same order id with other content is refused, not merged.
    let mut changed = order("twice-1");
    changed.amount_cents += 1;
    env.publish_order(&publisher, &changed).await;
    let channel = connection.create_channel().await.unwrap();
    let reason = wait_until(
        "the conflicting order to be dead-lettered",
        Duration::from_secs(20),
        || async {
            match channel
                .basic_get(
                    names.dead_letters().into(),
                    BasicGetOptions { no_ack: true },
                )
                .await
            {
                Ok(Some(message)) => Ok(header_str(
                    &message.delivery.properties,
                    headers::DEAD_LETTER_REASON,
                )
                .unwrap_or_default()),
                other => Err(format!("{:?}", other.map(|m| m.is_some()))),
            }
        },
    )
    .await;
    assert!(reason.contains("already used"), "{reason}");
}

#[tokio::test(flavor = "multi_thread")]
async fn malformed_json_a_wrong_schema_version_and_an_unknown_field_are_dead_lettered_with_a_reason(
) {
    let env = TestEnv::new().await;
    let mut system = env.system(1).await;
    let (connection, publisher) = env.broker().await;
    let names = env.amqp().names();

    let mut wrong_version = serde_json::to_value(order("bad-version")).unwrap();
    wrong_version["schema_version"] = 99.into();
    let mut unknown_field = serde_json::to_value(order("bad-field")).unwrap();
    unknown_field["colour"] = "red".into();
    let bad: [(&str, Vec<u8>); 3] = [
        ("malformed JSON", b"{\"order_id\": ".to_vec()),
        (
            "unsupported schema_version 99",
            serde_json::to_vec(&wrong_version).unwrap(),
        ),
        (
            "unknown field `colour`",
            serde_json::to_vec(&unknown_field).unwrap(),
        ),
    ];
    for (_, body) in &bad {
        env.publish_raw(&publisher, &names.orders(), body).await;
    }
    // Garbage on an agent queue and on the reply queue too.
    env.publish_raw(
        &publisher,
        &names.agent_requests("payment"),
        b"\x00\x01not json",
    )
    .await;
    env.publish_raw(&publisher, &names.scheduler_replies(), b"[]")
        .await;

    let channel = connection.create_channel().await.unwrap();
    let collected = std::sync::Mutex::new(Vec::<(String, String)>::new());
    wait_until("five dead letters", Duration::from_secs(30), || async {
        while let Ok(Some(message)) = channel
            .basic_get(
                names.dead_letters().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
        {
            let properties = &message.delivery.properties;
            collected.lock().unwrap().push((
                header_str(properties, headers::DEAD_LETTER_SOURCE_QUEUE).unwrap_or_default(),
                header_str(properties, headers::DEAD_LETTER_REASON).unwrap_or_default(),
            ));
        }
        let reasons = collected.lock().unwrap();
        if reasons.len() >= 5 {
            Ok(())
        } else {
            Err(format!("{reasons:?}"))
        }
    })
    .await;
    let reasons = collected.into_inner().unwrap();
    for (expected, _) in &bad {
        assert!(
            reasons
                .iter()
                .any(|(queue, reason)| *queue == names.orders() && reason.contains(expected)),
            "no dead letter from the orders queue saying {expected:?}: {reasons:?}"
        );
    }
    let sources: HashSet<&str> = reasons.iter().map(|(queue, _)| queue.as_str()).collect();
    assert!(
        sources.contains(names.agent_requests("payment").as_str()),
        "{reasons:?}"
    );
    assert!(
        sources.contains(names.scheduler_replies().as_str()),
        "{reasons:?}"
    );

    // The supervisor recorded them in the state store, with the order when known.
    env.wait_for_dead_letters(5, Duration::from_secs(20)).await;
    let letters = env.store.reads().dead_letters(100).await.unwrap();
    assert!(
        letters
            .iter()
            .any(|l| l.order_id.as_deref() == Some("bad-field")),
        "{letters:?}"
    );

    // Nothing else stopped: a good order still goes through.
    env.publish_order(&publisher, &order("good-after-bad"))
        .await;
    env.wait_for_count(ProcessState::Processed, 1, Duration::from_secs(30))
        .await;
    system.assert_all_running();
}

#[tokio::test(flavor = "multi_thread")]
async fn two_scheduler_processes_never_run_the_same_order_at_the_same_time() {
    let env = TestEnv::new().await;
    // Orders waiting to be claimed, as the supervisor leaves them after a timeout.
    let steps = env.steps();
    for n in 0..150 {
        env.store
            .writes()
            .insert_order(
                &order(&format!("claim-{n}")),
                sas_store::Plan::new("order", 1, &steps),
                &sas_messages::TraceParent::new_root().trace_id,
                "test",
            )
            .await
            .unwrap();
    }
    sqlx::query("UPDATE steps SET state = 'not_started', attempt = 0, attempt_id = NULL, complete_by = NULL")
        .execute(&env.db)
        .await
        .unwrap();
    sqlx::query("UPDATE order_process SET state = 'pending', locked_by = NULL, complete_by = NULL")
        .execute(&env.db)
        .await
        .unwrap();

    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents: Vec<_> = ["inventory", "payment", "shipping"]
        .iter()
        .map(|a| env.agent(a, 0, &sim, &[]))
        .collect();
    // Three schedulers racing on the same pending orders, claiming small batches.
    let batch = [
        Setting::SchedulerClaimBatch(4),
        Setting::SchedulerClaimIntervalMs(10),
    ];
    let _schedulers: Vec<_> = (0..3).map(|i| env.scheduler(i, &batch)).collect();
    env.wait_for_count(ProcessState::Processed, 150, Duration::from_secs(90))
        .await;

    let claims: Vec<(String, i64, i64)> = sqlx::query_as(
        "SELECT order_id, count(*) FILTER (WHERE event = 'claimed'), count(DISTINCT actor) FILTER (WHERE event = 'claimed')
           FROM history GROUP BY order_id",
    )
    .fetch_all(&env.db)
    .await
    .unwrap();
    assert_eq!(claims.len(), 150);
    for (order_id, claimed, _) in &claims {
        assert_eq!(*claimed, 1, "{order_id} was claimed {claimed} times");
    }
    let claimers: HashSet<String> =
        sqlx::query_scalar("SELECT DISTINCT actor FROM history WHERE event = 'claimed'")
            .fetch_all(&env.db)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert!(
        claimers.len() >= 2,
        "the schedulers did compete: {claimers:?}"
    );
    let repeated: i64 = sqlx::query_scalar("SELECT count(*) FROM steps WHERE attempt <> 1")
        .fetch_one(&env.db)
        .await
        .unwrap();
    assert_eq!(repeated, 0, "every step ran exactly one attempt");
    let applied = sim.applied_per_key().await.unwrap();
    assert_eq!(applied.len(), 450);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_test_environment_removes_its_database_and_queues() {
    let env = TestEnv::new().await;
    let database = env.database.clone();
    let settings = env.amqp();
    let (connection, _publisher) = env.broker().await;
    assert!(sas_tests::env::database_exists(&database).await);
    drop(env);
    assert!(
        !sas_tests::env::database_exists(&database).await,
        "database {database} left behind"
    );
    let channel = connection.create_channel().await.unwrap();
    let passive = channel
        .queue_declare(
            settings.names().orders().into(),
            sas_broker::lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await;
    assert!(
        passive.is_err(),
        "queue {} left behind",
        settings.names().orders()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn services_starting_together_on_an_empty_database_apply_the_migrations_once() {
    let env = TestEnv::unmigrated(3000).await;
    // Two schedulers and two supervisors race to migrate the same empty database.
    let mut services: Vec<_> = (0..2).map(|i| env.scheduler(i, &[])).collect();
    services.extend((0..2).map(|i| env.supervisor(i, &[])));
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("after-migration"))
        .await;
    env.wait_for_count(ProcessState::Processed, 1, Duration::from_secs(30))
        .await;
    let applied: Vec<(i64, bool)> =
        sqlx::query_as("SELECT version, success FROM _sqlx_migrations ORDER BY version")
            .fetch_all(&env.db)
            .await
            .unwrap();
    assert_eq!(
        applied.len(),
        sas_store::MIGRATOR.iter().count(),
        "{applied:?}"
    );
    assert!(applied.iter().all(|(_, success)| *success));
    // An index built CONCURRENTLY that failed half-way is left invalid.
    let invalid: Vec<String> =
        sqlx::query_scalar("SELECT indexrelid::regclass::text FROM pg_index WHERE NOT indisvalid")
            .fetch_all(&env.db)
            .await
            .unwrap();
    assert!(invalid.is_empty(), "invalid indexes: {invalid:?}");
    for service in &mut services {
        assert!(
            service.is_running(),
            "{} exited (log {})",
            service.name,
            service.log.display()
        );
        // Waiting for the migration lock must not deadlock with a
        // migration that builds an index CONCURRENTLY (each deadlock
        // costs a second, and under load many of them passed the deadline).
        let log = std::fs::read_to_string(&service.log).unwrap();
        assert!(
            !log.contains("deadlock detected"),
            "{} met a deadlock while migrating (log {})",
            service.name,
            service.log.display()
        );
    }
}

/// Queues an earlier version declared with another delivery limit (a queue
/// argument, which RabbitMQ never changes once the queue exists) are used as
/// they are, with a warning saying how to change the limit: a deployment
/// upgraded to a new `amqp.delivery_limit` keeps running. Before, every
/// service failed its declarations and waited for ever.
#[tokio::test(flavor = "multi_thread")]
async fn queues_declared_with_another_delivery_limit_are_used_as_they_are() {
    let env = TestEnv::new().await;
    let (_connection, publisher) = env
        .broker_with(sas_broker::AmqpSettings {
            delivery_limit: 7,
            ..env.amqp()
        })
        .await;
    let system = env.system(1).await;
    env.publish_order(&publisher, &order("upgraded-1")).await;
    env.wait_for_state(
        "upgraded-1",
        ProcessState::Processed,
        Duration::from_secs(30),
    )
    .await;
    let log = system.schedulers[0].log_text();
    assert!(
        log.contains("exists with other arguments") && log.contains("delivery-limit"),
        "the scheduler warns about the queue it uses as it is"
    );
}
