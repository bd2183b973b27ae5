//! The Postgres state store.
//!
//! Postgres is the single source of truth of the pattern: which orders exist,
//! who holds each one and until when, each step's current attempt, and every
//! decision taken. The services are stateless between messages.
//!
//! - [`admission`]: the agents' shared admission counters and limits.
//! - [`machine`]: the order state machine, pure: every transition is decided there.
//! - [`connect`]: pool settings with timeouts on every await.
//! - [`intake`]: storing a submitted order with its process record, idempotently.
//! - [`progress`]: the scheduler's transitions (claim, replies).
//! - [`recovery`]: the supervisor's transitions (expired deadlines).
//! - [`operator`]: dead letters, resubmission and cancellation.
//! - `apply`: loading snapshots under the order's lock, writing decisions.
//! - `fast`: the batched statement for successes of forward steps.
//! - [`timing`]: the deadline margins (start margin, grace) and their check.
//! - [`queries`]: read models for the CLI and metrics.
//! - [`search`]: orders by filter, in keyset pages; the sets of bulk actions.
//! - [`overview`]: orders by state, and per minute over the last hour.
//! - [`alerts`], [`dead_letters`]: operators acknowledging and resolving
//!   alerts, replaying and discarding dead letters.
//!
//! Every transition runs in one transaction that first locks the order's
//! `order_process` row and reads its snapshot, asks [`machine::decide`],
//! then writes the decision with guarded updates (`WHERE state = expected
//! AND attempt_id = ...`). Every time comes from `now()` in Postgres. The
//! store decides nothing itself; its two single-statement hot paths
//! (intake, a forward step's success) are held to the state machine by a
//! property test.

pub mod admission;
pub mod alerts;
mod apply;
pub mod connect;
pub mod dead_letters;
mod error;
mod fast;
pub mod intake;
pub mod machine;
pub mod model;
pub mod operator;
pub mod overview;
pub mod progress;
pub mod queries;
pub mod recovery;
pub mod retention;
pub mod search;
pub mod timing;

pub use connect::{DatabaseSettings, Store};
pub use error::StoreError;
pub use model::{Dispatch, NewStep, ProcessState, Progress, StepState};
pub use timing::DeadlineSettings;

/// The schema migrations, embedded in every binary that touches the store.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");
