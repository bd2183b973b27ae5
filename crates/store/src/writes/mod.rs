//! The store's writes: every change to an order, and the operators' records.
//!
//! Every transition of an order goes through one write kernel, `apply`: it
//! locks a batch of orders, loads their snapshots, asks
//! [`crate::machine::decide`] for each, and writes every decision of the
//! batch in one statement. The modules below are adapters from their inputs
//! to the machine's events:
//!
//! - [`intake`]: storing submitted orders with their process records, idempotently;
//! - [`progress`]: the scheduler's transitions (claims, replies);
//! - [`recovery`]: the supervisor's transitions (expired deadlines, dead letters);
//! - [`operator`]: resubmission, resume, cancellation, a dead letter's settlement;
//! - [`moves`]: moving waiting orders to another version of their workflow;
//! - [`events`]: events for wait steps, kept in their orders' mailboxes,
//!   and dead-lettered when their order never came;
//! - [`alerts`], [`dead_letters`]: operators acknowledging and resolving
//!   alerts, replaying and discarding dead letters;
//! - [`retention`]: deleting finished orders past their retention;
//! - `fast`: the batched statement for successes of forward steps, held to
//!   the machine by the property test (as intake's is).

pub mod alerts;
pub(crate) mod apply;
mod children;
pub mod dead_letters;
pub mod events;
mod fast;
pub mod intake;
pub(crate) mod key_room;
pub mod moves;
pub mod operator;
pub mod progress;
pub mod recovery;
pub mod retention;

use std::time::Duration;

use sqlx::PgPool;

use crate::Store;

/// The writes of a [`Store`] (see [`Store::writes`]): the services'
/// transitions of orders and the operators' actions.
#[derive(Debug, Clone, Copy)]
pub struct Writes<'a> {
    store: &'a Store,
}

impl<'a> Writes<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    fn pool(&self) -> &'a PgPool {
        self.store.pool()
    }

    /// The start margin of the requests this store dispatches.
    fn start_margin(&self) -> Duration {
        self.store.start_margin()
    }
}
