//! Faults that hit the shared RabbitMQ and PostgreSQL servers themselves
//! (restarts, killed connections) and the chaos test. Each test holds the
//! servers alone (`TestEnv::exclusive`), so no other test sees these
//! outages, and they run one at a time.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{RngExt, SeedableRng};
use sas_store::ProcessState;
use sas_tests::process::Service;
use sas_tests::Setting;
use sas_tests::{order, wait_until, TestEnv};

async fn run(program: &str, args: &[&str]) -> bool {
    match tokio::process::Command::new(program)
        .args(args)
        .output()
        .await
    {
        Ok(output) if output.status.success() => true,
        Ok(output) => {
            eprintln!(
                "{program} {args:?} failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            false
        }
        Err(error) => {
            eprintln!("cannot run {program}: {error}");
            false
        }
    }
}

/// Restarts RabbitMQ's application (every connection drops; quorum queues
/// keep their messages).
async fn restart_broker() {
    assert!(
        run("rabbitmqctl", &["stop_app"]).await,
        "rabbitmqctl stop_app (the tests need rights to restart RabbitMQ)"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        run("rabbitmqctl", &["start_app"]).await,
        "rabbitmqctl start_app"
    );
    assert!(run("rabbitmqctl", &["await_startup"]).await);
}

/// Restarts the PostgreSQL cluster when permitted; otherwise (not root)
/// terminates every connection to the test's database, which is what the
/// services see of a restart.
async fn restart_postgres(env: &TestEnv) {
    let version = std::fs::read_dir("/etc/postgresql").ok().and_then(|dir| {
        dir.filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .max()
    });
    let restarted = match version {
        Some(version) => {
            run(
                "pg_ctlcluster",
                &[
                    "--skip-systemctl-redirect",
                    &version,
                    "main",
                    "restart",
                    "-m",
                    "fast",
                ],
            )
            .await
        }
        None => false,
    };
    if !restarted {
        eprintln!(
            "could not restart PostgreSQL; terminating the test database's connections instead"
        );
        terminate_connections(env).await;
    }
}

async fn terminate_connections(env: &TestEnv) {
    let admin = std::env::var("SAS_TEST_DATABASE_ADMIN_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/postgres".into());
    let pool = sqlx::PgPool::connect(&admin)
        .await
        .expect("admin connection");
    let killed: i64 = sqlx::query_scalar(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = $1",
    )
    .bind(&env.database)
    .fetch_one(&pool)
    .await
    .expect("terminate connections");
    eprintln!("terminated {killed} connections to {}", env.database);
    pool.close().await;
}

/// Publishes orders `ids` through any outage: a failed publish reconnects
/// and tries again (the order id makes a repeat harmless).
async fn publish_through_outages(
    env: &TestEnv,
    orders: Vec<sas_messages::SubmitOrder>,
    pace: Duration,
) {
    let (mut connection, mut publisher) = env.broker().await;
    for order in orders {
        let id = order.order_id.as_str().to_owned();
        let body = serde_json::to_vec(&order).unwrap();
        loop {
            let sent = publisher
                .publish(
                    "",
                    &env.amqp().names().orders(),
                    &body,
                    sas_broker::publish::json_properties(&id),
                    true,
                )
                .await;
            if sent.is_ok() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
            let reconnected = tokio::time::timeout(Duration::from_secs(15), async {
                let settings = env.amqp();
                let connection = sas_broker::connect(&settings, "chaos-publisher")
                    .await
                    .ok()?;
                let publisher =
                    sas_broker::Publisher::open(&connection, settings.operation_timeout())
                        .await
                        .ok()?;
                Some((connection, publisher))
            })
            .await;
            if let Ok(Some((c, p))) = reconnected {
                let _ = connection.close(200, "replaced".into()).await;
                (connection, publisher) = (c, p);
            }
        }
        tokio::time::sleep(pace).await;
    }
    let _ = connection.close(200, "done".into()).await;
}

/// Runs 300 orders through a system of two agents per queue, lets `outage`
/// hit once 30 of them are processed, and checks that every order still
/// finishes, once, with no service restarted.
async fn outage_during_load<F: std::future::Future<Output = ()>>(
    env: &TestEnv,
    prefix: &str,
    outage: F,
) {
    let mut system = env.system(2).await;
    let ids: Vec<String> = (0..300).map(|n| format!("{prefix}{n}")).collect();
    let orders = ids.iter().map(|id| order(id)).collect();
    let publishing = publish_through_outages(env, orders, Duration::from_millis(10));
    let disrupting = async {
        env.wait_for_count(ProcessState::Processed, 30, Duration::from_secs(30))
            .await;
        outage.await;
    };
    tokio::join!(publishing, disrupting);
    env.wait_for_count(ProcessState::Processed, 300, Duration::from_secs(120))
        .await;
    system.assert_all_running();
    // A transaction cut short by the outage must not leave a pooled
    // connection inside it: a later statement would join it and be lost
    // with it (Postgres says so when the next one begins).
    for scheduler in &system.schedulers {
        assert!(
            !scheduler
                .log_text()
                .contains("already a transaction in progress"),
            "{} began a transaction inside another one: see {}",
            scheduler.name,
            scheduler.log.display()
        );
    }
    let by_order = system.sim.assert_every_order_done_once().await;
    assert_eq!(by_order.len(), 300);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_restart_during_load_loses_no_order() {
    let env = TestEnv::exclusive(5000).await;
    outage_during_load(&env, "broker-", restart_broker()).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_postgres_restart_and_killed_connections_during_load_lose_no_order() {
    let env = TestEnv::exclusive(5000).await;
    let outage = async {
        terminate_connections(&env).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        restart_postgres(&env).await;
        tokio::time::sleep(Duration::from_millis(700)).await;
        terminate_connections(&env).await;
    };
    outage_during_load(&env, "pg-", outage).await;
}

/// Waits (4 minutes at most) until all `orders` orders have ended, and
/// with `children` every child a parent started, and returns how many are
/// in each state and how many children there are. Both are counted at
/// each look: a parent ends only after its child, so the children counted
/// once everything ended are all of them (counted once beforehand, while a
/// parent had yet to start its child, they would be one short for ever).
async fn every_order_ended(
    env: &TestEnv,
    orders: usize,
    children: bool,
) -> (Vec<(ProcessState, i64)>, i64) {
    wait_until("every order to end", Duration::from_secs(240), || async {
        let children: i64 = if children {
            sqlx::query_scalar("SELECT count(*) FROM order_children")
                .fetch_one(&env.db)
                .await
                .map_err(|e| e.to_string())?
        } else {
            0
        };
        let counts = env
            .store
            .reads()
            .count_by_state()
            .await
            .map_err(|e| e.to_string())?;
        let ended: i64 = counts
            .iter()
            .filter(|(s, _)| s.is_terminal())
            .map(|(_, n)| n)
            .sum();
        if ended == orders as i64 + children {
            Ok((counts, children))
        } else {
            Err(format!("{counts:?}, {children} children"))
        }
    })
    .await
}

/// At least 1,000 orders (`SAS_CHAOS_ORDERS`) under load while processes of
/// every kind are killed with -9 and restarted at random (seeded by
/// `SAS_CHAOS_SEED`, printed so that a failure can be replayed), and the
/// broker is restarted once. One order in ten is a parent whose middle step
/// runs an order as a child, and operators cancel running parents
/// meanwhile: every tree ends as one, a compensated tree with every effect
/// of it undone.
#[tokio::test(flavor = "multi_thread")]
async fn chaos_every_order_ends_and_no_side_effect_happens_twice() {
    const MIN_KILLS: usize = 6;
    let orders: usize = std::env::var("SAS_CHAOS_ORDERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let seed: u64 = std::env::var("SAS_CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("chaos: {orders} orders, SAS_CHAOS_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);

    let env = TestEnv::exclusive(2000).await;
    let started = Instant::now();
    // Faults come from settings, so that a restarted remote-sim keeps them.
    let (sim_process, sim) = env
        .remote_sim(&[
            Setting::SimSeed(seed),
            Setting::SimFaultsLatencyMs(10),
            Setting::SimFaultsTransientFaultRate(0.03),
            Setting::SimFaultsHangRate(0.005),
            // A provider as real ones behave: 409 while a key is in flight,
            // 404 for the undo of what was never applied, a late action
            // after its undo refused, and some answers after the caller's
            // timeout.
            Setting::SimMode("strict".to_owned()),
            Setting::SimLateAnswerRate(0.01),
            Setting::SimLateAnswerMs(3000),
        ])
        .await;
    let supervisor_vars = [Setting::SupervisorMaxFailures(8)];
    // The test's order workflow, and a parent whose middle step runs an
    // order of it as a child: one order in ten is such a parent.
    let order_workflow =
        std::fs::read_to_string(env.workflow_file()).expect("the test's workflow file");
    let mut parent = String::from("name = \"parent\"\n\n");
    parent.push_str(&env.call_step(("hold", "inventory", "reserve", "release"), None));
    parent.push_str(
        "[[steps]]\nname = \"fulfil\"\nkind = \"child\"\nworkflow = \"order\"\ntimeout_ms = 60000\n\n",
    );
    parent.push_str(&env.call_step(("notify", "shipping", "ship", "cancel"), None));
    let workflows = env.workflows(&[("order.toml", &order_workflow), ("parent.toml", &parent)]);
    let mut processes: Vec<Service> = vec![sim_process];
    processes.extend(env.agents(2, &sim, &[]));
    processes.extend((0..2).map(|i| env.scheduler(i, &workflows)));
    processes.extend((0..2).map(|i| env.supervisor(i, &supervisor_vars)));

    let is_parent = |n: usize| n % 10 == 7;
    let submissions = (0..orders)
        .map(|n| {
            let mut submitted = order(&format!("chaos-{n}"));
            if is_parent(n) {
                submitted.workflow = Some("parent".into());
            }
            submitted
        })
        .collect();
    let pace = Duration::from_millis(15);
    let load_time = pace * orders as u32;
    let publishing = publish_through_outages(&env, submissions, pace);
    let mut kills: HashMap<String, usize> = HashMap::new();
    let chaos = async {
        let chaos_started = Instant::now();
        let mut broker_restarted = false;
        // The broker's restart takes seconds of the load's time, more on a
        // busy machine: the kills go on past the load until there are enough
        // of them, so that the run is chaos whatever the seed and the machine.
        while chaos_started.elapsed() < load_time || kills.values().sum::<usize>() < MIN_KILLS {
            tokio::time::sleep(Duration::from_millis(rng.random_range(200..800))).await;
            if !broker_restarted && chaos_started.elapsed() > load_time / 2 {
                eprintln!("chaos: restarting RabbitMQ");
                restart_broker().await;
                broker_restarted = true;
                continue;
            }
            let victim = rng.random_range(0..processes.len());
            let service = &mut processes[victim];
            eprintln!("chaos: kill -9 {}", service.name);
            service.kill9().await;
            *kills.entry(service.name.clone()).or_default() += 1;
            tokio::time::sleep(Duration::from_millis(rng.random_range(100..700))).await;
            env.restart(service).await;
        }
        assert!(broker_restarted, "the broker was restarted once");
    };
    // Operators cancel parents while the load runs: one running at that
    // moment (its child starting, running, or being undone), whatever the
    // kills do meanwhile.
    let mut cancel_rng = StdRng::seed_from_u64(seed ^ 0x5eed);
    let mut cancels = (0, 0);
    let cancelling = async {
        let since = Instant::now();
        while since.elapsed() < load_time {
            tokio::time::sleep(Duration::from_millis(cancel_rng.random_range(200..600))).await;
            let running: Vec<String> = sqlx::query_scalar(
                "SELECT order_id FROM order_process
                  WHERE workflow = 'parent' AND state IN ('pending', 'processing')",
            )
            .fetch_all(&env.db)
            .await
            .unwrap_or_default();
            if running.is_empty() {
                continue;
            }
            let parent = &running[cancel_rng.random_range(0..running.len())];
            let (code, _) = env.sasctl(&["cancel", parent, "--reason", "chaos"]).await;
            cancels.0 += 1;
            cancels.1 += usize::from(code == 0);
        }
    };
    tokio::join!(publishing, chaos, cancelling);
    let (cancels_sent, cancels_taken) = cancels;
    assert!(
        cancels_taken > 0,
        "no cancel reached a running parent ({cancels_sent} sent)"
    );

    // Every order ends, and so does every child a parent started.
    let (terminal, children) = every_order_ended(&env, orders, true).await;
    let count = |state: ProcessState| {
        terminal
            .iter()
            .find(|(s, _)| *s == state)
            .map_or(0, |(_, n)| *n)
    };
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&env.db)
        .await
        .unwrap();
    assert_eq!(
        stored,
        orders as i64 + children,
        "no order lost, no child twice"
    );

    // A parent's effects are counted with its child's (their keys start
    // with the parent's id): its own two and the child's three.
    let by_order = sim.effects_by_order().await;
    let states: HashMap<String, ProcessState> =
        sqlx::query_as::<_, (String, ProcessState)>("SELECT order_id, state FROM order_process")
            .fetch_all(&env.db)
            .await
            .unwrap()
            .into_iter()
            .collect();
    for (order_id, state) in &states {
        let Some(n) = order_id
            .strip_prefix("chaos-")
            .and_then(|n| n.parse::<usize>().ok())
        else {
            // A child: its parent's tree is checked whole.
            let parent = order_id.split(':').next().unwrap_or_default();
            assert_eq!(
                Some(state),
                states
                    .get(parent)
                    .filter(|s| **s != ProcessState::Error)
                    .or(Some(state)),
                "child {order_id} ended other than its parent"
            );
            continue;
        };
        let (forward, undo) = by_order.get(order_id).copied().unwrap_or((0, 0));
        let steps = if is_parent(n) { 5 } else { 3 };
        match state {
            ProcessState::Processed => assert!(
                forward == steps && undo == 0,
                "{order_id} processed with {forward} effects and {undo} undone"
            ),
            ProcessState::Compensated => assert!(
                forward <= undo,
                "{order_id} compensated but {forward} effects and only {undo} undone"
            ),
            _ => {}
        }
    }
    // No undo reached the remote before its action.
    sim.assert_no_undo_before_its_action().await;
    let stats = sim.stats().await.unwrap();
    eprintln!(
        "chaos: seed {seed}, {orders} orders and {children} children in {:.0?}: {} processed, {} compensated, {} error; kills {kills:?}; parents cancelled {cancels_taken} of {cancels_sent} asked; remote: {} calls, {} applied, {} deduplicated, {} transient faults, {} hangs",
        started.elapsed(),
        count(ProcessState::Processed),
        count(ProcessState::Compensated),
        count(ProcessState::Error),
        stats.calls,
        stats.applied,
        stats.deduplicated,
        stats.transient_faults,
        stats.hangs,
    );
}

/// The chaos of late actions: a strict remote without tombstones (an action
/// that lands after its undo stays applied), charges held on their way past
/// their step's deadline at random times (a proxy that forwards them after
/// the agent hung up), payment agents killed -9 with a delivery limit of 1
/// (their requests are dead-lettered), operators cancelling orders at
/// random, and shipments refused beside the charges in a parallel group.
/// Every order ends; every effect is applied once; no undo lands before its
/// action; a processed order undid nothing, and a compensated one undid
/// every action it applied. An order may end in `error` (an undo answered
/// 404, no proof), never `compensated` with an action standing.
/// `SAS_CHAOS_LATE_ORDERS` orders (default 300), seeded by `SAS_CHAOS_SEED`.
#[tokio::test(flavor = "multi_thread")]
async fn chaos_late_actions_are_undone_only_after_they_landed() {
    use sas_tests::http_proxy::HoldProxy;
    let orders: usize = std::env::var("SAS_CHAOS_LATE_ORDERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    let seed: u64 = std::env::var("SAS_CHAOS_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(rand::random);
    eprintln!("late chaos: {orders} orders, SAS_CHAOS_SEED={seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let env = TestEnv::exclusive(1500).await;
    let limit = Setting::AmqpDeliveryLimit(1);
    let workflow = format!(
        "name = \"order\"\nversion = 1\n{}{}{}",
        env.call_step(("reserve_stock", "inventory", "reserve", "release"), None),
        env.call_step(
            ("charge_payment", "payment", "charge", "refund"),
            Some("pay_and_ship")
        ),
        env.call_step(
            ("create_shipment", "shipping", "ship", "cancel"),
            Some("pay_and_ship")
        ),
    );
    let mut scheduler_settings = env.workflows(&[("order.toml", &workflow)]).to_vec();
    // A held charge lands within its deadline plus the grace.
    let grace = Setting::DeadlinesGraceMs(1500);
    scheduler_settings.extend([grace.clone(), limit.clone()]);
    let (_sim_process, sim) = env
        .remote_sim(&[Setting::SimSeed(seed), Setting::SimFaultsLatencyMs(10)])
        .await;
    sim.set_provider(serde_json::json!({
        "mode": "strict", "late_action": "apply", "late_answer_rate": 0.1, "late_answer_ms": 2500
    }))
    .await
    .unwrap();
    let refusing = serde_json::json!({ "latency_ms": 10, "transient_fault_rate": 0.0,
                                       "permanent_fault_rate": 0.15, "hang_rate": 0.0 });
    sim.set_faults(Some("shipping"), refusing).await.unwrap();
    let proxy = HoldProxy::start(sim.base_url()).await;
    let quick = [limit.clone(), Setting::CircuitFailureThreshold(1000)];
    let mut payment_settings = quick.to_vec();
    payment_settings.push(Setting::AgentRemoteUrl(format!("{}/payment", proxy.url())));
    let mut payments: Vec<Service> = (0..2)
        .map(|i| env.agent("payment", i, &sim, &payment_settings))
        .collect();
    let _others: Vec<Service> = ["inventory", "shipping"]
        .into_iter()
        .map(|agent| env.agent(agent, 0, &sim, &quick))
        .collect();
    let _scheduler = env.scheduler(0, &scheduler_settings);
    let _supervisor = env.supervisor(0, &[grace, limit]);
    let (_connection, publisher) = env
        .broker_with(sas_broker::AmqpSettings {
            delivery_limit: 1,
            ..env.amqp()
        })
        .await;
    let ids: Vec<String> = (0..orders).map(|n| format!("late-{n}")).collect();
    let started = Instant::now();
    let mut cancels = 0;
    let mut kills = 0;
    let mut published = 0;
    while published < ids.len() || started.elapsed() < Duration::from_secs(20) {
        if published < ids.len() {
            for id in &ids[published..(published + 10).min(ids.len())] {
                env.publish_order(&publisher, &order(id)).await;
            }
            published = (published + 10).min(ids.len());
        }
        match rng.random_range(0..10) {
            0..=3 => {
                // One of the latest: most likely still running.
                let victim = &ids[rng.random_range(published.saturating_sub(20)..published)];
                let cancelled = env
                    .store
                    .writes()
                    .cancel(victim, "chaos", "chaos-operator")
                    .await
                    .unwrap();
                cancels += usize::from(matches!(
                    cancelled,
                    sas_store::writes::operator::Cancel::Cancelled(_)
                ));
            }
            4 => {
                let agent = &mut payments[rng.random_range(0..2)];
                agent.kill9().await;
                tokio::time::sleep(Duration::from_millis(rng.random_range(100..400))).await;
                env.restart(agent).await;
                kills += 1;
            }
            5..=6 => proxy.hold("POST", "/payment/charge", Duration::from_millis(2000)),
            _ => proxy.clear_holds(),
        }
        tokio::time::sleep(Duration::from_millis(rng.random_range(100..300))).await;
    }
    proxy.clear_holds();
    let (terminal, _) = every_order_ended(&env, orders, false).await;
    // Each effect once (effects_by_order asserts it), no undo before its action.
    let by_order = sim.effects_by_order().await;
    sim.assert_no_undo_before_its_action().await;
    let states: HashMap<String, ProcessState> =
        sqlx::query_as::<_, (String, ProcessState)>("SELECT order_id, state FROM order_process")
            .fetch_all(&env.db)
            .await
            .unwrap()
            .into_iter()
            .collect();
    assert_eq!(states.len(), orders, "no order lost");
    for (order_id, state) in &states {
        let (forward, undone) = by_order.get(order_id).copied().unwrap_or((0, 0));
        match state {
            ProcessState::Processed => assert!(
                forward == 3 && undone == 0,
                "{order_id} processed with {forward} effects and {undone} undone"
            ),
            ProcessState::Compensated => assert_eq!(
                forward, undone,
                "{order_id} compensated with {forward} effects and {undone} undone"
            ),
            _ => {}
        }
    }
    // The roads were taken.
    let late = proxy
        .journal()
        .iter()
        .filter(|p| p.held_for.is_some() && p.client_connected == Some(false))
        .count();
    let letters = env.store.reads().dead_letters(1000).await.unwrap().len();
    let refused_beside: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM history WHERE event = 'compensation_started' AND step = 'create_shipment'",
    )
    .fetch_one(&env.db)
    .await
    .unwrap();
    let count = |state: ProcessState| {
        terminal
            .iter()
            .find(|(s, _)| *s == state)
            .map_or(0, |(_, n)| *n)
    };
    eprintln!(
        "late chaos: seed {seed}, {orders} orders in {:.0?}: {} processed, {} compensated, {} error; \
         {cancels} cancels, {kills} kills, {letters} dead letters, {refused_beside} shipments refused beside a charge, \
         {late} charges landed after their agent hung up",
        started.elapsed(),
        count(ProcessState::Processed),
        count(ProcessState::Compensated),
        count(ProcessState::Error),
    );
    assert!(
        cancels > 0 && refused_beside > 0 && late > 0,
        "every road was taken"
    );
}
