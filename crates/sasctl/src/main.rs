//! The `sasctl` binary: parses the command line and runs [`sasctl::run`].

use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    let cli = sasctl::Cli::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("sasctl: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(sasctl::run(cli)) {
        Ok(code) => code,
        Err(error) => {
            eprintln!("sasctl: {error:#}");
            ExitCode::FAILURE
        }
    }
}
