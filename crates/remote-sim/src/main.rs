//! The `remote-sim` binary: settings, logs, then [`remote_sim::run`] until SIGTERM.

use std::process::ExitCode;

use clap::Parser;

/// Simulated inventory, payment and shipping services with configurable
/// latency and faults, idempotency-key deduplication and a record of side effects.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    service: sas_runtime::ServiceArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    sas_runtime::run_service(
        "remote-sim",
        remote_sim::settings::DEFAULTS,
        &cli.service,
        remote_sim::run,
    )
}
