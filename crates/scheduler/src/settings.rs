//! The scheduler's settings (defaults in `defaults.toml`).

use sas_broker::ServiceAmqpSettings;
use sas_runtime::{HttpSettings, LogSettings, Validate};
use sas_store::{DatabaseSettings, DeadlineSettings};
use serde::Deserialize;

/// Compiled-in defaults.
pub const DEFAULTS: &str = include_str!("../defaults.toml");

/// Every setting of the scheduler.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Logs.
    pub log: LogSettings,
    /// Operations endpoint.
    pub http: HttpSettings,
    /// RabbitMQ.
    pub amqp: ServiceAmqpSettings,
    /// Postgres.
    pub database: DatabaseSettings,
    /// Deadline margins, shared with the other services (see [`sas_store::timing`]).
    pub deadlines: DeadlineSettings,
    /// The scheduler itself.
    pub scheduler: SchedulerSettings,
}

/// The `[scheduler]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SchedulerSettings {
    /// Instance id recorded as LockedBy; empty picks `scheduler-<random>`.
    pub id: String,
    /// Workflow definition file; empty uses the built-in order workflow.
    /// Give this or `workflow_dir`, not both.
    pub workflow_file: String,
    /// Folder of workflow definitions (every `*.toml` in it, one workflow
    /// each); a submission names its workflow. Empty: `workflow_file`.
    pub workflow_dir: String,
    /// How long an event for an order that does not exist is kept, waiting
    /// for the order, before it is dead-lettered, in seconds.
    pub event_ttl_secs: u64,
    /// Interval between claims of orders the supervisor sent back, in milliseconds.
    pub claim_interval_ms: u64,
    /// Most orders claimed in one transaction.
    pub claim_batch: i64,
    /// Longest wait for in-flight messages at shutdown, in milliseconds.
    pub drain_ms: u64,
    /// Orders taken from the orders queue at once (replies use `amqp.prefetch`).
    pub intake_prefetch: u16,
    /// Most orders, or replies, written in one statement.
    pub batch_max: usize,
    /// Statements of orders, and of replies, running at once.
    pub batch_workers: usize,
    /// Attempts in flight per agent allowed at first, before the supervisors
    /// have measured what the agent finishes.
    pub admission_initial: i32,
    /// The most attempts in flight per agent the limit may ever reach.
    pub admission_ceiling: i32,
    /// How long the scheduler remembers the orders it acknowledged, in
    /// seconds, to check them against the database whenever its pool
    /// replaced connections it lost (after a failover): 0 checks nothing. See
    /// [`crate::audit`].
    #[serde(default = "default_acknowledged_audit_secs")]
    pub acknowledged_audit_secs: u64,
    /// The tenancy file (see [`sas_runtime::tenancy`]): which broker user
    /// and gateway client belongs to which tenant, what each tenant may
    /// start, who holds which role. Empty: one tenant for everyone.
    #[serde(default)]
    pub tenancy_file: String,
    /// Interval between looks for due schedules, in milliseconds: how late
    /// an occurrence may start (see [`crate::schedules`]).
    #[serde(default = "default_schedule_interval_ms")]
    pub schedule_interval_ms: u64,
}

fn default_acknowledged_audit_secs() -> u64 {
    60
}

fn default_schedule_interval_ms() -> u64 {
    1000
}

impl Validate for Settings {
    fn validate(&self) -> Result<(), String> {
        self.amqp.validate()?;
        self.database.validate()?;
        self.deadlines.validate(None)?;
        if !(1..=31_536_000).contains(&self.scheduler.event_ttl_secs) {
            return Err("scheduler.event_ttl_secs must be 1 to 31536000 (a year)".into());
        }
        if self.scheduler.claim_interval_ms == 0 {
            return Err("scheduler.claim_interval_ms must be positive".into());
        }
        if !(10..=60_000).contains(&self.scheduler.schedule_interval_ms) {
            return Err("scheduler.schedule_interval_ms must be 10 to 60000 (a minute): an occurrence may start that late".into());
        }
        if self.scheduler.acknowledged_audit_secs > 3600 {
            return Err(
                "scheduler.acknowledged_audit_secs must be at most 3600: the scheduler keeps every order id it acknowledged that long in memory"
                    .into(),
            );
        }
        if !(1..=1000).contains(&self.scheduler.claim_batch) {
            return Err("scheduler.claim_batch must be between 1 and 1000".into());
        }
        if self.scheduler.admission_initial < 1
            || self.scheduler.admission_ceiling < self.scheduler.admission_initial
        {
            return Err("scheduler.admission_initial must be at least 1 and at most scheduler.admission_ceiling".into());
        }
        if self.scheduler.intake_prefetch == 0 {
            return Err("scheduler.intake_prefetch must be at least 1".into());
        }
        // The batch statements join their rows by nested loops: keep them small.
        if !(1..=256).contains(&self.scheduler.batch_max) {
            return Err("scheduler.batch_max must be between 1 and 256".into());
        }
        if !(1..=64).contains(&self.scheduler.batch_workers) {
            return Err("scheduler.batch_workers must be between 1 and 64".into());
        }
        Ok(())
    }
}

impl sas_runtime::HasLog for Settings {
    fn log(&self) -> &LogSettings {
        &self.log
    }
}
