//! Progress events sent to the client that submitted an order.

use chrono::{DateTime, Utc};
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::OrderId;

/// What happened to an order.
///
/// Readers must expect events they do not know: a new event is added
/// within `schema_version` 1 (as `rejected` was), and a client that does
/// not know it should log it and go on waiting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum StatusEvent {
    /// The order is stored and its workflow has started.
    Received,
    /// One step succeeded (`step` says which).
    StepCompleted,
    /// The order waits at a wait step (`step`) for an event or a time;
    /// `detail` says which, and until when.
    Waiting,
    /// Every step succeeded: terminal.
    Processed,
    /// A step failed for good or kept timing out: the completed steps are being undone.
    Compensating,
    /// Every completed step was undone: terminal.
    Compensated,
    /// The order could not be completed or undone; an operator alert was raised: terminal.
    Failed,
    /// The submitted message was refused at intake and dead-lettered
    /// (`detail` says why: malformed, another schema version, an unknown
    /// field, an invalid value, over the size limit, or an order id
    /// already used with other content): terminal for that message. Sent
    /// only to the `reply_to` the message named, never to the status
    /// exchange: it is about a message, not about a stored order.
    Rejected,
}

impl StatusEvent {
    /// Every event, in the order of an order's life.
    pub const ALL: [StatusEvent; 8] = [
        Self::Received,
        Self::StepCompleted,
        Self::Waiting,
        Self::Processed,
        Self::Compensating,
        Self::Compensated,
        Self::Failed,
        Self::Rejected,
    ];

    /// The name used on the wire (`step_completed`), for logs and metric labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Received => "received",
            Self::StepCompleted => "step_completed",
            Self::Waiting => "waiting",
            Self::Processed => "processed",
            Self::Compensating => "compensating",
            Self::Compensated => "compensated",
            Self::Failed => "failed",
            Self::Rejected => "rejected",
        }
    }

    /// True when no further event will follow for this order (until an
    /// operator resubmits it), or, for `rejected`, for this message.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            Self::Processed | Self::Compensated | Self::Failed | Self::Rejected
        )
    }
}

/// A status message, sent to the order's `reply_to` queue (if it named one)
/// and to the status exchange with routing key `order.<order_id>`.
///
/// Unknown fields are accepted: a status is a notification, and a reader
/// that refused a field added later would miss every status after an
/// upgrade of the services. Writers add only optional fields.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct OrderStatus {
    /// Always [`crate::SCHEMA_VERSION`].
    #[schemars(extend("const" = crate::SCHEMA_VERSION))]
    pub schema_version: u32,
    /// The order this is about. On `rejected`, the `order_id` the refused
    /// message carried, as it was (it may be invalid), or `""` when it had
    /// none that could be read (no valid order has an empty id).
    pub order_id: OrderId,
    /// What happened.
    pub event: StatusEvent,
    /// The step concerned, for step events.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step: Option<String>,
    /// Reason of a failure or of a rejection, or other detail.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    /// When it happened: the database clock, or the scheduler's for `rejected`.
    pub at: DateTime<Utc>,
}

#[cfg(test)]
mod tests {
    use super::StatusEvent;

    #[test]
    fn the_name_of_an_event_is_its_wire_name() {
        for event in StatusEvent::ALL {
            assert_eq!(serde_json::to_value(event).unwrap(), event.as_str());
        }
    }

    #[test]
    fn a_status_with_a_field_added_later_is_still_read() {
        let status: super::OrderStatus = serde_json::from_str(
            r#"{"schema_version":1,"order_id":"o","event":"rejected","detail":"why","at":"2026-11-22T10:00:00Z","later":1}"#,
        )
        .unwrap();
        assert_eq!(status.event, StatusEvent::Rejected);
        assert!(status.event.is_terminal());
    }
}
