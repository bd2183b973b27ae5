//! The keyed phase (issue 49): what limits by key cost per order. The same
//! orders, published as fast as the broker confirms, run three times on
//! one scheduler: through a workflow without limits, through one whose
//! charge is limited by merchant (`concurrency`, a fixed limit), and
//! through one whose limit is `adaptive`. The merchants are many and a
//! few are hot: half the orders go to [`HOT`] merchants, the rest each to
//! a merchant of its own among [`MERCHANTS`]. The fixed limit is high
//! enough that it never holds a hot merchant back at the remote's speed:
//! what it measures is the keys' bookkeeping (counting, locking), not the
//! limit's effect. The adaptive run measures the learning too: each key
//! starts at one attempt and climbs (slow start), so a merchant with few
//! orders runs them one or two at a time.
//!
//! The phase replaces the system's scheduler with one that runs the three
//! workflows, and runs two agent processes of its own (the overload phase
//! before it leaves none); the next phase replaces them again.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use sas_broker::Publisher;
use sas_lab::{order, TestEnv};
use serde_json::json;

use crate::drive::{publish_each, wait_processed};
use crate::phases::{cpu_per_order, ids, pg_commits};
use crate::report::{Keyed, KeyedRun};
use crate::system::{cpu_secs_by_program, quiet, start_agent, BenchSystem};

/// Merchants the orders not sent to a hot merchant are spread over.
pub const MERCHANTS: usize = 10_000;
/// The hot merchants, which get half of the orders.
pub const HOT: usize = 5;
/// The charge's limit per merchant: above what a hot merchant has in
/// flight at the remote's speed.
pub const LIMIT: u32 = 64;

/// The three workflows, by name: the order's three steps, the charge
/// limited by merchant or not.
fn workflows(env: &TestEnv) -> Vec<(String, String)> {
    let steps = |limit: &str| {
        format!(
            "{}{}{limit}\n{}",
            env.call_step(("reserve_stock", "inventory", "reserve", "release"), None),
            env.call_step(("charge_payment", "payment", "charge", "refund"), None),
            env.call_step(("create_shipment", "shipping", "ship", "cancel"), None),
        )
    };
    let key = "key = \"/attributes/merchant_id\"";
    [
        ("plain", String::new()),
        (
            "fixed",
            format!("concurrency = {{ {key}, limit = {LIMIT} }}"),
        ),
        (
            "adaptive",
            format!("concurrency = {{ {key}, limit = {LIMIT}, adaptive = true }}"),
        ),
    ]
    .into_iter()
    .map(|(name, limit)| {
        (
            name.to_owned(),
            format!("name = \"{name}\"\nversion = 1\n{}", steps(&limit)),
        )
    })
    .collect()
}

/// The merchant of the `index`th order: every other order to one of the
/// hot merchants, the others each to a merchant of the many.
fn merchant(index: usize) -> String {
    if index.is_multiple_of(2) {
        format!("hot-{}", (index / 2) % HOT)
    } else {
        format!("m-{}", (index / 2) % MERCHANTS)
    }
}

/// Runs the phase: `orders` orders through each workflow in turn.
///
/// # Errors
/// When a run's orders are not all processed within ten minutes.
pub async fn run(
    env: &TestEnv,
    publisher: &Publisher,
    system: &mut BenchSystem,
    orders: usize,
) -> anyhow::Result<Keyed> {
    system
        .sim
        .set_faults(None, json!({"latency_ms": 0, "transient_fault_rate": 0.0, "permanent_fault_rate": 0.0, "hang_rate": 0.0}))
        .await?;
    let files = workflows(env);
    let named: Vec<(String, &str)> = files
        .iter()
        .map(|(name, text)| (format!("{name}.toml"), text.as_str()))
        .collect();
    let named: Vec<(&str, &str)> = named.iter().map(|(f, t)| (f.as_str(), *t)).collect();
    // Alone: the system's own agents (still up with --keyed-only) go.
    for agent in &mut system.agents {
        agent.kill9().await;
    }
    system.scheduler.kill9().await;
    let mut vars = quiet();
    vars.extend(env.workflows(&named));
    system.scheduler = env.scheduler(2, &vars);
    let mut agents: Vec<_> = (0..2)
        .map(|i| start_agent(env, &system.sim, 500 + i, &[]))
        .collect();
    // Warm: the new scheduler is up with the three workflows.
    for (name, _) in &files {
        let warm = ids(&format!("kw-{name}-"), 4);
        send(env, publisher, name, &warm).await;
        wait_processed(env, &format!("kw-{name}-"), 4, Duration::from_secs(60)).await?;
    }
    let mut runs = BTreeMap::new();
    for (name, _) in &files {
        runs.insert(name.clone(), measure(env, publisher, name, orders).await?);
    }
    let learnt: i64 = sqlx::query_scalar("SELECT count(*) FROM key_learnt")
        .fetch_one(&env.db)
        .await?;
    for agent in &mut agents {
        agent.kill9().await;
    }
    Ok(Keyed {
        orders,
        hot_merchants: HOT,
        merchants: MERCHANTS,
        limit: LIMIT,
        keys_learnt: usize::try_from(learnt).unwrap_or(0),
        runs,
    })
}

/// Publishes the orders `ids` through workflow `workflow`, each with its
/// merchant, as fast as the broker confirms.
async fn send(env: &TestEnv, publisher: &Publisher, workflow: &str, ids: &[String]) {
    publish_each(env, publisher, ids, 0.0, |index, id| {
        let mut submitted = order(id);
        submitted.workflow = Some(workflow.to_owned());
        submitted.attributes = json!({ "merchant_id": merchant(index) })
            .as_object()
            .cloned();
        (submitted, sas_broker::publish::json_properties(id))
    })
    .await;
}

/// One run: `orders` orders through `workflow`, timed and costed.
async fn measure(
    env: &TestEnv,
    publisher: &Publisher,
    workflow: &str,
    orders: usize,
) -> anyhow::Result<KeyedRun> {
    let prefix = format!("k-{workflow}-");
    let commits_before = pg_commits(env).await;
    let cpu_before = cpu_secs_by_program();
    let started = Instant::now();
    send(env, publisher, workflow, &ids(&prefix, orders)).await;
    let finished = wait_processed(env, &prefix, orders, Duration::from_secs(600)).await?;
    let cpu_ms_per_order = cpu_per_order(&cpu_before, orders);
    // Postgres publishes its statistics about once a second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    Ok(KeyedRun {
        orders_per_sec: orders as f64 / (finished - started).as_secs_f64(),
        pg_commits_per_order: (pg_commits(env).await - commits_before) / orders as f64,
        cpu_ms_per_order,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn half_the_orders_go_to_the_hot_merchants_the_rest_spread_over_the_many() {
        let merchants: Vec<String> = (0..20).map(merchant).collect();
        let hot = merchants.iter().filter(|m| m.starts_with("hot-")).count();
        assert_eq!(hot, 10);
        let mut distinct = merchants.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), HOT + 10, "{merchants:?}");
    }
}
