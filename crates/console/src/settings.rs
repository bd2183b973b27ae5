//! The console's settings (defaults in `defaults.toml`).

use sas_broker::AmqpSettings;
use sas_runtime::{HttpSettings, LogSettings, Validate};
use sas_store::{DatabaseSettings, DeadlineSettings};
use serde::Deserialize;

use crate::auth::{parse_users, Role};

/// Compiled-in defaults.
pub const DEFAULTS: &str = include_str!("../defaults.toml");

/// Every setting of the console.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Logs.
    pub log: LogSettings,
    /// Where the pages, the API and the operations endpoints are served.
    pub http: HttpSettings,
    /// RabbitMQ: status messages of actions, replays, queue depths.
    pub amqp: AmqpSettings,
    /// Postgres, the state store the console reads and acts through.
    pub database: DatabaseSettings,
    /// The deployment's deadlines, as the scheduler and the supervisor have
    /// them: a cancel from the console names, and holds the order until,
    /// the time an undo may go by them, and its key lines count an attempt
    /// let go of for as long as the scheduler does.
    pub deadlines: DeadlineSettings,
    /// The console itself.
    pub console: ConsoleSettings,
}

/// The `[console]` section.
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleSettings {
    /// `name:role:secret` entries (see [`parse_users`]); a secret.
    pub users: String,
    /// Role of requests without credentials: `none` or `viewer`.
    pub anonymous: String,
    /// Key of the CSRF tokens; empty picks a random one at start.
    pub csrf_key: String,
    /// Failed logins allowed per minute per client address and per name.
    pub login_failures_per_minute: u32,
    /// Longest a page or API request may take, in milliseconds.
    pub request_timeout_ms: u64,
    /// Orders per page of the list.
    pub page_size: i64,
    /// Most orders one bulk action goes through (and one move of waiting
    /// orders looks at).
    pub bulk_limit: i64,
    /// How often the live pages look for changes, in milliseconds.
    pub live_interval_ms: u64,
    /// Instance name; empty picks `console-<random>`.
    pub id: String,
    /// The schedulers' tenancy file (see [`sas_runtime::tenancy`]): the
    /// roles a console user holds, so that *Send &lt;event&gt;* is refused at
    /// once to an operator whom the wait does not accept. Empty: every
    /// operator may send every event (as the schedulers then decide).
    #[serde(default)]
    pub tenancy_file: String,
}

impl std::fmt::Debug for ConsoleSettings {
    /// Secrets (the users' and the CSRF key) never reach a log line.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConsoleSettings")
            .field("users", &"<redacted>")
            .field("anonymous", &self.anonymous)
            .field("tenancy_file", &self.tenancy_file)
            .field("csrf_key", &"<redacted>")
            .field("login_failures_per_minute", &self.login_failures_per_minute)
            .field("request_timeout_ms", &self.request_timeout_ms)
            .field("page_size", &self.page_size)
            .field("bulk_limit", &self.bulk_limit)
            .field("live_interval_ms", &self.live_interval_ms)
            .field("id", &self.id)
            .finish()
    }
}

impl ConsoleSettings {
    /// The role of requests without credentials, if any.
    ///
    /// # Errors
    /// A message naming `console.anonymous` when it is neither `none` nor `viewer`.
    pub fn anonymous_role(&self) -> Result<Option<Role>, String> {
        match self.anonymous.as_str() {
            "none" => Ok(None),
            "viewer" => Ok(Some(Role::Viewer)),
            other => Err(format!(
                "console.anonymous must be \"none\" or \"viewer\" (got {other:?}); anonymous operators are not allowed"
            )),
        }
    }
}

impl Validate for Settings {
    fn validate(&self) -> Result<(), String> {
        self.amqp.validate()?;
        self.database.validate()?;
        self.deadlines.validate(None)?;
        let c = &self.console;
        let users = parse_users(&c.users)?;
        let anonymous = c.anonymous_role()?;
        if users.is_empty() && anonymous.is_none() {
            return Err("console.users is empty and console.anonymous is \"none\": nobody could use the console; \
                        set SAS_CONSOLE__USERS_FILE to a file of name:role:secret lines"
                .into());
        }
        if !(1..=sas_store::reads::search::MAX_PAGE).contains(&c.page_size) {
            return Err(format!(
                "console.page_size must be between 1 and {}",
                sas_store::reads::search::MAX_PAGE
            ));
        }
        if !(1..=1_000_000).contains(&c.bulk_limit) {
            return Err("console.bulk_limit must be between 1 and 1000000".into());
        }
        if c.live_interval_ms < 100 {
            return Err("console.live_interval_ms must be at least 100".into());
        }
        if c.request_timeout_ms < 1000 {
            return Err("console.request_timeout_ms must be at least 1000".into());
        }
        if !c.csrf_key.is_empty() && c.csrf_key.len() < 16 {
            return Err("console.csrf_key must be empty (random) or at least 16 characters".into());
        }
        Ok(())
    }
}

impl sas_runtime::HasLog for Settings {
    fn log(&self) -> &LogSettings {
        &self.log
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(users: &str, anonymous: &str) -> Settings {
        let mut table: toml::Table = toml::from_str(DEFAULTS).unwrap();
        let console = table["console"].as_table_mut().unwrap();
        console.insert("users".into(), users.into());
        console.insert("anonymous".into(), anonymous.into());
        table.try_into().unwrap()
    }

    #[test]
    fn the_defaults_refuse_to_start_a_console_nobody_may_use() {
        let error = settings("", "none").validate().unwrap_err();
        assert!(error.contains("SAS_CONSOLE__USERS_FILE"), "{error}");
        assert!(settings("", "viewer").validate().is_ok());
        assert!(settings("ann:operator:0123456789abcdef", "none")
            .validate()
            .is_ok());
    }

    #[test]
    fn anonymous_operators_are_refused() {
        let error = settings("", "operator").validate().unwrap_err();
        assert!(error.contains("console.anonymous"), "{error}");
    }

    #[test]
    fn secrets_stay_out_of_debug_output() {
        let text = format!("{:?}", settings("ann:operator:0123456789abcdef", "none"));
        assert!(!text.contains("0123456789abcdef"), "{text}");
    }
}
