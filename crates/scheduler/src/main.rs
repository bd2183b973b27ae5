//! The `scheduler` binary: settings, logs, then [`scheduler::run`] until
//! SIGTERM, or `scheduler migrate` to apply the migrations and exit.

use std::process::ExitCode;

use clap::Parser;

sas_runtime::use_jemalloc!();

/// Runs the order workflow: intake of submitted orders, one step at a time
/// through the agents, compensation when an order cannot complete.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    service: sas_runtime::ServiceArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, clap::Subcommand)]
enum Command {
    /// Apply the database migrations and exit: a one-shot job run as the
    /// database owner, so that the services can connect as a role that owns nothing.
    Migrate,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let defaults = scheduler::settings::DEFAULTS;
    match cli.command {
        None => sas_runtime::run_service("scheduler", defaults, &cli.service, scheduler::run),
        Some(Command::Migrate) => sas_runtime::run_service(
            "scheduler migrate",
            defaults,
            &cli.service,
            scheduler::migrate,
        ),
    }
}
