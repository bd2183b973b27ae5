//! Tenant quotas (issue 47, migration 0028) against real processes: two
//! schedulers sharing one quota per tenant through the store, a
//! supervisor recording refusals, and three tenants publishing at once:
//!
//! - `refused`, 4 orders a second with a burst of 4, over it refused:
//!   of 24 sent at once, about the burst is stored (the two schedulers
//!   together never let through more than the burst plus the rate over
//!   the time intake took), and each of the others is dead-lettered with
//!   a reason naming the quota and when to send again;
//! - `queued`, 8 a second with a burst of 2, over it held back for at
//!   most 2 s: of 24 sent at once, those that fit within 2 s (18) are
//!   stored, answered `received`, and started no faster than the rate
//!   allows; the rest are refused for waiting too long; every order
//!   stored ends processed;
//! - `free`, with no quota: all its orders are processed, none waits.
//!
//! Then, a second later, the refused tenant's quota has room again.

use std::time::{Duration, Instant};

use sas_store::ProcessState;
use sas_tests::{order, wait_until, Setting, TestEnv};

use crate::tenant_turns::publish_as;
use crate::tenants::dead_letter_reasons;

const TENANCY: &str = r#"
[tenants.refused]
members = ["gateway:refused"]
quota = { per_second = 4, burst = 4 }

[tenants.queued]
members = ["gateway:queued"]
quota = { per_second = 8, burst = 2, over = "queue", max_wait_secs = 2 }

[tenants.free]
members = ["gateway:free"]
"#;

/// The orders of `tenant` stored, and of them in `state`.
async fn stored(env: &TestEnv, tenant: &str, state: Option<ProcessState>) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM order_process
          WHERE order_id LIKE '%@' || $1 AND ($2::text IS NULL OR state::text = $2)",
    )
    .bind(tenant)
    .bind(state.map(|s| s.as_str()))
    .fetch_one(&env.db)
    .await
    .unwrap()
}

/// The dead letters whose reason says `text`.
async fn refusals(env: &TestEnv, text: &str) -> Vec<String> {
    dead_letter_reasons(env)
        .await
        .into_iter()
        .filter(|reason| reason.contains(text))
        .collect()
}

/// When each of `tenant`'s orders first started a step, in order (seconds
/// since the first).
async fn starts(env: &TestEnv, tenant: &str) -> Vec<f64> {
    sqlx::query_scalar(
        "SELECT EXTRACT(EPOCH FROM s.at - min(s.at) OVER ())::float8
           FROM (SELECT min(at) AS at FROM history
                  WHERE order_id LIKE '%@' || $1 AND event = 'dispatched'
                  GROUP BY order_id) s
          ORDER BY 1",
    )
    .bind(tenant)
    .fetch_all(&env.db)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_tenant_over_its_quota_is_refused_or_held_back_and_the_others_are_not() {
    let env = TestEnv::new().await;
    let file = std::env::temp_dir().join(format!("{}-quotas.toml", env.id));
    std::fs::write(&file, TENANCY).unwrap();
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let _agents = env.agents(1, &sim, &[]);
    let tenancy = [
        Setting::SchedulerTenancyFile(file.display().to_string()),
        Setting::AmqpDelegatingUsers(env.amqp().user().expect("a broker user")),
    ];
    let schedulers = [env.scheduler(0, &tenancy), env.scheduler(1, &tenancy)];
    let _supervisor = env.supervisor(0, &[]);
    let (_connection, publisher) = env.broker().await;

    let sent = Instant::now();
    for n in 0..24 {
        publish_as(&env, &publisher, "refused", &order(&format!("r-{n}"))).await;
        publish_as(&env, &publisher, "queued", &order(&format!("q-{n}"))).await;
        if n < 8 {
            publish_as(&env, &publisher, "free", &order(&format!("f-{n}"))).await;
        }
    }
    // Every order of the capped tenants is either stored or refused.
    wait_until(
        "every order stored or refused",
        Duration::from_secs(30),
        || async {
            let r = stored(&env, "refused", None).await
                + refusals(&env, "tenant refused is over its quota")
                    .await
                    .len() as i64;
            let q = stored(&env, "queued", None).await
                + refusals(&env, "tenant queued is over its quota")
                    .await
                    .len() as i64;
            (r == 24 && q == 24)
                .then_some(())
                .ok_or(format!("refused: {r} of 24 accounted; queued: {q} of 24"))
        },
    )
    .await;
    let intake_took = sent.elapsed().as_secs_f64();

    // Refused over the burst, whichever scheduler took the order.
    let refused_stored = stored(&env, "refused", None).await;
    let most = 4 + (4.0 * intake_took).ceil() as i64;
    assert!(
        (4..=most).contains(&refused_stored),
        "refused: {refused_stored} stored of 24 in {intake_took:.2} s (at most {most})"
    );
    let reasons = refusals(&env, "tenant refused is over its quota").await;
    assert_eq!(reasons.len() as i64, 24 - refused_stored);
    assert!(
        reasons[0]
            .contains("4 orders a second, 4 at once (tenants.refused.quota): send it again in"),
        "{}",
        reasons[0]
    );

    // The stored orders sent again, twice each (a client's retry, a
    // redelivery): duplicates, which take no turn, so none is refused
    // (taking turns, most would have been: the quota has room for a few).
    let again: Vec<String> = sqlx::query_scalar(
        "SELECT split_part(order_id, '@', 1) FROM order_process WHERE order_id LIKE '%@refused'",
    )
    .fetch_all(&env.db)
    .await
    .unwrap();
    for _ in 0..2 {
        for id in &again {
            publish_as(&env, &publisher, "refused", &order(id)).await;
        }
    }
    let duplicates = || {
        schedulers
            .iter()
            .map(|s| {
                std::fs::read_to_string(&s.log)
                    .unwrap_or_default()
                    .matches("duplicate submission ignored")
                    .count()
            })
            .sum::<usize>()
    };
    wait_until(
        "the orders sent again answered as duplicates",
        Duration::from_secs(30),
        || async {
            let seen = duplicates();
            (seen >= 2 * again.len())
                .then_some(())
                .ok_or(format!("{seen} of {} duplicates", 2 * again.len()))
        },
    )
    .await;
    assert_eq!(
        refusals(&env, "tenant refused is over its quota")
            .await
            .len() as i64,
        24 - refused_stored,
        "an order sent again was refused for the quota"
    );

    // Queued up to 2 s ahead, refused beyond.
    let queued_stored = stored(&env, "queued", None).await;
    let most = 18 + (8.0 * intake_took).ceil() as i64;
    assert!(
        (18..=most).contains(&queued_stored),
        "queued: {queued_stored} stored of 24 in {intake_took:.2} s (18 to {most})"
    );
    let reasons = refusals(&env, "tenant queued is over its quota").await;
    assert!(
        reasons
            .iter()
            .all(|reason| reason.contains("it would wait more than 2 s (max_wait_secs)")),
        "{reasons:?}"
    );

    // Everything stored ends processed; the free tenant's orders did not
    // wait for anyone's quota.
    env.wait_for_count(
        ProcessState::Processed,
        refused_stored + queued_stored + 8,
        Duration::from_secs(60),
    )
    .await;
    assert_eq!(stored(&env, "free", Some(ProcessState::Processed)).await, 8);
    let free = starts(&env, "free").await;
    assert!(
        free.last().copied().unwrap_or_default() < 1.5,
        "the free tenant's orders started within 1.5 s (the queued tenant's, held back, over 2 s): {free:?}"
    );

    // The queued tenant's held-back orders each say when they may start
    // (in their `received` line); those times are one emission (1/8 s)
    // apart, as the quota allows, and no order started before its time.
    // A claim starts what came due since the last one, so a start may lag
    // its time (by a claim interval and the claim's own work).
    let held: Vec<(String, f64, f64)> = sqlx::query_as(
        "SELECT h.order_id,
                EXTRACT(EPOCH FROM substring(h.detail from 'starts at (.*)$')::timestamptz)::float8,
                EXTRACT(EPOCH FROM (SELECT min(d.at) FROM history d
                                     WHERE d.order_id = h.order_id AND d.event = 'dispatched'))::float8
           FROM history h
          WHERE h.event = 'received' AND h.detail LIKE '%over its tenant''s quota: starts at %'
          ORDER BY 2",
    )
    .fetch_all(&env.db)
    .await
    .unwrap();
    assert!(
        held.len() as i64 >= 24 - 2 - (24 - queued_stored) - (8.0 * intake_took).ceil() as i64
            && held.iter().all(|(id, ..)| id.ends_with("@queued")),
        "the held-back orders (all of the queued tenant's but its burst and what intake's time allowed) say so: {held:?}"
    );
    let mut lag: f64 = 0.0;
    for pair in held.windows(2) {
        let apart = pair[1].1 - pair[0].1;
        assert!(
            apart >= 0.125 - 0.001,
            "{} may start {apart:.3} s after {}: the quota allows 8 a second",
            pair[1].0,
            pair[0].0
        );
    }
    for (order_id, may_start, started) in &held {
        assert!(
            started >= may_start,
            "{order_id} started {:.3} s before its time",
            may_start - started
        );
        lag = lag.max(started - may_start);
    }
    assert!(lag < 2.0, "held-back orders started up to {lag:.2} s late");
    eprintln!(
        "refused: {refused_stored} of 24 stored; queued: {queued_stored} of 24 stored, {} held back, started up to {lag:.3} s after their time; intake took {intake_took:.2} s",
        held.len()
    );

    // A second later the refused tenant's quota has room again (a wait
    // for time to pass, the quota's own subject, not for a condition).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    for n in 0..3 {
        publish_as(&env, &publisher, "refused", &order(&format!("later-{n}"))).await;
    }
    env.wait_for_count(
        ProcessState::Processed,
        refused_stored + queued_stored + 8 + 3,
        Duration::from_secs(30),
    )
    .await;
}

/// A gateway client whose tenant is over its quota hears so at once: 429
/// with `Retry-After`, nothing sent; the same order sent again is still
/// answered as a duplicate (a stored order takes no turn).
#[tokio::test(flavor = "multi_thread")]
async fn the_gateway_answers_an_order_over_its_tenant_s_quota_at_once_with_retry_after() {
    const SECRET: &str = "slow-secret-0123456789abcdef";
    let env = TestEnv::new().await;
    let file = std::env::temp_dir().join(format!("{}-gateway-quota.toml", env.id));
    std::fs::write(
        &file,
        "[tenants.slow]\nmembers = [\"gateway:slow\"]\nquota = { per_second = 0.1, burst = 1 }\n",
    )
    .unwrap();
    let user = env.amqp().user().expect("a broker user");
    let _scheduler = env.scheduler(
        0,
        &[
            Setting::SchedulerTenancyFile(file.display().to_string()),
            Setting::AmqpDelegatingUsers(user),
        ],
    );
    let port = sas_tests::process::free_port();
    let _gateway = env.spawn(
        "gateway",
        "gateway",
        &[
            Setting::Listen(port),
            Setting::GatewayClients(format!("slow:{SECRET}")),
            Setting::GatewayTenancyFile(file.display().to_string()),
        ],
    );
    let base = format!("http://127.0.0.1:{port}");
    sas_tests::wait::wait_ready("the gateway", &base).await;
    let post = |id: &str| {
        sas_tests::http_client()
            .post(format!("{base}/v1/orders"))
            .bearer_auth(SECRET)
            .json(&order(id))
            .send()
    };
    let first = post("g-1").await.expect("the gateway answers");
    assert_eq!(first.status(), reqwest::StatusCode::ACCEPTED);
    wait_until("g-1 stored", Duration::from_secs(20), || async {
        (stored(&env, "slow", None).await == 1)
            .then_some(())
            .ok_or_else(|| "not stored yet".to_owned())
    })
    .await;

    // One order in ten seconds: the next is over the quota, said at once.
    let over = post("g-2").await.expect("the gateway answers");
    assert_eq!(over.status(), reqwest::StatusCode::TOO_MANY_REQUESTS);
    let retry_after: u64 = over
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse().ok())
        .expect("a Retry-After in seconds");
    assert!((1..=10).contains(&retry_after), "Retry-After {retry_after}");
    let body: serde_json::Value = over.json().await.unwrap();
    assert!(
        body.to_string().contains("over tenant slow's quota"),
        "{body}"
    );
    // A stored order sent again takes no turn: answered as a duplicate.
    let again = post("g-1").await.expect("the gateway answers");
    assert_eq!(again.status(), reqwest::StatusCode::OK);
}
