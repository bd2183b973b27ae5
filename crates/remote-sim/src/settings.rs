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
    /// Seconds a decided key is remembered (and listed); 0 remembers every key.
    pub keys_kept_secs: u64,
    /// Keep each deciding call's body in its ledger entry (`null` otherwise).
    pub record_bodies: bool,
    /// Payments above this amount are declined.
    pub decline_above_cents: i64,
    /// Faults applied to every service.
    pub faults: Faults,
    /// `lenient` or `strict` (see [`Provider`]).
    pub mode: Mode,
    /// Strict mode: fraction of actions answered late.
    pub late_answer_rate: f64,
    /// Strict mode: how late, in milliseconds.
    pub late_answer_ms: u64,
    /// Strict mode: what becomes of an action that arrives after its undo.
    pub late_action: LateAction,
    /// PEM certificate chain for TLS; empty serves plain HTTP.
    pub tls_cert_file: String,
    /// PEM private key of `tls_cert_file`.
    pub tls_key_file: String,
    /// Bearer token required on the service routes; empty requires none.
    pub auth_token: Secret,
    /// Bearer token required on the admin and ledger routes; empty requires none.
    pub admin_token: Secret,
}

impl SimSettings {
    /// The provider behaviour these settings start with.
    pub fn provider(&self) -> Provider {
        Provider {
            mode: self.mode,
            late_answer_rate: self.late_answer_rate,
            late_answer_ms: self.late_answer_ms,
            late_action: self.late_action,
        }
    }
}

/// How forgiving the simulated provider is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// Every key decided at once under a lock; a repeat gets the first answer
    /// even while the first call is still answering; an undo of anything is applied.
    #[default]
    Lenient,
    /// Like a real payment API: 409 while the key is in flight, late answers,
    /// 404 for the undo of a key never applied, tombstones.
    Strict,
}

/// What strict mode does with an action that arrives after its undo.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LateAction {
    /// The undo tombstoned the key: the action is refused (410), nothing applied.
    #[default]
    Refuse,
    /// The action is applied, and stays applied: what a provider without
    /// tombstones does, and why agents must not start calls late.
    Apply,
}

/// The provider behaviour; also the body of `PUT /admin/provider` (fields
/// left out take their defaults: lenient, no late answers, refuse).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Provider {
    /// `lenient` or `strict`.
    pub mode: Mode,
    /// Strict mode: fraction of actions applied at once but answered late.
    pub late_answer_rate: f64,
    /// Strict mode: how late, in milliseconds.
    pub late_answer_ms: u64,
    /// Strict mode: an action after its undo is refused or applied.
    pub late_action: LateAction,
}

impl Provider {
    /// Checks the rate.
    ///
    /// # Errors
    /// A message naming the bad field.
    pub fn validate(&self) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.late_answer_rate) {
            return Err(format!(
                "sim.late_answer_rate must be between 0 and 1 (got {})",
                self.late_answer_rate
            ));
        }
        if self.late_answer_ms > 600_000 {
            return Err("sim.late_answer_ms must be at most 600000".into());
        }
        Ok(())
    }
}

/// Refuses strict mode while keys are forgotten: strict mode answers the undo
/// of a key it does not know with 404 ("nothing was applied"), and after
/// `keys_kept_secs` it no longer knows actions it did apply, so an agent would
/// take a charge that happened for one that never did and leave it in place.
///
/// # Errors
/// A message saying which of the two settings to change.
pub fn check_forgetting(mode: Mode, keys_kept_secs: u64) -> Result<(), String> {
    if mode == Mode::Strict && keys_kept_secs > 0 {
        return Err(format!(
            "strict mode answers 404 (nothing applied) to the undo of a key it has \
             forgotten, and sim.keys_kept_secs = {keys_kept_secs} forgets applied \
             actions: set sim.keys_kept_secs = 0 or use lenient mode"
        ));
    }
    Ok(())
}

/// A secret setting: its `Debug` never shows the value.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl From<&str> for Secret {
    fn from(value: &str) -> Self {
        Self(value.to_owned())
    }
}

impl Secret {
    /// The value, or `None` when unset.
    pub fn get(&self) -> Option<&str> {
        (!self.0.is_empty()).then_some(self.0.as_str())
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() {
            "\"\""
        } else {
            "[redacted]"
        })
    }
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
        self.sim.faults.validate()?;
        self.sim.provider().validate()?;
        let sim = &self.sim;
        check_forgetting(sim.mode, sim.keys_kept_secs)?;
        match (sim.tls_cert_file.is_empty(), sim.tls_key_file.is_empty()) {
            (true, true) => {}
            (false, false) => {
                for (key, path) in [
                    ("tls_cert_file", &sim.tls_cert_file),
                    ("tls_key_file", &sim.tls_key_file),
                ] {
                    std::fs::metadata(path)
                        .and_then(|_| std::fs::File::open(path))
                        .map_err(|error| format!("sim.{key}: cannot read {path:?}: {error}"))?;
                }
            }
            _ => return Err("sim.tls_cert_file and sim.tls_key_file go together".into()),
        }
        Ok(())
    }
}

impl sas_runtime::HasLog for Settings {
    fn log(&self) -> &LogSettings {
        &self.log
    }
}
