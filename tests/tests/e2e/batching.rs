//! Batching: group commit in the state store (many orders or replies in one
//! statement must each get the outcome they would get alone, and one bad
//! item must not fail the others), and coalesced acknowledgements in the
//! consumers (a `multiple` ack must never cover a message still in hand).

use sqlx::AssertSqlSafe;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use sas_broker::consume::{self, Consumed, ACK_HOLD};
use sas_broker::lapin::options::{BasicGetOptions, QueueDeclareOptions};
use sas_broker::lapin::types::FieldTable;
use sas_broker::lapin::BasicProperties;
use sas_messages::{StepOutcome, StepReply, SCHEMA_VERSION};
use sas_store::writes::intake::{Intake, Submission};
use sas_store::writes::progress::ReplyOutcome;
use sas_store::{Dispatch, Plan, ProcessState};
use sas_tests::{database_settings, order, wait_until, TestEnv};

fn submission(order_id: &str) -> Submission {
    Submission::new(
        order(order_id),
        sas_messages::TraceParent::new_root().trace_id,
    )
}

fn success(dispatch: &Dispatch) -> StepReply {
    StepReply {
        queued_ms: None,
        slot_wait_ms: None,
        retry_after_ms: None,
        call_ms: None,
        schema_version: SCHEMA_VERSION,
        order_id: dispatch.order_id.clone(),
        step: dispatch.step.clone(),
        attempt_id: dispatch.attempt_id,
        agent_id: "agent-test".into(),
        outcome: StepOutcome::Succeeded {
            result: serde_json::json!({ "ref": format!("{}-{}", dispatch.order_id, dispatch.step) }),
        },
    }
}

/// A failure of `dispatch`'s attempt that the remote never applied (a
/// refusal, or a call that never reached it), as its agent reports it.
fn failure(dispatch: &Dispatch, error: &str, permanent: bool) -> StepReply {
    StepReply {
        outcome: StepOutcome::Failed {
            error: error.into(),
            permanent,
            maybe_applied: false,
        },
        ..success(dispatch)
    }
}

fn accepted(outcome: &Result<Intake, sas_store::StoreError>) -> Dispatch {
    match outcome {
        Ok(Intake::Accepted(progress)) => progress
            .dispatches
            .first()
            .cloned()
            .expect("a first request"),
        other => panic!("expected the order to be accepted, got {other:?}"),
    }
}

/// Stores `batch` as orders of the plain workflow of `steps`, each
/// accepted, and returns each one's first request.
async fn accept_all(
    store: &sas_store::Store,
    batch: &[Submission],
    steps: &[sas_store::NewStep],
) -> Vec<Dispatch> {
    store
        .writes()
        .insert_orders(batch, Plan::new("order", 1, steps), "test")
        .await
        .iter()
        .map(accepted)
        .collect()
}

/// How many of a claim's orders it started (the others joined a line).
fn started(claimed: &[sas_store::writes::progress::Claimed]) -> usize {
    claimed
        .iter()
        .filter(|claim| !claim.progress.dispatches.is_empty())
        .count()
}

async fn count(env: &TestEnv, sql: impl sqlx::SqlSafeStr) -> i64 {
    sqlx::query_scalar(sql)
        .fetch_one(&env.db)
        .await
        .expect("count")
}

/// Stores the orders `ids` while their first agent has no admission row
/// (so each starts), then lets their deadlines pass and the supervisor's
/// recovery send them back: pending, due at once, each to take a slot
/// through the general path when claimed.
async fn due_again(env: &TestEnv, ids: &[String]) {
    let batch: Vec<Submission> = ids.iter().map(|id| submission(id)).collect();
    for outcome in env
        .store
        .writes()
        .insert_orders(&batch, Plan::new("order", 1, &env.steps()), "test")
        .await
    {
        accepted(&outcome);
    }
    sqlx::query("UPDATE order_process SET complete_by = now() - interval '1 hour'")
        .execute(&env.db)
        .await
        .expect("deadlines passed");
    let policy = sas_store::writes::recovery::RecoveryPolicy {
        max_failures: 3,
        backoff: sas_runtime::Backoff::new(
            Duration::from_millis(1),
            Duration::from_millis(1),
            sas_runtime::Jitter::None,
        ),
        grace: Duration::ZERO,
    };
    let recovered = env
        .store
        .writes()
        .recover_expired_with("test", &policy, 10, || 0.0)
        .await
        .expect("recover");
    assert_eq!(recovered.len(), ids.len());
    sqlx::query("UPDATE order_process SET not_before = now() - interval '1 second'")
        .execute(&env.db)
        .await
        .expect("due");
}

/// A supervisor's fold of inventory's shards, held open: the row locked and
/// set to `in_flight`, the shards to zero. Commit it to let it go.
async fn hold_a_fold(
    pool: &sqlx::PgPool,
    in_flight: i32,
) -> sqlx::Transaction<'static, sqlx::Postgres> {
    let mut fold = pool.begin().await.expect("a transaction");
    sqlx::query("SELECT agent FROM admission WHERE agent = 'inventory' FOR UPDATE")
        .execute(&mut *fold)
        .await
        .expect("fold");
    sqlx::query("UPDATE admission SET in_flight = $1 WHERE agent = 'inventory'")
        .bind(in_flight)
        .execute(&mut *fold)
        .await
        .expect("fold");
    sqlx::query("UPDATE admission_shard SET in_flight = 0 WHERE agent = 'inventory'")
        .execute(&mut *fold)
        .await
        .expect("fold");
    fold
}

/// A claim that has to wait for `fold`: started, seen waiting for a lock,
/// then the fold committed. Returns what the claim took.
async fn claim_behind(
    env: &TestEnv,
    fold: sqlx::Transaction<'static, sqlx::Postgres>,
) -> Vec<sas_store::writes::progress::Claimed> {
    let store = env.store.clone();
    let claim = tokio::spawn(async move { store.writes().claim_ready("test", 10).await });
    wait_for_a_lock(&env.db, "the claim waits for the row").await;
    fold.commit().await.expect("the fold ends");
    claim.await.expect("the claim task").expect("claim")
}

/// Waits until some backend of the test's database waits for a lock.
async fn wait_for_a_lock(pool: &sqlx::PgPool, what: &str) {
    wait_until(what, Duration::from_secs(10), || async {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity
              WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(pool)
        .await
        .map_err(|e| e.to_string())?;
        if waiting > 0 {
            Ok(())
        } else {
            Err("no backend waits for a lock".into())
        }
    })
    .await;
}

/// Stores `orders` in one batch, then answers each step of all of them with
/// one batch of successful replies, as many batches as the workflow has
/// steps. Returns the requests still outstanding after that: none, when
/// every order finished.
async fn run_every_step(
    store: &sas_store::Store,
    env: &TestEnv,
    orders: &[String],
) -> Vec<Dispatch> {
    let steps = env.steps();
    let batch: Vec<Submission> = orders.iter().map(|id| submission(id)).collect();
    let mut dispatches = accept_all(store, &batch, &steps).await;
    for _ in 0..steps.len() {
        let replies: Vec<StepReply> = dispatches.iter().map(success).collect();
        dispatches = store
            .writes()
            .record_replies(&replies, "test")
            .await
            .into_iter()
            .filter_map(|outcome| match outcome {
                Ok(ReplyOutcome::Applied { progress, .. }) => {
                    progress.dispatches.into_iter().next()
                }
                other => panic!("every reply applies, got {other:?}"),
            })
            .collect();
    }
    dispatches
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_of_orders_stores_each_once_and_one_the_database_refuses_fails_alone() {
    let env = TestEnv::new().await;
    let steps = env.steps();
    env.store
        .writes()
        .insert_order(
            &order("old"),
            Plan::new("order", 1, &steps),
            "trace",
            "test",
        )
        .await
        .expect("an order stored earlier");

    // Postgres refuses a NUL byte in text: that order fails, the others not.
    let mut refused = submission("refused");
    refused.order.reply_to = Some("client\0queue".into());
    let mut conflicting = submission("old");
    conflicting.order.amount_cents += 1;
    let batch = vec![
        submission("new-1"),
        refused,
        submission("old"),
        conflicting,
        submission("new-1"),
        submission("new-2"),
    ];
    let outcomes = env
        .store
        .writes()
        .insert_orders(&batch, Plan::new("order", 1, &steps), "test")
        .await;

    assert_eq!(outcomes.len(), batch.len(), "one outcome per submission");
    let first = accepted(&outcomes[0]);
    assert_eq!(
        (first.order_id.as_str(), first.step.as_str()),
        ("new-1", "reserve_stock")
    );
    assert!(
        matches!(&outcomes[1], Err(error) if !error.is_transient()),
        "the refused order gets a permanent error of its own, got {:?}",
        outcomes[1]
    );
    assert!(
        matches!(outcomes[2], Ok(Intake::Duplicate)),
        "{:?}",
        outcomes[2]
    );
    assert!(
        matches!(outcomes[3], Ok(Intake::Conflict)),
        "{:?}",
        outcomes[3]
    );
    assert!(
        matches!(outcomes[4], Ok(Intake::Duplicate)),
        "a repeat within the batch is a duplicate, got {:?}",
        outcomes[4]
    );
    let second = accepted(&outcomes[5]);
    assert_ne!(
        first.attempt_id, second.attempt_id,
        "each order has its own attempt"
    );

    assert_eq!(count(&env, "SELECT count(*) FROM orders").await, 3);
    assert_eq!(
        count(&env, "SELECT count(*) FROM steps WHERE state = 'running'").await,
        3,
        "old, new-1 and new-2 each have their first step running"
    );
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM history WHERE event = 'received'"
        )
        .await,
        3
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_batch_of_replies_applies_each_current_one_once_and_the_rest_by_the_general_path() {
    let env = TestEnv::new().await;
    let steps = env.steps();
    let names: Vec<String> = (0..4).map(|n| format!("order-{n}")).collect();
    let batch: Vec<Submission> = names.iter().map(|n| submission(n)).collect();
    let dispatches = accept_all(&env.store, &batch, &steps).await;

    let mut stale = success(&dispatches[2]);
    stale.attempt_id = sas_messages::AttemptId::new();
    let declined = failure(&dispatches[3], "out of stock", true);
    let replies = vec![
        success(&dispatches[0]),
        success(&dispatches[1]),
        // The same reply twice in one batch: applied once.
        success(&dispatches[0]),
        stale,
        declined,
    ];
    let outcomes = env.store.writes().record_replies(&replies, "test").await;

    assert_eq!(outcomes.len(), replies.len());
    for (index, order) in [(0, "order-0"), (1, "order-1")] {
        match &outcomes[index] {
            Ok(ReplyOutcome::Applied { progress, step, .. }) => {
                assert_eq!(step, "reserve_stock");
                let next = progress.dispatches.first().expect("the next request");
                assert_eq!(
                    (next.order_id.as_str(), next.step.as_str()),
                    (order, "charge_payment")
                );
                assert_eq!(
                    next.payload["results"]["reserve_stock"]["ref"],
                    format!("{order}-reserve_stock"),
                    "the next request carries the earlier results"
                );
            }
            other => panic!("reply {index} should be applied, got {other:?}"),
        }
    }
    assert!(
        matches!(outcomes[2], Ok(ReplyOutcome::Stale { .. })),
        "the repeat is stale, got {:?}",
        outcomes[2]
    );
    assert!(
        matches!(outcomes[3], Ok(ReplyOutcome::Stale { .. })),
        "a reply to another attempt is stale, got {:?}",
        outcomes[3]
    );
    match &outcomes[4] {
        Ok(ReplyOutcome::Applied { progress, .. }) => assert!(
            progress.dispatches.is_empty(),
            "a declined first step has nothing to undo"
        ),
        other => panic!("the declined reply takes the general path, got {other:?}"),
    }

    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM history WHERE event = 'step_completed'"
        )
        .await,
        2,
        "each current success is recorded once"
    );
    let states: Vec<(String, ProcessState)> =
        sqlx::query_as("SELECT order_id, state FROM order_process ORDER BY order_id")
            .fetch_all(&env.db)
            .await
            .expect("states");
    assert_eq!(states[0].1, ProcessState::Processing);
    assert_eq!(states[1].1, ProcessState::Processing);
    assert_eq!(
        states[2].1,
        ProcessState::Processing,
        "the stale reply changed nothing"
    );
    assert_ne!(
        states[3].1,
        ProcessState::Processing,
        "the declined order is winding down"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_last_step_of_a_batch_finishes_its_order() {
    let env = TestEnv::new().await;
    let names: Vec<String> = (0..3).map(|n| format!("full-{n}")).collect();
    let dispatches = run_every_step(&env.store, &env, &names).await;
    assert!(dispatches.is_empty(), "no request after the last step");
    assert_eq!(
        count(&env, "SELECT count(*) FROM order_process WHERE state = 'processed' AND locked_by IS NULL AND complete_by IS NULL").await,
        3
    );
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM history WHERE event = 'processed'"
        )
        .await,
        3
    );
    // One transaction per batch: the rows a statement wrote share its xmin.
    for event in ["received", "step_completed", "processed"] {
        let transactions = count(
            &env,
            AssertSqlSafe(format!(
                "SELECT count(DISTINCT xmin::text) FROM history WHERE event = '{event}'"
            )),
        )
        .await;
        let batches = if event == "step_completed" { 3 } else { 1 };
        assert_eq!(
            transactions, batches,
            "{event}: the three orders were written by one statement per batch"
        );
    }
}

/// JIT compilation cost most of Postgres's CPU at saturation: with
/// `index_plans`, a sequential scan nothing can avoid (the 3-row admission
/// table) is costed at 10^10, past `jit_above_cost`, and every supervisor
/// pass compiled its statements for 0.2 to 0.8 s. The services' connections
/// turn it off even where the database turns it on.
#[tokio::test(flavor = "multi_thread")]
async fn the_services_never_compile_statements_even_where_the_database_asks_to() {
    let env = TestEnv::new().await;
    sqlx::query(AssertSqlSafe(format!(
        "ALTER DATABASE {} SET jit = on",
        env.database
    )))
    .execute(&env.db)
    .await
    .expect("a database default");
    let jit = |pool: sqlx::PgPool| async move {
        let jit: String = sqlx::query_scalar("SHOW jit")
            .fetch_one(&pool)
            .await
            .expect("show jit");
        pool.close().await;
        jit
    };
    let plain = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&env.database_url)
        .await
        .expect("a plain connection");
    assert_eq!(jit(plain).await, "on", "the database's default applies");
    // A pool with the sessions a service's store opens.
    let services = sas_lab::pool(
        &sas_store::DatabaseSettings {
            max_connections: 1,
            migrate: false,
            ..database_settings(&env.database_url)
        },
        "sas-tests-services",
    );
    assert_eq!(jit(services).await, "off");
}

#[tokio::test(flavor = "multi_thread")]
async fn acknowledgements_held_behind_a_slow_message_never_cover_it() {
    let env = TestEnv::new().await;
    let settings = env.amqp();
    let queue = settings.names().agent_requests("inventory");
    let (client, publisher) = env.broker().await;
    for body in ["slow", "fast-1", "fast-2", "fast-3", "fast-4"] {
        publisher
            .publish(
                "",
                &queue,
                body.as_bytes(),
                BasicProperties::default(),
                true,
            )
            .await
            .expect("publish");
    }

    // A consumer whose first message never finishes, and whose others finish
    // at once: their acks cannot go in a multiple ack (it would cover the
    // slow one), so they must go one by one once held ACK_HOLD.
    let connection = Arc::new(
        sas_broker::connect(&settings, "ack-test")
            .await
            .expect("connect"),
    );
    let finished = Arc::new(AtomicUsize::new(0));
    let count = finished.clone();
    let consuming = {
        let (settings, queue, publisher) = (settings.clone(), queue.clone(), publisher.clone());
        let connection = connection.clone();
        tokio::spawn(async move {
            let _ = consume::consume(
                &connection,
                &settings,
                &queue,
                publisher,
                tokio_util::sync::CancellationToken::new(),
                Duration::from_millis(100),
                move |delivery| {
                    let count = count.clone();
                    async move {
                        if delivery.body == b"slow" {
                            std::future::pending::<()>().await;
                        }
                        count.fetch_add(1, Ordering::SeqCst);
                        Consumed::Ack
                    }
                },
            )
            .await;
        })
    };
    wait_until(
        "the four fast messages handled",
        Duration::from_secs(10),
        || async {
            match finished.load(Ordering::SeqCst) {
                4 => Ok(()),
                other => Err(other.to_string()),
            }
        },
    )
    .await;
    // The acks of the fast ones are held at most ACK_HOLD; give them ten times that.
    tokio::time::sleep(ACK_HOLD * 10).await;
    // The consumer goes away with the slow message in hand (as a process
    // that dies would): the broker puts back what was not acknowledged.
    connection.close(200, "gone".into()).await.expect("close");
    consuming.abort();

    let channel = client.create_channel().await.expect("channel");
    let ready = |channel: sas_broker::lapin::Channel, queue: String| async move {
        channel
            .queue_declare(
                queue.into(),
                QueueDeclareOptions {
                    passive: true,
                    ..QueueDeclareOptions::default()
                },
                FieldTable::default(),
            )
            .await
            .map(|q| q.message_count())
            .map_err(|e| e.to_string())
    };
    wait_until(
        "the unacknowledged message back in the queue",
        Duration::from_secs(10),
        || {
            let (channel, queue) = (channel.clone(), queue.clone());
            async move {
                match ready(channel, queue).await? {
                    0 => Err("0 ready".into()),
                    _ => Ok(()),
                }
            }
        },
    )
    .await;
    let mut back = Vec::new();
    while let Some(message) = channel
        .basic_get(queue.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .expect("get")
    {
        back.push(String::from_utf8_lossy(&message.delivery.data).into_owned());
    }
    assert_eq!(
        back,
        ["slow"],
        "only the message still in hand comes back: the fast ones were acknowledged, the slow one was not"
    );
}

/// Index entries of `order_process_open` read so far, as Postgres counts them.
async fn open_index_reads(env: &TestEnv) -> i64 {
    count(
        env,
        "SELECT idx_tup_read FROM pg_stat_user_indexes WHERE indexrelname = 'order_process_open'",
    )
    .await
}

/// The partial index of open orders fills with dead entries between vacuums
/// (every transition of a processing order leaves one), while the plan that
/// Postgres caches for a prepared statement was made when the tables were
/// small. A batch of replies must still find its few orders by primary key,
/// with the services' planner settings, and not read every one of those
/// entries.
#[tokio::test(flavor = "multi_thread")]
async fn a_batch_of_replies_finds_its_orders_by_key_whatever_plan_is_cached() {
    let env = TestEnv::new().await;
    let steps = env.steps();
    // One connection, shared with the store: one plan cache, and
    // statistics this test can flush on the session the store used.
    let session = sas_lab::pool(
        &sas_store::DatabaseSettings {
            max_connections: 1,
            migrate: false,
            index_plans: true,
            ..database_settings(&env.database_url)
        },
        "sas-tests-services",
    );
    let services = sas_store::Store::on_pool(session.clone());
    for sql in [
        "ALTER TABLE order_process SET (autovacuum_enabled = false)",
        "ALTER TABLE steps SET (autovacuum_enabled = false)",
    ] {
        sqlx::query(sql)
            .execute(&env.db)
            .await
            .expect("no vacuum during the test");
    }

    // Small tables, analyzed; then the statement runs often enough for
    // Postgres to settle on a plan.
    assert!(run_every_step(&services, &env, &["warm-0".to_owned()])
        .await
        .is_empty());
    sqlx::query("ANALYZE")
        .execute(&env.db)
        .await
        .expect("analyze");
    for n in 0..8 {
        assert!(run_every_step(&services, &env, &[format!("small-{n}")])
            .await
            .is_empty());
    }
    // 1,500 orders run to the end, leaving their dead index entries; three
    // stay at their first step.
    for chunk in 0..6 {
        let ids: Vec<String> = (0..250).map(|n| format!("done-{chunk}-{n}")).collect();
        assert!(run_every_step(&services, &env, &ids).await.is_empty());
    }
    let batch: Vec<Submission> = (0..3).map(|n| submission(&format!("open-{n}"))).collect();
    let waiting = accept_all(&services, &batch, &steps).await;

    let flush = || async {
        sqlx::query("SELECT pg_stat_force_next_flush()")
            .execute(&session)
            .await
            .expect("flush statistics");
        sqlx::query("SELECT 1")
            .execute(&session)
            .await
            .expect("a transaction that flushes");
    };
    flush().await;
    let before = open_index_reads(&env).await;
    let replies: Vec<StepReply> = waiting.iter().map(success).collect();
    for outcome in services.writes().record_replies(&replies, "test").await {
        assert!(
            matches!(outcome, Ok(ReplyOutcome::Applied { .. })),
            "{outcome:?}"
        );
    }
    flush().await;
    let read = open_index_reads(&env).await - before;
    assert!(
        read < 100,
        "the batch of 3 replies read {read} entries of the open-orders index, most of them dead"
    );
}

/// A claim starts several orders in one transaction and writes their
/// decisions in one statement: each room check counts the slots the
/// batch's earlier decisions took, so one claim never hands out more than
/// the agent's limit, and the rest wait in its line.
#[tokio::test(flavor = "multi_thread")]
async fn one_claim_of_many_orders_admits_no_more_than_the_agent_s_limit() {
    let env = TestEnv::new().await;
    let ids: Vec<String> = (0..5).map(|n| format!("room-{n}")).collect();
    due_again(&env, &ids).await;
    // The first step's agent takes two attempts at a time.
    sqlx::query(
        "INSERT INTO admission (agent, admit_limit, initial_limit, ceiling, deadline_ms)
         VALUES ('inventory', 2, 2, 2, 3000)",
    )
    .execute(&env.db)
    .await
    .expect("an admission row");

    let claimed = env
        .store
        .writes()
        .claim_ready("test", 10)
        .await
        .expect("claim");
    let started = started(&claimed);
    assert_eq!(
        started, 2,
        "one claim started {started} attempts under a limit of 2"
    );
    let lined = count(
        &env,
        "SELECT count(*) FROM order_process WHERE waiting_for = 'inventory'",
    )
    .await;
    assert_eq!(lined, 3);
    let counters: (i32, i32) =
        sqlx::query_as("SELECT in_flight, waiting FROM admission_now WHERE agent = 'inventory'")
            .fetch_one(&env.db)
            .await
            .expect("the counters");
    assert_eq!(counters, (2, 3));
}

/// Urgent orders pass a limit full of less urgent attempts (issue 26):
/// the agent serves what it holds by the lines' rule, so for an order of
/// priority 9 only the attempts at 9 are ahead of it, and the limit counts
/// those. What passes stays under the cap (the deadline target), and only
/// heads pass: an order that has waited long enough to stand before the
/// urgent ones in line holds them back until the limit has room for it.
#[tokio::test(flavor = "multi_thread")]
async fn urgent_orders_pass_a_limit_full_of_less_urgent_attempts_up_to_the_cap() {
    let env = TestEnv::new().await;
    let store = &env.store;
    sqlx::query(
        "INSERT INTO admission (agent, admit_limit, initial_limit, ceiling, deadline_ms)
         VALUES ('inventory', 4, 4, 100, 3000)",
    )
    .execute(&env.db)
    .await
    .expect("an admission row");
    let with_priority = |prefix: &str, n: usize, priority: u8| -> Vec<Submission> {
        (0..n)
            .map(|i| {
                let mut order = order(&format!("{prefix}-{i}"));
                order.priority = Some(priority);
                Submission::new(order, sas_messages::TraceParent::new_root().trace_id)
            })
            .collect()
    };
    // Four attempts of priority 5 fill the limit; then the law cuts it to 2.
    accept_all(store, &with_priority("busy", 4, 5), &env.steps()).await;
    let set = |limit: i32, cap: i32| {
        sqlx::query(
            "UPDATE admission SET admit_limit = $1, admit_cap = $2 WHERE agent = 'inventory'",
        )
        .bind(limit)
        .bind(cap)
        .execute(&env.db)
    };
    set(2, 7).await.expect("cut the limit");
    let steps = env.steps();
    let plan = || Plan::new("order", 1, &steps);
    // One at a time: each takes its own place in line.
    let lined = with_priority("low", 3, 5)
        .into_iter()
        .chain(with_priority("urgent", 4, 9));
    for submission in lined {
        for outcome in store
            .writes()
            .insert_orders(&[submission], plan(), "test")
            .await
        {
            assert!(
                matches!(&outcome, Ok(Intake::Accepted(progress)) if progress.dispatches.is_empty()),
                "the limit is full: {outcome:?}"
            );
        }
    }
    let claim = || async {
        let claimed = store.writes().claim_ready("test", 10).await.expect("claim");
        let mut ids: Vec<String> = claimed
            .iter()
            .filter_map(|claim| claim.progress.dispatches.first())
            .map(|dispatch| dispatch.order_id.to_string())
            .collect();
        ids.sort();
        ids
    };
    // Two urgent orders pass the four of priority 5 (the limit at 9 is 2);
    // the orders of priority 5 would queue behind the four, and wait.
    assert_eq!(claim().await, ["urgent-0", "urgent-1"]);
    assert_eq!(
        claim().await,
        Vec::<String>::new(),
        "the limit at 9 is full"
    );
    // A higher limit, but the cap leaves room for one attempt more.
    set(4, 7).await.expect("raise the limit");
    assert_eq!(claim().await, ["urgent-2"]);
    // An order of priority 5 that has waited 50 s stands before the last
    // urgent one in line, and holds it back: only heads pass, so the
    // line's order, aging included, is kept.
    set(4, 20).await.expect("raise the cap");
    sqlx::query(
        "UPDATE order_process SET admit_key = admit_key - interval '50 seconds'
          WHERE order_id = 'low-2'",
    )
    .execute(&env.db)
    .await
    .expect("an old wait");
    assert_eq!(claim().await, Vec::<String>::new());
    // Once the limit has room, the old order goes first, and the urgent
    // one passes the limit it fills.
    set(8, 20).await.expect("raise the limit");
    assert_eq!(claim().await, ["low-2"]);
    assert_eq!(claim().await, ["urgent-3"]);
    let counters: (i32, i32) =
        sqlx::query_as("SELECT in_flight, waiting FROM admission_now WHERE agent = 'inventory'")
            .fetch_one(&env.db)
            .await
            .expect("the counters");
    assert_eq!(counters, (9, 2), "4 + 1 + 4 in flight, 2 low in line");
}

/// The hot paths (an intake batch, a batch of replies) move an agent's
/// admission counters in one of its shards, not in its row, so that they
/// do not wait for each other's commits on that row (a third of their time
/// did, issue 26): orders are stored and run to the end while another
/// transaction holds every agent's row, as a claim or a supervisor does.
/// The supervisors' window then folds the shards back into the rows,
/// exactly.
#[tokio::test(flavor = "multi_thread")]
async fn batches_move_the_admission_counters_without_waiting_for_the_agents_rows() {
    let env = TestEnv::new().await;
    let agents: Vec<(String, Duration)> = env
        .steps()
        .iter()
        .filter_map(|step| step.kind.agent())
        .map(|agent| (agent.to_owned(), Duration::from_secs(10)))
        .collect();
    env.store
        .admission()
        .register(&agents, 100, 100)
        .await
        .expect("register the agents");
    let mut holder = env.db.begin().await.expect("a transaction");
    sqlx::query("SELECT agent FROM admission ORDER BY agent FOR UPDATE")
        .execute(&mut *holder)
        .await
        .expect("hold every agent's row");

    let orders: Vec<String> = (0..4).map(|n| format!("shard-{n}")).collect();
    let left = tokio::time::timeout(
        Duration::from_secs(20),
        run_every_step(&env.store, &env, &orders),
    )
    .await
    .expect("the batches waited for an agent's admission row");
    assert!(left.is_empty(), "every order finished: {left:?}");
    holder.rollback().await.expect("let the rows go");

    let totals = "SELECT agent, in_flight, settled::int8, peak_in_flight FROM admission_now
                   ORDER BY agent";
    let counters: Vec<(String, i32, i64, i32)> = sqlx::query_as(totals)
        .fetch_all(&env.db)
        .await
        .expect("the counters");
    let expected: Vec<(String, i32, i64, i32)> = ["inventory", "payment", "shipping"]
        .into_iter()
        .map(|agent| (agent.to_owned(), 0, 4, 4))
        .collect();
    assert_eq!(counters, expected, "nothing in flight, four settled each");
    let rows: Vec<(i32, i64)> =
        sqlx::query_as("SELECT in_flight, settled FROM admission ORDER BY agent")
            .fetch_all(&env.db)
            .await
            .expect("the rows");
    assert_eq!(rows, vec![(0, 0); 3], "the rows themselves were not moved");

    // A window ends: its shards are folded into each row, which then holds
    // the same totals, and the shards start again from zero.
    sqlx::query("UPDATE admission SET window_started = now() - interval '1 hour'")
        .execute(&env.db)
        .await
        .expect("the windows are due");
    let adaptation = sas_store::admission::Adaptation {
        window: Duration::from_secs(1),
        deadline_share: 0.5,
    };
    let adapted = env
        .store
        .admission()
        .adapt(&adaptation)
        .await
        .expect("adapt");
    assert_eq!(adapted.len(), 3);
    assert!(adapted.iter().all(|agent| agent.in_flight == 0));
    let rows: Vec<(i32, i64, i64)> = sqlx::query_as(
        "SELECT in_flight, settled, settled - window_settled FROM admission ORDER BY agent",
    )
    .fetch_all(&env.db)
    .await
    .expect("the rows");
    assert_eq!(rows, vec![(0, 4, 0); 3], "the shards folded into the rows");
    let shards: (i64, i64, i64) = sqlx::query_as(
        "SELECT count(*), count(*) FILTER (WHERE in_flight <> 0 OR settled <> 0
                                             OR peak_in_flight <> 0 OR in_flight_ms <> 0),
                count(DISTINCT agent)
           FROM admission_shard",
    )
    .fetch_one(&env.db)
    .await
    .expect("the shards");
    assert_eq!(shards, (24, 0, 3), "eight shards per agent, all at zero");
}

/// A claim serves an agent's line from its free slots, the row plus its
/// shards. When the claim has to wait for the row (a supervisor folding the
/// shards into it), it reads both after the wait: read in the statement
/// that took the lock, the row would come back folded beside the shards as
/// they were before the fold, counted twice, and the claim would start
/// more orders than the agent has slots.
#[tokio::test(flavor = "multi_thread")]
async fn a_claim_that_waits_for_a_fold_counts_the_shards_once() {
    let env = TestEnv::new().await;
    let pool = &env.db;
    env.store
        .admission()
        .register(&[("inventory".to_owned(), Duration::from_secs(10))], 4, 4)
        .await
        .expect("register the agent");
    // A full agent: ten new orders join its line.
    sqlx::query("UPDATE admission SET in_flight = 4 WHERE agent = 'inventory'")
        .execute(pool)
        .await
        .expect("fill the agent");
    let ids: Vec<String> = (0..10).map(|n| format!("fold-{n}")).collect();
    let batch: Vec<Submission> = ids.iter().map(|id| submission(id)).collect();
    env.store
        .writes()
        .insert_orders(&batch, Plan::new("order", 1, &env.steps()), "test")
        .await;
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM order_process WHERE waiting_for = 'inventory'"
        )
        .await,
        10
    );
    // Two slots free of four: the row counts 7 dispatched, a shard 5
    // settled by the hot path.
    sqlx::query("UPDATE admission SET in_flight = 7 WHERE agent = 'inventory'")
        .execute(pool)
        .await
        .expect("the row");
    sqlx::query(
        "UPDATE admission_shard SET in_flight = -5 WHERE agent = 'inventory' AND shard = 0",
    )
    .execute(pool)
    .await
    .expect("a shard");

    // A fold holds the row: the shard into the row, the shard to zero.
    let fold = hold_a_fold(pool, 2).await;
    let claimed = claim_behind(&env, fold).await;
    let started = started(&claimed);
    assert_eq!(
        started, 2,
        "the claim started {started} orders for 2 free slots"
    );
    let counters: (i32, i32) =
        sqlx::query_as("SELECT in_flight, waiting FROM admission_now WHERE agent = 'inventory'")
            .fetch_one(pool)
            .await
            .expect("the counters");
    assert_eq!(counters, (4, 8));
}

/// The general path (the write kernel's `apply_all`) moves an agent's row,
/// and its peak counts the row and the shards. When it has to wait for the
/// row (a supervisor folding the shards into it), it reads both after the
/// wait: read in the statement that waited, the row would come back folded
/// beside the shards as they were before the fold, and the peak would count
/// the folded attempts twice (7 here for 4 in flight), which the law then
/// reads as a limit in use.
#[tokio::test(flavor = "multi_thread")]
async fn the_general_path_that_waits_for_a_fold_counts_the_shards_once() {
    let env = TestEnv::new().await;
    let pool = &env.db;
    due_again(&env, &["general-fold".to_owned()]).await;
    // The agent has room; three attempts in flight, counted by the hot
    // path in a shard.
    env.store
        .admission()
        .register(&[("inventory".to_owned(), Duration::from_secs(10))], 10, 10)
        .await
        .expect("register the agent");
    sqlx::query("UPDATE admission_shard SET in_flight = 3 WHERE agent = 'inventory' AND shard = 0")
        .execute(pool)
        .await
        .expect("a shard");

    // A fold holds the row: the shard into the row, the shard to zero.
    let fold = hold_a_fold(pool, 3).await;
    // The due order is claimed through the general path, which takes a
    // slot and so moves the row.
    let claimed = claim_behind(&env, fold).await;
    assert_eq!(started(&claimed), 1, "the due order started");
    let row: (i32, i32) =
        sqlx::query_as("SELECT in_flight, peak_in_flight FROM admission WHERE agent = 'inventory'")
            .fetch_one(pool)
            .await
            .expect("the row");
    assert_eq!(
        row,
        (4, 4),
        "four in flight, and a peak of four: the folded shard counted once"
    );
}

/// Whether `error` is Postgres breaking a deadlock (SQLSTATE 40P01).
fn is_deadlock(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|db| db.code())
        .is_some_and(|code| code == "40P01")
}

/// [`is_deadlock`] for what the store returns, shared with a batch or not.
fn store_deadlock(error: &sas_store::StoreError) -> bool {
    match error {
        sas_store::StoreError::Database(error) => is_deadlock(error),
        sas_store::StoreError::Shared(shared) => store_deadlock(shared),
        _ => false,
    }
}

/// The one place a hot statement and a supervisor's fold can deadlock: an
/// agent's row made by hand has no shards, so the first hot statement to
/// pick one makes it, and making it checks the row through the foreign
/// key. A fold holding that row and making the same missing shard then
/// waits for the statement, which waits for the fold. Postgres breaks the
/// cycle within `deadlock_timeout` by failing one of them with an error
/// its caller retries (the scheduler's intake and reply batches, the
/// supervisor at its next window), and after the retry the order is
/// counted once and the agent has all its shards.
#[tokio::test(flavor = "multi_thread")]
async fn a_shard_made_beside_a_fold_deadlocks_at_most_once_and_is_counted_once() {
    let env = TestEnv::new().await;
    let pool = &env.db;
    env.store
        .admission()
        .register(&[("inventory".to_owned(), Duration::from_secs(10))], 10, 10)
        .await
        .expect("register the agent");
    // A row made by hand: no shards.
    sqlx::query("DELETE FROM admission_shard WHERE agent = 'inventory'")
        .execute(pool)
        .await
        .expect("remove the shards");

    // A fold takes the row; an intake batch picks a shard, makes it, and
    // waits for the row through the foreign key.
    let mut fold = pool.begin().await.expect("a transaction");
    sqlx::query("SELECT agent FROM admission WHERE agent = 'inventory' FOR UPDATE")
        .execute(&mut *fold)
        .await
        .expect("the fold locks the row");
    let plan_steps = env.steps();
    let store = env.store.clone();
    let intake = tokio::spawn(async move {
        store
            .writes()
            .insert_orders(
                &[submission("fk-shard-1")],
                Plan::new("order", 1, &plan_steps),
                "test",
            )
            .await
            .pop()
            .expect("one outcome")
    });
    wait_for_a_lock(pool, "the intake waits for the row").await;
    // The fold makes the missing shards, one of them the intake's.
    let made = sqlx::query(
        "INSERT INTO admission_shard (agent, shard)
         SELECT 'inventory', shard FROM generate_series(0, 7) AS s(shard) ORDER BY shard
         ON CONFLICT (agent, shard) DO NOTHING",
    )
    .execute(&mut *fold)
    .await;
    let folded = match made {
        Ok(_) => fold.commit().await.map(|_| ()),
        Err(error) => {
            fold.rollback().await.expect("end the fold");
            Err(error)
        }
    };
    let stored = intake.await.expect("the intake task");
    match (&folded, &stored) {
        (Ok(()), Err(error)) => assert!(
            store_deadlock(error) && error.is_transient(),
            "the intake failed with a deadlock its caller retries, not {error}"
        ),
        (Err(error), Ok(_)) => assert!(
            is_deadlock(error),
            "the fold failed with a deadlock, not {error}"
        ),
        other => panic!("exactly one of them fails with a deadlock: {other:?}"),
    }
    if stored.is_err() {
        // What the scheduler's intake does with a transient error.
        let again = env
            .store
            .writes()
            .insert_orders(
                &[submission("fk-shard-1")],
                Plan::new("order", 1, &env.steps()),
                "test",
            )
            .await;
        accepted(&again[0]);
    }
    let in_flight: i32 =
        sqlx::query_scalar("SELECT in_flight FROM admission_now WHERE agent = 'inventory'")
            .fetch_one(pool)
            .await
            .expect("the counters");
    assert_eq!(in_flight, 1, "the order's attempt counted once");
    // The next fold (here a reconciliation's) makes whatever is still
    // missing, and the recount from the orders finds nothing to correct.
    let corrections = env.store.admission().reconcile().await.expect("reconcile");
    assert!(corrections.is_empty(), "no drift: {corrections:?}");
    assert_eq!(
        count(
            &env,
            "SELECT count(*) FROM admission_shard WHERE agent = 'inventory'"
        )
        .await,
        8,
        "eight shards"
    );
}

/// Successes whose next agent has no free slot are left alone by the
/// batched reply statement (their orders must join that agent's line), and
/// the general path puts them all in the line in one transaction: one at a
/// time, each waited for the next agent's row behind the others' commits,
/// and at saturation with lines that convoy made thousands of
/// transactions wait 20 ms each (docs/performance.md). One transaction
/// shows in the history: every line it wrote carries its clock. A repeat
/// of a reply in the same batch still gets its own transaction, after,
/// and is stale.
#[tokio::test(flavor = "multi_thread")]
async fn replies_whose_next_agent_is_full_join_its_line_together() {
    let env = TestEnv::new().await;
    let pool = &env.db;
    let deadline = Duration::from_secs(10);
    let admission = env.store.admission();
    admission
        .register(&[("inventory".to_owned(), deadline)], 10, 10)
        .await
        .expect("register inventory");
    admission
        .register(&[("payment".to_owned(), deadline)], 1, 1)
        .await
        .expect("register payment");
    let ids: Vec<String> = (0..5).map(|n| format!("join-{n}")).collect();
    let batch: Vec<Submission> = ids.iter().map(|id| submission(id)).collect();
    let dispatches: Vec<Dispatch> = env
        .store
        .writes()
        .insert_orders(&batch, Plan::new("order", 1, &env.steps()), "test")
        .await
        .iter()
        .map(accepted)
        .collect();
    // Payment's one slot is taken.
    sqlx::query("UPDATE admission SET in_flight = 1 WHERE agent = 'payment'")
        .execute(pool)
        .await
        .expect("fill payment");

    let mut replies: Vec<StepReply> = dispatches.iter().map(success).collect();
    replies.push(success(&dispatches[0]));
    let outcomes = env.store.writes().record_replies(&replies, "test").await;
    for (reply, outcome) in replies.iter().zip(&outcomes).take(5) {
        match outcome {
            Ok(ReplyOutcome::Applied { progress, .. }) => assert!(
                progress.dispatches.is_empty(),
                "{} started payment without a slot",
                reply.order_id
            ),
            other => panic!("{} was not applied: {other:?}", reply.order_id),
        }
    }
    assert!(
        matches!(outcomes[5], Ok(ReplyOutcome::Stale { .. })),
        "the repeat is stale: {:?}",
        outcomes[5]
    );
    let lined: (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT at) FROM history
          WHERE event = 'waiting_for_admission' AND step = 'charge_payment'",
    )
    .fetch_one(pool)
    .await
    .expect("the history");
    assert_eq!(
        lined,
        (5, 1),
        "five orders joined payment's line, in one transaction"
    );
    let counters: Vec<(String, i32, i32)> = sqlx::query_as(
        "SELECT agent, in_flight, waiting FROM admission_now
          WHERE agent IN ('inventory', 'payment') ORDER BY agent",
    )
    .fetch_all(pool)
    .await
    .expect("the counters");
    assert_eq!(
        counters,
        vec![("inventory".to_owned(), 0, 0), ("payment".to_owned(), 1, 5)],
        "inventory's slots back, five waiting for payment's"
    );
}

/// A reply that has to wait for its order's lock is decided on what the
/// holder committed. The holder here replaces the step's attempt, as a
/// claim or a deadline's recovery does while a late reply of the old
/// attempt arrives: read in the statement that waited for the lock, the
/// steps were those from before the wait, the reply was taken for the
/// current attempt's, and its guarded write failed ("a decision's guards
/// did not hold") instead of the reply being found stale. The chaos test
/// met it as late answers raced the claims that retried their steps.
#[tokio::test(flavor = "multi_thread")]
async fn a_reply_that_waits_for_its_order_is_decided_on_what_the_holder_committed() {
    let env = TestEnv::new().await;
    let pool = &env.db;
    let dispatch = accepted(
        &env.store
            .writes()
            .insert_orders(
                &[submission("held-1")],
                Plan::new("order", 1, &env.steps()),
                "test",
            )
            .await[0],
    );
    let mut holder = pool.begin().await.expect("a transaction");
    sqlx::query("SELECT 1 FROM order_process WHERE order_id = 'held-1' FOR UPDATE")
        .execute(&mut *holder)
        .await
        .expect("lock the order");
    let replaced: uuid::Uuid = sqlx::query_scalar(
        "UPDATE steps SET attempt = attempt + 1, attempt_id = gen_random_uuid()
          WHERE order_id = 'held-1' AND position = 0 RETURNING attempt_id",
    )
    .fetch_one(&mut *holder)
    .await
    .expect("a new attempt");

    let late = failure(&dispatch, "connection refused: the call never left", false);
    let store = env.store.clone();
    let reply = tokio::spawn(async move { store.writes().record_reply(&late, "test").await });
    wait_for_a_lock(pool, "the reply waits for the order").await;
    holder.commit().await.expect("the holder commits");
    let outcome = reply.await.expect("the reply task");
    assert!(
        matches!(outcome, Ok(ReplyOutcome::Stale { .. })),
        "the replaced attempt's reply is stale: {outcome:?}"
    );
    let step: (String, i32, uuid::Uuid) = sqlx::query_as(
        "SELECT state::text, attempt, attempt_id FROM steps
          WHERE order_id = 'held-1' AND position = 0",
    )
    .fetch_one(pool)
    .await
    .expect("the step");
    assert_eq!(
        step,
        ("running".to_owned(), 2, replaced),
        "the holder's attempt runs on"
    );
}

/// Every request of an order carries the order's priority to its agent, in
/// the message's `priority` property, on each path that starts one: intake,
/// the batched statement of a reply, and the general path (a compensation).
#[tokio::test(flavor = "multi_thread")]
async fn every_request_of_an_order_carries_its_priority_to_the_agent() {
    let env = TestEnv::new().await;
    let steps = env.steps();
    let names = env.amqp().names();
    let batch: Vec<Submission> = [("urgent-1", Some(8)), ("plain-1", None)]
        .into_iter()
        .map(|(order_id, priority)| {
            let mut submission = submission(order_id);
            submission.order.priority = priority;
            submission
        })
        .collect();
    let first = accept_all(&env.store, &batch, &steps).await;
    let carried = |dispatch: &Dispatch| {
        let message = sas_announce::request_message(&names, dispatch, None);
        (dispatch.priority, *message.properties.priority())
    };
    assert_eq!(carried(&first[0]), (8, Some(8)), "intake");
    assert_eq!(carried(&first[1]), (5, Some(5)), "the default");

    let next = |outcome: &Result<ReplyOutcome, sas_store::StoreError>| match outcome {
        Ok(ReplyOutcome::Applied { progress, .. }) => progress
            .dispatches
            .first()
            .cloned()
            .expect("a next request"),
        other => panic!("expected an applied reply, got {other:?}"),
    };
    let replies = [success(&first[0])];
    let outcomes = env.store.writes().record_replies(&replies, "test").await;
    let charge = next(&outcomes[0]);
    assert_eq!(charge.step, "charge_payment");
    assert_eq!(carried(&charge), (8, Some(8)), "the batched statement");

    let declined = failure(&charge, "card declined", true);
    let outcome = env.store.writes().record_reply(&declined, "test").await;
    let undo = next(&outcome);
    assert_eq!(
        (undo.step.as_str(), undo.kind),
        ("reserve_stock", sas_messages::StepKind::Compensation)
    );
    assert_eq!(carried(&undo), (8, Some(8)), "the general path");
}

/// The first log line of `service` that says a batched intake statement
/// failed and its orders were stored one by one, if any.
fn intake_fallback_line(service: &sas_tests::Service) -> Option<String> {
    std::fs::read_to_string(&service.log)
        .unwrap_or_else(|e| panic!("read {}: {e}", service.log.display()))
        .lines()
        .find(|line| line.contains("storing its orders one by one"))
        .map(str::to_owned)
}

/// Publishes 64 orders at once, all before the scheduler starts so that it
/// takes them in batches: 63 good ones with their own `correlation_id`
/// property (stored with the order), and `bad`, published with `bad_body`
/// and `bad_properties` and the client's queue as its `reply_to` property.
/// Then checks that only `bad` is refused, once: answered `rejected` on
/// the client's queue with its correlation id and a reason holding
/// `reason`, dead-lettered and recorded with that reason, not stored;
/// that the 63 others are processed; and that they were stored by batched
/// statements (more than one order per intake batch, and no batched
/// statement failed into one statement per order).
async fn only_the_bad_order_of_a_batch_is_refused(
    bad_body: &[u8],
    bad_properties: BasicProperties,
    reason: &str,
) {
    let env = TestEnv::new().await;
    let (connection, publisher) = env.broker().await;
    let names = env.amqp().names();
    let (client_queue, channel) = env
        .client_queue(&connection, "sas.client.guest.batch")
        .await;
    let bad = "batch-31";
    let bad_correlation = bad_properties.correlation_id().clone();
    for i in 0..64 {
        let order_id = format!("batch-{i}");
        let (body, properties) = if order_id == bad {
            (
                bad_body.to_vec(),
                bad_properties
                    .clone()
                    .with_reply_to(client_queue.as_str().into()),
            )
        } else {
            (
                serde_json::to_vec(&order(&order_id)).unwrap(),
                BasicProperties::default().with_correlation_id(format!("c-{i}").into()),
            )
        };
        publisher
            .publish(
                "",
                &names.orders(),
                &body,
                properties.with_delivery_mode(2),
                true,
            )
            .await
            .expect("the broker confirms the order");
    }
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let ops = sas_tests::process::free_port();
    let mut scheduler = env.scheduler(0, &[sas_tests::Setting::Listen(ops)]);

    env.wait_for_count(ProcessState::Processed, 63, Duration::from_secs(90))
        .await;
    env.wait_for_dead_letters(1, Duration::from_secs(30)).await;
    let letters = env
        .store
        .reads()
        .dead_letters(100)
        .await
        .expect("read the dead letters");
    assert_eq!(letters.len(), 1, "one dead letter: {letters:?}");
    let letter = &letters[0];
    assert!(
        letter.reason.contains(reason),
        "the dead letter's reason names the property: {:?}",
        letter.reason
    );
    assert_eq!(letter.order_id.as_deref(), Some(bad), "{letter:?}");
    assert_eq!(
        letter.source_queue.as_deref(),
        Some(names.orders().as_str())
    );
    assert_eq!(
        env.state_of(bad).await,
        None,
        "the refused order is not stored"
    );
    assert_eq!(
        env.count(ProcessState::Processed).await,
        63,
        "every good order is processed, the refused one is not"
    );

    // Its client heard once, with its correlation id as it sent it.
    let answer = wait_until("the rejected answer", Duration::from_secs(10), || async {
        channel
            .basic_get(
                client_queue.as_str().into(),
                BasicGetOptions { no_ack: true },
            )
            .await
            .map_err(|e| e.to_string())?
            .ok_or_else(|| "nothing yet".to_owned())
    })
    .await;
    let status: sas_messages::OrderStatus =
        serde_json::from_slice(&answer.delivery.data).expect("a status message");
    assert_eq!(status.event, sas_messages::StatusEvent::Rejected);
    assert_eq!(status.order_id, bad);
    assert!(
        status
            .detail
            .as_deref()
            .unwrap_or_default()
            .contains(reason),
        "{status:?}"
    );
    assert_eq!(
        answer.delivery.properties.correlation_id(),
        &bad_correlation
    );
    assert!(
        channel
            .basic_get(
                client_queue.as_str().into(),
                BasicGetOptions { no_ack: true }
            )
            .await
            .expect("get")
            .is_none(),
        "answered once"
    );

    // The good orders went through batched statements: the intake batches
    // held exactly them, more than one a statement, and no batched statement
    // failed into one statement per order.
    let sample = |part: &str| format!("sas_batch_items_{part}{{batch=\"intake\"}}");
    let (items, batches) = (
        sas_tests::process::metric(ops, &sample("sum")).await,
        sas_tests::process::metric(ops, &sample("count")).await,
    );
    eprintln!("intake batches: {items:?} orders in {batches:?} statements");
    assert_eq!(
        items,
        Some(63.0),
        "the intake batches held the 63 good orders once each ({batches:?} batches)"
    );
    assert!(
        batches.is_some_and(|n| n < 63.0),
        "the good orders shared statements: {batches:?} batches"
    );
    assert_eq!(
        intake_fallback_line(&scheduler),
        None,
        "a batched intake statement failed (log {})",
        scheduler.log.display()
    );
    assert!(scheduler.is_running());
}

/// Postgres `text` cannot hold U+0000: before intake refused it, the
/// property failed the batched statement of every order beside it (which
/// were then stored one statement each), and the order came back on every
/// delivery until the queue's delivery limit dead-lettered it.
#[tokio::test(flavor = "multi_thread")]
async fn an_order_whose_correlation_id_holds_a_nul_is_refused_alone_and_its_batch_is_stored_in_one_statement(
) {
    only_the_bad_order_of_a_batch_is_refused(
        &serde_json::to_vec(&order("batch-31")).unwrap(),
        BasicProperties::default().with_correlation_id("c-\u{0}31".into()),
        "the correlation_id property holds a control character (U+0000 at byte 2)",
    )
    .await;
}

/// `jsonb` cannot hold U+0000 either: an order whose `attributes` hold one
/// is refused at intake, naming where, and its batch goes on.
#[tokio::test(flavor = "multi_thread")]
async fn an_order_whose_attributes_hold_a_nul_is_refused_alone_and_its_batch_is_stored_in_one_statement(
) {
    let mut bad = order("batch-31");
    let mut attributes = serde_json::Map::new();
    attributes.insert(
        "address".into(),
        serde_json::json!({ "lines": ["1 Main St", "flat\u{0}2"] }),
    );
    bad.attributes = Some(attributes);
    only_the_bad_order_of_a_batch_is_refused(
        &serde_json::to_vec(&bad).unwrap(),
        BasicProperties::default().with_correlation_id("c-31".into()),
        "attributes hold a NUL character (U+0000) at /address/lines/1",
    )
    .await;
}
