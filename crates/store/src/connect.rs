//! Connecting to Postgres.

use std::time::Duration;

use serde::Deserialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::PgPool;

use crate::{StoreError, MIGRATOR};

/// How to reach the state store. Part of every service's settings as `[database]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DatabaseSettings {
    /// `postgres://user@host:port/database`; the password may be in the URL or in `password`.
    pub url: String,
    /// Password, when kept out of the URL (from an environment variable or a secret file).
    #[serde(default)]
    pub password: Option<String>,
    /// Pool size. Two cores want few connections: more only queue inside Postgres.
    pub max_connections: u32,
    /// Longest wait for a pooled connection, in milliseconds.
    pub acquire_timeout_ms: u64,
    /// Longest a single statement may run, in milliseconds (server side), so a
    /// lost lock or a hung server never hangs a service.
    pub statement_timeout_ms: u64,
}

impl DatabaseSettings {
    /// Checks values that would otherwise fail late.
    ///
    /// # Errors
    /// A message naming the bad key.
    pub fn validate(&self) -> Result<(), String> {
        self.url
            .parse::<PgConnectOptions>()
            .map_err(|e| format!("database.url is not a valid Postgres URL: {e}"))?;
        if self.max_connections == 0 {
            return Err("database.max_connections must be at least 1".into());
        }
        if self.acquire_timeout_ms == 0 || self.statement_timeout_ms == 0 {
            return Err(
                "database.acquire_timeout_ms and database.statement_timeout_ms must be positive"
                    .into(),
            );
        }
        Ok(())
    }

    /// Connection options with the statement timeout and application name set.
    ///
    /// # Errors
    /// When the URL does not parse.
    pub fn connect_options(&self, application_name: &str) -> Result<PgConnectOptions, StoreError> {
        let mut options: PgConnectOptions = self.url.parse()?;
        if let Some(password) = &self.password {
            options = options.password(password);
        }
        Ok(options.application_name(application_name).options([(
            "statement_timeout",
            format!("{}ms", self.statement_timeout_ms),
        )]))
    }
}

/// A handle on the state store: a connection pool. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
}

impl Store {
    /// Opens a pool. Connections are made lazily, so a service starts (and
    /// reports not ready) while Postgres is down, and recovers when it returns.
    ///
    /// # Errors
    /// When the settings do not parse.
    pub fn connect_lazy(
        settings: &DatabaseSettings,
        application_name: &str,
    ) -> Result<Self, StoreError> {
        let pool = PgPoolOptions::new()
            .max_connections(settings.max_connections)
            .acquire_timeout(Duration::from_millis(settings.acquire_timeout_ms))
            .test_before_acquire(false)
            .connect_lazy_with(settings.connect_options(application_name)?);
        Ok(Self { pool })
    }

    /// Wraps an existing pool (tests).
    pub fn from_pool(pool: PgPool) -> Self {
        Self { pool }
    }

    /// The underlying pool, for queries this crate does not offer.
    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Applies pending migrations. sqlx holds a Postgres advisory lock on the
    /// database while it migrates, so several instances starting together
    /// apply each migration exactly once.
    ///
    /// # Errors
    /// When Postgres is unreachable or a migration fails.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        MIGRATOR.run(&self.pool).await?;
        Ok(())
    }

    /// True when a trivial query succeeds: the readiness probe.
    pub async fn is_reachable(&self) -> bool {
        sqlx::query("SELECT 1").execute(&self.pool).await.is_ok()
    }
}
