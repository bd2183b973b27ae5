//! Tenants: which client identity belongs to which tenant, which workflows
//! and priorities each tenant may use, and who holds which role (a wait
//! step may accept its event only from a role).
//!
//! An identity is written `<kind>:<name>`: `amqp:<broker user>` (the
//! `user_id` RabbitMQ validated), `gateway:<client>` (a gateway client),
//! `console:<user>` (a console user: an operator, who acts on every
//! tenant's orders, by the console's own roles). The schedulers and the
//! gateway read the same file (`tenancy.file`):
//!
//! ```toml
//! [tenants.shop]
//! members = ["amqp:shop", "gateway:shop"]
//! workflows = ["order", "large_order"]   # left out: every workflow
//! max_priority = 5                       # left out: 9
//! weight = 2                             # left out: 1
//! quota = { per_second = 20, burst = 40, over = "queue", max_wait_secs = 600 }
//!
//! [roles]
//! approver = ["gateway:shop-manager", "console:ann"]
//! ```
//!
//! With no file, tenancy is open: every identity belongs to the tenant
//! [`DEFAULT_TENANT`] and may use every workflow and priority, as before
//! tenants existed.

use std::collections::{BTreeMap, BTreeSet};

use sas_messages::ids::{is_tenant_name, DEFAULT_TENANT};
use sas_messages::order::MAX_PRIORITY;
use serde::Deserialize;

/// The principal every sender holds when tenancy is open (no file): a wait
/// step's `senders` then accept everyone, as before tenants existed.
pub const ANYONE: &str = "*";

/// The highest weight a tenant may have (`tenants.<t>.weight`).
pub const MAX_WEIGHT: u16 = 1000;

/// The kinds of identity, as an identity's text starts.
pub const IDENTITY_KINDS: [&str; 3] = ["amqp", "gateway", "console"];

/// The file as written.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenancyFile {
    #[serde(default)]
    tenants: BTreeMap<String, TenantFile>,
    #[serde(default)]
    roles: BTreeMap<String, Vec<String>>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct TenantFile {
    #[serde(default)]
    members: Vec<String>,
    #[serde(default)]
    workflows: Option<Vec<String>>,
    #[serde(default)]
    max_priority: Option<u8>,
    #[serde(default)]
    weight: Option<u16>,
    #[serde(default)]
    quota: Option<QuotaFile>,
}

/// `tenants.<t>.quota` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct QuotaFile {
    per_second: f64,
    #[serde(default)]
    burst: Option<u32>,
    #[serde(default)]
    over: OverQuota,
    #[serde(default)]
    max_wait_secs: Option<u32>,
}

/// What becomes of an order over its tenant's quota.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OverQuota {
    /// Rejected at intake, the reason saying when to send again: the
    /// client decides (the default: nothing waits that nobody asked to).
    #[default]
    Refuse,
    /// Stored, answered `received`, and started when the quota allows,
    /// if that is within `max_wait_secs`; refused beyond it.
    Queue,
}

/// The most orders a second a quota may allow: beyond it, a quota is
/// no limit (a turn is a microsecond).
pub const MAX_QUOTA_PER_SECOND: f64 = 100_000.0;

/// The fewest orders a second a quota may allow: one in 1,000 s.
pub const MIN_QUOTA_PER_SECOND: f64 = 0.001;

/// The longest a burst may be worth at the sustained rate, in seconds
/// (`(burst - 1) / per_second`): a year, so that every time the quota
/// computes stays in Postgres's range.
pub const MAX_QUOTA_BURST_SECS: f64 = 31_536_000.0;

/// The longest a queued order may be held back (`max_wait_secs`): a day.
pub const MAX_QUOTA_WAIT_SECS: u32 = 86_400;

/// How many orders a tenant may start (`tenants.<t>.quota`), shared by
/// every scheduler through the store: a tenant's burst costs the others
/// nothing past the lines' turns, and its bill stays what it bought.
#[derive(Debug, Clone, PartialEq)]
pub struct Quota {
    /// Orders a second, sustained.
    pub per_second: f64,
    /// Orders at once after a quiet spell (at least 1).
    pub burst: u32,
    /// Refused or queued when over.
    pub over: OverQuota,
    /// How far ahead a queued order may be placed; an order that would
    /// wait longer is refused. 0 with [`OverQuota::Refuse`].
    pub max_wait: std::time::Duration,
}

impl Quota {
    /// The time between two orders at the sustained rate.
    pub fn emission(&self) -> std::time::Duration {
        std::time::Duration::from_secs_f64(1.0 / self.per_second)
    }

    /// How early an order of a burst may start: `burst - 1` emissions.
    pub fn tolerance(&self) -> std::time::Duration {
        self.emission() * (self.burst - 1)
    }

    /// Checks a quota as written, naming the key.
    fn from_file(tenant: &str, file: QuotaFile) -> Result<Self, String> {
        let key = format!("tenants.{tenant}.quota");
        if !(file.per_second.is_finite()
            && (MIN_QUOTA_PER_SECOND..=MAX_QUOTA_PER_SECOND).contains(&file.per_second))
        {
            return Err(format!(
                "{key}.per_second is {}; give {MIN_QUOTA_PER_SECOND} to {MAX_QUOTA_PER_SECOND} orders a second",
                file.per_second
            ));
        }
        // A burst of one second's worth (at least 1) unless said.
        let burst = file
            .burst
            .unwrap_or_else(|| (file.per_second.ceil() as u32).max(1));
        if burst == 0 || burst > 1_000_000 {
            return Err(format!(
                "{key}.burst is {burst}; give 1 to 1000000 orders at once"
            ));
        }
        if f64::from(burst - 1) / file.per_second > MAX_QUOTA_BURST_SECS {
            return Err(format!(
                "{key}.burst of {burst} at {} a second is worth more than a year of orders: give a smaller burst",
                file.per_second
            ));
        }
        let max_wait_secs = match (file.over, file.max_wait_secs) {
            (OverQuota::Refuse, None) => 0,
            (OverQuota::Refuse, Some(_)) => {
                return Err(format!(
                    "{key}.max_wait_secs is for over = \"queue\"; a refused order waits for nothing"
                ))
            }
            (OverQuota::Queue, wait) => wait.unwrap_or(600),
        };
        if max_wait_secs > MAX_QUOTA_WAIT_SECS {
            return Err(format!(
                "{key}.max_wait_secs is {max_wait_secs}; an order waits at most {MAX_QUOTA_WAIT_SECS} s (a day)"
            ));
        }
        Ok(Self {
            per_second: file.per_second,
            burst,
            over: file.over,
            max_wait: std::time::Duration::from_secs(u64::from(max_wait_secs)),
        })
    }
}

/// What one tenant may do.
#[derive(Debug, Clone, PartialEq)]
pub struct Tenant {
    /// The workflows its clients may start; `None`: every one.
    pub workflows: Option<BTreeSet<String>>,
    /// The highest priority its orders may ask for.
    pub max_priority: u8,
    /// Its share of each agent's line against other tenants' busy orders
    /// of the same priority: a tenant of weight 2 takes two turns for one
    /// of weight 1 (migration 0027).
    pub weight: u16,
    /// How many orders it may start, if it is capped.
    pub quota: Option<Quota>,
}

/// Who sent a message or a request, as far as the deployment can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sender {
    /// `amqp:<user>`, `gateway:<client>` or `console:<user>`.
    pub identity: String,
    /// The tenant it belongs to; `None` for an operator (a console user)
    /// and for an identity the file gives to no tenant.
    pub tenant: Option<String>,
    /// What a wait step's `senders` may name it by: the identity,
    /// `tenant:<tenant>`, `role:<role>` for each role it holds.
    pub principals: Vec<String>,
}

impl Sender {
    /// True for a console user: an operator acts on every tenant's orders
    /// (addressing them by their stored ids, `ord-1@shop`).
    pub fn is_operator(&self) -> bool {
        self.identity.starts_with("console:")
    }
}

/// The deployment's tenants and roles (see the module docs).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Tenancy {
    configured: bool,
    tenants: BTreeMap<String, Tenant>,
    members: BTreeMap<String, String>,
    roles: BTreeMap<String, BTreeSet<String>>,
}

impl Tenancy {
    /// No tenancy file: one tenant, [`DEFAULT_TENANT`], for everyone.
    pub fn open() -> Self {
        Self::default()
    }

    /// Reads `tenancy.file` at `path`; an empty path is [`Tenancy::open`].
    ///
    /// # Errors
    /// A message naming the file and what in it is wrong.
    pub fn load(path: &str) -> Result<Self, String> {
        if path.is_empty() {
            return Ok(Self::open());
        }
        let text = std::fs::read_to_string(path)
            .map_err(|error| format!("cannot read tenancy.file {path}: {error}"))?;
        Self::parse(&text).map_err(|error| format!("tenancy.file {path}: {error}"))
    }

    /// Reads a tenancy file's text.
    ///
    /// # Errors
    /// A message naming what is wrong: an unknown key, a bad tenant or
    /// role name, an identity that is not `<kind>:<name>`, an identity in
    /// two tenants, a priority over the highest.
    pub fn parse(text: &str) -> Result<Self, String> {
        let file: TenancyFile = toml::from_str(text).map_err(|error| error.to_string())?;
        let mut tenancy = Self {
            configured: true,
            ..Self::default()
        };
        for (name, tenant) in file.tenants {
            if !is_tenant_name(&name) {
                return Err(format!(
                    "tenant name {name:?} must be 1 to 32 of a-z 0-9 - _"
                ));
            }
            let max_priority = tenant.max_priority.unwrap_or(MAX_PRIORITY);
            if max_priority > MAX_PRIORITY {
                return Err(format!(
                    "tenants.{name}.max_priority is {max_priority}; the highest priority is {MAX_PRIORITY}"
                ));
            }
            let weight = tenant.weight.unwrap_or(1);
            if !(1..=MAX_WEIGHT).contains(&weight) {
                return Err(format!(
                    "tenants.{name}.weight is {weight}; a weight is 1 to {MAX_WEIGHT}"
                ));
            }
            let quota = tenant
                .quota
                .map(|quota| Quota::from_file(&name, quota))
                .transpose()?;
            for member in tenant.members {
                check_identity(&member, &format!("tenants.{name}.members"))?;
                if member.starts_with("console:") {
                    return Err(format!("tenants.{name}.members names {member}: console users are operators of every tenant, members of none"));
                }
                if let Some(other) = tenancy.members.insert(member.clone(), name.clone()) {
                    return Err(format!(
                        "{member} is a member of two tenants ({other} and {name}): give it one"
                    ));
                }
            }
            tenancy.tenants.insert(
                name,
                Tenant {
                    workflows: tenant.workflows.map(|w| w.into_iter().collect()),
                    max_priority,
                    weight,
                    quota,
                },
            );
        }
        for (role, holders) in file.roles {
            if !is_tenant_name(&role) {
                return Err(format!("role name {role:?} must be 1 to 32 of a-z 0-9 - _"));
            }
            for holder in holders {
                check_identity(&holder, &format!("roles.{role}"))?;
                tenancy
                    .roles
                    .entry(holder)
                    .or_default()
                    .insert(role.clone());
            }
        }
        Ok(tenancy)
    }

    /// Each tenant and its weight in the agents' lines, for the store
    /// (`Store::register_tenants`); none when tenancy is open, whose one
    /// tenant's orders keep the order they came in.
    pub fn weights(&self) -> Vec<(String, u16)> {
        self.tenants
            .iter()
            .map(|(name, tenant)| (name.clone(), tenant.weight))
            .collect()
    }

    /// The quota of `tenant`, if it has one: only then does intake take
    /// a turn of the store's quota for its orders.
    pub fn quota(&self, tenant: &str) -> Option<&Quota> {
        self.tenants.get(tenant)?.quota.as_ref()
    }

    /// True when a file configured tenants (and so identities matter).
    pub fn is_configured(&self) -> bool {
        self.configured
    }

    /// Who `identity` is: its tenant and what a wait step may name it by.
    pub fn sender(&self, identity: &str) -> Sender {
        let tenant = if identity.starts_with("console:") {
            None
        } else if self.configured {
            self.members.get(identity).cloned()
        } else {
            Some(DEFAULT_TENANT.to_owned())
        };
        let mut principals = vec![identity.to_owned()];
        if !self.configured {
            // Open tenancy: everyone holds every role.
            principals.push(ANYONE.to_owned());
        }
        if let Some(tenant) = &tenant {
            principals.push(format!("tenant:{tenant}"));
        }
        if let Some(roles) = self.roles.get(identity) {
            principals.extend(roles.iter().map(|role| format!("role:{role}")));
        }
        Sender {
            identity: identity.to_owned(),
            tenant,
            principals,
        }
    }

    /// Whether `tenant` may start `workflow` at `priority`.
    ///
    /// # Errors
    /// Why not, naming the setting that would allow it.
    pub fn may_start(&self, tenant: &str, workflow: &str, priority: u8) -> Result<(), String> {
        if !self.configured {
            return Ok(());
        }
        let Some(rules) = self.tenants.get(tenant) else {
            return Err(format!("tenant {tenant} is not in the tenancy file"));
        };
        if let Some(allowed) = &rules.workflows {
            if !allowed.contains(workflow) {
                return Err(format!(
                    "tenant {tenant} may not start workflow {workflow:?} (tenants.{tenant}.workflows allows {})",
                    allowed.iter().cloned().collect::<Vec<_>>().join(", ")
                ));
            }
        }
        if priority > rules.max_priority {
            return Err(format!(
                "tenant {tenant} may ask for priority {} at most (tenants.{tenant}.max_priority); this order asks for {priority}",
                rules.max_priority
            ));
        }
        Ok(())
    }
}

/// Checks that `identity` reads `<kind>:<name>` with a known kind.
fn check_identity(identity: &str, key: &str) -> Result<(), String> {
    match identity.split_once(':') {
        Some((kind, name))
            if IDENTITY_KINDS.contains(&kind)
                && !name.is_empty()
                && name.len() <= 255
                && !name.chars().any(char::is_control) =>
        {
            Ok(())
        }
        _ => Err(format!(
            "{key} holds {identity:?}: write an identity as amqp:<broker user>, gateway:<client> or console:<user>"
        )),
    }
}

/// Who published a message: the identity its sending service vouches for
/// (header [`sas_messages::headers::SENDER`]) when the publishing broker
/// user is one of `delegating_users` (the gateway's, the console's), else
/// `amqp:<user_id>`.
///
/// # Errors
/// Why the message names nobody: no `user_id` (RabbitMQ validates it only
/// when it is set), or a delegating user that vouched for nobody or for an
/// identity of no known kind.
pub fn identity_of(
    user_id: Option<&str>,
    vouched_for: Option<&str>,
    delegating_users: &[String],
) -> Result<String, String> {
    let Some(user) = user_id.filter(|user| !user.is_empty()) else {
        return Err("the message has no user_id property: set it to the broker user you log in as (RabbitMQ checks it), so that the system knows who sent it".into());
    };
    if delegating_users.iter().any(|delegating| delegating == user) {
        let Some(identity) = vouched_for else {
            return Err(format!(
                "broker user {user} sends on others' behalf (amqp.delegating_users) but named nobody in the {} header",
                sas_messages::headers::SENDER
            ));
        };
        check_identity(identity, sas_messages::headers::SENDER)?;
        return Ok(identity.to_owned());
    }
    Ok(format!("amqp:{user}"))
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    const FILE: &str = r#"
        [tenants.shop]
        members = ["amqp:shop", "gateway:shop"]
        workflows = ["order", "large_order"]
        max_priority = 5
        weight = 3

        [tenants.rival]
        members = ["gateway:rival"]

        [roles]
        approver = ["gateway:manager", "console:ann"]
    "#;

    #[test]
    fn an_identity_has_its_tenant_and_roles_and_an_operator_has_none() {
        let tenancy = Tenancy::parse(FILE).unwrap();
        let shop = tenancy.sender("gateway:shop");
        assert_eq!(shop.tenant.as_deref(), Some("shop"));
        assert_eq!(shop.principals, ["gateway:shop", "tenant:shop"]);
        assert!(!shop.is_operator());
        let manager = tenancy.sender("gateway:manager");
        assert_eq!(manager.tenant, None, "in no tenant's members");
        assert_eq!(manager.principals, ["gateway:manager", "role:approver"]);
        let ann = tenancy.sender("console:ann");
        assert!(ann.is_operator());
        assert_eq!(ann.principals, ["console:ann", "role:approver"]);
        assert_eq!(tenancy.sender("amqp:stranger").tenant, None);
    }

    #[test]
    fn a_tenant_starts_only_its_workflows_at_its_priorities() {
        let tenancy = Tenancy::parse(FILE).unwrap();
        assert_eq!(tenancy.may_start("shop", "large_order", 5), Ok(()));
        let refused = tenancy.may_start("shop", "return", 4).unwrap_err();
        assert!(refused.contains("tenants.shop.workflows"), "{refused}");
        let refused = tenancy.may_start("shop", "order", 9).unwrap_err();
        assert!(refused.contains("priority 5 at most"), "{refused}");
        assert_eq!(tenancy.may_start("rival", "return", 9), Ok(()));
        assert!(tenancy.may_start("nobody", "order", 0).is_err());
    }

    #[test]
    fn a_tenant_weighs_one_in_the_lines_unless_the_file_says_more() {
        let tenancy = Tenancy::parse(FILE).unwrap();
        assert_eq!(
            tenancy.weights(),
            [("rival".to_owned(), 1), ("shop".to_owned(), 3)]
        );
        assert!(Tenancy::open().weights().is_empty());
    }

    #[test]
    fn a_quota_is_refused_unless_said_otherwise_and_queued_for_ten_minutes_at_most_by_default() {
        let tenancy = Tenancy::parse(
            "[tenants.a]\nquota = { per_second = 2.5 }\n\
             [tenants.b]\nquota = { per_second = 20, burst = 40, over = \"queue\" }\n\
             [tenants.c]\n",
        )
        .unwrap();
        let a = tenancy.quota("a").unwrap();
        assert_eq!(
            (a.burst, a.over, a.max_wait),
            (3, OverQuota::Refuse, Duration::ZERO)
        );
        assert_eq!(a.emission(), Duration::from_millis(400));
        assert_eq!(a.tolerance(), Duration::from_millis(800));
        let b = tenancy.quota("b").unwrap();
        assert_eq!((b.burst, b.over), (40, OverQuota::Queue));
        assert_eq!(b.max_wait, Duration::from_secs(600));
        assert_eq!(tenancy.quota("c"), None);
        assert_eq!(tenancy.quota("nobody"), None);
    }

    #[test]
    fn open_tenancy_puts_everyone_in_the_default_tenant_with_every_right() {
        let open = Tenancy::load("").unwrap();
        assert!(!open.is_configured());
        assert_eq!(
            open.sender("amqp:anyone").tenant.as_deref(),
            Some(DEFAULT_TENANT)
        );
        assert_eq!(open.may_start(DEFAULT_TENANT, "return", 9), Ok(()));
        assert!(open
            .sender("amqp:anyone")
            .principals
            .contains(&ANYONE.to_owned()));
    }

    #[test]
    fn a_bad_file_is_refused_naming_what_is_wrong() {
        for (text, says) in [
            ("[tenants.Shop]\nmembers = []", "tenant name \"Shop\""),
            ("[tenants.a]\nmembers = [\"shop\"]", "write an identity as"),
            (
                "[tenants.a]\nmembers = [\"ldap:x\"]",
                "write an identity as",
            ),
            (
                "[tenants.a]\nmembers = [\"amqp:x\"]\n[tenants.b]\nmembers = [\"amqp:x\"]",
                "member of two tenants",
            ),
            ("[tenants.a]\nmax_priority = 10", "highest priority is 9"),
            ("[tenants.a]\nweight = 0", "a weight is 1 to 1000"),
            ("[tenants.a]\nweight = 1001", "a weight is 1 to 1000"),
            ("[tenants.a]\nmembers = [\"console:ann\"]", "operators"),
            ("[tenant.a]", "unknown field"),
            (
                "[tenants.a]\nquota = { per_second = 0 }",
                "give 0.001 to 100000",
            ),
            (
                "[tenants.a]\nquota = { per_second = 1e-20 }",
                "give 0.001 to 100000",
            ),
            (
                "[tenants.a]\nquota = { per_second = 1e9 }",
                "give 0.001 to 100000",
            ),
            (
                "[tenants.a]\nquota = { per_second = 0.001, burst = 1000000 }",
                "more than a year",
            ),
            (
                "[tenants.a]\nquota = { per_second = 1, burst = 0 }",
                "1 to 1000000",
            ),
            (
                "[tenants.a]\nquota = { per_second = 1, max_wait_secs = 5 }",
                "max_wait_secs is for over = \"queue\"",
            ),
            (
                "[tenants.a]\nquota = { per_second = 1, over = \"queue\", max_wait_secs = 90000 }",
                "at most 86400 s",
            ),
            (
                "[tenants.a]\nquota = { per_second = 1, over = \"drop\" }",
                "unknown variant",
            ),
            (
                "[tenants.a]\nquota = { burst = 3 }",
                "missing field `per_second`",
            ),
        ] {
            let error = Tenancy::parse(text).unwrap_err();
            assert!(error.contains(says), "{text}: {error}");
        }
    }

    #[test]
    fn only_a_delegating_user_vouches_for_someone_else() {
        let gateway = ["sas-gateway".to_owned()];
        assert_eq!(
            identity_of(Some("shop"), Some("gateway:rival"), &gateway),
            Ok("amqp:shop".into()),
            "a client's header is not believed"
        );
        assert_eq!(
            identity_of(Some("sas-gateway"), Some("gateway:shop"), &gateway),
            Ok("gateway:shop".into())
        );
        assert!(identity_of(Some("sas-gateway"), None, &gateway).is_err());
        assert!(identity_of(Some("sas-gateway"), Some("root"), &gateway).is_err());
        assert!(identity_of(None, None, &gateway)
            .unwrap_err()
            .contains("user_id"));
    }
}
