//! The `console` binary: settings, logs, then [`sas_console::run`] until
//! SIGTERM; or `console hash-secret`, which prints the hash to store in
//! `console.users` in place of a secret.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The operator console: pages and a JSON API to find orders, follow them,
/// resubmit or cancel them (one or by filter), and deal with alerts and
/// dead letters.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(flatten)]
    service: sas_runtime::ServiceArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Read a secret from standard input (one line) and print its argon2id
    /// hash, to put in console.users as name:role:HASH (exit 2 when the
    /// secret is shorter than 16 characters).
    HashSecret,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::HashSecret) = cli.command {
        return sas_runtime::secret::hash_secret_command("console");
    }
    sas_runtime::run_service(
        "console",
        sas_console::settings::DEFAULTS,
        &cli.service,
        sas_console::run,
    )
}
