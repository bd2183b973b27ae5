//! Reaching whichever broker node is alive, sending again what a dying
//! connection left unconfirmed, and waiting for a Postgres primary rather
//! than writing to a standby (docs/high-availability.md).

use std::time::Duration;

use sas_store::machine::HistoryEvent;
use sas_store::ProcessState;
use sas_store::Store;
use sas_tests::env::database_settings;
use sas_tests::postgres_pair::PostgresPair;
use sas_tests::process::{free_port, metric};
use sas_tests::proxy::{url_at, AmqpProxy};
use sas_tests::Setting;
use sas_tests::{order, wait_for_state_in, wait_until, TestEnv};
use sqlx::Connection as _;

/// Waits until the scheduler, with metrics on `metrics_port`, consumes its
/// replies through `proxy`.
async fn wait_consuming(env: &TestEnv, proxy: &AmqpProxy, metrics_port: u16) {
    wait_until(
        "the scheduler to consume",
        Duration::from_secs(20),
        || async {
            let replies = format!(
                "sas_consumers{{queue=\"{}sas.scheduler.replies\"}}",
                env.prefix
            );
            let consumers = metric(metrics_port, &replies).await;
            match proxy.connections() {
                0 => Err("no connection through the proxy".to_owned()),
                _ if consumers.is_none() => Err("not consuming yet".to_owned()),
                _ => Ok(()),
            }
        },
    )
    .await;
}

/// A whole system with 30-second step deadlines whose one scheduler reaches
/// RabbitMQ through an [`AmqpProxy`], consuming by the time it is returned.
struct ProxiedScheduler {
    env: TestEnv,
    sim: sas_tests::sim::SimClient,
    proxy: AmqpProxy,
    metrics_port: u16,
    publisher: sas_broker::Publisher,
    /// Kept for their lifetime: the processes stop when dropped.
    _processes: Vec<sas_tests::process::Service>,
    _connection: sas_broker::lapin::Connection,
}

impl ProxiedScheduler {
    async fn start() -> Self {
        Self::start_with(&[]).await
    }

    /// [`ProxiedScheduler::start`] with the scheduler's `settings` too.
    async fn start_with(settings: &[Setting]) -> Self {
        let env = TestEnv::with_step_timeout(30_000).await;
        let (sim_process, sim) = env.remote_sim(&[]).await;
        let mut processes = env.agents(1, &sim, &[]);
        processes.push(sim_process);
        processes.push(env.supervisor(0, &[]));
        let proxy = AmqpProxy::start(&env.amqp_url).await;
        let metrics_port = free_port();
        let mut all = vec![
            Setting::AmqpUrl(proxy.url(&env.amqp_url)),
            Setting::Listen(metrics_port),
        ];
        all.extend_from_slice(settings);
        processes.push(env.scheduler(0, &all));
        let (connection, publisher) = env.broker().await;
        wait_consuming(&env, &proxy, metrics_port).await;
        Self {
            env,
            sim,
            proxy,
            metrics_port,
            publisher,
            _processes: processes,
            _connection: connection,
        }
    }
}

/// The broker took the first step's request, and its confirm never came
/// back before the scheduler's connection died. The scheduler sends the
/// request again on its next connection at once, not after the step's
/// 30-second deadline; the agent gets it twice, the remote service applies
/// it once (same idempotency key), and the second reply is fenced off as stale.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_left_unconfirmed_by_a_lost_connection_is_sent_again_and_done_once() {
    // Every field bound: the processes and the connection live to the end.
    let ProxiedScheduler {
        env,
        sim,
        proxy,
        metrics_port,
        publisher,
        _processes,
        _connection,
    } = ProxiedScheduler::start().await;
    // From now on its confirms stop coming back.
    proxy.swallow_confirms(true);

    env.publish_order(&publisher, &order("unconfirmed-1")).await;
    // The first request reached its queue and the agent: the reservation is
    // applied, while the scheduler still waits for the request's confirm.
    sim.wait_applied("unconfirmed-1:reserve_stock").await;
    assert!(proxy.confirms_swallowed() > 0, "no confirm was held back");
    proxy.swallow_confirms(false);
    proxy.cut();

    let started = std::time::Instant::now();
    env.wait_for_state(
        "unconfirmed-1",
        ProcessState::Processed,
        Duration::from_secs(20),
    )
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "not the supervisor's retry after the 30 s deadline"
    );
    no_deadline_missed_and_each_effect_once(&env, &sim, "unconfirmed-1").await;
    // What the lost connection left unconfirmed went out again on the next one.
    wait_for_count(
        metrics_port,
        "sas_republished_total",
        "the scheduler to send again",
    )
    .await;
    // The agent answered both copies of the request; the second reply is stale.
    wait_for_count(
        metrics_port,
        "sas_stale_replies_total",
        "the duplicate reply to be fenced",
    )
    .await;
}

/// Asserts that `order_id` missed no deadline and every side effect was applied once.
async fn no_deadline_missed_and_each_effect_once(
    env: &TestEnv,
    sim: &sas_tests::sim::SimClient,
    order_id: &str,
) {
    let detail = env.detail(order_id).await;
    assert_eq!(detail.summary.failure_count, 0, "no deadline was missed");
    for (key, count) in sim.applied_per_key().await.unwrap() {
        assert_eq!(count, 1, "{key} applied {count} times");
    }
}

/// Waits until the counter `sample` of the process with metrics on `port` is at least 1.
async fn wait_for_count(port: u16, sample: &str, what: &str) {
    wait_until(what, Duration::from_secs(10), || async {
        let value = metric(port, sample).await;
        (value.unwrap_or(0.0) >= 1.0)
            .then_some(())
            .ok_or_else(|| format!("{sample}: {value:?}"))
    })
    .await;
}

/// The scheduler stored the order and published its first request, which
/// never reached the broker: the connection died with it unread. Only the
/// copy sent again on the next connection can start the step before its
/// 30-second deadline.
#[tokio::test(flavor = "multi_thread")]
async fn a_request_lost_with_its_connection_is_sent_again_on_the_next_one() {
    // Every field bound: the processes and the connection live to the end.
    let ProxiedScheduler {
        env,
        sim,
        proxy,
        metrics_port: _,
        publisher,
        _processes,
        _connection,
    } = ProxiedScheduler::start().await;
    proxy.drop_from_clients(true);
    env.publish_order(&publisher, &order("lost-request-1"))
        .await;
    // The order is stored before its request is published: wait for the
    // request itself to be dropped, or a slow scheduler sends it after the
    // proxy passes again and nothing is lost.
    wait_request_dropped(&env, &proxy, "inventory").await;
    proxy.drop_from_clients(false);
    proxy.cut();
    env.wait_for_state(
        "lost-request-1",
        ProcessState::Processed,
        Duration::from_secs(20),
    )
    .await;
    no_deadline_missed_and_each_effect_once(&env, &sim, "lost-request-1").await;
}

/// Waits until the proxy has dropped a request published to `agent`'s queue.
async fn wait_request_dropped(env: &TestEnv, proxy: &AmqpProxy, agent: &str) {
    let queue = env.amqp().names().agent_requests(agent);
    wait_until(
        &format!("a request to {queue} dropped"),
        Duration::from_secs(20),
        || async {
            let dropped = proxy.dropped_publishes();
            dropped
                .contains(&queue)
                .then_some(())
                .ok_or_else(|| format!("dropped so far: {dropped:?}"))
        },
    )
    .await;
}

/// How many history lines of `order_id` say `event`.
async fn history_count(env: &TestEnv, order_id: &str, event: HistoryEvent) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM history WHERE order_id = $1 AND event = $2")
        .bind(order_id)
        .bind(event.as_str())
        .fetch_one(&env.db)
        .await
        .unwrap()
}

/// Waits until `order_id`'s history says `event`.
async fn wait_for_history(env: &TestEnv, order_id: &str, event: HistoryEvent) {
    wait_until(
        &format!("{order_id} to be {}", event.as_str()),
        Duration::from_secs(20),
        || async {
            match history_count(env, order_id, event).await {
                0 => Err("not yet".to_owned()),
                _ => Ok(()),
            }
        },
    )
    .await;
}

/// A claim took an order from its agent's line and committed, and the
/// request it announced never reached the broker: the connection died with
/// it unread. The claim's loop goes down with the connection, yet the
/// order is held with a 30-second deadline, so only the copy its announcing
/// task sends again on the next connection can start the step in time.
/// Every agent admits one attempt at a time, and the remote takes three
/// seconds a reservation, so the second order waits in line until the
/// first one's reply frees the slot.
#[tokio::test(flavor = "multi_thread")]
async fn a_claims_request_lost_with_its_connection_is_sent_again_on_the_next_one() {
    let ProxiedScheduler {
        env,
        sim,
        proxy,
        metrics_port,
        publisher,
        _processes,
        _connection,
    } = ProxiedScheduler::start_with(&[
        Setting::SchedulerAdmissionInitial(1),
        Setting::SchedulerAdmissionCeiling(1),
    ])
    .await;
    // Slow enough that the second order is in line, and the proxy dropping,
    // before the first one's reservation comes back, on a slow machine too.
    let slow = serde_json::json!({ "latency_ms": 3000, "transient_fault_rate": 0.0, "permanent_fault_rate": 0.0, "hang_rate": 0.0 });
    sim.set_faults(Some("inventory"), slow)
        .await
        .expect("slow the remote's inventory");
    env.publish_order(&publisher, &order("claim-lost-1")).await;
    wait_for_history(&env, "claim-lost-1", HistoryEvent::Dispatched).await;
    env.publish_order(&publisher, &order("claim-lost-2")).await;
    wait_for_history(&env, "claim-lost-2", HistoryEvent::Queued).await;
    // The first order's reply still comes in, frees the slot, and a claim
    // takes the second order; what the scheduler sends is lost.
    proxy.drop_from_clients(true);
    // The claim commits before its request is published: wait for the
    // request itself to be dropped, or a slow scheduler sends it after the
    // proxy passes again and nothing is lost (CI saw it, under a whole run).
    wait_for_history(&env, "claim-lost-2", HistoryEvent::Claimed).await;
    wait_request_dropped(&env, &proxy, "inventory").await;
    proxy.drop_from_clients(false);
    proxy.cut();

    let started = std::time::Instant::now();
    for id in ["claim-lost-1", "claim-lost-2"] {
        env.wait_for_state(id, ProcessState::Processed, Duration::from_secs(20))
            .await;
    }
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "not the supervisor's retry after the 30 s deadline"
    );
    // The claimed attempt itself ran: no step of the order needed another.
    let attempts: Vec<i32> =
        sqlx::query_scalar("SELECT attempt FROM steps WHERE order_id = $1 ORDER BY position")
            .bind("claim-lost-2")
            .fetch_all(&env.db)
            .await
            .unwrap();
    assert_eq!(attempts, vec![1, 1, 1], "one attempt per step");
    for id in ["claim-lost-1", "claim-lost-2"] {
        no_deadline_missed_and_each_effect_once(&env, &sim, id).await;
    }
    wait_for_count(
        metrics_port,
        "sas_republished_total",
        "the scheduler to send again",
    )
    .await;
}

/// A cluster node that is down costs nothing: the URL names a node nobody
/// listens on, `amqp.nodes` the real one, and every service reaches it.
#[tokio::test(flavor = "multi_thread")]
async fn a_node_that_is_down_is_skipped_for_the_next_one_in_the_list() {
    let env = TestEnv::new().await;
    let uri: sas_broker::lapin::uri::AMQPUri = env.amqp_url.parse().unwrap();
    let cluster = [
        Setting::AmqpUrl(url_at(&env.amqp_url, free_port())),
        Setting::AmqpNodes(format!("{}:{}", uri.authority.host, uri.authority.port)),
    ];
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &cluster);
    let _supervisor = env.supervisor(0, &cluster);
    let _scheduler = env.scheduler(0, &cluster);
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("skip-dead-node-1"))
        .await;
    env.wait_for_state(
        "skip-dead-node-1",
        ProcessState::Processed,
        Duration::from_secs(30),
    )
    .await;
}

/// A primary and its streaming standby, with database `sas` created on the
/// primary.
async fn pair_with_database() -> PostgresPair {
    let pair = tokio::task::spawn_blocking(PostgresPair::start)
        .await
        .expect("start a primary and its standby");
    let mut admin = sqlx::PgConnection::connect(&pair.primary_url("postgres"))
        .await
        .expect("connect to the primary");
    sqlx::query("CREATE DATABASE sas")
        .execute(&mut admin)
        .await
        .expect("create the database");
    pair
}

/// A scheduler whose database URL reaches only a standby (as after a
/// failover, before the routing follows) is not ready and writes nothing
/// there: its migrations and an order that arrives wait. Once the primary
/// crashed and the standby was promoted, the same process, not restarted,
/// is ready, migrates, and the order is processed, each effect once.
#[tokio::test(flavor = "multi_thread")]
async fn a_service_that_reaches_only_a_standby_waits_until_it_is_promoted() {
    let env = TestEnv::new().await;
    // Created on the primary, the database reaches the standby by replication.
    let pair = pair_with_database().await;
    wait_until(
        "the database to reach the standby",
        Duration::from_secs(20),
        || async {
            sqlx::PgConnection::connect(&pair.standby_url("sas"))
                .await
                .map(drop)
                .map_err(|e| e.to_string())
        },
    )
    .await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let port = free_port();
    let scheduler = env.scheduler(
        0,
        &[
            Setting::DatabaseUrl(pair.standby_url("sas")),
            Setting::Listen(port),
        ],
    );
    // Not ready, and saying why in its log (the broker waits for the
    // migrations, so /readyz names whichever it misses first).
    wait_until(
        "the scheduler to refuse the standby",
        Duration::from_secs(20),
        || async {
            let refused = scheduler
                .log_text()
                .contains("connected to a Postgres standby");
            match sas_tests::local_status(port, "/readyz").await {
                Some((503, _)) if refused => Ok(()),
                other => Err(format!("{other:?}, refusal logged: {refused}")),
            }
        },
    )
    .await;
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("on-standby-1")).await;
    let tables: i64 =
        sqlx::query_scalar("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
            .fetch_one(
                &mut sqlx::PgConnection::connect(&pair.standby_url("sas"))
                    .await
                    .unwrap(),
            )
            .await
            .unwrap();
    assert_eq!(tables, 0, "nothing was migrated onto the standby");
    assert_eq!(
        sas_tests::local_status(port, "/readyz")
            .await
            .map(|(status, _)| status),
        Some(503),
        "still not ready on a standby"
    );

    let pair = tokio::task::spawn_blocking(move || {
        pair.crash_primary();
        pair.promote_standby();
        pair
    })
    .await
    .expect("crash the primary and promote the standby");
    wait_until("/readyz once promoted", Duration::from_secs(30), || async {
        match sas_tests::local_status(port, "/readyz").await {
            Some((200, _)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    })
    .await;
    let promoted = Store::connect_lazy(&database_settings(&pair.standby_url("sas")), "sas-tests")
        .expect("store settings");
    wait_for_state_in(
        &promoted,
        "on-standby-1",
        ProcessState::Processed,
        Duration::from_secs(30),
    )
    .await;
    for (key, count) in sim.applied_per_key().await.unwrap() {
        assert_eq!(count, 1, "{key} applied {count} times");
    }
}

/// While the reply queue answers the payment agent's replies with negative
/// confirms (as a quorum queue does while it elects a leader), the agent
/// sends its reply again after a pause, on the same connection, instead of
/// handing the request back: the request is delivered once (the old way,
/// every nack was a redelivery, and four of them passed the delivery limit
/// and dead-lettered a step that had succeeded), and the order is processed.
#[tokio::test(flavor = "multi_thread")]
async fn an_agent_sends_a_nacked_reply_again_without_handing_its_request_back() {
    let env = TestEnv::with_step_timeout(30_000).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let proxy = AmqpProxy::start(&env.amqp_url).await;
    let payment_port = free_port();
    let payment = env.agent(
        "payment",
        0,
        &sim,
        &[
            Setting::AmqpUrl(proxy.url(&env.amqp_url)),
            Setting::Listen(payment_port),
        ],
    );
    let _others = [
        env.agent("inventory", 0, &sim, &[]),
        env.agent("shipping", 0, &sim, &[]),
    ];
    let _scheduler = env.scheduler(0, &[]);
    let _supervisor = env.supervisor(0, &[]);
    let consumers = format!("sas_consumers{{queue=\"{}sas.agent.payment\"}}", env.prefix);
    wait_until(
        "the payment agent to consume",
        Duration::from_secs(20),
        || async {
            (proxy.connections() > 0 && metric(payment_port, &consumers).await.is_some())
                .then_some(())
                .ok_or_else(|| "not consuming yet".to_owned())
        },
    )
    .await;
    proxy.nack_confirms(true);
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("nacked-reply-1"))
        .await;
    wait_until("five replies nacked", Duration::from_secs(20), || async {
        (proxy.confirms_nacked() >= 5)
            .then_some(())
            .ok_or_else(|| format!("{} nacked", proxy.confirms_nacked()))
    })
    .await;
    proxy.nack_confirms(false);
    env.wait_for_state(
        "nacked-reply-1",
        ProcessState::Processed,
        Duration::from_secs(20),
    )
    .await;
    let log = payment.log_text();
    assert!(
        !log.contains("redelivered request"),
        "the request was handed back: {log}"
    );
    let republished = metric(payment_port, "sas_republished_total").await;
    assert!(republished.unwrap_or(0.0) >= 1.0, "{republished:?}");
    for (key, count) in sim.applied_per_key().await.unwrap() {
        assert_eq!(count, 1, "{key} applied {count} times");
    }
}

/// An asynchronous standby that was behind when its primary crashed lost
/// the orders committed (and acknowledged) in between, and nothing in the
/// promoted database says they ever existed. The scheduler remembers what
/// it acknowledged: once its pool reaches the promoted standby (through a
/// proxy standing in for HAProxy), it raises one `orders_lost` alert naming
/// exactly those orders, and not the one the standby had.
#[tokio::test(flavor = "multi_thread")]
async fn orders_a_failover_lost_after_they_were_acknowledged_are_named_in_an_alert() {
    let env = TestEnv::new().await;
    let pair = pair_with_database().await;
    let primary = format!("127.0.0.1:{}", pair.primary_port);
    let route = sas_tests::tcp_delay::DelayProxy::start(&primary, Duration::ZERO).await;
    let port = free_port();
    let scheduler = env.scheduler(
        0,
        &[
            Setting::DatabaseUrl(route.postgres_url(&pair.primary_url("sas"))),
            Setting::Listen(port),
        ],
    );
    let (_connection, publisher) = env.broker().await;
    env.publish_order(&publisher, &order("kept-1")).await;
    wait_for_order(&pair.standby_url("sas"), "kept-1", "the standby").await;

    // From now on the primary commits alone.
    let pair = tokio::task::spawn_blocking(move || {
        pair.stop_standby();
        pair
    })
    .await
    .expect("stop the standby");
    let lost = ["lost-1", "lost-2", "lost-3"];
    for id in lost {
        env.publish_order(&publisher, &order(id)).await;
    }
    for id in lost {
        wait_for_order(&pair.primary_url("sas"), id, "the primary").await;
    }
    // Acknowledged: the scheduler remembers all four.
    wait_until(
        "the scheduler to acknowledge the orders",
        Duration::from_secs(20),
        || async {
            let remembered = metric(port, "sas_audit_acknowledged_orders").await;
            (remembered.unwrap_or(0.0) >= 4.0)
                .then_some(())
                .ok_or_else(|| format!("{remembered:?}"))
        },
    )
    .await;
    let pair = tokio::task::spawn_blocking(move || {
        pair.crash_primary();
        pair.start_standby();
        pair.promote_standby();
        pair
    })
    .await
    .expect("crash the primary and promote the standby");
    route.point_at(&format!("127.0.0.1:{}", pair.standby_port));
    route.cut();
    let promoted = Store::connect_lazy(&database_settings(&pair.standby_url("sas")), "sas-tests")
        .expect("store settings");

    let alert = wait_until(
        "an orders_lost alert on the promoted standby",
        Duration::from_secs(30),
        || async {
            let alerts = promoted
                .reads()
                .alerts(false, 100)
                .await
                .map_err(|e| e.to_string())?;
            alerts
                .into_iter()
                .find(|alert| alert.kind == sas_store::machine::AlertKind::OrdersLost)
                .ok_or_else(|| "no alert yet".to_owned())
        },
    )
    .await;
    assert!(alert.order_id.is_none(), "{alert:?}");
    assert!(
        alert
            .message
            .starts_with("3 orders scheduler-0 acknowledged"),
        "{}",
        alert.message
    );
    for id in lost {
        assert!(alert.message.contains(id), "{id}: {}", alert.message);
    }
    assert!(!alert.message.contains("kept-1"), "{}", alert.message);
    assert_eq!(metric(port, "sas_orders_lost_total").await, Some(3.0));
    assert!(
        scheduler.log_text().contains("lost-2"),
        "the log names every lost order"
    );
}

/// Waits until the database at `url` (a primary or a standby) holds order
/// `order_id`.
async fn wait_for_order(url: &str, order_id: &str, what: &str) {
    wait_until(
        &format!("{order_id} on {what}"),
        Duration::from_secs(20),
        || async {
            let mut connection = sqlx::PgConnection::connect(url)
                .await
                .map_err(|e| e.to_string())?;
            let held: Option<String> =
                sqlx::query_scalar("SELECT order_id FROM orders WHERE order_id = $1")
                    .bind(order_id)
                    .fetch_optional(&mut connection)
                    .await
                    .map_err(|e| e.to_string())?;
            held.map(drop).ok_or_else(|| "not yet".to_owned())
        },
    )
    .await;
}
