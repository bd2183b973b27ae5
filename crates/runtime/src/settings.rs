//! Layered settings: compiled-in defaults, then an optional file, then
//! environment variables `SAS_<SECTION>__<KEY>` (for example
//! `SAS_AMQP__URL`). A value ending in `_FILE` names a file whose contents
//! are the value (`SAS_DATABASE__PASSWORD_FILE=/run/secrets/db`), so secrets
//! stay out of the environment and out of images.

use std::collections::HashMap;
use std::path::Path;

use anyhow::Context;
use config::{Config, Environment, File, FileFormat};
use serde::de::DeserializeOwned;
use serde::Deserialize;

/// Checks a loaded settings tree; the message names the bad key.
pub trait Validate {
    /// # Errors
    /// A message naming the offending key and what is expected of it.
    fn validate(&self) -> Result<(), String>;
}

/// Log output format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line, for log shippers.
    Json,
}

/// The `[log]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LogSettings {
    /// `text` or `json`.
    pub format: LogFormat,
    /// A `tracing` filter such as `info` or `info,scheduler=debug`.
    pub filter: String,
    /// Where spans go over OTLP/HTTP (JSON), such as
    /// `http://otel-collector:4318`; empty (the default) exports none.
    #[serde(default)]
    pub otlp_endpoint: String,
}

/// Environment variable prefix of every setting.
pub const ENV_PREFIX: &str = "SAS";

/// Loads settings: `defaults` (TOML text), then `file` if given, then the
/// environment; then validates them.
///
/// # Errors
/// A message naming the file, the key or the variable that is wrong.
pub fn load_settings<T: DeserializeOwned + Validate>(
    defaults: &str,
    file: Option<&Path>,
) -> anyhow::Result<T> {
    // Only variables of the sections this binary has are read: a deployment
    // may share one environment between services (SAS_DATABASE__URL is
    // meaningless to an agent), while a misspelt key inside a known section
    // is still refused.
    let table: toml::Table =
        toml::from_str(defaults).context("compiled-in defaults are not TOML")?;
    let known = |key: &str| {
        key.split("__")
            .next()
            .is_some_and(|section| table.contains_key(section))
    };
    let is_setting = |key: &str| {
        let mut value: Option<&toml::Value> = None;
        for part in key.split("__") {
            value = match value {
                None => table.get(part),
                Some(toml::Value::Table(inner)) => inner.get(part),
                Some(_) => None,
            };
            if value.is_none() {
                return false;
            }
        }
        true
    };
    let mut variables = HashMap::new();
    let mut builder = Config::builder().add_source(File::from_str(defaults, FileFormat::Toml));
    if let Some(path) = file {
        builder = builder.add_source(File::from(path).format(FileFormat::Toml).required(true));
    }
    for (name, value) in std::env::vars() {
        let Some(key) = name.strip_prefix(&format!("{ENV_PREFIX}_")) else {
            continue;
        };
        let key = key.to_lowercase();
        if !known(&key) {
            continue;
        }
        // Secrets from files: SAS_X__Y_FILE=/path sets x.y to the file's contents.
        match key.strip_suffix("_file") {
            Some(secret) if !is_setting(&key) => {
                let contents = std::fs::read_to_string(&value)
                    .with_context(|| format!("cannot read {name}={value}"))?;
                builder = builder
                    .set_override(secret.replace("__", "."), contents.trim_end().to_owned())
                    .with_context(|| format!("bad setting name {name}"))?;
            }
            _ => {
                variables.insert(format!("{ENV_PREFIX}_{}", key.to_uppercase()), value);
            }
        }
    }
    let config = builder
        .add_source(
            Environment::with_prefix(ENV_PREFIX)
                .prefix_separator("_")
                .separator("__")
                .try_parsing(true)
                .ignore_empty(true)
                .source(Some(variables)),
        )
        .build()
        .context("cannot read settings")?;
    let settings: T = config.try_deserialize().map_err(|error| {
        anyhow::anyhow!(
            "invalid settings: {error} (keys map to variables as amqp.url -> SAS_AMQP__URL)"
        )
    })?;
    settings
        .validate()
        .map_err(|message| anyhow::anyhow!("invalid settings: {message}"))?;
    Ok(settings)
}

/// The `[http]` section: where the operations endpoint listens.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HttpSettings {
    /// `host:port`; port 0 picks a free one.
    pub listen: String,
    /// A PEM certificate chain: with `tls_key_file`, the service serves
    /// HTTPS only on `listen` (the console, the gateway's clients, or a
    /// service's operations endpoint; the gateway's `ops_listen` stays
    /// plain); both empty, plain HTTP.
    #[serde(default)]
    pub tls_cert_file: String,
    /// The PEM private key of `tls_cert_file`.
    #[serde(default)]
    pub tls_key_file: String,
}

impl HttpSettings {
    /// The TLS server configuration of `tls_cert_file` and `tls_key_file`,
    /// or `None` for plain HTTP.
    ///
    /// # Errors
    /// A message naming the key: one file without the other, a file that
    /// cannot be read, or a key that is not the certificate's.
    pub fn tls(&self) -> anyhow::Result<Option<rustls::ServerConfig>> {
        crate::tls::server_config("http", &self.tls_cert_file, &self.tls_key_file)
    }
}

/// `SAS_*` variables this binary does not read (their section is not one of
/// its own), such as a misspelt section or another service's settings.
///
/// `--check-config` refuses them, so that a deployment file cannot set a key
/// a service silently ignores; a normal start only logs them.
///
/// # Errors
/// When `defaults` is not TOML.
pub fn ignored_variables(defaults: &str) -> anyhow::Result<Vec<String>> {
    let table: toml::Table =
        toml::from_str(defaults).context("compiled-in defaults are not TOML")?;
    let mut ignored: Vec<String> = std::env::vars()
        .map(|(name, _)| name)
        .filter(|name| {
            let Some(key) = name.strip_prefix(&format!("{ENV_PREFIX}_")) else {
                return false;
            };
            let section = key.to_lowercase();
            let section = section.split("__").next().unwrap_or_default();
            key != "CONFIG_FILE" && !table.contains_key(section)
        })
        .collect();
    ignored.sort();
    Ok(ignored)
}
