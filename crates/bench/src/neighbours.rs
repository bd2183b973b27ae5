//! The noisy-neighbour phase (issue 47): two tenants share a slow remote
//! service. Tenant `quiet` sends a tenth of what the remote absorbs, first
//! alone (its yardstick), then while tenant `noisy` sends ten times it.
//! Tenants take turns in the agents' lines (migration 0027), so the quiet
//! tenant's orders should take about as long as alone (target: p99 within
//! 1.5 times the yardstick's), though the noisy one's backlog grows by
//! nine times the capacity every second.
//!
//! Tenants take turns in the lines only: the attempts a limit admits at once
//! go to the agent's queue, where the broker serves them first come, first
//! served. The phase's scheduler starts its limits at [`STARTING_LIMIT`],
//! not at the default 256, which the first burst on a cold agent would
//! fill with the noisy tenant's orders before the supervisors' first window
//! brings it down to what the remote holds (measured: the quiet tenant's
//! p99 20 times its own alone, with 256).
//!
//! The system's scheduler is replaced by one that reads a tenancy file
//! naming the two tenants, and trusts the benchmark's broker user to say
//! which of them sends each order (`amqp.delegating_users`, as the gateway
//! vouches for its clients). The last phase: the noisy backlog is left to
//! the database the run drops.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use sas_broker::lapin::types::{AMQPValue, FieldTable};
use sas_broker::Publisher;
use sas_lab::{order, Setting, TestEnv};
use sas_messages::QueueNames;
use serde_json::json;

use crate::drive::{publish_each, StatusListener};
use crate::phases::ids;
use crate::report::{percentiles, Neighbours};
use crate::system::{quiet, start_agent, BenchSystem};
use crate::time_spent::{self, Clock, Gap};

/// Latency of every remote call in this phase, as in the overload phase.
const LATENCY_MS: u64 = 100;
/// Calls at once per agent process and queue.
const CONCURRENCY: u32 = 4;
/// The quiet tenant's load, as a share of the capacity.
const QUIET_FACTOR: f64 = 0.1;
/// The noisy tenant's load, as a multiple of the capacity.
const NOISY_FACTOR: f64 = 10.0;
/// The scheduler's starting limit per agent (`scheduler.admission_initial`,
/// 256 by default).
pub const STARTING_LIMIT: u32 = 8;

/// Runs the phase: the quiet tenant alone for `secs`, then both for `secs`;
/// with `noisy_quota`, the noisy tenant has a quota of that many orders a
/// second, refused beyond it.
///
/// # Errors
/// When the quiet tenant's orders do not all end within two minutes.
pub async fn run(
    env: &TestEnv,
    publisher: &Publisher,
    system: &mut BenchSystem,
    secs: f64,
    noisy_quota: Option<f64>,
) -> anyhow::Result<Neighbours> {
    for agent in &mut system.agents {
        agent.kill9().await;
    }
    system.scheduler.kill9().await;
    system
        .sim
        .set_faults(None, json!({"latency_ms": LATENCY_MS, "transient_fault_rate": 0.0, "permanent_fault_rate": 0.0, "hang_rate": 0.0}))
        .await?;
    let user = env
        .amqp()
        .user()
        .ok_or_else(|| anyhow::anyhow!("the broker URL names no user"))?;
    let tenancy = std::env::temp_dir().join(format!("{}-neighbours.toml", env.id));
    let quota = noisy_quota.map_or_else(String::new, |per_second| {
        format!("quota = {{ per_second = {per_second}, over = \"refuse\" }}\n")
    });
    std::fs::write(
        &tenancy,
        format!("[tenants.quiet]\nmembers = [\"gateway:quiet\"]\n[tenants.noisy]\nmembers = [\"gateway:noisy\"]\n{quota}"),
    )?;
    let mut vars = quiet();
    vars.push(Setting::SchedulerTenancyFile(tenancy.display().to_string()));
    vars.push(Setting::AmqpDelegatingUsers(user.clone()));
    // Tenants take turns in the lines; what a cold limit admits at once
    // goes to the agent queue, first come, first served (see the module
    // docs).
    vars.push(Setting::SchedulerAdmissionInitial(STARTING_LIMIT));
    system.scheduler = env.scheduler(1, &vars);
    let mut agent = start_agent(
        env,
        &system.sim,
        400,
        &[Setting::AgentConcurrency(CONCURRENCY)],
    );
    // Each step of an order has a queue of its own, each served at
    // CONCURRENCY calls per LATENCY_MS.
    let capacity = f64::from(CONCURRENCY * 1000) / LATENCY_MS as f64;
    let quiet_n = (capacity * QUIET_FACTOR * secs).ceil() as usize;
    let warm = ids("nb-warm-", 4);
    let alone_ids = ids("nb-alone-", quiet_n);
    let quiet_ids = ids("nb-quiet-", quiet_n);
    // The quiet tenant's client hears its own orders' statuses only, as a
    // client of the status exchange does: bound to each (as sent and as
    // stored), not to every order's, which would have this process decode
    // the noisy tenant's thousands a second on the machine it measures.
    let keys: Vec<String> = [&warm, &alone_ids, &quiet_ids]
        .into_iter()
        .flatten()
        .flat_map(|id| {
            [
                QueueNames::status_routing_key(id),
                QueueNames::status_routing_key(&format!("{id}@quiet")),
            ]
        })
        .collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let listener = StatusListener::bound(env, &keys).await?;
    let clock = Clock::now();
    let client = Client {
        env,
        publisher,
        user: &user,
    };
    // Warm: the new scheduler is up and has the tenants.
    client.send("quiet", &warm, 0.0).await;
    wait_ended(env, &warm, "quiet", Duration::from_secs(60)).await?;

    let alone_sent = client
        .send("quiet", &alone_ids, capacity * QUIET_FACTOR)
        .await;
    wait_ended(env, &alone_ids, "quiet", Duration::from_secs(120)).await?;
    let noisy_ids = ids("nb-noisy-", (capacity * NOISY_FACTOR * secs) as usize);
    let started = Instant::now();
    let (quiet_sent, _) = tokio::join!(
        client.send("quiet", &quiet_ids, capacity * QUIET_FACTOR),
        client.send("noisy", &noisy_ids, capacity * NOISY_FACTOR),
    );
    wait_ended(env, &quiet_ids, "quiet", Duration::from_secs(120)).await?;
    let window = started.elapsed().as_secs_f64();
    let noisy_processed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM order_process WHERE order_id LIKE 'nb-noisy-%@noisy' AND state = 'processed'",
    )
    .fetch_one(&env.db)
    .await?;
    let noisy_stored: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM order_process WHERE order_id LIKE 'nb-noisy-%@noisy'",
    )
    .fetch_one(&env.db)
    .await?;
    listener
        .wait_for_processed(4 + 2 * quiet_n, Duration::from_secs(10))
        .await;
    let quiet_alone_gaps = where_time_went(env, &listener, &alone_sent, &clock).await?;
    let quiet_beside_noisy_gaps = where_time_went(env, &listener, &quiet_sent, &clock).await?;
    agent.kill9().await;
    Ok(Neighbours {
        capacity_orders_per_sec: capacity,
        quiet_orders: quiet_n,
        noisy_orders: noisy_ids.len(),
        quiet_alone_ms: percentiles(latencies(&listener, &alone_sent, "quiet")),
        quiet_beside_noisy_ms: percentiles(latencies(&listener, &quiet_sent, "quiet")),
        noisy_goodput_fraction: noisy_processed as f64 / window / capacity,
        noisy_quota_per_sec: noisy_quota,
        noisy_stored: usize::try_from(noisy_stored).unwrap_or(0),
        quiet_alone_gaps,
        quiet_beside_noisy_gaps,
    })
}

/// Where the quiet tenant's orders of `sent` spent their time, from their
/// history (see [`time_spent`]).
async fn where_time_went(
    env: &TestEnv,
    listener: &StatusListener,
    sent: &HashMap<String, Instant>,
    clock: &Clock,
) -> anyhow::Result<Vec<Gap>> {
    let stored = |id: &str| format!("{id}@quiet");
    let ids: Vec<String> = sent.keys().map(|id| stored(id)).collect();
    let rows: Vec<(
        String,
        String,
        Option<String>,
        chrono::DateTime<chrono::Utc>,
    )> = sqlx::query_as("SELECT order_id, event, step, at FROM history WHERE order_id = ANY($1)")
        .bind(&ids)
        .fetch_all(&env.db)
        .await?;
    let lines = rows
        .into_iter()
        .map(|(order_id, event, step, at)| time_spent::Line {
            order_id,
            event,
            step,
            at,
        })
        .collect();
    let sent_at = sent
        .iter()
        .map(|(id, at)| (stored(id), clock.wall(*at)))
        .collect();
    let heard = {
        let done = listener.processed.lock().expect("lock");
        sent.keys()
            .filter_map(|id| {
                let at = done.get(&stored(id)).or_else(|| done.get(id))?;
                Some((stored(id), clock.wall(*at)))
            })
            .collect()
    };
    Ok(time_spent::gaps(lines, &sent_at, &heard))
}

/// Publishes orders as the gateway client of a tenant, vouched for by the
/// benchmark's broker user.
struct Client<'a> {
    env: &'a TestEnv,
    publisher: &'a Publisher,
    user: &'a str,
}

impl Client<'_> {
    async fn send(&self, tenant: &str, ids: &[String], rate: f64) -> HashMap<String, Instant> {
        publish_each(self.env, self.publisher, ids, rate, |_, id| {
            let mut headers = FieldTable::default();
            headers.insert(
                sas_messages::headers::SENDER.into(),
                AMQPValue::LongString(format!("gateway:{tenant}").into()),
            );
            let properties = sas_broker::publish::json_properties(id)
                .with_user_id(self.user.into())
                .with_headers(headers);
            (order(id), properties)
        })
        .await
    }
}

/// Milliseconds from submit to `processed` of each order of `sent`, whose
/// statuses name it as stored (`<id>@<tenant>`) or as sent.
fn latencies(listener: &StatusListener, sent: &HashMap<String, Instant>, tenant: &str) -> Vec<f64> {
    let done = listener.processed.lock().expect("lock");
    sent.iter()
        .filter_map(|(id, at)| {
            let end = done
                .get(&format!("{id}@{tenant}"))
                .or_else(|| done.get(id))?;
            Some((*end - *at).as_secs_f64() * 1000.0)
        })
        .collect()
}

/// Returns once every order of `ids`, sent as `tenant`'s, has ended.
async fn wait_ended(
    env: &TestEnv,
    ids: &[String],
    tenant: &str,
    within: Duration,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + within;
    let stored: Vec<String> = ids.iter().map(|id| format!("{id}@{tenant}")).collect();
    loop {
        let ended: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM order_process
              WHERE order_id = ANY($1) AND state IN ('processed', 'compensated', 'error')",
        )
        .bind(&stored)
        .fetch_one(&env.db)
        .await?;
        if ended >= ids.len() as i64 {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "only {ended} of {} orders {}... of {tenant} ended within {within:?}",
            ids.len(),
            ids.first().map_or("", String::as_str)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
