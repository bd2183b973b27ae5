//! The two ids every service passes around: an order's, and an attempt's.
//!
//! Both are plain strings and UUIDs on the wire (`serde(transparent)`), but
//! distinct types in the code, so that an attempt id is never passed where
//! an order id belongs, or a step name where either does.

use std::fmt;
use std::ops::Deref;
use std::str::FromStr;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

/// The client's id of an order (`ord-1001`), unique in a deployment.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize, JsonSchema,
)]
#[serde(transparent)]
#[schemars(inline)]
pub struct OrderId(String);

impl OrderId {
    /// The id as text, for SQL parameters, headers and logs.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The id as an owned string.
    pub fn into_string(self) -> String {
        self.0
    }
}

impl Deref for OrderId {
    type Target = str;

    fn deref(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for OrderId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl std::borrow::Borrow<str> for OrderId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for OrderId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl From<String> for OrderId {
    fn from(id: String) -> Self {
        Self(id)
    }
}

impl From<&str> for OrderId {
    fn from(id: &str) -> Self {
        Self(id.to_owned())
    }
}

impl PartialEq<str> for OrderId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for OrderId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

/// The tenant of every order when tenancy is not configured, and of the
/// identities a tenancy file leaves out of every tenant's list only where
/// it says so: its orders' ids are stored as their clients sent them.
pub const DEFAULT_TENANT: &str = "default";

/// What separates a client's id from its tenant in a stored order id
/// (`ord-1@shop`). A client's id cannot hold it ([`crate::order`]'s id
/// rule), so a stored id names its tenant without doubt, and a client can
/// never name another tenant's order.
pub const TENANT_SEPARATOR: char = '@';

/// True when `tenant` can name a tenant: 1 to 32 of `a-z 0-9 - _`.
pub fn is_tenant_name(tenant: &str) -> bool {
    (1..=32).contains(&tenant.len())
        && tenant
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'-' | b'_'))
}

impl OrderId {
    /// The id under which the store keeps this client id for `tenant`:
    /// itself for [`DEFAULT_TENANT`], else `id@tenant`. Order ids are so
    /// unique per tenant: two tenants' `ord-1` are two orders, and no
    /// answer about one says anything about the other.
    pub fn qualified(&self, tenant: &str) -> OrderId {
        if tenant == DEFAULT_TENANT {
            self.clone()
        } else {
            OrderId(format!("{}{TENANT_SEPARATOR}{tenant}", self.0))
        }
    }

    /// The tenant a stored id belongs to.
    pub fn tenant(&self) -> &str {
        tenant_of(&self.0)
    }

    /// The id as its client sent it: a stored id without its tenant.
    pub fn client_id(&self) -> &str {
        client_id(&self.0)
    }
}

/// The tenant of stored order id `id` (see [`OrderId::qualified`]).
pub fn tenant_of(id: &str) -> &str {
    id.rsplit_once(TENANT_SEPARATOR)
        .map_or(DEFAULT_TENANT, |(_, tenant)| tenant)
}

/// Stored order id `id` as its client knows it (see [`OrderId::qualified`]).
pub fn client_id(id: &str) -> &str {
    id.rsplit_once(TENANT_SEPARATOR)
        .map_or(id, |(client, _)| client)
}

/// Qualifies a key (a correlation key) with `tenant` as order ids are: a
/// key one tenant's event names reaches only that tenant's orders. The
/// tenant [`DEFAULT_TENANT`] keeps a key as it is, unless the key holds
/// the separator (a key an order read from its attributes, `x@shop`): that
/// one is qualified too, so it never meets another tenant's `x`.
pub fn qualified_key(key: &str, tenant: &str) -> String {
    if tenant == DEFAULT_TENANT && !key.contains(TENANT_SEPARATOR) {
        key.to_owned()
    } else {
        format!("{key}{TENANT_SEPARATOR}{tenant}")
    }
}

/// The id of one attempt of one step: the request's `correlation_id`, and
/// the fence its reply must match.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    Serialize,
    Deserialize,
    JsonSchema,
)]
#[serde(transparent)]
#[schemars(inline)]
pub struct AttemptId(Uuid);

impl AttemptId {
    /// A new attempt id: a UUIDv7, so ids sort by creation time.
    pub fn new() -> Self {
        Self(Uuid::now_v7())
    }

    /// The UUID, for SQL parameters.
    pub fn as_uuid(self) -> Uuid {
        self.0
    }
}

impl From<Uuid> for AttemptId {
    fn from(id: Uuid) -> Self {
        Self(id)
    }
}

impl fmt::Display for AttemptId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl FromStr for AttemptId {
    type Err = uuid::Error;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        text.parse().map(Self)
    }
}

#[cfg(test)]
mod tenant_tests {
    use super::*;

    #[test]
    fn a_tenant_s_ids_are_its_own_and_the_default_tenant_s_stay_as_sent() {
        let id = OrderId::from("ord-1");
        assert_eq!(id.qualified(DEFAULT_TENANT), "ord-1");
        let shop = id.qualified("shop");
        assert_eq!(shop, "ord-1@shop");
        assert_ne!(shop, id.qualified("rival"));
        assert_eq!((shop.tenant(), shop.client_id()), ("shop", "ord-1"));
        assert_eq!((id.tenant(), id.client_id()), (DEFAULT_TENANT, "ord-1"));
        assert_eq!(qualified_key("pay-7", "shop"), "pay-7@shop");
        assert_eq!(qualified_key("pay-7", DEFAULT_TENANT), "pay-7");
        assert_eq!(
            qualified_key("pay-7@rival", DEFAULT_TENANT),
            "pay-7@rival@default",
            "a default order's key never meets rival's pay-7"
        );
        assert!(is_tenant_name("shop-eu_1"));
        for bad in ["", "Shop", "a@b", "a.b", &"x".repeat(33)] {
            assert!(!is_tenant_name(bad), "{bad:?}");
        }
    }
}
