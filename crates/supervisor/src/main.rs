//! The `supervisor` binary: settings, logs, then [`supervisor::run`] until SIGTERM.

use std::process::ExitCode;

use clap::Parser;

/// Finds steps whose complete-by has passed and retries them with backoff or
/// starts compensation; records dead letters; raises operator alerts.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    service: sas_runtime::ServiceArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    sas_runtime::run_service(
        "supervisor",
        supervisor::settings::DEFAULTS,
        &cli.service,
        supervisor::run,
    )
}
