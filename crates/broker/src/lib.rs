//! RabbitMQ plumbing shared by every service.
//!
//! - [`settings`]: the `[amqp]` settings section.
//! - [`connection`]: connecting with timeouts, and [`connection::Session`], the
//!   reconnect loop every service runs its broker work inside.
//! - [`topology`]: declaring the quorum queues and exchanges, identically everywhere.
//! - [`publish`]: publishing with confirms, with a timeout on every await.
//! - [`consume`]: consuming with manual acks, concurrent handlers, dead-lettering.
//! - [`identity`]: the broker users of our services, and the settings that name them.
//!
//! lapin's own recovery is not relied on: a session that loses its connection
//! drops every channel and starts over, and the broker requeues whatever was
//! unacknowledged. Handlers are idempotent, so that is safe.

pub mod connection;
pub mod consume;
mod error;
pub mod identity;
pub mod publish;
pub mod settings;
pub mod topology;

pub use connection::{connect, Session};
pub use consume::{Consumed, Delivery};
pub use error::BrokerError;
pub use identity::ServiceAmqpSettings;
pub use publish::{Publisher, SharedPublisher};
pub use settings::AmqpSettings;

pub use lapin;
