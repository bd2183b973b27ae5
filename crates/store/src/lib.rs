//! The Postgres state store.
//!
//! Postgres is the single source of truth of the pattern: which orders exist,
//! who holds each one and until when, each step's current attempt, and every
//! decision taken. The services are stateless between messages.
//!
//! - [`connect`]: pool settings with timeouts on every await.
//! - [`intake`]: storing a submitted order with its process record, idempotently.
//! - [`progress`]: the scheduler's transitions (claim, dispatch, replies).
//! - [`recovery`]: the supervisor's transitions (expired deadlines, dead letters).
//! - [`queries`]: read models for the CLI and metrics.
//!
//! Every transition runs in one transaction that first locks the order's
//! `order_process` row, then changes steps with guarded updates
//! (`WHERE state = expected AND attempt_id = ...`): one that lost a race
//! changes nothing and says so. Every time comes from `now()` in Postgres.

pub mod connect;
mod error;
mod fast;
pub mod intake;
pub mod model;
pub mod operator;
pub mod progress;
pub mod queries;
pub mod recovery;

pub use connect::{DatabaseSettings, Store};
pub use error::StoreError;
pub use model::{Dispatch, NewStep, ProcessState, Progress, StepState};

/// The schema migrations, embedded in every binary that touches the store.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");
