//! Concurrency limits by key (issue 49): a payment step limited to a few
//! attempts at once per merchant, against real processes (two schedulers,
//! three payment agents, remote-sim counting the calls it is answering per
//! merchant). The remote is the judge: whatever the schedulers and agents
//! do, kill -9 included, no merchant's API sees more calls at once than
//! the limit, every order is processed, and nothing stays counted. Also a
//! remote's `Retry-After` pausing one key, a rate per key, and a limit
//! that learns what a merchant's API copes with.

use std::collections::BTreeMap;
use std::time::Duration;

use sas_store::ProcessState;
use sas_tests::process::{free_port, metric, sample_in, wait_for_metric};
use sas_tests::{order, Setting, TestEnv};

/// The size: 2,000 orders over 50 merchants, 40 each: more than
/// ten times what each merchant's limit lets run at once.
const MERCHANTS: usize = 50;
const LIMIT: u32 = 3;
const ORDERS: usize = 2_000;

/// The test's order workflow, its payment step limited by merchant.
fn limited_workflow(env: &TestEnv) -> String {
    format!(
        "name = \"order\"\nversion = 1\n{}{}concurrency = {{ key = \"/attributes/merchant_id\", limit = {LIMIT} }}\n\n{}",
        env.call_step(("reserve_stock", "inventory", "reserve", "release"), None),
        env.call_step(("charge_payment", "payment", "charge", "refund"), None),
        env.call_step(("create_shipment", "shipping", "ship", "cancel"), None),
    )
}

/// An order of `merchant`.
fn merchant_order(order_id: &str, merchant: &str) -> sas_messages::SubmitOrder {
    let mut submitted = order(order_id);
    submitted.attributes = serde_json::json!({ "merchant_id": merchant })
        .as_object()
        .cloned();
    submitted
}

/// Publishes `each` orders of every one of `merchants`, in turn
/// (`<merchant>-<n>`).
async fn publish_for(
    env: &TestEnv,
    publisher: &sas_broker::Publisher,
    merchants: &[&str],
    each: usize,
) {
    for n in 0..each {
        for merchant in merchants {
            env.publish_order(
                publisher,
                &merchant_order(&format!("{merchant}-{n}"), merchant),
            )
            .await;
        }
    }
}

/// The charges in remote-sim's ledger of `merchant`'s orders
/// (`<merchant>-<n>`).
fn charges_of<'a>(
    effects: &'a [sas_tests::sim::Entry],
    merchant: &'a str,
) -> impl Iterator<Item = &'a sas_tests::sim::Entry> {
    effects.iter().filter(move |e| {
        e.operation == "charge"
            && e.order_id
                .as_deref()
                .and_then(|id| id.strip_prefix(merchant))
                .is_some_and(|rest| rest.starts_with('-'))
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn no_merchant_sees_more_than_its_limit_across_schedulers_and_agents_through_kill_9() {
    let env = TestEnv::with_step_timeout(3_000).await;
    let (_sim_process, sim) = env.remote_sim(&[Setting::SimFaultsLatencyMs(30)]).await;
    // A charge takes a second: fifty merchants' limits (150 calls at once)
    // stay full while the orders flow in.
    sim.set_faults(
        Some("payment"),
        serde_json::json!({ "latency_ms": 1000, "transient_fault_rate": 0.0, "permanent_fault_rate": 0.0, "hang_rate": 0.0 }),
    )
    .await
    .expect("slow the charges");
    let mut schedulers_settings = env
        .workflows(&[("order.toml", &limited_workflow(&env))])
        .to_vec();
    // The agents' lines are not what holds the calls back.
    schedulers_settings.extend([
        Setting::SchedulerAdmissionInitial(256),
        Setting::SchedulerAdmissionCeiling(512),
    ]);
    let wide = [Setting::AgentConcurrency(96)];
    let mut payments: Vec<_> = (0..3)
        .map(|i| env.agent("payment", i, &sim, &wide))
        .collect();
    let _inventory = env.agent("inventory", 0, &sim, &wide);
    let _shipping = env.agent("shipping", 0, &sim, &wide);
    let mut schedulers: Vec<_> = (0..2)
        .map(|i| env.scheduler(i, &schedulers_settings))
        .collect();
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;

    for n in 0..ORDERS {
        let merchant = format!("m-{}", n % MERCHANTS);
        env.publish_order(
            &publisher,
            &merchant_order(&format!("keyed-{n}"), &merchant),
        )
        .await;
    }
    // The lines are visible while they last: the busiest keys, each with
    // its limit, never more than it in flight.
    let busy = sas_tests::wait_until("a merchant's line", Duration::from_secs(30), || async {
        let keys = env
            .store
            .admission()
            .key_lines(20)
            .await
            .map_err(|e| e.to_string())?;
        match keys.iter().find(|k| k.waiting > 0) {
            Some(line) => Ok(line.clone()),
            None => Err(format!("no key has orders waiting: {keys:?}")),
        }
    })
    .await;
    assert!(busy.key.starts_with("payment:m-"), "{busy:?}");
    assert_eq!(busy.limit, Some(LIMIT as i32));
    assert!(busy.in_flight <= i64::from(LIMIT), "{busy:?}");
    assert!(busy.oldest_wait_secs.is_some());
    let (code, stats) = env.sasctl(&["stats"]).await;
    assert_eq!(code, 0, "{stats}");
    assert!(
        stats.contains("KEY") && stats.contains("payment:m-"),
        "{stats}"
    );

    // Under way: a third processed. Then kill -9 a scheduler and a payment
    // agent, whatever they hold.
    env.wait_for_count(
        ProcessState::Processed,
        (ORDERS / 3) as i64,
        Duration::from_secs(90),
    )
    .await;
    schedulers[1].kill9().await;
    payments[2].kill9().await;
    env.wait_for_count(
        ProcessState::Processed,
        ORDERS as i64,
        Duration::from_secs(180),
    )
    .await;

    // The remote's count: never more than the limit at once per merchant,
    // and the limit was reached (the merchants' lines were what held the
    // calls back, not the agents).
    let seen = sim.concurrency().await.expect("read remote-sim's counts");
    let charges: Vec<_> = seen
        .iter()
        .filter(|(key, _)| key.starts_with("payment:"))
        .collect();
    assert_eq!(charges.len(), MERCHANTS, "{seen:?}");
    for (key, calls) in &charges {
        assert!(
            calls.peak <= LIMIT,
            "{key}: {} calls at once at the remote, over its limit of {LIMIT}",
            calls.peak
        );
        assert_eq!(calls.in_flight, 0, "{key}");
    }
    assert!(
        charges.iter().any(|(_, calls)| calls.peak == LIMIT),
        "no merchant reached its limit: {charges:?}"
    );

    // Orders waited in their merchant's line, and nothing is left in one
    // or counted in flight (no slot leaked through the kills).
    let (queued, waiting, in_flight): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT count(*) FROM history
                  WHERE event = 'waiting_for_admission' AND detail LIKE 'key payment:m-%'),
                (SELECT count(*) FROM order_process WHERE waiting_key IS NOT NULL),
                (SELECT count(*) FROM steps
                  WHERE limit_key IS NOT NULL AND state IN ('running', 'compensating'))",
    )
    .fetch_one(&env.db)
    .await
    .expect("read the lines");
    assert!(queued > 0, "no order waited for its merchant's room");
    assert_eq!((waiting, in_flight), (0, 0));
    let keys = env
        .store
        .admission()
        .key_lines(20)
        .await
        .expect("read the key lines");
    assert!(keys.is_empty(), "idle keys have no state: {keys:?}");
    let keys: Vec<String> = sqlx::query_scalar(
        "SELECT DISTINCT limit_key FROM steps WHERE limit_key IS NOT NULL ORDER BY 1",
    )
    .fetch_all(&env.db)
    .await
    .expect("read the keys");
    let mut expected: Vec<String> = (0..MERCHANTS).map(|m| format!("payment:m-{m}")).collect();
    expected.sort();
    assert_eq!(keys, expected);
    sim.assert_every_order_done_once().await;
    drop(schedulers);
}

/// A merchant's API key rate-limited by the remote (429 with
/// `Retry-After`): that merchant's key pauses, visibly, until the remote's
/// time, its orders waiting in its line without a failure; the other
/// merchant's orders go on meanwhile, and the agent's lane never pauses.
#[tokio::test(flavor = "multi_thread")]
async fn a_merchant_s_retry_after_pauses_its_key_only_and_counts_no_failure() {
    const EACH: usize = 12;
    // Alone on the machine: the other merchant's charges all landing within
    // the pause, and the pause seen (in the store and the metrics) while it
    // lasts, are timings a neighbour test loading both cores would bend; CI
    // once missed one of them.
    let env = TestEnv::exclusive(3_000).await;
    let (_sim_process, sim) = env.remote_sim(&[Setting::SimFaultsLatencyMs(20)]).await;
    let settings = env.workflows(&[("order.toml", &limited_workflow(&env))]);
    let ops = free_port();
    let _payment = env.agent("payment", 0, &sim, &[Setting::Listen(ops)]);
    let _inventory = env.agent("inventory", 0, &sim, &[]);
    let _shipping = env.agent("shipping", 0, &sim, &[]);
    let _scheduler = env.scheduler(0, &settings);
    // Only the paused merchant's key is exported with a label.
    let supervisor_ops = free_port();
    let _supervisor = env.supervisor(
        0,
        &[
            Setting::Listen(supervisor_ops),
            Setting::SupervisorKeyMetrics("payment:slow".into()),
        ],
    );
    let (_connection, publisher) = env.broker().await;

    // Long enough that, on a slow machine too, the pause is still on when
    // the test looks for it in the store and the metrics, and every charge
    // of the other merchant lands within it.
    let throttle = Duration::from_secs(10);
    sim.throttle_merchant("payment", "slow", throttle.as_millis() as u64)
        .await
        .expect("throttle one merchant");
    let throttle_ends = chrono::Utc::now() + chrono::Duration::from_std(throttle).unwrap();
    publish_for(&env, &publisher, &["slow", "fast"], EACH).await;

    // The pause is visible while it lasts, with the orders in its line.
    let paused = sas_tests::wait_until(
        "the merchant's key paused",
        Duration::from_secs(20),
        || async {
            let keys = env
                .store
                .admission()
                .key_lines(20)
                .await
                .map_err(|e| e.to_string())?;
            keys.iter()
                .find(|k| k.key == "payment:slow" && k.paused_until.is_some() && k.waiting > 0)
                .cloned()
                .ok_or_else(|| format!("payment:slow not paused with orders waiting: {keys:?}"))
        },
    )
    .await;
    assert!(
        paused.paused_until.unwrap() >= throttle_ends - chrono::Duration::seconds(1),
        "paused until {:?}, the remote asked until {throttle_ends}",
        paused.paused_until
    );
    // And in the supervisor's metrics: the key the operator named, with its
    // label, and the totals (one key paused), read from one scrape: the next
    // may come after the pause ended; no other merchant's label.
    let until = sas_tests::wait_until(
        "the key's pause exported",
        Duration::from_secs(10),
        || async {
            let page = sas_tests::http_get(format!("http://127.0.0.1:{supervisor_ops}/metrics"))
                .await
                .map_err(|e| e.to_string())?
                .text()
                .await
                .map_err(|e| e.to_string())?;
            let until = sample_in(&page, "sas_key_paused_until_seconds{key=\"payment:slow\"}");
            let paused = sample_in(&page, "sas_keys_paused");
            match (until, paused) {
                (Some(until), Some(paused)) if until > 0.0 => Ok((until, paused)),
                other => Err(format!("paused until, keys paused: {other:?}")),
            }
        },
    )
    .await;
    assert!(
        until.0 >= (throttle_ends.timestamp() - 1) as f64,
        "{until:?}"
    );
    assert_eq!(until.1, 1.0, "one key paused");
    env.wait_for_count(
        ProcessState::Processed,
        2 * EACH as i64,
        Duration::from_secs(60),
    )
    .await;

    // The other merchant was not slowed: every one of its charges landed
    // during the pause; none of the paused merchant's before the remote's
    // time.
    let effects = sim.side_effects().await.expect("the ledger");
    let charged = |merchant: &str| -> Vec<chrono::DateTime<chrono::Utc>> {
        charges_of(&effects, merchant)
            .filter_map(|e| e.applied_at)
            .collect()
    };
    let (fast, slow) = (charged("fast"), charged("slow"));
    assert_eq!((fast.len(), slow.len()), (EACH, EACH), "each charged once");
    assert!(fast.iter().all(|at| *at < throttle_ends), "{fast:?}");
    let quiet_from = throttle_ends - chrono::Duration::milliseconds(500);
    assert!(
        slow.iter().all(|at| *at >= quiet_from),
        "a charge before the remote's time: {slow:?}"
    );

    // Paused, not hammered: at most one 429 per attempt in flight when the
    // pause began (the key's limit), and none counted as a failure.
    let stats = sim.stats().await.expect("remote-sim's stats");
    assert!(
        (1..=u64::from(LIMIT)).contains(&stats.throttled),
        "{} calls answered 429 for a paused key",
        stats.throttled
    );
    let (failures, failed_lines, rested): (i64, i64, i64) = sqlx::query_as(
        "SELECT (SELECT COALESCE(sum(failure_count), 0)::int8 FROM order_process),
                (SELECT count(*) FROM history WHERE event IN
                     ('transient_failure', 'retry_scheduled', 'compensation_started')),
                (SELECT count(*) FROM history
                  WHERE event = 'waiting_for_admission' AND detail LIKE 'key payment:slow was asked by the remote to rest%')",
    )
    .fetch_one(&env.db)
    .await
    .expect("read the history");
    assert_eq!((failures, failed_lines), (0, 0));
    assert!(
        rested >= 1,
        "no order went back to its key's line for the pause"
    );
    // The agent's lane never paused: the remote named a key.
    let lane = metric(ops, "sas_agent_paused_until_seconds{agent=\"payment\"}").await;
    assert_eq!(lane, Some(0.0));
    // Idle again: the labelled gauges fall to zero, and no merchant the
    // operator did not name was ever labelled.
    wait_for_metric(
        "the key's gauges back to zero",
        supervisor_ops,
        "sas_key_paused_until_seconds{key=\"payment:slow\"}",
        Duration::from_secs(10),
        |until| until == 0.0,
    )
    .await;
    let exported = sas_tests::http_get(format!("http://127.0.0.1:{supervisor_ops}/metrics"))
        .await
        .expect("reach the supervisor's metrics")
        .text()
        .await
        .expect("read the supervisor's metrics");
    assert!(!exported.contains("payment:fast"), "{exported}");
    assert!(exported.contains("sas_key_lines_waiting 0"), "{exported}");
    // The ended pause is forgotten (the supervisor's sas_forget_quiet_keys).
    env.wait_for_none(
        "ended key pauses",
        "SELECT count(*) FROM key_pauses",
        Duration::from_secs(10),
    )
    .await;
}

/// A payment step limited to 10 starts a second per merchant (burst 5),
/// two schedulers serving two merchants' lines: at the remote, no window
/// of either merchant's charges holds more than the rate allows, and the
/// rate reached is within 5% of the limit.
#[tokio::test(flavor = "multi_thread")]
async fn each_merchant_s_charges_keep_to_its_rate_across_schedulers() {
    const EACH: usize = 50;
    const PER_SECOND: f64 = 10.0;
    const BURST: usize = 5;
    // Alone on the machine: a rate reached within 5% is a timing, which a
    // neighbour test loading both cores would bend.
    let env = TestEnv::exclusive(3_000).await;
    let (_sim_process, sim) = env.remote_sim(&[Setting::SimFaultsLatencyMs(5)]).await;
    let workflow = format!(
        "name = \"order\"\nversion = 1\n{}{}rate = {{ key = \"/attributes/merchant_id\", per_second = {PER_SECOND}, burst = {BURST} }}\n\n{}",
        env.call_step(("reserve_stock", "inventory", "reserve", "release"), None),
        env.call_step(("charge_payment", "payment", "charge", "refund"), None),
        env.call_step(("create_shipment", "shipping", "ship", "cancel"), None),
    );
    let settings = env.workflows(&[("order.toml", &workflow)]);
    let _agents: Vec<_> = ["payment", "inventory", "shipping"]
        .into_iter()
        .map(|agent| env.agent(agent, 0, &sim, &[Setting::AgentConcurrency(16)]))
        .collect();
    let _schedulers: Vec<_> = (0..2).map(|i| env.scheduler(i, &settings)).collect();
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;
    publish_for(&env, &publisher, &["a", "b"], EACH).await;
    env.wait_for_count(
        ProcessState::Processed,
        2 * EACH as i64,
        Duration::from_secs(60),
    )
    .await;

    let effects = sim.side_effects().await.expect("the ledger");
    for merchant in ["a", "b"] {
        let mut at: Vec<chrono::DateTime<chrono::Utc>> =
            charges_of(&effects, merchant).map(|e| e.at).collect();
        at.sort();
        let dispatched: Vec<chrono::DateTime<chrono::Utc>> = sqlx::query_scalar(
            "SELECT at FROM history WHERE event = 'dispatched' AND step = 'charge_payment'
                AND order_id LIKE $1 ORDER BY at",
        )
        .bind(format!("{merchant}-%"))
        .fetch_all(&env.db)
        .await
        .expect("read the dispatches");
        assert_eq!(at.len(), EACH, "each of {merchant}'s orders charged once");
        assert_eq!(
            dispatched.len(),
            EACH,
            "each of {merchant}'s charges dispatched once"
        );
        // The starts (database clock): no window holds more than the burst
        // plus the rate's share of it.
        assert_within_rate(
            merchant,
            "dispatched",
            &dispatched,
            PER_SECOND,
            BURST as f64,
            0.0,
        );
        // At the remote, the calls arrive a few tens of milliseconds after
        // their start, unevenly (agent queue, call slots, an agent waiting
        // for a core): the same bound, with 500 ms of that jitter allowed
        // for (with 200 ms, a window held 2 calls too many in 2 of 6 runs
        // of this module on 2026-11-29: 42 in 3.4 s).
        assert_within_rate(merchant, "charged", &at, PER_SECOND, BURST as f64, 0.5);
        // And the rate was reached, within 5%, at the starts (database
        // clock), once the line was long (the first orders reach their
        // charge one by one: the first start came up to 450 ms before the
        // next): the claims wake when the line's next start comes due, not
        // only every claim interval (without that, 9.1 a second in a whole
        // test run). Measured 9.99 to 10.21 (a little above when a stalled
        // claim's catch-up falls in the span, as the burst allows). Never
        // above the burst plus the rate: the windows above.
        const LONG: usize = 10;
        let span = (dispatched[EACH - 1] - dispatched[LONG])
            .num_microseconds()
            .unwrap() as f64
            / 1e6;
        let started = (EACH - 1 - LONG) as f64 / span;
        assert!(
            started >= PER_SECOND * 0.95,
            "merchant {merchant}: {started:.2} charges started a second on a long line, the limit is {PER_SECOND}"
        );
        // At the remote, the arrivals' jitter moves both ends of the span:
        // measured 9.46 to 10.60 a second.
        let secs = (at[EACH - 1] - at[0]).num_microseconds().unwrap() as f64 / 1e6;
        let arrived = (EACH - BURST) as f64 / secs;
        assert!(
            (PER_SECOND * 0.85..=PER_SECOND * 1.1).contains(&arrived),
            "merchant {merchant}: {arrived:.2} charges a second after the burst at the remote, the limit is {PER_SECOND}"
        );
    }
    assert_no_failure_counted(&env).await;
}

/// An adaptive key learns what its remote copes with: two merchants under
/// one declared ceiling of 20, one whose API serves two calls at once (50
/// ms each; more wait there, slower and slower), one whose API serves a
/// hundred. The slow merchant's key learns a limit near what its API
/// serves in time, and its API sees a few calls at once, not the ceiling's
/// twenty; the fast one's learns up to the ceiling. Every order is
/// processed, none failed.
#[tokio::test(flavor = "multi_thread")]
async fn an_adaptive_key_learns_what_its_merchant_s_api_copes_with() {
    const EACH: usize = 200;
    const CEILING: u32 = 20;
    // Alone on the machine: the keys learn from the calls' latency, which a
    // neighbour test loading both cores stretches (the fast merchant's key
    // once learnt 8 beside others, 20 alone).
    let env = TestEnv::exclusive(5_000).await;
    let (_sim_process, sim) = env.remote_sim(&[Setting::SimFaultsLatencyMs(1)]).await;
    sim.set_merchant_capacity("payment", "slow", 2, 50)
        .await
        .expect("give the slow merchant's API its capacity");
    sim.set_merchant_capacity("payment", "fast", 100, 50)
        .await
        .expect("give the fast merchant's API its capacity");
    let workflow = format!(
        "name = \"order\"\nversion = 1\n{}{}concurrency = {{ key = \"/attributes/merchant_id\", limit = {CEILING}, adaptive = true }}\n\n{}",
        env.call_step(("reserve_stock", "inventory", "reserve", "release"), None),
        env.call_step(("charge_payment", "payment", "charge", "refund"), None),
        env.call_step(("create_shipment", "shipping", "ship", "cancel"), None),
    );
    let mut settings = env.workflows(&[("order.toml", &workflow)]).to_vec();
    // The agents' lines are not what holds the calls back.
    settings.extend([
        Setting::SchedulerAdmissionInitial(64),
        Setting::SchedulerAdmissionCeiling(128),
    ]);
    let wide = [Setting::AgentConcurrency(32)];
    let _payments: Vec<_> = (0..2)
        .map(|i| env.agent("payment", i, &sim, &wide))
        .collect();
    let _inventory = env.agent("inventory", 0, &sim, &wide);
    let _shipping = env.agent("shipping", 0, &sim, &wide);
    let _schedulers: Vec<_> = (0..2).map(|i| env.scheduler(i, &settings)).collect();
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;

    // Each merchant's calls at its API, sampled while its orders run.
    let watching = tokio::spawn({
        let sim = sim.clone();
        async move {
            let mut seen: BTreeMap<&'static str, Vec<(u64, u32)>> = BTreeMap::new();
            loop {
                if let Ok(counts) = sim.concurrency().await {
                    let mut done = true;
                    for merchant in ["slow", "fast"] {
                        let calls = counts.get(&format!("payment:{merchant}"));
                        if let Some(calls) = calls {
                            seen.entry(merchant)
                                .or_default()
                                .push((calls.calls, calls.in_flight));
                        }
                        done &= calls.is_some_and(|c| c.calls >= EACH as u64 && c.in_flight == 0);
                    }
                    if done {
                        return seen;
                    }
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    publish_for(&env, &publisher, &["slow", "fast"], EACH).await;
    env.wait_for_count(
        ProcessState::Processed,
        2 * EACH as i64,
        Duration::from_secs(120),
    )
    .await;
    let seen = tokio::time::timeout(Duration::from_secs(10), watching)
        .await
        .expect("both merchants' calls all answered")
        .expect("the sampling task");

    // Once a key has learnt (a third of its calls made) and while its line
    // is long (before the last sixth), the calls its API holds at once,
    // sorted.
    let learning = |merchant: &str| -> Vec<u32> {
        let mut held: Vec<u32> = seen[merchant]
            .iter()
            .filter(|(calls, _)| (EACH as u64 / 3..EACH as u64 * 5 / 6).contains(calls))
            .map(|(_, in_flight)| *in_flight)
            .collect();
        held.sort_unstable();
        assert!(held.len() >= 10, "too few samples of {merchant}: {seen:?}");
        held
    };
    let (slow, fast) = (learning("slow"), learning("fast"));
    let median = |held: &[u32]| held[held.len() / 2];
    // The slow merchant's API holds a few calls at once: what it serves in
    // time (2 at once, up to 1.5 times as slow: about 3), not the
    // ceiling's 20. Measured: a median of 3 or 4 and at most 6 or 7
    // adaptive; a median of 15 and 19 at most with the same limit not
    // adaptive.
    assert!(
        median(&slow) <= 8,
        "the slow merchant's API held {} calls at once (median), its capacity is 2: {slow:?}",
        median(&slow)
    );
    assert!(
        slow[slow.len() - 1] <= 12,
        "the slow merchant's API held {} calls at once, its capacity is 2: {slow:?}",
        slow[slow.len() - 1]
    );
    let learnt: Vec<(String, f64)> =
        sqlx::query_as("SELECT key, learnt_limit FROM key_learnt ORDER BY key")
            .fetch_all(&env.db)
            .await
            .expect("read what the keys learnt");
    let limit_of = |key: &str| {
        learnt
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, limit)| *limit)
            .unwrap_or_else(|| panic!("{key} learnt nothing: {learnt:?}"))
    };
    assert!(limit_of("payment:slow") <= 10.0, "{learnt:?}");
    // The fast merchant's key grew past what the slow one's API serves at
    // once (and a limit stuck at one fails here). Not to the ceiling: a
    // limit grows only while it is full, and the fast line rarely is (its
    // orders reach it from the stock step no faster than this machine
    // serves them: a median of about 3 calls at its API), and on 2 cores
    // the call times the agents measure include waiting for a core.
    // Measured 6.5 to 14.2 of 20 in 9 runs, the slow key 6.0 to 7.3.
    assert!(
        limit_of("payment:fast") >= 4.0,
        "the fast merchant's key never grew: {learnt:?}; its API held {fast:?}"
    );
    assert_no_failure_counted(&env).await;
    sim.assert_every_order_done_once().await;
}

/// Panics when any order of `env` counted a failure: waiting for a key is
/// not failing.
async fn assert_no_failure_counted(env: &TestEnv) {
    let failures: i64 =
        sqlx::query_scalar("SELECT COALESCE(sum(failure_count), 0)::int8 FROM order_process")
            .fetch_one(&env.db)
            .await
            .expect("read the failures");
    assert_eq!(failures, 0);
}

/// Panics when a window of the sorted instants `at` holds more than
/// `burst` plus `per_second` times its length plus `jitter` seconds.
fn assert_within_rate(
    merchant: &str,
    what: &str,
    at: &[chrono::DateTime<chrono::Utc>],
    per_second: f64,
    burst: f64,
    jitter: f64,
) {
    for i in 0..at.len() {
        for j in i..at.len() {
            let secs = (at[j] - at[i]).num_microseconds().unwrap() as f64 / 1e6;
            let allowed = (per_second * (secs + jitter) + burst).floor() as usize;
            assert!(
                j - i < allowed + 1,
                "merchant {merchant}: {} {what} within {secs:.3} s, the rate allows {allowed}",
                j - i + 1
            );
        }
    }
}
