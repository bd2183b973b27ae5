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
