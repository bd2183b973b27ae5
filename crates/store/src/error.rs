//! The store's error type.

/// What went wrong talking to the state store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Postgres refused a query or could not be reached.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The migrations could not be applied.
    #[error("could not apply database migrations: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    /// A statement shared by a batch of callers failed; each caller gets this.
    #[error("{0}")]
    Shared(std::sync::Arc<StoreError>),
    /// The data contradicts a rule of the state machine; a bug, not bad luck.
    #[error("state store invariant broken: {0}")]
    Invariant(String),
}

impl StoreError {
    /// True when retrying later may succeed (connection lost, pool exhausted,
    /// server restarting, serialization conflict); false for bugs and bad data.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Database(error) => Self::is_transient_sqlx(error),
            Self::Shared(error) => error.is_transient(),
            Self::Migrate(_) => true,
            Self::Invariant(_) => false,
        }
    }

    /// Whether a database error is worth retrying (see [`StoreError::is_transient`]).
    pub fn is_transient_sqlx(error: &sqlx::Error) -> bool {
        match error {
            sqlx::Error::Io(_)
            | sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed => true,
            sqlx::Error::Database(db) => db.code().is_some_and(|code| {
                // 08: connection exception, 40: transaction rollback
                // (serialization, deadlock), 57: operator intervention
                // (admin shutdown, query canceled), 53: insufficient resources.
                ["08", "40", "57", "53"]
                    .iter()
                    .any(|class| code.starts_with(class))
            }),
            _ => false,
        }
    }
}
