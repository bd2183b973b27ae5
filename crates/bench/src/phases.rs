//! The phases of one benchmark run, in order.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;
use sas_broker::Publisher;
use sas_lab::TestEnv;
use serde_json::json;

use crate::budget;
use crate::drive::{counter_sum, publish, wait_processed, StatusListener};
use crate::report::{percentiles, Batching, Report, ScalingPoint, BARE_COMMITS_PER_ORDER};
use crate::system::{cpu_secs_by_program, memory_mib, start_agent, BenchSystem};
use crate::{calibrate, Sizes};
use sas_lab::sim::SimClient;
use sas_lab::Setting;

/// Deadline of each step attempt in the benchmark's workflow.
const STEP_TIMEOUT_MS: u64 = 10_000;
/// The supervisor interval the harness configures.
const SUPERVISOR_INTERVAL_SECS: f64 = 0.2;

/// The ids `<prefix>0` .. `<prefix><n-1>` of a phase's orders.
pub(crate) fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

pub(crate) async fn pg_commits(env: &TestEnv) -> f64 {
    sqlx::query_scalar::<_, i64>(
        "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()",
    )
    .fetch_one(&env.db)
    .await
    .unwrap_or(0) as f64
}

fn record_memory(system: &BenchSystem, into: &mut BTreeMap<String, f64>, peak: bool) {
    for (binary, pid) in system.processes() {
        let (resident, high_water) = memory_mib(pid);
        let value = if peak { high_water } else { resident };
        let entry = into.entry(binary.to_owned()).or_default();
        *entry = entry.max(value);
    }
}

/// What to leave out or change, for tuning loops.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Orders/s of the latency phase, instead of half the saturation rate.
    pub latency_rate: Option<f64>,
    /// Stop after the latency phase.
    pub throughput_only: bool,
    /// Skip from the warm-up straight to the overload phase.
    pub overload_only: bool,
    /// Skip from the warm-up straight to the noisy-neighbour phase.
    pub neighbours_only: bool,
    /// Skip from the warm-up straight to the keyed phase.
    pub keyed_only: bool,
    /// The noisy tenant's quota in the noisy-neighbour phase, orders/s.
    pub noisy_quota: Option<f64>,
    /// One order in this many of the overload phase's loads is urgent.
    pub urgent_every: usize,
}

/// Messages the scheduler has seen go through the quorum queues (orders,
/// step requests and their replies), and status messages it has sent, so far.
async fn message_counts(scheduler_port: u16) -> (f64, f64) {
    let queued = counter_sum(scheduler_port, "sas_orders_received_total").await
        + 2.0 * counter_sum(scheduler_port, "sas_step_requests_total").await;
    let statuses = counter_sum(scheduler_port, "sas_status_messages_total").await;
    (queued, statuses)
}

/// CPU milliseconds per order since `before`, for the programs of the
/// system under test (the services, Postgres, RabbitMQ, the benchmark).
pub(crate) fn cpu_per_order(
    before: &BTreeMap<String, f64>,
    orders: usize,
) -> BTreeMap<String, f64> {
    const PROGRAMS: [&str; 7] = [
        "scheduler",
        "agent",
        "supervisor",
        "remote-sim",
        "postgres",
        "rabbitmq",
        "sas-bench",
    ];
    cpu_secs_by_program()
        .into_iter()
        .filter(|(program, _)| PROGRAMS.contains(&program.as_str()))
        .map(|(program, secs)| {
            let used = secs - before.get(&program).copied().unwrap_or_default();
            (program, used * 1000.0 / orders as f64)
        })
        .collect()
}

/// Runs every phase and returns the report.
///
/// # Errors
/// When a phase cannot complete (the system did not process its orders in time).
pub async fn run_all(
    sizes: Sizes,
    options: Options,
    progress: &ProgressBar,
) -> anyhow::Result<Report> {
    let env = TestEnv::with_step_timeout(STEP_TIMEOUT_MS).await;
    let mut report = Report {
        quick: sizes.saturation_orders < 1000,
        ..Report::default()
    };
    calibrate_limits(&env, sizes, &mut report, progress).await?;

    progress.set_message("starting the system");
    let (_connection, publisher) = env.broker().await;
    let mut system = start_warm(&env, &publisher, &mut report).await?;
    if options.neighbours_only {
        return neighbours(
            &env,
            &publisher,
            &mut system,
            sizes,
            options.noisy_quota,
            report,
            progress,
        )
        .await;
    }
    if options.keyed_only {
        return keyed(&env, &publisher, &mut system, sizes, report, progress).await;
    }
    if options.overload_only {
        for agent in &mut system.agents {
            agent.kill9().await;
        }
        return overload(&env, &publisher, &system, sizes, options, report, progress).await;
    }

    saturation(&env, &publisher, &system, sizes, &mut report, progress).await?;
    latency(
        &env,
        &publisher,
        &system,
        sizes,
        options,
        &mut report,
        progress,
    )
    .await?;
    if options.throughput_only {
        return Ok(report);
    }
    scaling(&env, &publisher, &mut system, sizes, &mut report, progress).await?;
    recovery(&env, &publisher, &system, sizes, &mut report, progress).await?;
    let report = overload(&env, &publisher, &system, sizes, options, report, progress).await?;
    let report = keyed(&env, &publisher, &mut system, sizes, report, progress).await?;
    neighbours(
        &env,
        &publisher,
        &mut system,
        sizes,
        options.noisy_quota,
        report,
        progress,
    )
    .await
}

/// The calibrations: the broker's and Postgres's own limits, against which
/// the system's figures are read.
async fn calibrate_limits(
    env: &TestEnv,
    sizes: Sizes,
    report: &mut Report,
    progress: &ProgressBar,
) -> anyhow::Result<()> {
    progress.set_message("calibrating the broker");
    report.broker_limit_msgs_per_sec =
        calibrate::broker_limit(env, sizes.calibration_messages).await?;
    progress.inc(1);
    progress.set_message("calibrating Postgres");
    report.postgres_limit_commits_per_sec =
        calibrate::postgres_limit(env, sizes.calibration_secs).await?;
    progress.inc(1);
    Ok(())
}

/// Starts the system with two agent processes and puts a few orders
/// through it, so that no phase measures a cold start; records the memory
/// at idle.
async fn start_warm(
    env: &TestEnv,
    publisher: &Publisher,
    report: &mut Report,
) -> anyhow::Result<BenchSystem> {
    let system = BenchSystem::start(env, 2).await;
    publish(env, publisher, &ids("warmup-", 20), 0.0, None).await;
    wait_processed(env, "warmup-", 20, Duration::from_secs(60)).await?;
    tokio::time::sleep(Duration::from_millis(500)).await;
    record_memory(&system, &mut report.rss_idle_mib, false);
    Ok(system)
}

/// Saturation: orders published as fast as the broker confirms; the
/// throughput, and what each order costs in messages, commits, CPU and memory.
async fn saturation(
    env: &TestEnv,
    publisher: &Publisher,
    system: &BenchSystem,
    sizes: Sizes,
    report: &mut Report,
    progress: &ProgressBar,
) -> anyhow::Result<()> {
    // Every phase's orders name a reply_to queue, as clients that want their
    // outcome do: saturation and latency measure the same work per order.
    let listener = StatusListener::start(env).await?;
    progress.set_message(format!("saturation: {} orders", sizes.saturation_orders));
    let port = system.scheduler_port;
    let (queued_before, statuses_before) = message_counts(port).await;
    let commits_before = pg_commits(env).await;
    let claimed_before = counter_sum(port, "sas_orders_claimed_total").await;
    let batches_before = budget::Reading::take(port, &[]).await;
    let cpu_before = cpu_secs_by_program();
    let started = Instant::now();
    publish(
        env,
        publisher,
        &ids("sat-", sizes.saturation_orders),
        0.0,
        Some(&listener.queue),
    )
    .await;
    let finished = wait_processed(
        env,
        "sat-",
        sizes.saturation_orders,
        Duration::from_secs(600),
    )
    .await?;
    report.orders_per_sec = sizes.saturation_orders as f64 / (finished - started).as_secs_f64();
    report.cpu_ms_per_order = cpu_per_order(&cpu_before, sizes.saturation_orders);
    record_memory(system, &mut report.rss_mib, true);
    // Postgres publishes its statistics about once a second.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let (queued_after, statuses_after) = message_counts(port).await;
    let orders = sizes.saturation_orders as f64;
    report.msgs_per_order = (queued_after - queued_before) / orders;
    report.status_msgs_per_order = (statuses_after - statuses_before) / orders;
    report.pg_commits_per_order = (pg_commits(env).await - commits_before) / orders;
    let batches = budget::Reading::take(port, &[]).await;
    report.saturation_batching = Batching {
        intake_items: batches.scheduler_batch_mean(&batches_before, "sas_batch_items", "intake"),
        reply_items: batches.scheduler_batch_mean(&batches_before, "sas_batch_items", "replies"),
        claimed_per_order: (counter_sum(port, "sas_orders_claimed_total").await - claimed_before)
            / orders,
    };
    if report.msgs_per_order > 0.0 {
        report.efficiency =
            report.orders_per_sec / (report.broker_limit_msgs_per_sec / report.msgs_per_order);
    }
    progress.inc(1);
    Ok(())
}

/// Latency: orders at a steady rate (half the saturation rate unless told),
/// each timed from its publish to its `processed` status, and where that
/// time went (see [`crate::budget`]).
async fn latency(
    env: &TestEnv,
    publisher: &Publisher,
    system: &BenchSystem,
    sizes: Sizes,
    options: Options,
    report: &mut Report,
    progress: &ProgressBar,
) -> anyhow::Result<()> {
    let rate = options
        .latency_rate
        .unwrap_or((report.orders_per_sec / 2.0).max(1.0));
    let count = ((rate * sizes.latency_secs) as usize).max(30);
    progress.set_message(format!("latency: {count} orders at {rate:.0}/s"));
    // A queue of its own, so no status left from saturation is ahead in line.
    let listener = StatusListener::start(env).await?;
    let before = budget::Reading::take(system.scheduler_port, &system.agent_ports).await;
    let cpu_before = cpu_secs_by_program();
    let started = (Instant::now(), std::time::SystemTime::now());
    let sent = publish(
        env,
        publisher,
        &ids("lat-", count),
        rate,
        Some(&listener.queue),
    )
    .await;
    wait_processed(env, "lat-", count, Duration::from_secs(300)).await?;
    // Read as the last order ends, before the waits below idle the machine.
    let busy_secs = started.0.elapsed().as_secs_f64();
    report.latency_cpu_ms_per_order = cpu_per_order(&cpu_before, count);
    listener
        .wait_for_processed(count, Duration::from_secs(10))
        .await;
    // The timeline's origin: the first publish (a little after the phase's
    // start, by the publish itself).
    let first = sent.values().min().copied().unwrap_or(started.0);
    let timeline = timeline(&sent, &listener.processed.lock().expect("lock"), first);
    let samples: Vec<f64> = timeline.iter().map(|[_, ms]| *ms).collect();
    let after = budget::Reading::take(system.scheduler_port, &system.agent_ports).await;
    let client = {
        let waits = listener.status_wait_ms.lock().expect("lock");
        budget::ClientSide {
            status_wait_ms: waits.values().sum(),
            statuses: waits.len(),
            mean_latency_ms: samples.iter().sum::<f64>() / samples.len().max(1) as f64,
        }
    };
    let names = env.amqp().names();
    report.latency_budget = budget::budget(
        &before,
        &after,
        samples.len(),
        (&names.orders(), &names.scheduler_replies()),
        &client,
    );
    report.latency_mean_ms = client.mean_latency_ms;
    report.latency_ms = percentiles(samples);
    report.latency_timeline = timeline;
    let cores = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    report.latency_cpu_busy = report.latency_cpu_ms_per_order.values().sum::<f64>() * count as f64
        / 1000.0
        / busy_secs
        / cores as f64;
    report.latency_timeline_started_unix_ms = (started.1 + (first - started.0))
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| {
            u64::try_from(since.as_millis()).unwrap_or(u64::MAX)
        });
    report.latency_rate_orders_per_sec = rate;
    progress.set_message(format!(
        "latency: RabbitMQ and Postgres alone at {rate:.0} orders/s"
    ));
    // An extra beside the phase's figures: a failure costs the row, not the run.
    match bare_work(env, rate, sizes, report).await {
        Ok(bare) => report.latency_bare_cpu_ms_per_order = bare,
        Err(error) => progress.println(format!(
            "sas-bench: the bare work's CPU at {rate:.0} orders/s was not measured: {error:#}"
        )),
    }
    progress.inc(1);
    Ok(())
}

/// The bare work's CPU at `rate` orders/s (see
/// [`Report::latency_bare_cpu_ms_per_order`]): the broker's and Postgres's
/// calibrations paced at the rate's messages and commits, one after the
/// other, while the system idles.
async fn bare_work(
    env: &TestEnv,
    rate: f64,
    sizes: Sizes,
    report: &Report,
) -> anyhow::Result<BTreeMap<String, f64>> {
    let messages = report.msgs_per_order;
    anyhow::ensure!(
        messages > 0.0,
        "the saturation phase counted no messages per order"
    );
    let per_message =
        calibrate::broker_cpu_at(env, rate * messages, sizes.calibration_secs).await?;
    let per_commit =
        calibrate::postgres_cpu_at(env, rate * BARE_COMMITS_PER_ORDER, sizes.calibration_secs)
            .await?;
    Ok(BTreeMap::from([
        ("rabbitmq".to_owned(), per_message * messages),
        ("postgres".to_owned(), per_commit * BARE_COMMITS_PER_ORDER),
    ]))
}

/// Each processed order as `[sent, ms]` (see [`Report::latency_timeline`]),
/// `sent` in seconds from `first`, in the order sent.
fn timeline(
    sent: &HashMap<String, Instant>,
    processed: &HashMap<String, Instant>,
    first: Instant,
) -> Vec<[f64; 2]> {
    let mut timeline: Vec<[f64; 2]> = sent
        .iter()
        .filter_map(|(id, at)| {
            let done = processed.get(id)?;
            Some([
                (*at - first).as_secs_f64(),
                (*done - *at).as_secs_f64() * 1000.0,
            ])
        })
        .collect();
    timeline.sort_by(|a, b| a[0].total_cmp(&b[0]));
    timeline
}

/// Scaling: the throughput with each number of agent processes while the
/// remote service is the bottleneck, and how near linear it grows.
async fn scaling(
    env: &TestEnv,
    publisher: &Publisher,
    system: &mut BenchSystem,
    sizes: Sizes,
    report: &mut Report,
    progress: &ProgressBar,
) -> anyhow::Result<()> {
    // The remote service answers in 50 ms and takes one call at a time from
    // each agent process (agent.concurrency = 1), so the remote service is
    // the bottleneck; prefetch 2 keeps the next request at hand.
    for agent in &mut system.agents {
        agent.kill9().await;
    }
    system.sim.set_faults(None, json!({"latency_ms": 50, "transient_fault_rate": 0.0, "permanent_fault_rate": 0.0, "hang_rate": 0.0})).await?;
    for &agents in sizes.scaling_agents {
        progress.set_message(format!("scaling: {agents} agent process(es)"));
        let orders_per_sec = throughput_with_agents(
            env,
            publisher,
            &system.sim,
            agents,
            sizes.scaling_orders_per_agent,
        )
        .await?;
        report.scaling.push(ScalingPoint {
            agents,
            orders_per_sec,
        });
    }
    if let (Some(first), Some(last)) = (report.scaling.first(), report.scaling.last()) {
        report.scaling_efficiency = (last.orders_per_sec / first.orders_per_sec)
            / (last.agents as f64 / first.agents as f64);
    }
    progress.inc(1);
    Ok(())
}

/// One point of the scaling curve: orders/s through `agents` fresh agent
/// processes, each taking one call at a time, stopped again afterwards.
async fn throughput_with_agents(
    env: &TestEnv,
    publisher: &Publisher,
    sim: &SimClient,
    agents: usize,
    orders_per_agent: usize,
) -> anyhow::Result<f64> {
    let one_at_a_time = [Setting::AgentConcurrency(1), Setting::AmqpPrefetch(2)];
    let mut running: Vec<_> = (0..agents)
        .map(|i| start_agent(env, sim, 100 + agents * 10 + i, &one_at_a_time))
        .collect();
    let warm = format!("scale-{agents}-warm-");
    publish(env, publisher, &ids(&warm, agents), 0.0, None).await;
    wait_processed(env, &warm, agents, Duration::from_secs(60)).await?;
    let prefix = format!("scale-{agents}-run-");
    let n = orders_per_agent * agents;
    let started = Instant::now();
    publish(env, publisher, &ids(&prefix, n), 0.0, None).await;
    let finished = wait_processed(env, &prefix, n, Duration::from_secs(600)).await?;
    for agent in &mut running {
        agent.kill9().await;
    }
    Ok(n as f64 / (finished - started).as_secs_f64())
}

/// Recovery: an agent killed with -9 while orders are in flight, timed
/// until every order is processed, against the bound the design promises.
async fn recovery(
    env: &TestEnv,
    publisher: &Publisher,
    system: &BenchSystem,
    sizes: Sizes,
    report: &mut Report,
    progress: &ProgressBar,
) -> anyhow::Result<()> {
    progress.set_message("recovery: kill -9 of an agent under load");
    let mut agents: Vec<_> = (0..2)
        .map(|i| start_agent(env, &system.sim, 200 + i, &[]))
        .collect();
    publish(env, publisher, &ids("rec-warm-", 2), 0.0, None).await;
    wait_processed(env, "rec-warm-", 2, Duration::from_secs(60)).await?;
    let n = sizes.recovery_orders;
    let recovery_ids = ids("rec-", n);
    let publishing = publish(
        env,
        publisher,
        &recovery_ids,
        (n as f64 / 2.0).max(20.0),
        None,
    );
    let killing = async {
        while crate::drive::processed(env, "rec-").await < (n / 4) as i64 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        agents[0].kill9().await;
        Instant::now()
    };
    let (_, killed_at) = tokio::join!(publishing, killing);
    let recovered = wait_processed(env, "rec-", n, Duration::from_secs(120)).await?;
    report.recovery_secs = (recovered - killed_at).as_secs_f64();
    // complete-by + the supervisor's grace (a fifth of it, as the harness
    // sets) + one scan interval.
    report.recovery_bound_secs = STEP_TIMEOUT_MS as f64 * 1.2 / 1000.0 + SUPERVISOR_INTERVAL_SECS;
    record_memory(system, &mut report.rss_mib, true);
    progress.inc(1);
    drop(agents);
    Ok(())
}

/// The last phase: a slow remote service offered more than it can take.
async fn overload(
    env: &TestEnv,
    publisher: &Publisher,
    system: &BenchSystem,
    sizes: Sizes,
    options: Options,
    mut report: Report,
    progress: &ProgressBar,
) -> anyhow::Result<Report> {
    progress.set_message("overload: a slow remote offered 3x and 10x its capacity");
    let (alone, points) = crate::overload::run(
        env,
        publisher,
        system,
        &[3.0, 10.0],
        sizes.overload_offer_secs,
        options.urgent_every,
    )
    .await?;
    report.overload = points;
    report.overload_urgent_alone_ms = alone.latency_urgent_ms;
    report.overload_urgent_alone_first_step_ms = alone.urgent_first_step_ms;
    progress.inc(1);
    Ok(report)
}

/// What limits by key cost per order (it replaces the system's
/// scheduler).
async fn keyed(
    env: &TestEnv,
    publisher: &Publisher,
    system: &mut BenchSystem,
    sizes: Sizes,
    mut report: Report,
    progress: &ProgressBar,
) -> anyhow::Result<Report> {
    progress.set_message(format!(
        "keyed: {} orders each without limits by key, with a fixed one, with an adaptive one",
        sizes.keyed_orders
    ));
    report.keyed = Some(crate::keyed::run(env, publisher, system, sizes.keyed_orders).await?);
    progress.inc(1);
    Ok(report)
}

/// The very last phase (it replaces the system's scheduler): a quiet
/// tenant beside a noisy one on a slow remote.
async fn neighbours(
    env: &TestEnv,
    publisher: &Publisher,
    system: &mut BenchSystem,
    sizes: Sizes,
    noisy_quota: Option<f64>,
    mut report: Report,
    progress: &ProgressBar,
) -> anyhow::Result<Report> {
    progress.set_message("neighbours: a quiet tenant beside one sending 10x the capacity");
    report.neighbours = Some(
        crate::neighbours::run(env, publisher, system, sizes.neighbours_secs, noisy_quota).await?,
    );
    progress.inc(1);
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_timeline_is_each_processed_order_in_the_order_sent() {
        let start = Instant::now();
        let at = |ms: u64| start + Duration::from_millis(ms);
        let sent: HashMap<String, Instant> = [("b", 10), ("a", 0), ("c", 20)]
            .into_iter()
            .map(|(id, ms)| (id.to_owned(), at(ms)))
            .collect();
        // "c" never finished: it has no latency to show.
        let processed: HashMap<String, Instant> = [("a", 50), ("b", 30)]
            .into_iter()
            .map(|(id, ms)| (id.to_owned(), at(ms)))
            .collect();
        let timeline = timeline(&sent, &processed, start);
        let rounded: Vec<(u64, u64)> = timeline
            .iter()
            .map(|[sent, ms]| ((sent * 1000.0).round() as u64, ms.round() as u64))
            .collect();
        assert_eq!(rounded, [(0, 50), (10, 20)]);
        assert!(super::timeline(&HashMap::new(), &processed, start).is_empty());
    }
}
