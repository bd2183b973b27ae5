//! The `main` of every service.

use std::future::Future;
use std::path::PathBuf;
use std::process::ExitCode;

use serde::de::DeserializeOwned;
use tokio_util::sync::CancellationToken;

use crate::settings::{load_settings, LogSettings, Validate};

/// Command-line arguments every service accepts.
#[derive(Debug, Clone, clap::Args)]
pub struct ServiceArgs {
    /// Settings file (TOML). Values from `SAS_*` environment variables override it.
    #[arg(long, short = 'c', env = "SAS_CONFIG_FILE", value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Load and validate the settings and exit: 0 when valid, 2 when a value
    /// is bad or a `SAS_*` variable names no setting of this binary.
    #[arg(long)]
    pub check_config: bool,
}

/// Settings that carry a `[log]` section.
pub trait HasLog {
    /// The `[log]` section.
    fn log(&self) -> &LogSettings;
}

/// Runs a service: loads and validates settings (or only checks them), sets up
/// logs, then runs `run(settings, shutdown)` on a multi-threaded runtime until
/// it returns; `shutdown` fires on SIGTERM or SIGINT.
pub fn run_service<S, F, Fut>(name: &str, defaults: &str, args: &ServiceArgs, run: F) -> ExitCode
where
    S: DeserializeOwned + Validate + HasLog + std::fmt::Debug,
    F: FnOnce(S, CancellationToken) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let settings: S = match load_settings(defaults, args.config.as_deref()) {
        Ok(settings) => settings,
        Err(error) => {
            eprintln!("{name}: {error:#}");
            return ExitCode::from(2);
        }
    };
    let ignored = crate::settings::ignored_variables(defaults).unwrap_or_default();
    if args.check_config {
        if !ignored.is_empty() {
            eprintln!(
                "{name}: these variables name no setting of {name}: {}",
                ignored.join(", ")
            );
            return ExitCode::from(2);
        }
        println!("{name}: settings are valid");
        return ExitCode::SUCCESS;
    }
    if let Err(error) = crate::telemetry::init(settings.log(), name) {
        eprintln!("{name}: {error:#}");
        return ExitCode::from(2);
    }
    if !ignored.is_empty() {
        tracing::info!(variables = %ignored.join(","), "ignoring variables of sections {name} does not have");
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("{name}: cannot start the async runtime: {error}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async move {
        let shutdown = crate::shutdown::on_signal();
        run(settings, shutdown).await
    });
    crate::telemetry::flush();
    match result {
        Ok(()) => {
            tracing::info!("{name} stopped");
            ExitCode::SUCCESS
        }
        Err(error) => {
            tracing::error!(error = format!("{error:#}"), "{name} failed");
            eprintln!("{name}: {error:#}");
            ExitCode::FAILURE
        }
    }
}
