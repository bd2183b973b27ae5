//! Progress events sent to the client that submitted an order.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::OrderId;

/// What happened to an order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StatusEvent {
    /// The order is stored and its workflow has started.
    Received,
    /// One step succeeded (`step` says which).
    StepCompleted,
    /// Every step succeeded: terminal.
    Processed,
    /// A step failed for good or kept timing out: the completed steps are being undone.
    Compensating,
    /// Every completed step was undone: terminal.
    Compensated,
    /// The order could not be completed or undone; an operator alert was raised: terminal.
    Failed,
}

impl StatusEvent {
    /// The name used on the wire (`step_completed`), for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Received => "received",
            Self::StepCompleted => "step_completed",
            Self::Processed => "processed",
            Self::Compensating => "compensating",
            Self::Compensated => "compensated",
            Self::Failed => "failed",
        }
    }

    /// True when no further event will follow for this order (until an operator resubmits it).
    pub fn is_terminal(self) -> bool {
        matches!(self, Self::Processed | Self::Compensated | Self::Failed)
    }
}

/// A status message, sent to the order's `reply_to` queue (if it named one)
/// and to the status exchange with routing key `order.<order_id>`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OrderStatus {
    /// Always [`crate::SCHEMA_VERSION`].
    pub schema_version: u32,
    /// The order this is about.
    pub order_id: OrderId,
    /// What happened.
    pub event: StatusEvent,
    /// The step concerned, for step events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    /// Reason of a failure, or other detail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// When it happened (database clock).
    pub at: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::StatusEvent;

    #[test]
    fn the_name_of_an_event_is_its_wire_name() {
        for event in [
            StatusEvent::Received,
            StatusEvent::StepCompleted,
            StatusEvent::Processed,
            StatusEvent::Compensating,
            StatusEvent::Compensated,
            StatusEvent::Failed,
        ] {
            assert_eq!(serde_json::to_value(event).unwrap(), event.as_str());
        }
    }
}
