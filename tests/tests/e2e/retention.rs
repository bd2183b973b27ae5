//! Retention: a deployment that runs for years deletes finished orders (with
//! their steps, history and alerts) and old dead letters, and keeps
//! everything else.

use sqlx::AssertSqlSafe;
use std::time::Duration;

use sas_store::ProcessState;
use sas_tests::process::{free_port, metric, System};
use sas_tests::Setting;
use sas_tests::{order, wait_until, TestEnv};

/// Retention every 100 ms, in batches of 3 so that a pass takes several.
fn retention_vars(ops: u16) -> Vec<Setting> {
    vec![
        Setting::RetentionFinishedSecs(1),
        Setting::RetentionDeadLettersSecs(3600),
        Setting::RetentionIntervalMs(100),
        Setting::RetentionBatch(3),
        Setting::Listen(ops),
    ]
}

async fn rows(env: &TestEnv, table: &str) -> i64 {
    sqlx::query_scalar(AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
        .fetch_one(&env.db)
        .await
        .unwrap()
}

/// Orders retired so far, by the supervisors listening on `ops` together.
async fn retired_orders(ops: [u16; 2]) -> f64 {
    let mut retired = 0.0;
    for port in ops {
        retired += metric(port, "sas_retired_total{what=\"orders\"}")
            .await
            .unwrap_or(0.0);
    }
    retired
}

#[tokio::test(flavor = "multi_thread")]
async fn finished_orders_and_old_dead_letters_go_and_everything_else_stays() {
    let env = TestEnv::new().await;
    let (sim_process, sim) = env.remote_sim(&[]).await;
    let ops = [free_port(), free_port()];
    // Two supervisors share the work.
    let mut system = System {
        agents: env.agents(1, &sim, &[]),
        schedulers: vec![env.scheduler(0, &[])],
        supervisors: vec![
            env.supervisor(0, &retention_vars(ops[0])),
            env.supervisor(1, &retention_vars(ops[1])),
        ],
        sim_process,
        sim,
    };
    let pool = &env.db;
    // What must stay, whatever its age: an order still running, an order in
    // error with an open alert, and a dead letter younger than its age.
    let (_connection, publisher) = env.broker().await;
    for id in ["keep-running", "keep-error"] {
        env.publish_order(&publisher, &order(id)).await;
    }
    env.wait_for_count(ProcessState::Processed, 2, Duration::from_secs(30))
        .await;
    sqlx::query(
        "UPDATE order_process SET state = 'processing', locked_by = 'scheduler-x',
                complete_by = now() + interval '1 hour', updated_at = now() - interval '1 day'
          WHERE order_id = 'keep-running'",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "WITH e AS (UPDATE order_process SET state = 'error', updated_at = now() - interval '1 day'
                     WHERE order_id = 'keep-error' RETURNING order_id)
         INSERT INTO alerts (order_id, kind, message) SELECT order_id, 'compensation_failed', 'test' FROM e",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO dead_letters (at, source_queue, reason, body)
         VALUES (now() - interval '2 hours', 'q', 'rejected', 'old'), (now(), 'q', 'rejected', 'new')",
    )
    .execute(pool)
    .await
    .unwrap();
    // And 20 orders that finish now. All 20 retired (counted by the two
    // supervisors together), not just none left: on a slow machine the
    // first ones can be retired before the last one is stored.
    env.publish_orders(&publisher, "gone", 20).await;
    wait_until(
        "finished orders deleted",
        Duration::from_secs(60),
        || async {
            let left: Vec<String> =
                sqlx::query_scalar("SELECT order_id FROM orders ORDER BY order_id")
                    .fetch_all(pool)
                    .await
                    .map_err(|e| e.to_string())?;
            let retired = retired_orders(ops).await;
            if left == ["keep-error", "keep-running"] && retired == 20.0 {
                Ok(())
            } else {
                Err(format!("orders left: {left:?}, {retired} retired"))
            }
        },
    )
    .await;
    // Every gone order's rows went with it; the kept ones keep theirs.
    for table in ["order_process", "steps", "history", "alerts"] {
        let strays: i64 = sqlx::query_scalar(AssertSqlSafe(format!(
            "SELECT count(*) FROM {table} WHERE order_id NOT IN ('keep-error', 'keep-running')"
        )))
        .fetch_one(pool)
        .await
        .unwrap();
        assert_eq!(strays, 0, "{table} keeps rows of deleted orders");
    }
    assert_eq!(rows(&env, "steps").await, 6);
    assert!(
        rows(&env, "history").await >= 10,
        "the kept orders' history stays"
    );
    assert_eq!(rows(&env, "alerts").await, 1);
    let dead_letters: Vec<String> = sqlx::query_scalar("SELECT body FROM dead_letters")
        .fetch_all(pool)
        .await
        .unwrap();
    assert_eq!(dead_letters, ["new"]);
    // Schedules' decided runs go at the finished orders' age, but never a
    // started run whose order was not stored yet; a deleted schedule goes.
    // Without a scheduler, which would store (here: refuse) the unfired run.
    let mut scheduler = system.schedulers.remove(0);
    scheduler.kill9().await;
    sqlx::query(
        "INSERT INTO schedule_runs (tenant, name, occurrence, outcome, reason, order_id, order_body,
                                    recorded_by, recorded_at, fired_at)
         VALUES ('default', 's', now() - interval '3 hours', 'started', NULL, 's:1', '{}', 'x',
                 now() - interval '2 hours', now() - interval '2 hours'),
                ('default', 's', now() - interval '2 hours', 'skipped', 'busy', NULL, NULL, 'x',
                 now() - interval '2 hours', NULL),
                ('default', 's', now() - interval '1 hour', 'started', NULL, 's:unfired', '{}', 'x',
                 now() - interval '2 hours', NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(
        "INSERT INTO schedules (tenant, name, workflow, cron, time_zone, order_template, overlap,
                                catch_up_ms, created_by, updated_by, deleted_at)
         VALUES ('default', 'deleted', 'order', '@daily', 'UTC', '{}', 'skip', 0, 'x', 'x',
                 now() - interval '2 hours'),
                ('default', 'live', 'order', '@daily', 'UTC', '{}', 'skip', 0, 'x', 'x', NULL)",
    )
    .execute(pool)
    .await
    .unwrap();
    wait_until(
        "old schedule runs deleted",
        Duration::from_secs(30),
        || async {
            let runs: Vec<Option<String>> =
                sqlx::query_scalar("SELECT order_id FROM schedule_runs")
                    .fetch_all(pool)
                    .await
                    .map_err(|e| e.to_string())?;
            let schedules: Vec<String> = sqlx::query_scalar("SELECT name FROM schedules")
                .fetch_all(pool)
                .await
                .map_err(|e| e.to_string())?;
            if runs == [Some("s:unfired".to_owned())] && schedules == ["live"] {
                Ok(())
            } else {
                Err(format!("runs {runs:?}, schedules {schedules:?}"))
            }
        },
    )
    .await;
    // No order retired twice (an order stored again after it was retired
    // would be).
    assert_eq!(retired_orders(ops).await, 20.0);
    // Once the alert is resolved, the order in error goes too.
    sqlx::query("UPDATE alerts SET resolved_at = now()")
        .execute(pool)
        .await
        .unwrap();
    wait_until(
        "the resolved order deleted",
        Duration::from_secs(30),
        || async {
            match rows(&env, "orders").await {
                1 => Ok(()),
                n => Err(format!("{n} orders")),
            }
        },
    )
    .await;
    system.assert_all_running();
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_refuses_an_age_of_zero_in_the_database_itself() {
    let env = TestEnv::new().await;
    let error = sqlx::query_scalar::<_, i32>("SELECT sas_retire_finished(interval '0', 10)")
        .fetch_one(&env.db)
        .await
        .unwrap_err()
        .to_string();
    assert!(error.contains("older_than must be positive"), "{error}");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_dead_letter_queue_is_bounded_in_length_bytes_and_age() {
    // Alone on the broker while rabbitmqctl runs (a whole Erlang node each time).
    let env = TestEnv::exclusive(3000).await;
    let (_connection, _publisher) = env.broker().await;
    let queue = env.amqp().names().dead_letters();
    let output = std::process::Command::new("rabbitmqctl")
        .args([
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "arguments",
        ])
        .output()
        .expect("rabbitmqctl runs");
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text
        .lines()
        .find(|line| line.split_whitespace().next() == Some(queue.as_str()))
        .unwrap_or_else(|| panic!("{queue} not declared: {text}"));
    for argument in ["x-max-length", "x-max-length-bytes", "x-message-ttl"] {
        assert!(line.contains(argument), "{queue} lacks {argument}: {line}");
    }
}
