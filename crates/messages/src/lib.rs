//! Wire contracts shared by every service and the CLI.
//!
//! Nothing else in the workspace defines a message type or a queue name: the
//! scheduler, agents, supervisor and `sasctl` all depend on this crate, and the
//! README documents each type here with a JSON example so that any AMQP client
//! can take part.
//!
//! - [`ids`]: the order id and attempt id types.
//! - [`names`]: queue, exchange and header names (with a deployment prefix).
//! - [`order`]: the order a client submits, and its validation.
//! - [`attributes`]: an order's attributes checked against its workflow's
//!   JSON Schema, with one refusal wherever an order starts.
//! - [`event`]: an event from the outside world that a wait step waits for.
//! - [`schedule`]: a change to a durable schedule, sent over the broker.
//! - [`step`]: the request an agent receives and the reply it sends back.
//! - [`status`]: progress events sent to the client.
//! - [`trace`]: W3C trace context carried in AMQP headers.
//! - [`storable`]: text and JSON without U+0000, which Postgres refuses.
//! - [`decode`](mod@decode): strict decoding of bytes into a message, with reasons fit for a
//!   dead-letter header.
//! - [`contract`]: the JSON Schemas and the AsyncAPI document generated from
//!   all of the above (checked in under `contract/`).

pub mod attributes;
pub mod contract;
pub mod decode;
pub mod event;
pub mod ids;
pub mod names;
pub mod order;
pub mod schedule;
pub mod status;
pub mod step;
pub mod storable;
pub mod trace;

pub use decode::{decode, DecodeError};
pub use event::OrderEvent;
pub use ids::{AttemptId, OrderId};
pub use names::{headers, QueueNames};
pub use order::{
    OrderLine, SubmitOrder, DEFAULT_PRIORITY, MAX_PRIORITY, PRIORITY_STEP, UNDO_HEAD_START,
};
pub use schedule::{ScheduleCommand, ScheduleDefinition, ScheduleVerb};
pub use status::{OrderStatus, StatusEvent};
pub use step::{StepKind, StepOutcome, StepReply, StepRequest};
pub use trace::TraceParent;

/// The only `schema_version` this build reads and writes.
///
/// A message carrying another version is dead-lettered rather than guessed at,
/// so that a rolling upgrade never misreads a field.
pub const SCHEMA_VERSION: u32 = 1;

/// `content_type` set on every message we publish.
pub const CONTENT_TYPE_JSON: &str = "application/json";
