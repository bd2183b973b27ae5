//! The store's reads: what operators, clients and metrics are shown. Nothing
//! here writes, so the console's pages and sasctl's listings can take a
//! [`Reads`] and nothing more.
//!
//! - [`queries`]: one order's detail, status, body and history; alerts and
//!   dead letters; counts by state.
//! - [`search`]: orders by filter, in keyset pages; the sets of bulk actions.
//! - [`overview`]: orders by state, and per minute over the last hour.
//! - [`dead_letters`]: one recorded dead letter, and whether it may be replayed.
//! - [`workflows`]: the registered workflow versions, with their orders
//!   counted by state.

pub mod dead_letters;
pub mod overview;
pub mod queries;
pub mod search;
pub mod workflows;

use sqlx::PgPool;

use crate::Store;

/// The read models of a [`Store`] (see [`Store::reads`]): the queries
/// operators and clients make, apart from the writes that move orders.
#[derive(Debug, Clone, Copy)]
pub struct Reads<'a> {
    store: &'a Store,
}

impl<'a> Reads<'a> {
    pub(crate) fn new(store: &'a Store) -> Self {
        Self { store }
    }

    fn pool(&self) -> &'a PgPool {
        self.store.pool()
    }
}
