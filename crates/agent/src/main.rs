//! The `agent` binary: settings, logs, then [`agent::run`] until SIGTERM.

use std::process::ExitCode;

use clap::Parser;

sas_runtime::use_jemalloc!();

/// Serves one agent queue: calls the remote service for each step request
/// (retries within the deadline, idempotency key, circuit breaker) and replies.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    service: sas_runtime::ServiceArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    sas_runtime::run_service("agent", agent::settings::DEFAULTS, &cli.service, agent::run)
}
