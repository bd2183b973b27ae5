//! The supervisor's settings (defaults in `defaults.toml`).

use std::time::Duration;

use sas_broker::ServiceAmqpSettings;
use sas_runtime::{HttpSettings, LogSettings, Validate};
use sas_store::writes::recovery::RecoveryPolicy;
use sas_store::{DatabaseSettings, DeadlineSettings};
use serde::Deserialize;

/// Compiled-in defaults.
pub const DEFAULTS: &str = include_str!("../defaults.toml");

/// Every setting of the supervisor.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Logs.
    pub log: LogSettings,
    /// Operations endpoint.
    pub http: HttpSettings,
    /// RabbitMQ (status messages and dead-letter records).
    pub amqp: ServiceAmqpSettings,
    /// Postgres.
    pub database: DatabaseSettings,
    /// Deadline margins, shared with the other services (see [`sas_store::timing`]).
    pub deadlines: DeadlineSettings,
    /// The supervisor itself.
    pub supervisor: SupervisorSettings,
    /// What is deleted, and when.
    pub retention: RetentionSettings,
}

/// The `[retention]` section: a deployment that runs for years must not
/// keep every order and dead letter for ever.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionSettings {
    /// Seconds after it finished that an order (processed, compensated, or
    /// in error with no open alert) is deleted with its steps, history and
    /// alerts; 0 keeps every order.
    pub finished_secs: u64,
    /// Seconds after it was recorded that a dead letter is deleted; 0 keeps
    /// every dead letter.
    pub dead_letters_secs: u64,
    /// How often to look, in milliseconds (at once again while batches come
    /// back full).
    pub interval_ms: u64,
    /// Most orders, or dead letters, deleted per transaction.
    pub batch: i32,
}

impl RetentionSettings {
    /// The policy for the store, with 0 meaning "keep".
    pub fn retention(&self) -> sas_store::writes::retention::Retention {
        let age = |secs: u64| (secs > 0).then(|| Duration::from_secs(secs));
        sas_store::writes::retention::Retention {
            finished: age(self.finished_secs),
            dead_letters: age(self.dead_letters_secs),
            batch: self.batch,
        }
    }
}

/// The `[supervisor]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SupervisorSettings {
    /// Instance id; empty picks `supervisor-<random>`.
    pub id: String,
    /// Scan interval, in milliseconds.
    pub interval_ms: u64,
    /// Most orders recovered per transaction.
    pub batch: i64,
    /// Failures tolerated before compensation.
    pub max_failures: i32,
    /// First retry wait, in milliseconds.
    pub backoff_base_ms: u64,
    /// Longest retry wait, in milliseconds.
    pub backoff_max_ms: u64,
    /// Longest wait for in-flight work at shutdown, in milliseconds.
    pub drain_ms: u64,
    /// Length of the window over which an agent's completions are measured
    /// before its admission limit is adapted, in milliseconds.
    pub admission_window_ms: u64,
    /// Share of a step's deadline that admitted attempts may spend queued and
    /// running: the limit is completions/s × deadline × this.
    pub admission_deadline_share: f64,
    /// How often the admission counters are recounted from the orders and
    /// corrected if they drifted, in milliseconds.
    pub admission_reconcile_ms: u64,
    /// Key lines of the workflows' concurrency limits that get gauges of
    /// their own, labelled with the key: names or prefixes, separated by
    /// commas (`payment:m-1,partner_api`). Empty: none, only the totals (a
    /// label per merchant could be a million series).
    #[serde(default)]
    pub key_metrics: String,
}

impl SupervisorSettings {
    /// The prefixes of `key_metrics`: the key lines exported with a label.
    pub fn key_metric_prefixes(&self) -> Vec<String> {
        self.key_metrics
            .split(',')
            .map(str::trim)
            .filter(|prefix| !prefix.is_empty())
            .map(str::to_owned)
            .collect()
    }

    /// How admission limits are adapted.
    pub fn adaptation(&self) -> sas_store::admission::Adaptation {
        sas_store::admission::Adaptation {
            window: Duration::from_millis(self.admission_window_ms),
            deadline_share: self.admission_deadline_share,
        }
    }
}

impl SupervisorSettings {
    /// The recovery policy these settings describe.
    pub fn policy(&self, deadlines: &DeadlineSettings) -> RecoveryPolicy {
        RecoveryPolicy {
            max_failures: self.max_failures,
            backoff: sas_runtime::Backoff::new(
                Duration::from_millis(self.backoff_base_ms),
                Duration::from_millis(self.backoff_max_ms),
                sas_runtime::Jitter::Equal,
            ),
            grace: deadlines.grace(),
        }
    }
}

impl Validate for Settings {
    fn validate(&self) -> Result<(), String> {
        self.amqp.validate()?;
        self.database.validate()?;
        self.deadlines.validate(None)?;
        let s = &self.supervisor;
        if s.interval_ms == 0 {
            return Err("supervisor.interval_ms must be positive".into());
        }
        if !(1..=10_000).contains(&s.batch) {
            return Err("supervisor.batch must be between 1 and 10000".into());
        }
        if s.admission_reconcile_ms == 0 {
            return Err("supervisor.admission_reconcile_ms must be positive".into());
        }
        if s.admission_window_ms == 0 || !(0.05..=1.0).contains(&s.admission_deadline_share) {
            return Err("supervisor.admission_window_ms must be positive and supervisor.admission_deadline_share between 0.05 and 1".into());
        }
        if s.max_failures < 0 {
            return Err("supervisor.max_failures must not be negative".into());
        }
        let r = &self.retention;
        if r.interval_ms == 0 || !(1..=10_000).contains(&r.batch) {
            return Err(
                "retention.interval_ms must be positive and retention.batch between 1 and 10000"
                    .into(),
            );
        }
        if s.backoff_base_ms == 0 || s.backoff_max_ms < s.backoff_base_ms {
            return Err(
                "supervisor.backoff_base_ms must be positive and at most supervisor.backoff_max_ms"
                    .into(),
            );
        }
        Ok(())
    }
}

impl sas_runtime::HasLog for Settings {
    fn log(&self) -> &LogSettings {
        &self.log
    }
}
