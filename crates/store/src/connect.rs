//! Connecting to Postgres.

use std::time::Duration;

use serde::Deserialize;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgSslMode};
use sqlx::PgPool;

use crate::StoreError;

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
    /// Apply pending migrations at start. Deployments that run a separate
    /// migration job (as the owner role) set this to false, so the services
    /// can connect as a role that owns nothing.
    #[serde(default = "default_true")]
    pub migrate: bool,
    /// TLS: `disable`, `prefer`, `require`, `verify-ca` or `verify-full`.
    /// `prefer` falls back to plaintext silently; a deployment that needs TLS
    /// must say `verify-full`.
    #[serde(default)]
    pub ssl_mode: SslMode,
    /// CA certificate (PEM) to verify the server with; empty uses the system roots.
    #[serde(default)]
    pub ssl_root_cert: String,
    /// Keep the services' statements on index plans (`enable_seqscan`,
    /// `enable_hashjoin` and `enable_mergejoin` off on their connections).
    ///
    /// Every statement is prepared once per connection, and Postgres keeps a
    /// generic plan made when the tables were small: right after a fresh
    /// start that is sequential scans and hash joins, which it keeps while
    /// the tables grow, until autovacuum analyzes them a minute or more
    /// later. The services only run keyed statements, for which index
    /// lookups are right at every size; measured on a fresh database, this
    /// halves Postgres's CPU per order.
    #[serde(default = "default_true")]
    pub index_plans: bool,
    /// How long a session may sit idle inside a transaction before Postgres
    /// ends it (`idle_in_transaction_session_timeout`), in milliseconds. A
    /// service stopped (SIGSTOP, a paused container, a frozen VM) between
    /// two statements of a transaction holds its locks until then: with the
    /// admission rows, every claim of those agents waits. The services'
    /// transactions never wait on anything but the database between their
    /// statements, so this may be short.
    #[serde(default = "default_idle_in_transaction_timeout_ms")]
    pub idle_in_transaction_timeout_ms: u64,
    /// TCP keepalives of the server's end of each connection
    /// (`tcp_keepalives_idle`, seconds; probes then every third of it,
    /// three of them): a service whose host died or was cut off is found
    /// out in about twice this, and its session and locks ended. (A stopped
    /// process's kernel still answers keepalives: the idle timeout above
    /// covers that case. sqlx sets no keepalive on the client's end.)
    #[serde(default = "default_keepalive_secs")]
    pub keepalive_secs: u64,
}

fn default_true() -> bool {
    true
}

fn default_idle_in_transaction_timeout_ms() -> u64 {
    5_000
}

fn default_keepalive_secs() -> u64 {
    10
}

/// TLS to Postgres (`database.ssl_mode`), with libpq's `sslmode` names in
/// kebab-case: `disable`, `prefer`, `require`, `verify-ca`, `verify-full`.
///
/// An enum rather than a string, so that a misspelt mode is refused when the
/// settings are loaded instead of when the first connection is made. It is
/// read through [`SslMode::from_str`](std::str::FromStr::from_str) rather than serde's derived enum
/// support: the `config` crate reports an unknown variant without the
/// allowed names, while this error lists them (and `config` adds the key,
/// `database.ssl_mode`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum SslMode {
    /// Plaintext only.
    Disable,
    /// TLS when the server offers it, plaintext otherwise, without a word:
    /// sqlx's and libpq's default, and ours, for local setups.
    #[default]
    Prefer,
    /// TLS, without checking the server's certificate.
    Require,
    /// TLS with a certificate signed by a trusted CA (`ssl_root_cert`).
    VerifyCa,
    /// TLS with a trusted certificate issued for the host: what a deployment
    /// that needs TLS must ask for.
    VerifyFull,
}

impl SslMode {
    /// Every mode, from least to most strict.
    pub const ALL: [Self; 5] = [
        Self::Disable,
        Self::Prefer,
        Self::Require,
        Self::VerifyCa,
        Self::VerifyFull,
    ];

    /// The setting's name of the mode (libpq's `sslmode`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Disable => "disable",
            Self::Prefer => "prefer",
            Self::Require => "require",
            Self::VerifyCa => "verify-ca",
            Self::VerifyFull => "verify-full",
        }
    }
}

impl std::fmt::Display for SslMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for SslMode {
    type Err = String;

    /// Reads a mode by its name.
    ///
    /// # Errors
    /// A message listing the allowed names, for an unknown one.
    fn from_str(name: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|mode| mode.as_str() == name)
            .ok_or_else(|| {
                format!("expected disable, prefer, require, verify-ca or verify-full, got {name:?}")
            })
    }
}

impl TryFrom<String> for SslMode {
    type Error = String;

    fn try_from(name: String) -> Result<Self, Self::Error> {
        name.parse()
    }
}

impl From<SslMode> for PgSslMode {
    fn from(mode: SslMode) -> Self {
        match mode {
            SslMode::Disable => Self::Disable,
            SslMode::Prefer => Self::Prefer,
            SslMode::Require => Self::Require,
            SslMode::VerifyCa => Self::VerifyCa,
            SslMode::VerifyFull => Self::VerifyFull,
        }
    }
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
        if !self.ssl_root_cert.is_empty() && !std::path::Path::new(&self.ssl_root_cert).is_file() {
            return Err(format!(
                "database.ssl_root_cert {:?} is not a readable file",
                self.ssl_root_cert
            ));
        }
        if self.acquire_timeout_ms == 0 || self.statement_timeout_ms == 0 {
            return Err(
                "database.acquire_timeout_ms and database.statement_timeout_ms must be positive"
                    .into(),
            );
        }
        if self.idle_in_transaction_timeout_ms < 1_000 {
            return Err(format!(
                "database.idle_in_transaction_timeout_ms ({}) must be at least 1000: a busy \
                 service may pause between two statements of a transaction for some hundred \
                 milliseconds, and Postgres would end its session",
                self.idle_in_transaction_timeout_ms
            ));
        }
        if self.keepalive_secs < 3 {
            return Err(format!(
                "database.keepalive_secs ({}) must be at least 3",
                self.keepalive_secs
            ));
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
        // The URL may carry sslmode too; the setting wins when it is not the default.
        if self.ssl_mode != SslMode::Prefer || !self.url.contains("sslmode=") {
            options = options.ssl_mode(self.ssl_mode.into());
        }
        if !self.ssl_root_cert.is_empty() {
            options = options.ssl_root_cert(&self.ssl_root_cert);
        }
        let mut server = vec![
            (
                "statement_timeout",
                format!("{}ms", self.statement_timeout_ms),
            ),
            // No JIT compilation: every statement here is short. With
            // index_plans, a sequential scan that cannot be avoided (the
            // 3-row admission table, a count) is costed at 10^10, far past
            // jit_above_cost, so each supervisor pass compiled its
            // statements for 0.2 to 0.8 s of CPU. Measured: that took most
            // of Postgres's CPU at saturation (docs/performance.md).
            ("jit", "off".to_owned()),
            // A session stopped inside a transaction is ended, and its locks
            // released (see idle_in_transaction_timeout_ms).
            (
                "idle_in_transaction_session_timeout",
                format!("{}ms", self.idle_in_transaction_timeout_ms),
            ),
            // The server's end of the connection probes a silent client.
            ("tcp_keepalives_idle", self.keepalive_secs.to_string()),
            (
                "tcp_keepalives_interval",
                (self.keepalive_secs / 3).max(1).to_string(),
            ),
            ("tcp_keepalives_count", "3".to_owned()),
        ];
        if self.index_plans {
            for planner in ["enable_seqscan", "enable_hashjoin", "enable_mergejoin"] {
                server.push((planner, "off".to_owned()));
            }
        }
        Ok(options.application_name(application_name).options(server))
    }
}

/// A handle on the state store: a connection pool. Cheap to clone.
#[derive(Debug, Clone)]
pub struct Store {
    pool: PgPool,
    /// The deadline margins of the decisions taken through this store: how
    /// long before an attempt's deadline agents stop starting calls (the
    /// `start_by` of every request it dispatches), and how long after it an
    /// undo of an action whose outcome is unknown waits (see
    /// [`crate::machine::undo`]).
    deadlines: crate::DeadlineSettings,
    /// The largest step request the decisions taken through this store may
    /// build (`amqp.max_message_bytes`).
    max_request_bytes: usize,
    /// Connections the pool has opened so far: a new one after the first
    /// means the pool lost connections (a failover, a database restart) and
    /// what was committed before may be worth checking
    /// ([`Store::connections_opened`]).
    connections_opened: std::sync::Arc<std::sync::atomic::AtomicU64>,
    /// The last key line this store's claims served (see
    /// `Writes::claim_key_heads`): the next claim goes on after it, so
    /// that with more key lines than a claim serves none waits for good.
    pub(crate) key_cursor: std::sync::Arc<std::sync::Mutex<String>>,
    /// When the soonest rate-limited key line this store's last claim left
    /// waiting may start again ([`Store::next_key_start`]).
    pub(crate) next_key_start: std::sync::Arc<std::sync::Mutex<Option<std::time::Instant>>>,
}

/// The shortest wait [`Store::next_key_start`] asks of a claim loop.
pub const LEAST_KEY_WAKE: std::time::Duration = std::time::Duration::from_millis(5);

/// The largest step request a store builds unless told otherwise: the
/// default of `amqp.max_message_bytes`.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 65_536;

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
        let connections_opened = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let opened = connections_opened.clone();
        let pool = PgPoolOptions::new()
            .max_connections(settings.max_connections)
            .acquire_timeout(Duration::from_millis(settings.acquire_timeout_ms))
            .test_before_acquire(false)
            .after_connect(move |connection, _| {
                let opened = opened.clone();
                Box::pin(async move {
                    refuse_standby(connection).await?;
                    opened.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    Ok(())
                })
            })
            .connect_lazy_with(settings.connect_options(application_name)?);
        Ok(Self {
            pool,
            deadlines: crate::DeadlineSettings::default(),
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            connections_opened,
            key_cursor: std::sync::Arc::default(),
            next_key_start: std::sync::Arc::default(),
        })
    }

    /// How long until the soonest rate-limited key line whose rate held
    /// back this store's last claim may start one (`None`: no rate held
    /// one back, or it was asked already): a claim loop that wakes then,
    /// rather than at its interval, keeps a line to its rate instead of a
    /// little under it. Read once: a claim that fails before the key lines
    /// leaves none behind. Never under [`LEAST_KEY_WAKE`], so that a claim
    /// that took long cannot make the next one follow at once.
    pub fn next_key_start(&self) -> Option<std::time::Duration> {
        self.next_key_start
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .map(|at| {
                at.saturating_duration_since(std::time::Instant::now())
                    .max(LEAST_KEY_WAKE)
            })
    }

    /// Records when the soonest rate-limited key line may start next, from
    /// now (see [`Store::next_key_start`]).
    pub(crate) fn set_next_key_start(&self, due: Option<std::time::Duration>) {
        *self
            .next_key_start
            .lock()
            .unwrap_or_else(|e| e.into_inner()) = due.map(|due| std::time::Instant::now() + due);
    }

    /// How many connections to a primary the pool has opened so far. Less
    /// those open now, it says how many the pool closed: when it replaced
    /// connections it lost (a failover, a database or proxy restart), the
    /// scheduler checks that the primary it reaches holds what it
    /// acknowledged (its audit of acknowledged orders).
    pub fn connections_opened(&self) -> u64 {
        self.connections_opened
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// How many connections the pool holds now (those being opened
    /// included): with [`Store::connections_opened`], how many it closed.
    pub fn connections_open(&self) -> u32 {
        self.pool.size()
    }

    /// This store building step requests of at most `bytes` (the
    /// deployment's `amqp.max_message_bytes`): a larger one is refused where
    /// it is built, with the reason, instead of by the broker or an agent.
    pub fn with_max_request_bytes(mut self, bytes: usize) -> Self {
        self.max_request_bytes = bytes;
        self
    }

    /// This store deciding with the deployment's `[deadlines]`: the start
    /// margin of the requests it dispatches and the grace before an undo
    /// (see [`crate::timing`]). Services that start attempts or undos (the
    /// scheduler, the supervisor) must pass theirs. The operators' tools
    /// (the console, sasctl) pass theirs too: they only hand compensations
    /// to a claim, and the claiming scheduler's grace decides when each
    /// undo goes, but the time they record and hold the order until, and
    /// the attempts their key lines count in flight, follow theirs.
    pub fn with_deadlines(mut self, deadlines: crate::DeadlineSettings) -> Self {
        self.deadlines = deadlines;
        self
    }

    /// The writes: transitions of orders and operators' records.
    pub fn writes(&self) -> crate::Writes<'_> {
        crate::Writes::new(self)
    }

    /// The reads: what operators, clients and metrics are shown.
    pub fn reads(&self) -> crate::Reads<'_> {
        crate::Reads::new(self)
    }

    /// The agents' admission rows.
    pub fn admission(&self) -> crate::Admission<'_> {
        crate::Admission::new(self)
    }

    /// The schedules: managed by operators and tenants' clients, fired by
    /// the schedulers.
    pub fn schedules(&self) -> crate::Schedules<'_> {
        crate::Schedules::new(self)
    }

    /// The inputs of a decision taken now (database clock) by `actor`.
    pub(crate) fn context<'a>(
        &self,
        now: chrono::DateTime<chrono::Utc>,
        actor: &'a str,
    ) -> crate::machine::Context<'a> {
        crate::machine::Context {
            now,
            actor,
            next_attempt_id: sas_messages::AttemptId::new(),
            start_margin: self.deadlines.start_margin(),
            grace: self.deadlines.grace(),
            max_request_bytes: self.max_request_bytes,
            closed: None,
            closed_key: None,
        }
    }

    /// The largest step request this store builds.
    pub(crate) fn max_request_bytes(&self) -> usize {
        self.max_request_bytes
    }

    /// The start margin of the requests this store dispatches.
    pub(crate) fn start_margin(&self) -> Duration {
        self.deadlines.start_margin()
    }

    /// The grace before an undo of an action whose outcome is unknown.
    pub(crate) fn grace(&self) -> Duration {
        self.deadlines.grace()
    }

    /// The underlying pool, private to this crate: every read and write is
    /// a store method. The tests and the benchmark query through pools of
    /// their own (`sas_lab::pool`), or hand a store theirs
    /// ([`Store::on_pool`]).
    ///
    /// ```compile_fail
    /// fn reach(store: &sas_store::Store) {
    ///     let _ = store.pool();
    /// }
    /// ```
    pub(crate) fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// A store on a pool the caller made and keeps: the store's sessions
    /// are then the caller's too, for a test that must run its own
    /// statement on the session the store used (a statistics flush on a
    /// one-connection pool). It opens no door to a pool the caller did not
    /// already hold. The pool's sessions are as the caller set them (see
    /// [`DatabaseSettings::connect_options`]); connections are not counted
    /// in [`Store::connections_opened`].
    pub fn on_pool(pool: PgPool) -> Self {
        Self {
            pool,
            deadlines: crate::DeadlineSettings::default(),
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            connections_opened: std::sync::Arc::default(),
            key_cursor: std::sync::Arc::default(),
            next_key_start: std::sync::Arc::default(),
        }
    }

    /// Applies pending migrations. The process holds a Postgres advisory
    /// lock on the database while it migrates (sqlx's, asked for without
    /// waiting inside Postgres: see `migration_lock`), so several instances
    /// starting together apply each migration exactly once.
    ///
    /// # Errors
    /// When Postgres is unreachable or a migration fails.
    pub async fn migrate(&self) -> Result<(), StoreError> {
        let mut migrator = sqlx::migrate!("./migrations");
        migrator.set_locking(false);
        let mut connection = self.pool.acquire().await?;
        let lock = crate::migration_lock::lock(&mut connection).await?;
        let applied = migrator.run(&mut *connection).await;
        if crate::migration_lock::unlock(&mut connection, lock)
            .await
            .is_err()
        {
            // Closing the session gives the lock back with it; back in
            // the pool it would hold the lock for good.
            drop(connection.detach());
        }
        applied?;
        Ok(())
    }

    /// Applies the migrations if `settings.migrate` asks for it, waiting out
    /// a database that is not up yet (retrying transient errors with
    /// [`sas_runtime::retry::TRANSIENT`]'s waits) until `shutdown`. Returns false on shutdown.
    ///
    /// # Errors
    /// When a migration fails for good.
    pub async fn migrate_if_asked(
        &self,
        settings: &DatabaseSettings,
        shutdown: &tokio_util::sync::CancellationToken,
    ) -> Result<bool, StoreError> {
        if !settings.migrate {
            return Ok(true);
        }
        match sas_runtime::retry_transient(
            shutdown,
            "applying the migrations",
            StoreError::is_transient,
            || self.migrate(),
        )
        .await
        {
            Some(result) => result.map(|()| true),
            None => Ok(false),
        }
    }

    /// [`Store::is_reachable`] as a check the operations endpoint can hold
    /// (see `sas_runtime::ops::broker_and_database_readiness`).
    pub fn reachable_check(
        &self,
    ) -> impl Fn() -> futures_util::future::BoxFuture<'static, bool> + Send + Sync + 'static {
        let store = self.clone();
        move || {
            let store = store.clone();
            Box::pin(async move { store.is_reachable().await })
        }
    }

    /// True when the store answers as a primary that takes writes: the
    /// readiness probe. A standby, or a demoted primary, is not ready.
    pub async fn is_reachable(&self) -> bool {
        matches!(
            sqlx::query_scalar::<_, bool>("SELECT NOT pg_is_in_recovery()")
                .fetch_one(&self.pool)
                .await,
            Ok(true)
        )
    }
}

/// Refuses a new connection that reached a server in recovery (a standby,
/// or an old primary that came back as one): writes there would fail one
/// by one, and a pool holding it would keep failing. The error is
/// transient ([`StoreError::is_transient`]), so callers wait and connect
/// again, as when the primary is down; with HAProxy on Patroni's health
/// checks (docs/high-availability.md) the next try reaches the new primary.
async fn refuse_standby(connection: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    let standby: bool = sqlx::query_scalar("SELECT pg_is_in_recovery()")
        .fetch_one(connection)
        .await?;
    if standby {
        return Err(sqlx::Error::Io(std::io::Error::other(
            "connected to a Postgres standby (read-only): waiting for the primary; \
             check that database.url routes to the primary only",
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use sqlx::postgres::PgSslMode;

    use super::{DatabaseSettings, SslMode};

    fn settings(url: &str, ssl_mode: SslMode) -> DatabaseSettings {
        DatabaseSettings {
            url: url.to_owned(),
            password: None,
            max_connections: 1,
            acquire_timeout_ms: 1_000,
            statement_timeout_ms: 1_000,
            migrate: false,
            ssl_mode,
            ssl_root_cert: String::new(),
            index_plans: false,
            idle_in_transaction_timeout_ms: 5_000,
            keepalive_secs: 10,
        }
    }

    #[test]
    fn every_ssl_mode_is_read_by_its_libpq_name() {
        for (name, mode) in [
            ("disable", SslMode::Disable),
            ("prefer", SslMode::Prefer),
            ("require", SslMode::Require),
            ("verify-ca", SslMode::VerifyCa),
            ("verify-full", SslMode::VerifyFull),
        ] {
            assert_eq!(
                serde_json::from_value::<SslMode>(name.into()).unwrap(),
                mode
            );
        }
        assert_eq!(SslMode::default(), SslMode::Prefer);
    }

    #[test]
    fn an_unknown_ssl_mode_is_refused_naming_the_allowed_ones() {
        let error = serde_json::from_value::<SslMode>("verify_full".into())
            .unwrap_err()
            .to_string();
        for mode in SslMode::ALL {
            assert!(error.contains(mode.as_str()), "{error}");
        }
        assert!(error.contains("\"verify_full\""), "{error}");
    }

    #[test]
    fn the_url_s_sslmode_is_kept_unless_the_setting_asks_for_another_than_prefer() {
        let mode = |url: &str, ssl_mode| {
            settings(url, ssl_mode)
                .connect_options("test")
                .unwrap()
                .get_ssl_mode()
        };
        let with_require = "postgres://u@localhost/db?sslmode=require";
        assert!(matches!(
            mode(with_require, SslMode::Prefer),
            PgSslMode::Require
        ));
        assert!(matches!(
            mode(with_require, SslMode::VerifyFull),
            PgSslMode::VerifyFull
        ));
        assert!(matches!(
            mode("postgres://u@localhost/db", SslMode::Disable),
            PgSslMode::Disable
        ));
        assert!(matches!(
            mode("postgres://u@localhost/db", SslMode::Prefer),
            PgSslMode::Prefer
        ));
    }
}
