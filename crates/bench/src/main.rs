//! `sas-bench`: the end-to-end benchmark (run it with `scripts/bench.sh`).
//!
//! It starts the whole system as local processes against the local RabbitMQ
//! and Postgres (its own database and queue prefix), and measures in one run:
//! the broker's and Postgres's own limits (calibration), saturation
//! throughput, latency at half saturation, scaling with agent processes while
//! the remote service is the bottleneck, recovery from an agent killed with
//! -9, overload, what limits by key cost per order, noisy neighbours, and
//! the memory of each binary. It writes a JSON report and prints a table.

mod budget;
mod calibrate;
mod drive;
mod keyed;
mod neighbours;
mod overload;
mod phases;
mod report;
mod soak;
mod system;
mod time_spent;

use std::path::PathBuf;

use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

/// Measures the system end to end and writes a JSON report.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    /// A small, fast run (used by the tests so the benchmark cannot rot).
    #[arg(long)]
    quick: bool,
    /// Where to write the JSON report.
    #[arg(long, default_value = "target/bench/latest.json")]
    out: PathBuf,
    /// A setting for every service, as `SAS_SECTION__KEY=value` (repeatable),
    /// to compare tunings in the same harness.
    #[arg(long = "set", value_name = "VAR=VALUE")]
    settings: Vec<String>,
    /// Measure latency at this many orders/s instead of half the saturation rate.
    #[arg(long, value_name = "ORDERS_PER_SEC")]
    latency_rate: Option<f64>,
    /// Seconds of load in the latency phase (default 8, 1.5 with --quick):
    /// longer gives steadier percentiles.
    #[arg(long, value_name = "SECS")]
    latency_secs: Option<f64>,
    /// Stop after the latency phase (no scaling or recovery): for tuning loops.
    #[arg(long, conflicts_with = "overload_only")]
    throughput_only: bool,
    /// Run only the overload phase (after the calibrations and a warm-up):
    /// for tuning admission control.
    #[arg(long, conflicts_with = "neighbours_only")]
    overload_only: bool,
    /// Run only the noisy-neighbour phase (after the calibrations and a
    /// warm-up): a quiet tenant alone, then beside one sending 10x what a
    /// slow remote absorbs.
    #[arg(long, conflicts_with = "throughput_only")]
    neighbours_only: bool,
    /// Run only the keyed phase (after the calibrations and a warm-up):
    /// what limits by key cost per order, fixed and adaptive, beside the
    /// same orders without.
    #[arg(long, conflicts_with_all = ["throughput_only", "overload_only", "neighbours_only"])]
    keyed_only: bool,
    /// In the noisy-neighbour phase, give the noisy tenant a quota of this
    /// many orders a second (refused beyond: `tenants.<t>.quota`, over =
    /// "refuse"), as an operator facing a noisy tenant would.
    #[arg(long, value_name = "ORDERS_PER_SEC")]
    noisy_quota: Option<f64>,
    /// One order in this many of the overload phase's 3x and 10x loads is
    /// urgent (priority 9). At the default, 10, urgent orders alone ask
    /// for the whole remote at 10x; 20 leaves them half of it.
    #[arg(long, value_name = "N", default_value_t = 10, value_parser = clap::value_parser!(u16).range(1..))]
    urgent_every: u16,
    /// Instead of the phases, the soak: this many orders at --soak-rate
    /// with retention set to --soak-retention-secs, sampled every 10 s
    /// (database size, rows per table, throughput, memory).
    #[arg(long, value_name = "ORDERS")]
    soak: Option<usize>,
    /// Orders a second in the soak.
    #[arg(long, value_name = "ORDERS_PER_SEC", default_value_t = 300.0)]
    soak_rate: f64,
    /// How long finished orders are kept in the soak.
    #[arg(long, value_name = "SECS", default_value_t = 30)]
    soak_retention_secs: u64,
}

/// How big each phase is.
#[derive(Debug, Clone, Copy)]
pub struct Sizes {
    /// Messages for the broker calibration.
    pub calibration_messages: usize,
    /// Seconds of single-row updates for the Postgres calibration.
    pub calibration_secs: f64,
    /// Orders in the saturation phase.
    pub saturation_orders: usize,
    /// Seconds of load in the latency phase.
    pub latency_secs: f64,
    /// Agent process counts of the scaling phase.
    pub scaling_agents: &'static [usize],
    /// Orders per agent process in the scaling phase.
    pub scaling_orders_per_agent: usize,
    /// Orders in flight when an agent is killed.
    pub recovery_orders: usize,
    /// Seconds each overload factor is offered.
    pub overload_offer_secs: f64,
    /// Seconds of each half of the noisy-neighbour phase.
    pub neighbours_secs: f64,
    /// Orders in each run of the keyed phase.
    pub keyed_orders: usize,
}

const FULL: Sizes = Sizes {
    calibration_messages: 20_000,
    calibration_secs: 3.0,
    saturation_orders: 5_000,
    latency_secs: 8.0,
    scaling_agents: &[1, 2, 4, 8],
    scaling_orders_per_agent: 100,
    recovery_orders: 400,
    overload_offer_secs: 5.0,
    neighbours_secs: 15.0,
    keyed_orders: 3_000,
};

const QUICK: Sizes = Sizes {
    calibration_messages: 1_000,
    calibration_secs: 0.5,
    saturation_orders: 150,
    latency_secs: 1.5,
    scaling_agents: &[1, 2],
    scaling_orders_per_agent: 15,
    recovery_orders: 60,
    overload_offer_secs: 0.5,
    neighbours_secs: 2.0,
    keyed_orders: 60,
};

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    match runtime.block_on(run(cli)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("sas-bench: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let mut sizes = if cli.quick { QUICK } else { FULL };
    if let Some(rate) = cli.latency_rate {
        anyhow::ensure!(
            rate.is_finite() && rate > 0.0,
            "--latency-rate must be a positive number of orders a second, got {rate}"
        );
    }
    if let Some(secs) = cli.latency_secs {
        anyhow::ensure!(secs > 0.0, "--latency-secs must be positive, got {secs}");
        sizes.latency_secs = secs;
    }
    let mut extra = Vec::new();
    for setting in &cli.settings {
        let (key, value) = setting
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("--set takes VAR=VALUE, got {setting:?}"))?;
        anyhow::ensure!(
            key.starts_with("SAS_"),
            "--set names a SAS_* variable, got {key:?}"
        );
        extra.push(sas_lab::Setting::Raw(
            Box::leak(key.to_owned().into_boxed_str()),
            value.to_owned(),
        ));
    }
    if cli.soak.is_some() {
        anyhow::ensure!(
            cli.soak_rate > 0.0 && cli.soak_retention_secs > 0,
            "--soak-rate and --soak-retention-secs must be positive"
        );
        extra.extend(soak::settings(cli.soak_retention_secs));
    }
    let _ = system::EXTRA.set(extra);
    if let Some(orders) = cli.soak {
        let samples = soak::run(orders, cli.soak_rate, std::time::Duration::from_secs(10)).await?;
        if let Some(dir) = cli.out.parent() {
            std::fs::create_dir_all(dir)?;
        }
        std::fs::write(&cli.out, serde_json::to_string_pretty(&samples)?)?;
        println!("soak report written to {}", cli.out.display());
        return Ok(());
    }
    let progress = ProgressBar::new(9);
    progress.set_style(
        ProgressStyle::with_template("{spinner} [{elapsed_precise}] [{bar:30}] {pos}/{len} {msg}")?
            .progress_chars("=> "),
    );
    progress.enable_steady_tick(std::time::Duration::from_millis(200));
    let options = phases::Options {
        latency_rate: cli.latency_rate,
        throughput_only: cli.throughput_only,
        overload_only: cli.overload_only,
        neighbours_only: cli.neighbours_only,
        keyed_only: cli.keyed_only,
        noisy_quota: cli.noisy_quota,
        urgent_every: usize::from(cli.urgent_every),
    };
    let report = phases::run_all(sizes, options, &progress).await?;
    progress.finish_with_message("done");
    if let Some(dir) = cli.out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    std::fs::write(&cli.out, serde_json::to_string_pretty(&report)?)?;
    println!("{}", report.table());
    println!("report written to {}", cli.out.display());
    Ok(())
}
