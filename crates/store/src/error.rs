//! The store's error type.

use sqlx::migrate::MigrateError;

/// What went wrong talking to the state store.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// Postgres refused a query or could not be reached.
    #[error("database error: {0}")]
    Database(#[from] sqlx::Error),
    /// The migrations could not be applied. The message is complete (the
    /// migration's version and description, the database's reason, and what
    /// to do), so the sqlx error is not repeated as its source.
    #[error("{}", describe_migrate_error(.0))]
    Migrate(MigrateError),
    /// A statement shared by a batch of callers failed; each caller gets this.
    #[error("{0}")]
    Shared(std::sync::Arc<StoreError>),
    /// Nothing to retry here: the data contradicts a rule of the state
    /// machine (a bug, not bad luck), the workflow cannot be stored (no
    /// steps), or a caller's group-commit batch gave no answer (it
    /// panicked, or the process is stopping). The message concerned goes
    /// back to its queue; the text says which case.
    #[error("state store invariant broken: {0}")]
    Invariant(String),
}

impl StoreError {
    /// True when Postgres rolled the transaction back as a deadlock or a
    /// serialization failure (SQLSTATE class 40): nothing of it was
    /// written, and running it again at once is the remedy.
    pub fn is_rolled_back(&self) -> bool {
        match self {
            Self::Database(sqlx::Error::Database(db)) => {
                db.code().is_some_and(|code| code.starts_with("40"))
            }
            Self::Shared(error) => error.is_rolled_back(),
            _ => false,
        }
    }

    /// True when retrying later may succeed (connection lost, pool exhausted,
    /// server restarting, serialization conflict); false for bugs and bad data.
    pub fn is_transient(&self) -> bool {
        match self {
            Self::Database(error) => Self::is_transient_sqlx(error),
            Self::Shared(error) => error.is_transient(),
            Self::Migrate(error) => Self::is_transient_migrate(error),
            Self::Invariant(_) => false,
        }
    }

    /// Whether applying the migrations again may succeed: only when the
    /// database could not be reached or the connection broke (the cause is
    /// transient per [`StoreError::is_transient_sqlx`]). A migration whose
    /// SQL the database refuses, or a database whose applied migrations do
    /// not match this build's, fails the same way every time.
    pub fn is_transient_migrate(error: &MigrateError) -> bool {
        match error {
            MigrateError::Execute(error) | MigrateError::ExecuteMigration(error, _) => {
                Self::is_transient_sqlx(error)
            }
            _ => false,
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
                // (admin shutdown, query canceled), 53: insufficient resources;
                // 25006: a write on a read-only server (a primary demoted
                // under a connection during a failover); 25P03: the session
                // sat idle in a transaction past
                // idle_in_transaction_session_timeout (the process was
                // stopped) and Postgres ended it.
                ["08", "40", "57", "53"]
                    .iter()
                    .any(|class| code.starts_with(class))
                    || code == "25006"
                    || code == "25P03"
            }),
            _ => false,
        }
    }
}

impl From<MigrateError> for StoreError {
    fn from(error: MigrateError) -> Self {
        Self::Migrate(error)
    }
}

/// "migration 1 (initial)": the version and the description of the file
/// (`0001_initial.sql`), or only the version when this build has no such
/// migration.
fn name_migration(version: i64) -> String {
    match crate::MIGRATOR.iter().find(|m| m.version == version) {
        Some(migration) => format!("migration {version} ({})", migration.description),
        None => format!("migration {version}"),
    }
}

/// The database's own words for a failed statement, with its SQLSTATE code.
fn database_reason(error: &sqlx::Error) -> String {
    match error {
        sqlx::Error::Database(database) => match database.code() {
            Some(code) => format!("{} (SQLSTATE {code})", database.message()),
            None => database.message().to_owned(),
        },
        other => other.to_string(),
    }
}

/// What went wrong applying the migrations, which migration, and what an
/// operator can do about it.
fn describe_migrate_error(error: &MigrateError) -> String {
    match error {
        MigrateError::ExecuteMigration(cause, version) if StoreError::is_transient_sqlx(cause) => {
            format!(
                "{} was interrupted: {}",
                name_migration(*version),
                database_reason(cause)
            )
        }
        MigrateError::ExecuteMigration(cause, version) => {
            let atomic = crate::MIGRATOR
                .iter()
                .any(|m| m.version == *version && !m.no_tx);
            format!(
                "{} failed: the database refused it: {}. {}The database holds objects that \
                 conflict with the schema (another application's, or a hand-made change): \
                 point database.url at a database of its own (an empty one is set up from \
                 scratch), or repair the conflict, then apply the migrations again",
                name_migration(*version),
                database_reason(cause),
                if atomic {
                    "Nothing of it was applied (it runs in one transaction). "
                } else {
                    ""
                }
            )
        }
        MigrateError::Execute(cause) if StoreError::is_transient_sqlx(cause) => {
            format!(
                "cannot apply the database migrations yet: {}",
                database_reason(cause)
            )
        }
        MigrateError::Execute(cause) => format!(
            "cannot apply the database migrations: the database refused: {}. Check that \
             database.url names the right database and a role that may create tables in it \
             (the migrations run as the database owner)",
            database_reason(cause)
        ),
        MigrateError::VersionMismatch(version) => format!(
            "{} was applied to this database with other content than this build's (its \
             checksum differs): the database was migrated by another build. Run the build \
             that matches the database; an applied migration must never be edited",
            name_migration(*version)
        ),
        MigrateError::VersionMissing(version) => format!(
            "migration {version} is applied to this database but unknown to this build: the \
             database was migrated by a newer build. Run that build, or a newer one"
        ),
        MigrateError::Dirty(version) => format!(
            "{} is recorded as partially applied in _sqlx_migrations: repair the database by \
             hand, delete that row, then apply the migrations again",
            name_migration(*version)
        ),
        other => format!("cannot apply the database migrations: {other}"),
    }
}

#[cfg(test)]
mod tests {
    use sqlx::migrate::MigrateError;

    use super::StoreError;

    #[test]
    fn only_a_migration_that_could_not_reach_the_database_is_transient() {
        let refused =
            || sqlx::Error::Io(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        let transient = |error| StoreError::Migrate(error).is_transient();
        assert!(transient(MigrateError::Execute(refused())));
        assert!(transient(MigrateError::ExecuteMigration(refused(), 1)));
        // Any error of the statement itself (the end-to-end test has the
        // database refusing a migration's SQL).
        assert!(!transient(MigrateError::ExecuteMigration(
            sqlx::Error::RowNotFound,
            1
        )));
        assert!(!transient(MigrateError::VersionMismatch(1)));
        assert!(!transient(MigrateError::VersionMissing(99)));
        assert!(!transient(MigrateError::Dirty(1)));
    }

    #[test]
    fn a_checksum_mismatch_names_the_migration_and_what_to_do() {
        let message = StoreError::Migrate(MigrateError::VersionMismatch(1)).to_string();
        assert!(message.contains("migration 1 (initial)"), "{message}");
        assert!(message.contains("checksum"), "{message}");
        assert!(message.contains("Run the build"), "{message}");
    }
}
