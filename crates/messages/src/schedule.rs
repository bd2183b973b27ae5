//! A change to a durable schedule, sent over the broker by a client that
//! may not write the state store: the HTTP gateway, on its clients'
//! behalf. It travels on the events exchange and queue (the way a client
//! already reaches the schedulers), told from an [`crate::OrderEvent`] by
//! its AMQP `type` property, [`SCHEDULE_COMMAND_TYPE`]. A scheduler applies
//! it within the sender's tenant, once per `command_id`, and records the
//! outcome, which the sender reads back (see docs/schedules.md).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::order::InvalidOrder;
use crate::SCHEMA_VERSION;

/// The AMQP `type` property of a [`ScheduleCommand`] on the events queue.
pub const SCHEDULE_COMMAND_TYPE: &str = "sas.schedule-command";
/// Longest accepted command id, in bytes.
pub const MAX_COMMAND_ID_LEN: usize = 128;
/// Longest schedule name, in bytes: its runs' order ids add a time to it.
pub const MAX_SCHEDULE_NAME_LEN: usize = 38;

/// A change to one schedule of the sender's tenant.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScheduleCommand {
    /// Must equal [`SCHEMA_VERSION`].
    #[schemars(extend("const" = SCHEMA_VERSION))]
    pub schema_version: u32,
    /// The sender's id for this command: the same id again is the same
    /// command, applied once, answered with the first outcome.
    #[schemars(length(min = 1, max = MAX_COMMAND_ID_LEN))]
    pub command_id: String,
    /// The schedule's name within the tenant.
    #[schemars(regex(pattern = "^[A-Za-z0-9_-]{1,38}$"))]
    pub schedule: String,
    /// What to do.
    pub action: ScheduleVerb,
    /// For `create` (and only then): the schedule.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub definition: Option<ScheduleDefinition>,
}

/// What a [`ScheduleCommand`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleVerb {
    /// Create it (refused when one of that name exists).
    Create,
    /// Decide no occurrence until resumed.
    Pause,
    /// Run again from the next occurrence after now.
    Resume,
    /// Start a run now.
    Trigger,
    /// Delete it: it starts nothing more.
    Delete,
}

impl ScheduleVerb {
    /// Its name on the wire and in paths.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Create => "create",
            Self::Pause => "pause",
            Self::Resume => "resume",
            Self::Trigger => "trigger",
            Self::Delete => "delete",
        }
    }
}

/// A schedule as its creator gives it; the schedulers check it as sasctl
/// and the console do (docs/schedules.md).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ScheduleDefinition {
    /// A cron expression of 5 fields or 6 (seconds first), or a nickname (`@daily`).
    pub cron: String,
    /// The IANA time zone the expression is read in (`UTC` when empty).
    #[serde(default)]
    pub time_zone: String,
    /// The order each run submits, without `order_id`.
    pub order: serde_json::Value,
    /// `skip` (when empty), `buffer_one` or `allow`.
    #[serde(default)]
    pub overlap: String,
    /// How old an occurrence may be and still start after an outage, in
    /// seconds (an hour when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub catch_up_secs: Option<u64>,
    /// Create it paused.
    #[serde(default)]
    pub paused: bool,
}

impl ScheduleCommand {
    /// Checks what the type system cannot: version, the command id and
    /// schedule name syntax, a definition exactly for `create`. The
    /// definition itself is checked by whoever applies it.
    ///
    /// # Errors
    /// [`InvalidOrder`] naming the first offending field.
    pub fn validate(&self) -> Result<(), InvalidOrder> {
        if self.schema_version != SCHEMA_VERSION {
            return Err(InvalidOrder(format!(
                "unsupported schema_version {} (this system reads {SCHEMA_VERSION})",
                self.schema_version
            )));
        }
        if self.command_id.is_empty()
            || self.command_id.len() > MAX_COMMAND_ID_LEN
            || self.command_id.chars().any(char::is_control)
        {
            return Err(InvalidOrder(format!(
                "command_id must be 1 to {MAX_COMMAND_ID_LEN} bytes without control characters"
            )));
        }
        if !is_schedule_name(&self.schedule) {
            return Err(InvalidOrder(format!(
                "schedule must be 1 to {MAX_SCHEDULE_NAME_LEN} letters, digits, '_' or '-' (got {:?})",
                self.schedule
            )));
        }
        match (self.action, &self.definition) {
            (ScheduleVerb::Create, None) => Err(InvalidOrder(
                "a create command carries the schedule's definition".into(),
            )),
            (ScheduleVerb::Create, Some(_)) | (_, None) => Ok(()),
            (action, Some(_)) => Err(InvalidOrder(format!(
                "a {} command carries no definition",
                action.as_str()
            ))),
        }
    }
}

/// True for a valid schedule name: 1 to [`MAX_SCHEDULE_NAME_LEN`] ASCII
/// letters, digits, `_` or `-`.
pub fn is_schedule_name(name: &str) -> bool {
    (1..=MAX_SCHEDULE_NAME_LEN).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command(action: ScheduleVerb, definition: Option<ScheduleDefinition>) -> ScheduleCommand {
        ScheduleCommand {
            schema_version: SCHEMA_VERSION,
            command_id: "c-1".into(),
            schedule: "nightly".into(),
            action,
            definition,
        }
    }

    fn definition() -> ScheduleDefinition {
        ScheduleDefinition {
            cron: "0 2 * * *".into(),
            time_zone: String::new(),
            order: serde_json::json!({}),
            overlap: String::new(),
            catch_up_secs: None,
            paused: false,
        }
    }

    #[test]
    fn a_definition_goes_with_create_and_nothing_else() {
        assert!(command(ScheduleVerb::Create, Some(definition()))
            .validate()
            .is_ok());
        assert!(command(ScheduleVerb::Pause, None).validate().is_ok());
        let error = command(ScheduleVerb::Create, None).validate().unwrap_err();
        assert!(error.0.contains("definition"), "{error}");
        let error = command(ScheduleVerb::Delete, Some(definition()))
            .validate()
            .unwrap_err();
        assert!(error.0.contains("delete command"), "{error}");
    }

    #[test]
    fn bad_ids_names_and_versions_are_named() {
        for (change, field) in [
            (
                (|c: &mut ScheduleCommand| c.command_id = String::new())
                    as fn(&mut ScheduleCommand),
                "command_id",
            ),
            (|c| c.command_id = "a\nb".into(), "command_id"),
            (|c| c.schedule = "a b".into(), "schedule"),
            (|c| c.schedule = "n".repeat(39), "schedule"),
            (|c| c.schema_version = 2, "schema_version"),
        ] {
            let mut bad = command(ScheduleVerb::Trigger, None);
            change(&mut bad);
            let error = bad.validate().unwrap_err();
            assert!(error.0.contains(field), "{field}: {error}");
        }
        let wire =
            r#"{"schema_version":1,"command_id":"c","schedule":"s","action":"pause","colour":1}"#;
        assert!(serde_json::from_str::<ScheduleCommand>(wire).is_err());
    }
}
