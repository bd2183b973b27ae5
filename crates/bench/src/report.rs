//! The benchmark's report: JSON fields and a readable table.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::Serialize;

use crate::budget::BudgetLine;

/// Latency percentiles, in milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Latency {
    /// Median.
    pub p50: f64,
    /// 95th percentile.
    pub p95: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// One point of the scaling curve.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ScalingPoint {
    /// Agent processes.
    pub agents: usize,
    /// Throughput.
    pub orders_per_sec: f64,
}

/// One offered load of the overload phase.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct OverloadPoint {
    /// Offered load as a multiple of what the remote service can absorb.
    pub offered_factor: f64,
    /// Orders offered.
    pub orders: usize,
    /// What the remote service can absorb, orders/s.
    pub capacity_orders_per_sec: f64,
    /// Orders processed per second from the first submit to the last
    /// processed, as a fraction of the capacity.
    pub goodput_fraction: f64,
    /// Orders that ended compensated or in error (target 0).
    pub failed_or_compensated: i64,
    /// One order in this many was urgent (priority 9); the rest had none.
    pub urgent_every: usize,
    /// How many of the orders were urgent.
    pub urgent_orders: usize,
    /// Submit to processed of the priority-9 orders (one in `urgent_every`), ms.
    pub latency_urgent_ms: Latency,
    /// Submit to the first step's completion of the same orders, ms: the
    /// part of their latency spent waiting to be admitted and for a call
    /// slot, plus one call; the rest is their later steps.
    pub urgent_first_step_ms: Latency,
    /// Submit to processed of orders without a priority, ms.
    pub latency_normal_ms: Latency,
}

/// The noisy-neighbour phase: a quiet tenant's latency beside a noisy one.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Neighbours {
    /// What the remote service can absorb, orders/s.
    pub capacity_orders_per_sec: f64,
    /// Orders the quiet tenant sent in each half (a tenth of the capacity).
    pub quiet_orders: usize,
    /// Orders the noisy tenant sent beside it (ten times the capacity).
    pub noisy_orders: usize,
    /// Submit to processed of the quiet tenant's orders alone, ms: the
    /// yardstick.
    pub quiet_alone_ms: Latency,
    /// The same while the noisy tenant sends (target: p99 within 1.5 times
    /// the yardstick's).
    pub quiet_beside_noisy_ms: Latency,
    /// The noisy tenant's orders processed per second while the quiet
    /// tenant's were, as a fraction of the capacity: it keeps the rest.
    pub noisy_goodput_fraction: f64,
    /// The noisy tenant's quota, orders/s (`--noisy-quota`), if it had one.
    pub noisy_quota_per_sec: Option<f64>,
    /// The noisy tenant's orders stored (the rest refused by its quota).
    pub noisy_stored: usize,
    /// Where the quiet tenant's orders spent their time alone, hop by hop
    /// (from their history).
    pub quiet_alone_gaps: Vec<crate::time_spent::Gap>,
    /// The same beside the noisy tenant: the hops that grew are what a
    /// neighbour slows.
    pub quiet_beside_noisy_gaps: Vec<crate::time_spent::Gap>,
}

/// The keyed phase: the same orders through a workflow without limits by
/// key, with a fixed one, and with an adaptive one (see `keyed.rs`).
#[derive(Debug, Clone, Default, Serialize)]
pub struct Keyed {
    /// Orders in each run.
    pub orders: usize,
    /// Merchants that get half of the orders.
    pub hot_merchants: usize,
    /// Merchants the other half is spread over.
    pub merchants: usize,
    /// The charge's limit per merchant.
    pub limit: u32,
    /// Keys with a learnt limit after the adaptive run.
    pub keys_learnt: usize,
    /// Each run by workflow: `plain`, `fixed`, `adaptive`.
    pub runs: BTreeMap<String, KeyedRun>,
}

/// One run of the keyed phase.
#[derive(Debug, Clone, Default, Serialize)]
pub struct KeyedRun {
    /// Orders processed a second, published as fast as the broker confirms.
    pub orders_per_sec: f64,
    /// Postgres commits per order.
    pub pg_commits_per_order: f64,
    /// CPU milliseconds per order, by program.
    pub cpu_ms_per_order: BTreeMap<String, f64>,
}

/// How the saturation phase's writes were grouped (see `Report`).
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Batching {
    /// Mean orders per intake statement.
    pub intake_items: f64,
    /// Mean replies per reply statement.
    pub reply_items: f64,
    /// Orders claimed, per order (`sas_orders_claimed_total`): from an
    /// admission line, and also back from backoff or resumed compensations,
    /// of which a saturation run has none.
    pub claimed_per_order: f64,
}

/// Everything one run measured.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Report {
    /// Quick (test) or full run.
    pub quick: bool,
    /// Saturation throughput of the 3-step workflow, submit to processed.
    pub orders_per_sec: f64,
    /// Persistent, confirmed messages per second through one quorum queue and back.
    pub broker_limit_msgs_per_sec: f64,
    /// Single-row committed updates per second in Postgres.
    pub postgres_limit_commits_per_sec: f64,
    /// Persistent messages through quorum queues per order (the order, step
    /// requests and replies): the kind the broker limit measures.
    pub msgs_per_order: f64,
    /// Status messages per order (to the status exchange and the order's
    /// `reply_to` queue, neither a quorum queue), counted apart.
    pub status_msgs_per_order: f64,
    /// `orders_per_sec / (broker_limit_msgs_per_sec / msgs_per_order)`.
    pub efficiency: f64,
    /// Postgres commits per order during saturation.
    pub pg_commits_per_order: f64,
    /// During saturation, the mean items per group commit of the
    /// scheduler's intake and reply batches, and orders claimed from an
    /// admission line per order: why commits per order are what they are.
    pub saturation_batching: Batching,
    /// Submit-to-processed latency at half the saturation rate.
    pub latency_ms: Latency,
    /// The rate used for the latency phase.
    pub latency_rate_orders_per_sec: f64,
    /// Mean submit-to-processed latency of the latency phase, ms.
    pub latency_mean_ms: f64,
    /// Where the latency phase's time went, stage by stage (see `budget.rs`).
    pub latency_budget: Vec<BudgetLine>,
    /// Every order of the latency phase as `[sent, ms]`: seconds from the
    /// phase's first publish, and its submit-to-processed latency, in the
    /// order sent. The percentiles say how slow the tail is; this says
    /// when it happened, so a stall (a tail bunched in time) can be told
    /// from a spread (a tail scattered through the phase).
    pub latency_timeline: Vec<[f64; 2]>,
    /// When the latency phase's first order was published, as milliseconds
    /// since the UNIX epoch: lays the timeline beside samples taken outside
    /// the benchmark (`top`, `pg_stat_activity`).
    pub latency_timeline_started_unix_ms: u64,
    /// Throughput by agent processes, remote service at 50 ms.
    pub scaling: Vec<ScalingPoint>,
    /// Throughput with the most agents over the single agent's, divided by the agent ratio.
    pub scaling_efficiency: f64,
    /// Seconds from an agent's kill -9 until every order then in flight was processed.
    pub recovery_secs: f64,
    /// The bound recovery must meet: complete-by plus one supervisor interval.
    pub recovery_bound_secs: f64,
    /// Peak resident memory per binary under load, MiB.
    pub rss_mib: BTreeMap<String, f64>,
    /// Resident memory per binary at idle, MiB.
    pub rss_idle_mib: BTreeMap<String, f64>,
    /// Offered loads beyond what a slow remote service absorbs.
    pub overload: Vec<OverloadPoint>,
    /// Submit to processed of urgent orders offered alone to the overload
    /// phase's slow remote, before its loads, ms: the yardstick of urgent
    /// orders under overload (target: their p99 within 1.5 times this p99).
    pub overload_urgent_alone_ms: Latency,
    /// Submit to the first step's completion of those orders alone, ms (see
    /// [`OverloadPoint::urgent_first_step_ms`]).
    pub overload_urgent_alone_first_step_ms: Latency,
    /// Two tenants on a slow remote: a quiet one beside a noisy one (not
    /// measured with `--throughput-only` and `--overload-only`).
    pub neighbours: Option<Neighbours>,
    /// What limits by key cost per order (not measured with
    /// `--throughput-only`, `--overload-only` and `--neighbours-only`).
    pub keyed: Option<Keyed>,
    /// CPU milliseconds per order during saturation, by program (the
    /// services, Postgres, RabbitMQ, the benchmark's own client): where the
    /// time goes.
    pub cpu_ms_per_order: BTreeMap<String, f64>,
    /// The same during the latency phase, at its lower rate: smaller batches
    /// cost more per order there.
    pub latency_cpu_ms_per_order: BTreeMap<String, f64>,
    /// The share of the machine's cores the system under test used through
    /// the latency phase: its CPU seconds (`latency_cpu_ms_per_order` × the
    /// phase's orders ÷ 1000) ÷ the seconds from the first publish to the
    /// last order processed ÷ the cores. Near 1, an order's time is mostly
    /// waiting for a core.
    pub latency_cpu_busy: f64,
    /// What an order's bare work costs RabbitMQ and Postgres alone at the
    /// latency phase's rate, in CPU milliseconds per order: `rabbitmq` for
    /// its quorum messages (`msgs_per_order` of them, through one quorum
    /// queue at that many times the rate, each confirmed, consumed and
    /// acknowledged on its own), `postgres` for [`BARE_COMMITS_PER_ORDER`]
    /// one-row commits (at that many times the rate), measured while the
    /// system idles (its polls count too, a few percent). Set beside
    /// `latency_cpu_ms_per_order`: not a lower bound, since the system
    /// coalesces confirms, acks and statements, and the order's status
    /// messages are left out. Empty when not measured (`--overload-only`,
    /// or it failed: the run says why).
    pub latency_bare_cpu_ms_per_order: BTreeMap<String, f64>,
}

/// The commits of an order's transitions when none is batched with
/// another: its intake and its three replies.
pub const BARE_COMMITS_PER_ORDER: f64 = 4.0;

impl Report {
    /// The report as a plain-text table.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "\nsas benchmark{}",
            if self.quick { " (quick)" } else { "" }
        );
        self.limit_rows(&mut out);
        self.saturation_rows(&mut out);
        self.latency_row(&mut out);
        self.budget_rows(&mut out);
        self.scaling_rows(&mut out);
        self.recovery_row(&mut out);
        self.overload_rows(&mut out);
        self.keyed_rows(&mut out);
        self.neighbour_rows(&mut out);
        self.memory_rows(&mut out);
        out
    }

    /// The calibrations: the limits the system's figures are read against.
    fn limit_rows(&self, out: &mut String) {
        row(
            out,
            "broker limit (msgs/s, quorum, confirmed)",
            format!("{:.0}", self.broker_limit_msgs_per_sec),
        );
        row(
            out,
            "postgres limit (single-row commits/s)",
            format!("{:.0}", self.postgres_limit_commits_per_sec),
        );
    }

    /// Saturation: the throughput and what each order costs.
    fn saturation_rows(&self, out: &mut String) {
        row(
            out,
            "saturation (orders/s, 3 steps)",
            format!("{:.0}", self.orders_per_sec),
        );
        row(
            out,
            "quorum-queue messages per order",
            format!("{:.1}", self.msgs_per_order),
        );
        row(
            out,
            "status messages per order (not quorum)",
            format!("{:.1}", self.status_msgs_per_order),
        );
        row(
            out,
            "postgres commits per order",
            format!("{:.1}", self.pg_commits_per_order),
        );
        row(
            out,
            "items per intake / reply commit, claims/order",
            format!(
                "{:.1} / {:.1}, {:.2}",
                self.saturation_batching.intake_items,
                self.saturation_batching.reply_items,
                self.saturation_batching.claimed_per_order
            ),
        );
        row(
            out,
            "efficiency vs broker limit",
            format!("{:.2}", self.efficiency),
        );
        cpu_row(
            out,
            "cpu ms per order (saturation)",
            &self.cpu_ms_per_order,
            "",
        );
    }

    /// Latency: the percentiles at the rate the phase used.
    fn latency_row(&self, out: &mut String) {
        row(
            out,
            &format!(
                "latency at {:.0} orders/s (ms)",
                self.latency_rate_orders_per_sec
            ),
            format!(
                "p50 {:.1}  p95 {:.1}  p99 {:.1}",
                self.latency_ms.p50, self.latency_ms.p95, self.latency_ms.p99
            ),
        );
        cpu_row(
            out,
            "cpu ms per order (latency phase)",
            &self.latency_cpu_ms_per_order,
            &format!("; the machine {:.0}% busy", self.latency_cpu_busy * 100.0),
        );
        if let (Some(rabbitmq), Some(postgres)) = (
            self.latency_bare_cpu_ms_per_order.get("rabbitmq"),
            self.latency_bare_cpu_ms_per_order.get("postgres"),
        ) {
            row(
                out,
                "bare work alone at that rate (cpu ms/order)",
                format!(
                    "rabbitmq {rabbitmq:.2} ({:.1} quorum messages, one by one), \
                     postgres {postgres:.2} ({BARE_COMMITS_PER_ORDER:.0} one-row commits)",
                    self.msgs_per_order
                ),
            );
        }
    }

    /// The latency budget: each stage's milliseconds per order, how often
    /// an order met it and how long each time.
    fn budget_rows(&self, out: &mut String) {
        if self.latency_budget.is_empty() {
            return;
        }
        row(
            out,
            "latency budget (ms per order)",
            format!("mean latency {:.1}", self.latency_mean_ms),
        );
        for line in &self.latency_budget {
            let stage = if line.on_path {
                line.stage.clone()
            } else {
                format!("(off the path) {}", line.stage)
            };
            let _ = writeln!(
                out,
                "    {stage:<66} {:>7.2}  ({:.1} x {:.2} ms)",
                line.ms_per_order, line.times_per_order, line.mean_ms
            );
        }
    }

    /// Scaling: the throughput at each number of agent processes, and how
    /// near linear it grew.
    fn scaling_rows(&self, out: &mut String) {
        for point in &self.scaling {
            row(
                out,
                &format!("scaling: {} agent process(es), 50 ms remote", point.agents),
                format!("{:.1} orders/s", point.orders_per_sec),
            );
        }
        row(
            out,
            "scaling efficiency (vs linear)",
            format!("{:.2}", self.scaling_efficiency),
        );
    }

    /// Recovery: the time after an agent's kill -9, next to its bound.
    fn recovery_row(&self, out: &mut String) {
        row(
            out,
            "recovery after agent kill -9 (s)",
            format!(
                "{:.2} (bound {:.1})",
                self.recovery_secs, self.recovery_bound_secs
            ),
        );
    }

    /// Overload: goodput, failures and latency by priority at each offered load.
    fn overload_rows(&self, out: &mut String) {
        let alone = self.overload_urgent_alone_ms;
        let alone_first = self.overload_urgent_alone_first_step_ms;
        if !self.overload.is_empty() {
            row(
                out,
                "overload: urgent orders alone (no backlog)",
                format!(
                    "p50/p99 {:.0}/{:.0} ms  (first step done p99 {:.0} ms)",
                    alone.p50, alone.p99, alone_first.p99
                ),
            );
        }
        for point in &self.overload {
            row(
                out,
                &format!(
                    "overload {:.0}x ({} orders, 1 in {} urgent, capacity {:.0}/s)",
                    point.offered_factor,
                    point.orders,
                    point.urgent_every,
                    point.capacity_orders_per_sec
                ),
                format!(
                    "goodput {:.2}  failed {}  urgent p50/p99 {:.0}/{:.0} ms ({:.1}x alone; first step done p99 {:.0} ms)  normal p50/p99 {:.0}/{:.0} ms",
                    point.goodput_fraction,
                    point.failed_or_compensated,
                    point.latency_urgent_ms.p50,
                    point.latency_urgent_ms.p99,
                    point.latency_urgent_ms.p99 / alone.p99.max(1.0),
                    point.urgent_first_step_ms.p99,
                    point.latency_normal_ms.p50,
                    point.latency_normal_ms.p99
                ),
            );
        }
    }

    /// Keyed: each run's throughput and cost, beside the plain run's.
    fn keyed_rows(&self, out: &mut String) {
        let Some(keyed) = &self.keyed else {
            return;
        };
        let plain = keyed.runs.get("plain");
        let runs = ["plain", "fixed", "adaptive"]
            .into_iter()
            .filter_map(|name| Some((name, keyed.runs.get(name)?)));
        for (name, run) in runs {
            let total = |run: &KeyedRun| run.cpu_ms_per_order.values().sum::<f64>();
            let ratio = plain
                .filter(|_| name != "plain")
                .map_or_else(String::new, |plain| {
                    format!(
                        " ({:.2}x plain's throughput, {:.2}x its CPU)",
                        run.orders_per_sec / plain.orders_per_sec.max(f64::MIN_POSITIVE),
                        total(run) / total(plain).max(f64::MIN_POSITIVE)
                    )
                });
            row(
                out,
                &format!(
                    "keyed {name}: {} orders, {} hot of {} merchants, limit {}",
                    keyed.orders, keyed.hot_merchants, keyed.merchants, keyed.limit
                ),
                format!(
                    "{:.0} orders/s  {:.2} commits/order{ratio}",
                    run.orders_per_sec, run.pg_commits_per_order
                ),
            );
            cpu_row(
                out,
                &format!("keyed {name}: cpu ms/order"),
                &run.cpu_ms_per_order,
                "",
            );
        }
    }

    /// Neighbours: the quiet tenant alone and beside the noisy one.
    fn neighbour_rows(&self, out: &mut String) {
        let Some(n) = &self.neighbours else {
            return;
        };
        row(
            out,
            &format!(
                "neighbours: quiet tenant alone ({} orders at 0.1x, capacity {:.0}/s)",
                n.quiet_orders, n.capacity_orders_per_sec
            ),
            format!(
                "p50/p99 {:.0}/{:.0} ms",
                n.quiet_alone_ms.p50, n.quiet_alone_ms.p99
            ),
        );
        row(
            out,
            &format!(
                "neighbours: quiet beside noisy at 10x ({} orders, {} stored{})",
                n.noisy_orders,
                n.noisy_stored,
                n.noisy_quota_per_sec
                    .map_or_else(String::new, |q| format!(", quota {q}/s"))
            ),
            format!(
                "p50/p99 {:.0}/{:.0} ms ({:.2}x alone)  noisy goodput {:.2}",
                n.quiet_beside_noisy_ms.p50,
                n.quiet_beside_noisy_ms.p99,
                n.quiet_beside_noisy_ms.p99 / n.quiet_alone_ms.p99.max(1.0),
                n.noisy_goodput_fraction
            ),
        );
        for beside in &n.quiet_beside_noisy_gaps {
            let alone = n
                .quiet_alone_gaps
                .iter()
                .find(|gap| gap.between == beside.between);
            row(
                out,
                &format!("neighbours: quiet {}", beside.between),
                format!(
                    "mean {:.0} ms (alone {}), max {:.0} ms",
                    beside.mean_ms,
                    alone.map_or_else(|| "-".to_owned(), |gap| format!("{:.0}", gap.mean_ms)),
                    beside.max_ms
                ),
            );
        }
    }

    /// Memory: each binary's resident memory at idle and at its peak.
    fn memory_rows(&self, out: &mut String) {
        for (binary, peak) in &self.rss_mib {
            let idle = self.rss_idle_mib.get(binary).copied().unwrap_or_default();
            row(
                out,
                &format!("rss {binary} (MiB)"),
                format!("idle {idle:.1}  peak {peak:.1}"),
            );
        }
    }
}

/// CPU per order by program, with the total first (nothing when no CPU was
/// read), and `after` behind it.
fn cpu_row(out: &mut String, name: &str, cpu: &BTreeMap<String, f64>, after: &str) {
    if cpu.is_empty() {
        return;
    }
    let total: f64 = cpu.values().sum();
    let parts: Vec<String> = cpu
        .iter()
        .map(|(program, ms)| format!("{program} {ms:.2}"))
        .collect();
    row(
        out,
        name,
        format!("{total:.2}: {}{after}", parts.join(", ")),
    );
}

/// One line of the table: the name in a column wide enough for the
/// longest, then the value.
fn row(out: &mut String, name: &str, value: String) {
    let _ = writeln!(out, "  {name:<44} {value}");
}

/// Percentiles of `samples` (milliseconds).
pub fn percentiles(mut samples: Vec<f64>) -> Latency {
    if samples.is_empty() {
        return Latency::default();
    }
    samples.sort_by(f64::total_cmp);
    let at = |q: f64| samples[((samples.len() as f64 - 1.0) * q).round() as usize];
    Latency {
        p50: at(0.50),
        p95: at(0.95),
        p99: at(0.99),
    }
}
