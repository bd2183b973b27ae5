//! remote-sim's settings (defaults in `defaults.toml`).

use sas_runtime::{HttpSettings, LogSettings, Validate};
use serde::{Deserialize, Serialize};

/// Compiled-in defaults.
pub const DEFAULTS: &str = include_str!("../defaults.toml");

/// Every setting of remote-sim.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Logs.
    pub log: LogSettings,
    /// Where it listens.
    pub http: HttpSettings,
    /// The simulation.
    pub sim: SimSettings,
}

/// The `[sim]` section.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimSettings {
    /// Seed of the fault dice; 0 seeds from the clock.
    pub seed: u64,
    /// Journal of applied side effects; empty keeps them in memory.
    pub journal_file: String,
    /// Payments above this amount are declined.
    pub decline_above_cents: i64,
    /// Faults applied to every service.
    pub faults: Faults,
}

/// Latency and fault rates; also the body of `PUT /admin/faults`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Faults {
    /// Added to every call, in milliseconds.
    pub latency_ms: u64,
    /// Probability of a 503 before anything is applied.
    pub transient_fault_rate: f64,
    /// Probability that a new key is refused for good (422).
    pub permanent_fault_rate: f64,
    /// Probability that a call applies its effect and never answers.
    pub hang_rate: f64,
}

impl Faults {
    /// Checks that every rate is a probability.
    ///
    /// # Errors
    /// A message naming the bad field.
    pub fn validate(&self) -> Result<(), String> {
        for (name, rate) in [
            ("transient_fault_rate", self.transient_fault_rate),
            ("permanent_fault_rate", self.permanent_fault_rate),
            ("hang_rate", self.hang_rate),
        ] {
            if !(0.0..=1.0).contains(&rate) {
                return Err(format!(
                    "sim.faults.{name} must be between 0 and 1 (got {rate})"
                ));
            }
        }
        if self.transient_fault_rate + self.permanent_fault_rate + self.hang_rate > 1.0 {
            return Err("the sum of sim.faults rates must not exceed 1".into());
        }
        Ok(())
    }
}

impl Validate for Settings {
    fn validate(&self) -> Result<(), String> {
        self.sim.faults.validate()
    }
}

impl sas_runtime::HasLog for Settings {
    fn log(&self) -> &LogSettings {
        &self.log
    }
}
