//! Structured logs.

use tracing_subscriber::{fmt, EnvFilter};

use crate::settings::{LogFormat, LogSettings};

/// Installs the global log subscriber; `RUST_LOG` overrides the configured filter.
///
/// # Errors
/// When the filter does not parse.
pub fn init(settings: &LogSettings) -> anyhow::Result<()> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(value) if !value.is_empty() => EnvFilter::try_new(value)?,
        _ => EnvFilter::try_new(&settings.filter)
            .map_err(|e| anyhow::anyhow!("log.filter is not a valid filter: {e}"))?,
    };
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let result = match settings.format {
        LogFormat::Text => builder.try_init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .try_init(),
    };
    result.map_err(|e| anyhow::anyhow!("cannot install the log subscriber: {e}"))
}
