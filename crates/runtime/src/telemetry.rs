//! Structured logs.

use tracing_subscriber::{fmt, EnvFilter};

use crate::settings::{LogFormat, LogSettings};

/// The TLS verifier reqwest uses logs an error of its own, without the URL,
/// for every certificate it refuses; the agent logs one line with the URL
/// and the verifier's reason for each, so the verifier's is muted unless
/// the filter names it.
const QUIET_VERIFIER: &str = "rustls_platform_verifier=off";

/// Installs the global log subscriber; `RUST_LOG` overrides the configured filter.
///
/// # Errors
/// When the filter does not parse.
pub fn init(settings: &LogSettings) -> anyhow::Result<()> {
    let text = match std::env::var("RUST_LOG") {
        Ok(value) if !value.is_empty() => value,
        _ => settings.filter.clone(),
    };
    let mut filter = EnvFilter::try_new(&text)
        .map_err(|e| anyhow::anyhow!("log.filter is not a valid filter: {e}"))?;
    if !text.contains("rustls_platform_verifier") {
        filter = filter.add_directive(QUIET_VERIFIER.parse()?);
    }
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
