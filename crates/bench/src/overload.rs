//! The overload phase: a slow remote service offered 3 and 10 times what it
//! can absorb. Admission control should turn the excess into waiting, not
//! failures: goodput near the remote's capacity, no order failed or
//! compensated, and urgent orders (priority 9) well ahead of the rest.

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

/// Runs the phase with `agents` fresh agent processes, offering each factor
/// for `offer_secs`.
///
/// # Errors
/// When the orders do not all end within ten minutes.
pub async fn run(
    env: &TestEnv,
    publisher: &Publisher,
    system: &BenchSystem,
    factors: &[f64],
    offer_secs: f64,
) -> anyhow::Result<Vec<OverloadPoint>> {
    system
        .sim
        .set_faults(None, json!({"latency_ms": LATENCY_MS, "transient_fault_rate": 0.0, "permanent_fault_rate": 0.0, "hang_rate": 0.0}))
        .await?;
    let limited = [Setting::AgentConcurrency(CONCURRENCY)];
    let mut agents = vec![start_agent(env, &system.sim, 300, &limited)];
    // Every step of an order goes through a queue of its own, each served at
    // CONCURRENCY calls per LATENCY_MS: the pipeline finishes that many orders.
    let capacity = f64::from(CONCURRENCY * 1000) / LATENCY_MS as f64;
    let mut points = Vec::new();
    for (round, &factor) in factors.iter().enumerate() {
        let rate = capacity * factor;
        let n = (rate * offer_secs) as usize;
        let prefix = format!("over-{round}-");
        let ids: Vec<String> = (0..n).map(|i| format!("{prefix}{i}")).collect();
        let listener = StatusListener::start(env).await?;
        let urgent = |index: usize| (index % 10 == 9).then_some(9);
        let started = Instant::now();
        let sent =
            publish_with_priority(env, publisher, &ids, rate, Some(&listener.queue), urgent).await;
        // Every order ends, processed or not.
        let ended = async {
            loop {
                let open: i64 = sqlx::query_scalar(
                    "SELECT count(*) FROM order_process
                      WHERE order_id LIKE $1 || '%' AND state NOT IN ('processed', 'compensated', 'error')",
                )
                .bind(&prefix)
                .fetch_one(env.store.pool())
                .await
                .unwrap_or(i64::MAX);
                if open == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(600), ended)
            .await
            .map_err(|_| {
                anyhow::anyhow!("overload {factor}x: orders still open after 10 minutes")
            })?;
        let finished = Instant::now();
        let failed: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM order_process WHERE order_id LIKE $1 || '%' AND state IN ('compensated', 'error')",
        )
        .bind(&prefix)
        .fetch_one(env.store.pool())
        .await?;
        let processed = n as i64 - failed;
        let deadline = Instant::now() + Duration::from_secs(10);
        while (listener.processed.lock().expect("lock").len() as i64) < processed
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let (mut urgent_ms, mut normal_ms) = (Vec::new(), Vec::new());
        {
            let done = listener.processed.lock().expect("lock");
            for (index, id) in ids.iter().enumerate() {
                if let (Some(at), Some(end)) = (sent.get(id), done.get(id)) {
                    let ms = (*end - *at).as_secs_f64() * 1000.0;
                    if urgent(index).is_some() {
                        urgent_ms.push(ms);
                    } else {
                        normal_ms.push(ms);
                    }
                }
            }
        }
        points.push(OverloadPoint {
            offered_factor: factor,
            orders: n,
            capacity_orders_per_sec: capacity,
            goodput_fraction: processed as f64 / (finished - started).as_secs_f64() / capacity,
            failed_or_compensated: failed,
            latency_urgent_ms: percentiles(urgent_ms),
            latency_normal_ms: percentiles(normal_ms),
        });
    }
    for agent in &mut agents {
        agent.kill9().await;
    }
    Ok(points)
}
