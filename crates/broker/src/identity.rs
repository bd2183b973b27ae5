//! Who may say what: the broker users of our own services.
//!
//! RabbitMQ validates the `user_id` property of every message against the
//! user that published it, and every publisher of ours sets it (see
//! [`crate::Publisher`]). So a consumer can tell an agent's reply from a
//! client's forgery, and a service's dead letter from a client's, by
//! `user_id` alone, whatever the body and headers claim.
//!
//! [`ServiceAmqpSettings`] is the `[amqp]` section of the services that
//! judge messages by it (scheduler and supervisor): [`AmqpSettings`] plus
//! `amqp.agent_users` and `amqp.service_users`.

use std::ops::Deref;

use serde::{Deserialize, Deserializer};

use crate::AmqpSettings;

/// The `[amqp]` section of a service that trusts messages by their
/// `user_id`: the broker settings and the identities of our services.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServiceAmqpSettings {
    /// How to reach RabbitMQ.
    #[serde(flatten)]
    pub broker: AmqpSettings,
    /// Broker users our agents log in as. A reply whose `user_id` is not one
    /// of them is refused (counted, logged, dead-lettered). Empty accepts a
    /// reply from anyone, as before user ids were checked: production must
    /// set it.
    #[serde(default, deserialize_with = "string_list")]
    pub agent_users: Vec<String>,
    /// Broker users of our schedulers and supervisors. With `agent_users`,
    /// the identities whose dead letters may steer settlement. Both empty:
    /// every dead letter is trusted, as before.
    #[serde(default, deserialize_with = "string_list")]
    pub service_users: Vec<String>,
    /// Broker users of our services that send orders and events on
    /// someone else's behalf (the gateway's, the console's): their
    /// [`sas_messages::headers::SENDER`] header names the sender. Anyone
    /// else is known by its own `user_id` (see
    /// [`sas_runtime::tenancy::identity_of`]).
    #[serde(default, deserialize_with = "string_list")]
    pub delegating_users: Vec<String>,
}

impl Deref for ServiceAmqpSettings {
    type Target = AmqpSettings;

    fn deref(&self) -> &AmqpSettings {
        &self.broker
    }
}

impl ServiceAmqpSettings {
    /// Checks the broker settings and the user lists.
    ///
    /// # Errors
    /// A message naming the bad key.
    pub fn validate(&self) -> Result<(), String> {
        self.broker.validate()?;
        for (key, users) in [
            ("amqp.agent_users", &self.agent_users),
            ("amqp.service_users", &self.service_users),
            ("amqp.delegating_users", &self.delegating_users),
        ] {
            if users.iter().any(|user| user.is_empty() || user.len() > 255) {
                return Err(format!(
                    "{key} holds an empty or over-long user name: {users:?}"
                ));
            }
        }
        Ok(())
    }

    /// Whether a reply published as `user_id` may be applied.
    pub fn accepts_reply_from(&self, user_id: Option<&str>) -> bool {
        self.agent_users.is_empty() || user_id.is_some_and(|user| self.is_agent(user))
    }

    /// Whether `user` is one of `amqp.agent_users`.
    pub fn is_agent(&self, user: &str) -> bool {
        self.agent_users.iter().any(|agent| agent == user)
    }

    /// Whether `user_id` is one of our services (agents included); with
    /// neither list set, everyone is.
    pub fn is_service(&self, user_id: Option<&str>) -> bool {
        if self.agent_users.is_empty() && self.service_users.is_empty() {
            return true;
        }
        user_id.is_some_and(|user| {
            self.is_agent(user) || self.service_users.iter().any(|service| service == user)
        })
    }

    /// Whether an agent may obey a step request published as `user_id`:
    /// only the schedulers and supervisors send requests and undos, so it
    /// must be one of `amqp.service_users` (when that is set). A broker
    /// user that may write to the default exchange (the console's, which
    /// replays orders through it) could otherwise make an agent call any
    /// route of its remote with any body and key.
    pub fn accepts_request_from(&self, user_id: Option<&str>) -> bool {
        self.service_users.is_empty()
            || user_id.is_some_and(|user| self.service_users.iter().any(|service| service == user))
    }

    /// Whether the identities are checked at all (either list is set).
    pub fn checks_identities(&self) -> bool {
        !(self.agent_users.is_empty() && self.service_users.is_empty())
    }
}

/// A list of names from a TOML array or from one comma-separated string
/// (how an environment variable gives it: `SAS_AMQP__AGENT_USERS=a,b`).
pub(crate) fn string_list<'de, D: Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Names {
        List(Vec<String>),
        Joined(String),
    }
    let names = match Names::deserialize(deserializer)? {
        Names::List(names) => names,
        Names::Joined(joined) => joined.split(',').map(str::to_owned).collect(),
    };
    Ok(names
        .into_iter()
        .map(|name| name.trim().to_owned())
        .filter(|name| !name.is_empty())
        .collect())
}

#[cfg(test)]
mod tests {
    use super::ServiceAmqpSettings;

    fn settings(extra: &str) -> ServiceAmqpSettings {
        let text = format!(
            "url = \"amqp://guest:guest@127.0.0.1:5672/%2f\"\nprefix = \"\"\nprefetch = 1\n\
             operation_timeout_ms = 1000\ndelivery_limit = 3\nmax_message_bytes = 65536\n\
             reconnect_base_ms = 100\nreconnect_max_ms = 1000\n{extra}"
        );
        toml::from_str(&text).expect("settings")
    }

    #[test]
    fn without_agent_users_a_reply_from_anyone_is_accepted() {
        let open = settings("");
        assert!(open.accepts_reply_from(Some("guest")));
        assert!(open.accepts_reply_from(None));
        assert!(open.is_service(None));
        assert!(!open.checks_identities());
    }

    #[test]
    fn with_agent_users_only_their_replies_are_accepted() {
        let strict = settings(
            "agent_users = \"sas-agent, sas-agent-2\"\nservice_users = [\"sas-scheduler\"]",
        );
        assert_eq!(strict.agent_users, ["sas-agent", "sas-agent-2"]);
        assert!(strict.accepts_reply_from(Some("sas-agent-2")));
        assert!(!strict.accepts_reply_from(Some("sas-scheduler")));
        assert!(!strict.accepts_reply_from(Some("client")));
        assert!(!strict.accepts_reply_from(None));
        assert!(strict.is_service(Some("sas-scheduler")));
        assert!(strict.is_service(Some("sas-agent")));
        assert!(!strict.is_service(Some("client")));
        assert!(!strict.is_service(None));
        assert!(strict.accepts_request_from(Some("sas-scheduler")));
        assert!(!strict.accepts_request_from(Some("sas-agent")));
        assert!(!strict.accepts_request_from(Some("sas-console")));
        assert!(!strict.accepts_request_from(None));
        assert!(settings("").accepts_request_from(Some("anyone")));
    }

    #[test]
    fn a_misspelt_amqp_key_is_still_refused() {
        let text = "url = \"amqp://x\"\nprefix = \"\"\nprefetch = 1\noperation_timeout_ms = 1\n\
                    delivery_limit = 3\nmax_message_bytes = 65536\nreconnect_base_ms = 1\n\
                    reconnect_max_ms = 1\nagent_user = [\"a\"]";
        let error = toml::from_str::<ServiceAmqpSettings>(text).unwrap_err();
        assert!(error.to_string().contains("agent_user"), "{error}");
    }
}
