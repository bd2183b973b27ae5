//! The `gateway` binary: settings, logs, then [`sas_gateway::run`] until
//! SIGTERM; `gateway hash-secret` prints the hash to store in
//! `gateway.clients`; `gateway openapi` prints the OpenAPI document.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// The HTTP gateway: submit orders and follow them over HTTP, for clients
/// that do not speak AMQP.
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
    /// Read a client secret from standard input (one line) and print its
    /// argon2id hash, to put in gateway.clients as name:HASH (exit 2 when
    /// the secret is shorter than 16 characters).
    HashSecret,
    /// Print the OpenAPI document of the client API (contract/openapi.json).
    Openapi,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Some(Command::HashSecret) => sas_runtime::secret::hash_secret_command("gateway"),
        Some(Command::Openapi) => {
            print!("{}", sas_gateway::openapi::text());
            ExitCode::SUCCESS
        }
        None => sas_runtime::run_service(
            "gateway",
            sas_gateway::settings::DEFAULTS,
            &cli.service,
            sas_gateway::run,
        ),
    }
}
