//! The Postgres state store.
//!
//! Postgres is the single source of truth of the pattern: which orders exist,
//! who holds each one and until when, each step's current attempt, and every
//! decision taken. The services are stateless between messages.
//!
//! A [`Store`] is a connection pool that hands out four roles:
//!
//! - [`Store::writes`] ([`writes`]): every transition of an order, through
//!   one write kernel, and the operators' records;
//! - [`Store::reads`] ([`reads`]): what operators, clients and metrics are
//!   shown (queries, search, overview, dead letters);
//! - [`Store::admission`] ([`admission`]): the agents' shared admission
//!   counters and limits;
//! - [`Store::schedules`] ([`schedules`]): durable schedules, managed by
//!   operators and fired by the schedulers.
//!
//! Beside them:
//! - [`machine`]: the order state machine, pure: every transition is decided there.
//! - [`connect`]: pool settings with timeouts on every await; migrations.
//! - [`timing`]: the deadline margins (start margin, grace) and their check.
//! - [`model`]: the states and the messages a transition produces.
//! - [`quota`]: tenants' quotas, taken by intake (on [`Store::admission`]).
//!
//! Every transition runs in one transaction that first locks the orders'
//! `order_process` rows and reads its snapshot, asks [`machine::decide`],
//! then writes the decision with guarded updates (`WHERE state = expected
//! AND attempt_id = ...`). Every time comes from `now()` in Postgres. The
//! store decides nothing itself; its two single-statement hot paths
//! (intake, a forward step's success) are held to the state machine by a
//! property test.

pub mod admission;
pub mod connect;
mod error;
pub mod machine;
mod migration_lock;
pub mod model;
pub mod quota;
pub mod reads;
pub mod schedules;
mod step_columns;
pub mod timing;
pub mod writes;

pub use admission::Admission;
pub use connect::{DatabaseSettings, Store};
pub use error::StoreError;
pub use machine::call::{CallTemplate, OnFailure, StepCalls};
pub use machine::concurrency::Concurrency;
pub use model::{Dispatch, NewStep, Plan, ProcessState, Progress, StepState};
pub use reads::Reads;
pub use schedules::Schedules;
pub use timing::DeadlineSettings;
pub use writes::Writes;

/// The schema migrations, embedded in every binary that touches the store.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");
