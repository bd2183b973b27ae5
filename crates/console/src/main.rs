//! The `console` binary: settings, logs, then [`sas_console::run`] until SIGTERM.

use std::process::ExitCode;

use clap::Parser;

/// The operator console: pages and a JSON API to find orders, follow them,
/// resubmit or cancel them (one or by filter), and deal with alerts and
/// dead letters.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    service: sas_runtime::ServiceArgs,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    sas_runtime::run_service(
        "console",
        sas_console::settings::DEFAULTS,
        &cli.service,
        sas_console::run,
    )
}
