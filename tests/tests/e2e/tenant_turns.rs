//! Tenants take turns in the agents' lines (issue 47, migration 0027),
//! against real processes: a slow remote (50 ms a call, one agent process
//! per queue of one call at a time, an admission limit of 2), tenant `a`
//! bursting 120 orders at once and tenant `b` sending 4 right after.
//!
//! Before, every agent's line was first come, first served: `b`'s orders
//! waited behind all of `a`'s burst and ended last. Now each of `b`'s
//! orders takes the next turn in each line, and ends while most of `a`'s
//! burst still waits; an urgent order of `a` still passes `a`'s own
//! backlog; and every order ends processed.
//!
//! Then two busy tenants, `heavy` of weight 3 and `light` of weight 1,
//! each with 60 orders in the same line: of the first 40 the line serves,
//! about 30 are `heavy`'s.
//!
//! The tenants' clients publish as the test's broker user, which the
//! scheduler trusts to name them (`amqp.delegating_users`), as the gateway
//! does its clients.

use std::time::{Duration, Instant};

use sas_broker::lapin::types::{AMQPValue, FieldTable};
use sas_broker::lapin::BasicProperties;
use sas_broker::Publisher;
use sas_store::ProcessState;
use sas_tests::{order, wait_until, Setting, TestEnv};
use serde_json::json;
use sqlx::Connection as _;

/// Publishes `order` as gateway client `client`, vouched for by the broker
/// user `guest`.
pub(crate) async fn publish_as(
    env: &TestEnv,
    publisher: &Publisher,
    client: &str,
    order: &sas_messages::SubmitOrder,
) {
    let mut headers = FieldTable::default();
    headers.insert(
        sas_messages::headers::SENDER.into(),
        AMQPValue::LongString(format!("gateway:{client}").into()),
    );
    let properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_user_id(env.amqp().user().expect("a broker user").into())
        .with_headers(headers);
    publisher
        .publish(
            "",
            &env.amqp().names().orders(),
            &serde_json::to_vec(order).unwrap(),
            properties,
            true,
        )
        .await
        .expect("publish");
}

async fn processed(env: &TestEnv, tenant: &str) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM order_process
          WHERE order_id LIKE '%@' || $1 AND state = 'processed'",
    )
    .bind(tenant)
    .fetch_one(&env.db)
    .await
    .unwrap()
}

/// A slow system (remote-sim at `latency_ms` a call) whose scheduler reads
/// `tenancy` (a tenancy file's text) and keeps each agent's limit at
/// `limit`, up to `ceiling`, and no agent yet: a test stores its orders
/// first, so that what it measures is the order the lines serve them in,
/// not how fast it published them. No supervisor adapts the limits.
async fn slow_scheduler(
    env: &TestEnv,
    tenancy: &str,
    latency_ms: u64,
    (limit, ceiling): (u32, u32),
) -> (Vec<sas_tests::process::Service>, sas_tests::sim::SimClient) {
    let file = std::env::temp_dir().join(format!("{}-turns.toml", env.id));
    std::fs::write(&file, tenancy).unwrap();
    let (sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(
        None,
        json!({"latency_ms": latency_ms, "transient_fault_rate": 0.0, "permanent_fault_rate": 0.0, "hang_rate": 0.0}),
    )
    .await
    .expect("slow the remote");
    let processes = vec![
        sim_process,
        env.scheduler(
            0,
            &[
                Setting::SchedulerTenancyFile(file.display().to_string()),
                Setting::AmqpDelegatingUsers(env.amqp().user().expect("a broker user")),
                Setting::SchedulerAdmissionInitial(limit),
                Setting::SchedulerAdmissionCeiling(ceiling),
            ],
        ),
    ];
    (processes, sim)
}

/// One agent process of one call at a time per queue.
fn slow_agents(env: &TestEnv, sim: &sas_tests::sim::SimClient) -> Vec<sas_tests::process::Service> {
    env.agents(1, sim, &[Setting::AgentConcurrency(1)])
}

/// Waits until at least `n` orders are stored: in the agents' lines, or
/// already through them. Counting those still in line instead would ask
/// for a peak that a slow publish may never reach while the lines drain.
async fn stored(env: &TestEnv, n: i64) {
    wait_until(
        &format!("{n} orders stored"),
        Duration::from_secs(30),
        || async {
            let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM order_process")
                .fetch_one(&env.db)
                .await
                .unwrap();
            (stored >= n)
                .then_some(())
                .ok_or(format!("{stored} stored"))
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_quiet_tenant_takes_the_next_turn_past_a_busy_tenants_burst() {
    // A burst meant to fill the lines for seconds: alone on the machine, so
    // that what is measured is the lines' order, not CPU contention.
    let env = TestEnv::exclusive(5000).await;
    let (_system, sim) = slow_scheduler(
        &env,
        "[tenants.a]\nmembers = [\"gateway:a\"]\n[tenants.b]\nmembers = [\"gateway:b\"]\n",
        50,
        (2, 2),
    )
    .await;
    let (_connection, publisher) = env.broker().await;

    let burst = 120;
    for n in 0..burst {
        publish_as(&env, &publisher, "a", &order(&format!("a-{n}"))).await;
    }
    // a's burst is in the lines before b's first order arrives.
    stored(&env, i64::from(burst)).await;
    let mut urgent = order("a-urgent");
    urgent.priority = Some(9);
    publish_as(&env, &publisher, "a", &urgent).await;
    let sent = Instant::now();
    for n in 0..4 {
        publish_as(&env, &publisher, "b", &order(&format!("b-{n}"))).await;
    }
    // Every order in line before any is served.
    stored(&env, i64::from(burst) + 5).await;
    let _agents = slow_agents(&env, &sim);
    wait_until(
        "b's orders and a's urgent order processed",
        Duration::from_secs(60),
        || async {
            let b = processed(&env, "b").await;
            let urgent = env.state_of("a-urgent@a").await;
            (b == 4 && urgent == Some(ProcessState::Processed))
                .then_some(())
                .ok_or(format!("b processed {b}, a-urgent {urgent:?}"))
        },
    )
    .await;
    let b_took = sent.elapsed();
    let a_done = processed(&env, "a").await;
    eprintln!("b's 4 orders ended {b_took:?} after they were sent, with {a_done} of a's ended");
    // First come, first served, b's orders would end after all 120 of a's
    // (about 3 s of the remote's time per agent); taking turns, each goes
    // next in each line, and most of a's burst is still to do.
    assert!(
        a_done < 60,
        "b's 4 orders ended after {b_took:?}, when {a_done} of a's {} had already ended: b waited behind a's burst",
        burst + 1
    );
    env.wait_for_count(
        ProcessState::Processed,
        i64::from(burst) + 5,
        Duration::from_secs(120),
    )
    .await;
    let waited = crate::overload::orders_that_waited(&env).await;
    assert!(waited > 100, "the orders waited in line: {waited}");
}

#[tokio::test(flavor = "multi_thread")]
async fn two_busy_tenants_take_turns_by_weight() {
    let env = TestEnv::exclusive(5000).await;
    let (_system, sim) = slow_scheduler(
        &env,
        "[tenants.heavy]\nmembers = [\"gateway:heavy\"]\nweight = 3\n\
         [tenants.light]\nmembers = [\"gateway:light\"]\n",
        40,
        (1, 1),
    )
    .await;
    let (_connection, publisher) = env.broker().await;
    // One order takes the only slot; the rest wait in inventory's line,
    // light's sent first.
    publish_as(&env, &publisher, "light", &order("first")).await;
    for n in 0..60 {
        publish_as(&env, &publisher, "light", &order(&format!("l-{n}"))).await;
    }
    for n in 0..60 {
        publish_as(&env, &publisher, "heavy", &order(&format!("h-{n}"))).await;
    }
    stored(&env, 121).await;
    let _agents = slow_agents(&env, &sim);
    env.wait_for_count(ProcessState::Processed, 121, Duration::from_secs(120))
        .await;
    // The order in which inventory's line was served: its first attempts.
    let served: Vec<String> = sqlx::query_scalar(
        "SELECT order_id FROM history
          WHERE event = 'dispatched' AND step = 'reserve_stock' AND order_id <> 'first@light'
          ORDER BY at, id",
    )
    .fetch_all(&env.db)
    .await
    .unwrap();
    // From the first of heavy's served on (light's first ones may have
    // been served before heavy's arrived).
    let heavy = served
        .iter()
        .skip_while(|id| !id.ends_with("@heavy"))
        .take(40)
        .filter(|id| id.ends_with("@heavy"))
        .count();
    // First come, first served, light's would go first; taking turns by
    // weight, three in four are heavy's.
    assert!(
        (26..=34).contains(&heavy),
        "{heavy} of the first 40 served were heavy's: {served:?}"
    );
}

/// A limit full of one tenant's work, and room under the cap: another
/// tenant's order, with nothing in flight at the agent, passes the limit at
/// once (the agent will give it the next call slot before the busy
/// tenant's requests it holds), rather than waiting in line for a reply to
/// free room and then at the agent for the round after. The busy tenant's
/// next order waits for room, as before.
#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_with_nothing_in_flight_passes_a_limit_full_of_another_tenants_work() {
    let env = TestEnv::new().await;
    let (_system, sim) = slow_scheduler(
        &env,
        "[tenants.a]\nmembers = [\"gateway:a\"]\n[tenants.b]\nmembers = [\"gateway:b\"]\n",
        1000,
        (1, 10),
    )
    .await;
    // No supervisor measures the agents here: the cap, which the
    // supervisors set every window, is set by hand (0 lets nothing pass).
    wait_until("inventory registered", Duration::from_secs(20), || async {
        let updated = sqlx::query("UPDATE admission SET admit_cap = 10 WHERE agent = 'inventory'")
            .execute(&env.db)
            .await
            .map_err(|e| e.to_string())?
            .rows_affected();
        (updated == 1).then_some(()).ok_or("not yet".to_owned())
    })
    .await;
    let _agents = slow_agents(&env, &sim);
    let (_connection, publisher) = env.broker().await;
    // a-0 fills the limit alone, then a's others join the line: published
    // together, two intakes in transactions of their own could each take
    // the one free slot (seen: two of a's in flight at a limit of 1), and
    // the pass is rightly closed at twice the limit.
    publish_as(&env, &publisher, "a", &order("a-0")).await;
    stored(&env, 1).await;
    for n in 1..4 {
        publish_as(&env, &publisher, "a", &order(&format!("a-{n}"))).await;
    }
    stored(&env, 4).await;
    publish_as(&env, &publisher, "b", &order("b-0")).await;
    env.wait_for_count(ProcessState::Processed, 5, Duration::from_secs(60))
        .await;
    let at = |order_id: &'static str, event: &'static str| {
        let db = env.db.clone();
        async move {
            sqlx::query_scalar::<_, chrono::DateTime<chrono::Utc>>(
                "SELECT min(at) FROM history
                  WHERE order_id = $1 AND event = $2 AND step = 'reserve_stock'",
            )
            .bind(order_id)
            .bind(event)
            .fetch_one(&db)
            .await
            .unwrap()
        }
    };
    // When the first of a's reservations gave its slot back (its answer,
    // or its recovery on a machine busy enough for it to miss its
    // deadline), whichever of a's orders the scheduler took in first: its
    // four publishes are separate messages. And when a's second started.
    let (first_reserved, a_next): (chrono::DateTime<chrono::Utc>, chrono::DateTime<chrono::Utc>) =
        sqlx::query_as(
            "SELECT (SELECT min(at) FROM history
                      WHERE order_id LIKE '%@a' AND step = 'reserve_stock'
                        AND event IN ('step_completed', 'retry_scheduled', 'transient_failure',
                                      'not_started', 'step_failed')),
                    (SELECT at FROM history
                      WHERE order_id LIKE '%@a' AND step = 'reserve_stock' AND event = 'dispatched'
                      ORDER BY at OFFSET 1 LIMIT 1)",
        )
        .fetch_one(&env.db)
        .await
        .expect("a's reservations");
    let b_dispatched = at("b-0@b", "dispatched").await;
    assert!(
        b_dispatched < first_reserved,
        "b's order started at {b_dispatched}, after a's first reservation ended at {first_reserved}: it waited in line"
    );
    assert!(
        a_next >= first_reserved,
        "a's second reservation started at {a_next}, before its first gave its slot back at {first_reserved}: a busy tenant passed its own limit"
    );
}

/// An order of tenant `tenant` (stored id `<id>@<tenant>`) joining agent
/// `x`'s line as the state store puts it there: `admit_key` its arrival
/// less its head start (10 s per priority level, a day for an undo).
async fn join_line(db: &mut sqlx::PgConnection, stored_id: &str, undo: bool) {
    sqlx::query("INSERT INTO orders (order_id, body) VALUES ($1, '{}')")
        .bind(stored_id)
        .execute(&mut *db)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO order_process (order_id, workflow, state, priority, waiting_for, admit_key)
         VALUES ($1, 'order', $2::process_state, 5, 'x',
                 now() - interval '50 seconds' - CASE WHEN $3 THEN interval '1 day' ELSE interval '0' END)",
    )
    .bind(stored_id)
    .bind(if undo { "compensating" } else { "pending" })
    .bind(undo)
    .execute(&mut *db)
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread")]
async fn an_undo_waiting_in_line_never_pushes_its_tenants_new_work_back() {
    let env = TestEnv::new().await;
    let mut db = sqlx::PgConnection::connect(&env.database_url)
        .await
        .unwrap();
    sqlx::query(
        "INSERT INTO admission (agent, admit_limit, initial_limit, ceiling, deadline_ms)
         VALUES ('x', 1, 1, 1, 1000)",
    )
    .execute(&mut db)
    .await
    .unwrap();
    sqlx::query("INSERT INTO tenant_share (tenant, weight) VALUES ('a', 1), ('b', 1)")
        .execute(&mut db)
        .await
        .unwrap();
    let mut tx = sqlx::Connection::begin(&mut db).await.unwrap();
    join_line(&mut tx, "undo@a", true).await;
    join_line(&mut tx, "new@a", false).await;
    join_line(&mut tx, "new@b", false).await;
    tx.commit().await.unwrap();
    let keys: Vec<(String, f64)> = sqlx::query_as(
        "SELECT p.order_id, EXTRACT(EPOCH FROM p.admit_key - a.line_head)::float8
           FROM order_process p JOIN admission a ON a.agent = p.waiting_for
          ORDER BY p.admit_key",
    )
    .fetch_all(&mut db)
    .await
    .unwrap();
    // The undo first, then a's and b's new orders, each at the head of its
    // own flow: a's is not placed a day behind, after its undo's turn.
    let order: Vec<&str> = keys.iter().map(|(id, _)| id.as_str()).collect();
    assert_eq!(order[0], "undo@a", "{keys:?}");
    for (id, from_head) in &keys {
        assert!(
            from_head.abs() < 1.0,
            "{id} placed {from_head} s from the head: {keys:?}"
        );
    }
}
