//! The overload phase: a slow remote service offered 3 and 10 times what it
//! can absorb. Admission control should turn the excess into waiting, not
//! failures: goodput near the remote's capacity, no order failed or
//! compensated, and urgent orders (priority 9) well ahead of the rest. The
//! urgent orders' yardstick is measured in the same run: urgent orders
//! offered alone, at a quarter of the capacity, with no backlog to pass.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use sas_broker::Publisher;
use sas_lab::TestEnv;
use serde_json::json;

use crate::drive::{publish_with_priority, StatusListener};
use crate::report::{percentiles, OverloadPoint};
use crate::system::{start_agent, BenchSystem};
use sas_lab::Setting;

/// Latency of every remote call in this phase.
const LATENCY_MS: u64 = 100;
/// Calls at once per agent process and queue.
const CONCURRENCY: u32 = 4;
/// The load at which urgent orders are measured alone: no backlog forms.
const ALONE_FACTOR: f64 = 0.25;

/// Runs the phase with a fresh agent process: urgent orders alone first,
/// then each factor, each offered for `offer_secs`. Returns the point of
/// the urgent orders alone (the yardstick) and a point per factor.
///
/// # Errors
/// When the orders do not all end within ten minutes.
pub async fn run(
    env: &TestEnv,
    publisher: &Publisher,
    system: &BenchSystem,
    factors: &[f64],
    offer_secs: f64,
    urgent_every: usize,
) -> anyhow::Result<(OverloadPoint, Vec<OverloadPoint>)> {
    system
        .sim
        .set_faults(None, json!({"latency_ms": LATENCY_MS, "transient_fault_rate": 0.0, "permanent_fault_rate": 0.0, "hang_rate": 0.0}))
        .await?;
    let limited = [Setting::AgentConcurrency(CONCURRENCY)];
    let mut agents = vec![start_agent(env, &system.sim, 300, &limited)];
    // Every step of an order goes through a queue of its own, each served at
    // CONCURRENCY calls per LATENCY_MS: the pipeline finishes that many orders.
    let capacity = f64::from(CONCURRENCY * 1000) / LATENCY_MS as f64;
    let alone = Offer {
        factor: ALONE_FACTOR,
        capacity,
        secs: offer_secs,
        urgent_every: 1,
    };
    let urgent_alone = alone.run(env, publisher, "over-alone-").await?;
    let mut points = Vec::new();
    for (round, &factor) in factors.iter().enumerate() {
        let prefix = format!("over-{round}-");
        let offer = Offer {
            factor,
            capacity,
            secs: offer_secs,
            urgent_every,
        };
        points.push(offer.run(env, publisher, &prefix).await?);
    }
    for agent in &mut agents {
        agent.kill9().await;
    }
    Ok((urgent_alone, points))
}

/// One offered load: `factor` times the `capacity` for `secs`, one order in
/// `urgent_every` urgent (priority 9), the rest with none.
struct Offer {
    factor: f64,
    capacity: f64,
    secs: f64,
    urgent_every: usize,
}

impl Offer {
    /// Offers the load as orders `<prefix>0`, `<prefix>1`..., measured once
    /// every one has ended.
    async fn run(
        &self,
        env: &TestEnv,
        publisher: &Publisher,
        prefix: &str,
    ) -> anyhow::Result<OverloadPoint> {
        let (factor, capacity) = (self.factor, self.capacity);
        let every = self.urgent_every.max(1);
        let priority_of = |index: usize| (index % every == every - 1).then_some(9);
        let rate = capacity * factor;
        let n = (rate * self.secs) as usize;
        let ids: Vec<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
        let listener = StatusListener::start(env).await?;
        let started = Instant::now();
        let sent = publish_with_priority(
            env,
            publisher,
            &ids,
            rate,
            Some(&listener.queue),
            priority_of,
        )
        .await;
        tokio::time::timeout(Duration::from_secs(600), all_ended(env, prefix))
            .await
            .map_err(|_| {
                anyhow::anyhow!("overload {factor}x: orders still open after 10 minutes")
            })?;
        let finished = Instant::now();
        let failed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM order_process WHERE order_id LIKE $1 || '%' AND state IN ('compensated', 'error')",
    )
    .bind(prefix)
    .fetch_one(&env.db)
    .await?;
        let processed = n as i64 - failed;
        // Never negative: the failed are some of the `n`.
        let arrived = usize::try_from(processed).unwrap_or(0);
        listener
            .wait_for_processed(arrived, Duration::from_secs(10))
            .await;
        let (urgent_ms, normal_ms) =
            latencies_by_priority(&listener.processed, &ids, &sent, priority_of);
        let (urgent_first_step_ms, _) =
            latencies_by_priority(&listener.first_step, &ids, &sent, priority_of);
        Ok(OverloadPoint {
            offered_factor: factor,
            orders: n,
            capacity_orders_per_sec: capacity,
            goodput_fraction: processed as f64 / (finished - started).as_secs_f64() / capacity,
            failed_or_compensated: failed,
            urgent_every: every,
            urgent_orders: (0..n).filter(|&index| priority_of(index).is_some()).count(),
            latency_urgent_ms: percentiles(urgent_ms),
            urgent_first_step_ms: percentiles(urgent_first_step_ms),
            latency_normal_ms: percentiles(normal_ms),
        })
    }
}

/// Returns once every order whose id starts with `prefix` has ended,
/// processed or not (the caller bounds the wait).
async fn all_ended(env: &TestEnv, prefix: &str) {
    loop {
        let open: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM order_process
              WHERE order_id LIKE $1 || '%' AND state NOT IN ('processed', 'compensated', 'error')",
        )
        .bind(prefix)
        .fetch_one(&env.db)
        .await
        .unwrap_or(i64::MAX);
        if open == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Milliseconds from submit to the status `arrivals` recorded (the
/// listener's `processed` or `first_step`) of each order that has one,
/// urgent and normal apart.
fn latencies_by_priority(
    arrivals: &Mutex<HashMap<String, Instant>>,
    ids: &[String],
    sent: &HashMap<String, Instant>,
    priority_of: impl Fn(usize) -> Option<u8>,
) -> (Vec<f64>, Vec<f64>) {
    let (mut urgent_ms, mut normal_ms) = (Vec::new(), Vec::new());
    let done = arrivals.lock().expect("lock");
    for (index, id) in ids.iter().enumerate() {
        if let (Some(at), Some(end)) = (sent.get(id), done.get(id)) {
            let ms = (*end - *at).as_secs_f64() * 1000.0;
            if priority_of(index).is_some() {
                urgent_ms.push(ms);
            } else {
                normal_ms.push(ms);
            }
        }
    }
    (urgent_ms, normal_ms)
}
