//! A remote that answers 429 with `Retry-After`: the agent pauses its calls
//! to that service until then (its other lanes go on), the orders wait
//! without a failure counted and keep their place, and the pause is
//! visible; against real processes and remote-sim rate-limiting one
//! service.

use std::time::Duration;

use sas_store::ProcessState;
use sas_tests::process::{free_port, wait_for_metric};
use sas_tests::{Setting, TestEnv};

#[tokio::test(flavor = "multi_thread")]
async fn a_remote_s_retry_after_pauses_its_lane_without_a_failure_and_orders_keep_their_place() {
    const ORDERS: usize = 10;
    // Steps of 2 s: the 5 s pause outlasts a request's start deadline, so
    // requests answer "not started" and go back to their line meanwhile.
    let env = TestEnv::with_step_timeout(2_000).await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let ops = free_port();
    let _payment = env.agent("payment", 0, &sim, &[Setting::Listen(ops)]);
    let inventory_ops = free_port();
    let _inventory = env.agent("inventory", 0, &sim, &[Setting::Listen(inventory_ops)]);
    let _shipping = env.agent("shipping", 0, &sim, &[]);
    let scheduler_ops = free_port();
    let _scheduler = env.scheduler(0, &[Setting::Listen(scheduler_ops)]);
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    // Every reservation must land within the pause: the services' start,
    // slow on a loaded machine, must not count against it.
    for (what, port) in [
        ("the scheduler", scheduler_ops),
        ("the inventory agent", inventory_ops),
        ("the payment agent", ops),
    ] {
        sas_tests::wait::wait_ready(what, &format!("http://127.0.0.1:{port}")).await;
    }

    let throttle = Duration::from_secs(5);
    sim.throttle("payment", throttle.as_millis() as u64)
        .await
        .expect("throttle payment");
    let throttle_ends = chrono::Utc::now() + chrono::Duration::from_std(throttle).unwrap();
    env.publish_orders(&publisher, "slow", ORDERS).await;

    // The pause is visible while it lasts.
    let until = wait_for_metric(
        "the payment lane paused",
        ops,
        "sas_agent_paused_until_seconds{agent=\"payment\"}",
        Duration::from_secs(10),
        |until| until > 0.0,
    )
    .await;
    assert!(
        until >= (throttle_ends.timestamp() - 1) as f64,
        "paused until {until}, the remote asked until {throttle_ends}"
    );
    env.wait_for_count(
        ProcessState::Processed,
        ORDERS as i64,
        Duration::from_secs(60),
    )
    .await;

    // Nothing failed: no missed deadline, no transient failure, no retry
    // scheduled; the waits were "not started", back in line.
    let (failures, failed_lines, not_started): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT COALESCE(sum(failure_count), 0)::int8 FROM order_process),
                (SELECT count(*) FROM history WHERE event IN
                     ('transient_failure', 'retry_scheduled', 'compensation_started')),
                (SELECT count(*) FROM history WHERE event = 'not_started' AND step = 'charge_payment')",
    )
    .fetch_one(&env.db)
    .await
    .expect("read the history");
    assert_eq!((failures, failed_lines), (0, 0));
    assert!(
        not_started >= 1,
        "requests waited past their start deadline"
    );
    // Each request waited out the pause to its start deadline before it
    // answered (a step's window, 2 s): a few rounds an order, not one every
    // claim.
    assert!(
        not_started <= 5 * ORDERS as i64,
        "{not_started} not-started answers for {ORDERS} orders in a 5 s pause"
    );

    // The agent paused instead of retrying each request on its own backoff:
    // at most one 429 per request it held when the pause began, then quiet.
    let stats = sim.stats().await.expect("remote-sim's stats");
    assert!(
        stats.throttled <= ORDERS as u64,
        "{} calls answered 429 during a 5 s pause",
        stats.throttled
    );
    // Its other lanes were not paused: every reservation landed while
    // payment was rate-limited.
    let effects = sim.side_effects().await.expect("the ledger");
    let reserved: Vec<_> = effects
        .iter()
        .filter(|e| e.operation == "reserve")
        .filter_map(|e| e.applied_at)
        .collect();
    assert_eq!(reserved.len(), ORDERS);
    assert!(
        reserved.iter().all(|at| *at < throttle_ends),
        "{reserved:?}"
    );
    let charged: Vec<_> = effects
        .iter()
        .filter(|e| e.operation == "charge")
        .filter_map(|e| e.applied_at)
        .collect();
    assert_eq!(charged.len(), ORDERS, "each order charged once");
    let quiet_from = throttle_ends - chrono::Duration::seconds(1);
    assert!(
        charged.iter().all(|at| *at >= quiet_from),
        "a charge before the remote's time: {charged:?}"
    );
}
