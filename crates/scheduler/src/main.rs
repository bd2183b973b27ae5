//! The `scheduler` binary: settings, logs, then [`scheduler::run`] until SIGTERM.

use std::process::ExitCode;

use clap::Parser;

/// Runs the order workflow: intake of submitted orders, one step at a time
/// through the agents, compensation when an order cannot complete.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    service: sas_runtime::ServiceArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    sas_runtime::run_service(
        "scheduler",
        scheduler::settings::DEFAULTS,
        &cli.service,
        scheduler::run,
    )
}
