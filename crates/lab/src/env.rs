//! One test's private world: a database, a queue prefix, a folder for logs.

use sqlx::postgres::PgPoolOptions;
use sqlx::{AssertSqlSafe, PgPool};
use std::path::PathBuf;
use std::time::Duration;

use sas_broker::lapin::{BasicProperties, Connection};
use sas_broker::{topology, AmqpSettings, Publisher};
use sas_messages::SubmitOrder;
use sas_store::connect::SslMode;
use sas_store::{DatabaseSettings, DeadlineSettings, ProcessState, Store};
use sqlx::Connection as _;

use crate::servers::ServerGuard;

/// The built-in order workflow: (step, agent, action, compensation).
pub(crate) const STEPS: [(&str, &str, &str, &str); 3] = [
    ("reserve_stock", "inventory", "reserve", "release"),
    ("charge_payment", "payment", "charge", "refund"),
    ("create_shipment", "shipping", "ship", "cancel"),
];

/// Agents of the built-in workflow.
pub const AGENTS: [&str; 3] = ["inventory", "payment", "shipping"];

/// The folder holding the workspace's binaries (`target/debug` or
/// `target/release`), found from the running executable.
///
/// # Panics
/// When the test executable's path is unusual.
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current_exe");
    let dir = exe.parent().expect("the executable has a folder");
    // A binary of the workspace (the benchmark) lives beside the services;
    // a test executable one level down, in deps/.
    if dir.join("scheduler").exists() {
        return dir.to_path_buf();
    }
    dir.parent()
        .expect("test binary lives in target/<profile>/deps")
        .to_path_buf()
}

/// A test's own database and queue prefix, dropped when the value is,
/// and its hold on the servers they live on ([`crate::servers`]).
pub struct TestEnv {
    /// Short unique id, part of every name.
    pub id: String,
    /// Queue-name prefix (`t<id>.`).
    pub prefix: String,
    /// Database name.
    pub database: String,
    /// URL of the test's database.
    pub database_url: String,
    /// RabbitMQ URL.
    pub amqp_url: String,
    /// A store on the test's database (migrated).
    pub store: Store,
    /// The test's own pool on its database, for the ad hoc queries a store
    /// does not offer (its sessions set as [`database_settings`] says).
    pub db: PgPool,
    /// Folder for this test's logs, workflow file and journals.
    pub dir: PathBuf,
    /// Deadline of each step attempt in the test workflow, in milliseconds.
    pub step_timeout_ms: u64,
    /// The test's hold on the shared RabbitMQ and Postgres, shared or
    /// exclusive, for the env's life (let go after the teardown).
    servers: ServerGuard,
}

fn admin_url() -> String {
    std::env::var("SAS_TEST_DATABASE_ADMIN_URL")
        .unwrap_or_else(|_| "postgres://postgres:postgres@127.0.0.1:5432/postgres".into())
}

fn amqp_url() -> String {
    std::env::var("SAS_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=5".into())
}

impl TestEnv {
    /// A new database (migrated) and prefix, with 3-second step deadlines,
    /// sharing the servers with other tests.
    ///
    /// # Panics
    /// When Postgres cannot be reached.
    pub async fn new() -> Self {
        Self::with_step_timeout(3000).await
    }

    /// As [`TestEnv::new`], with the given step deadline.
    ///
    /// # Panics
    /// When Postgres cannot be reached.
    pub async fn with_step_timeout(step_timeout_ms: u64) -> Self {
        Self::migrated(step_timeout_ms, ServerGuard::shared().await).await
    }

    /// As [`TestEnv::with_step_timeout`], holding the RabbitMQ and Postgres
    /// servers alone for the env's life (waiting until the tests using them
    /// are done, and keeping new ones out): for tests that restart them,
    /// cut their connections, or load the whole machine. See
    /// [`crate::servers`].
    ///
    /// # Panics
    /// When Postgres cannot be reached.
    pub async fn exclusive(step_timeout_ms: u64) -> Self {
        Self::migrated(step_timeout_ms, ServerGuard::exclusive().await).await
    }

    async fn migrated(step_timeout_ms: u64, servers: ServerGuard) -> Self {
        let env = Self::open(step_timeout_ms, servers).await;
        env.store
            .migrate()
            .await
            .expect("migrate the test database");
        env
    }

    /// As [`TestEnv::with_step_timeout`], but with an empty database: the
    /// services must apply the migrations themselves.
    ///
    /// # Panics
    /// When Postgres cannot be reached.
    pub async fn unmigrated(step_timeout_ms: u64) -> Self {
        Self::open(step_timeout_ms, ServerGuard::shared().await).await
    }

    /// Whether this env holds the servers alone ([`TestEnv::exclusive`]).
    pub fn is_exclusive(&self) -> bool {
        self.servers.is_exclusive()
    }

    async fn open(step_timeout_ms: u64, servers: ServerGuard) -> Self {
        let id = format!("t{}", &uuid::Uuid::new_v4().simple().to_string()[..10]);
        let database = format!("sas_{id}");
        let mut admin = sqlx::PgConnection::connect(&admin_url())
            .await
            .expect("connect to Postgres as admin (set SAS_TEST_DATABASE_ADMIN_URL)");
        sqlx::query(AssertSqlSafe(format!("CREATE DATABASE {database}")))
            .execute(&mut admin)
            .await
            .expect("create the test database");
        let _ = admin.close().await;
        let database_url = {
            let base = admin_url();
            let cut = base.rfind('/').expect("admin URL has a database");
            format!("{}/{database}", &base[..cut])
        };
        // The default deadlines, not the services' (deadlines_for): the
        // state-machine test's model decides with the defaults. Its key
        // lines so count an attempt let go of for 2 s after its deadline.
        let store = Store::connect_lazy(&database_settings(&database_url), "sas-tests")
            .expect("store settings");
        let db = pool(&database_settings(&database_url), "sas-tests-queries");
        let dir = bin_dir().join("test-runs").join(&id);
        std::fs::create_dir_all(&dir).expect("create the test folder");
        let env = Self {
            prefix: format!("{id}."),
            id,
            database,
            database_url,
            amqp_url: amqp_url(),
            store,
            db,
            dir,
            step_timeout_ms,
            servers,
        };
        std::fs::write(env.workflow_file(), env.workflow_text()).expect("write the workflow");
        eprintln!(
            "test env {}{}: logs in {}",
            env.id,
            if env.is_exclusive() {
                " (RabbitMQ and Postgres held alone)"
            } else {
                ""
            },
            env.dir.display()
        );
        env
    }

    /// The test workflow file: the built-in steps with the test's deadline.
    pub fn workflow_file(&self) -> PathBuf {
        self.dir.join("workflow.toml")
    }

    /// Writes `files` (file name, TOML text) to the test's workflows folder
    /// and returns the settings that make a scheduler run that folder
    /// instead of the test workflow file.
    ///
    /// # Panics
    /// When the folder cannot be written.
    pub fn workflows(&self, files: &[(&str, &str)]) -> [crate::Setting; 2] {
        let folder = self.dir.join("workflows");
        std::fs::create_dir_all(&folder).expect("create the workflows folder");
        for (name, text) in files {
            std::fs::write(folder.join(name), text).expect("write a workflow file");
        }
        [
            crate::Setting::SchedulerWorkflowFile(String::new()),
            crate::Setting::SchedulerWorkflowDir(folder.display().to_string()),
        ]
    }

    /// A workflow call step as TOML, with the test's deadline, in `group`
    /// if one is named.
    pub fn call_step(
        &self,
        (name, agent, action, compensation): (&str, &str, &str, &str),
        group: Option<&str>,
    ) -> String {
        let group = group.map_or_else(String::new, |g| format!("group = \"{g}\"\n"));
        format!(
            "[[steps]]\nname = \"{name}\"\nagent = \"{agent}\"\naction = \"{action}\"\n\
             compensation = \"{compensation}\"\ntimeout_ms = {}\n{group}\n",
            self.step_timeout_ms
        )
    }

    /// The test workflow's steps, as the store copies them onto an order
    /// (for tests that write orders straight into the store).
    pub fn steps(&self) -> Vec<sas_store::NewStep> {
        STEPS
            .iter()
            .map(|(name, agent, action, compensation)| sas_store::NewStep {
                name: (*name).into(),
                kind: sas_store::machine::kind::Kind::Call(
                    sas_store::machine::kind::CallStep::new(agent, action, Some(compensation)),
                ),
                timeout: std::time::Duration::from_millis(self.step_timeout_ms),
                group: None,
            })
            .collect()
    }

    fn workflow_text(&self) -> String {
        let mut text = String::from("name = \"order\"\n");
        for (name, agent, action, compensation) in STEPS {
            text.push_str(&format!(
                "[[steps]]\nname = \"{name}\"\nagent = \"{agent}\"\naction = \"{action}\"\ncompensation = \"{compensation}\"\ntimeout_ms = {}\n",
                self.step_timeout_ms
            ));
        }
        text
    }

    /// AMQP settings of this test's deployment.
    pub fn amqp(&self) -> AmqpSettings {
        AmqpSettings {
            url: self.amqp_url.clone(),
            nodes: Vec::new(),
            prefix: self.prefix.clone(),
            prefetch: 32,
            operation_timeout_ms: 10_000,
            delivery_limit: 3,
            max_message_bytes: 65_536,
            reconnect_base_ms: 100,
            reconnect_max_ms: 1_000,
            status_exchange: true,
            tls_ca_file: String::new(),
        }
    }

    /// A connection to RabbitMQ, with this test's topology declared (so
    /// messages can be published before the services have started).
    ///
    /// # Panics
    /// When RabbitMQ cannot be reached.
    pub async fn broker(&self) -> (Connection, Publisher) {
        self.broker_with(self.amqp()).await
    }

    /// [`TestEnv::broker`] with `settings` (a test that runs its services
    /// with another `amqp.delivery_limit` must declare the queues with it:
    /// it is a queue argument).
    ///
    /// # Panics
    /// When RabbitMQ cannot be reached.
    pub async fn broker_with(&self, settings: AmqpSettings) -> (Connection, Publisher) {
        let connection = sas_broker::connect(&settings, &format!("{}-test", self.id))
            .await
            .expect("connect to RabbitMQ");
        let channel = connection.create_channel().await.expect("channel");
        topology::declare_common(&channel, &settings)
            .await
            .expect("declare");
        let names = settings.names();
        for queue in [names.orders(), names.events(), names.scheduler_replies()]
            .into_iter()
            .chain(AGENTS.iter().map(|agent| names.agent_requests(agent)))
        {
            topology::declare_work_queue(&channel, &settings, &queue)
                .await
                .expect("declare a work queue");
        }
        let publisher = Publisher::open(&connection, settings.operation_timeout())
            .await
            .expect("publisher");
        (connection, publisher)
    }

    /// Publishes an order (confirmed) as any AMQP client would.
    ///
    /// # Panics
    /// When the broker does not confirm it.
    pub async fn publish_order(&self, publisher: &Publisher, order: &SubmitOrder) {
        let body = serde_json::to_vec(order).expect("serialize");
        self.publish_raw(publisher, &self.amqp().names().orders(), &body)
            .await;
    }

    /// Publishes an event for an order's wait step (confirmed), as any
    /// AMQP client would.
    ///
    /// # Panics
    /// When the broker does not confirm it.
    pub async fn publish_event(&self, publisher: &Publisher, event: &sas_messages::OrderEvent) {
        let body = serde_json::to_vec(event).expect("serialize");
        self.publish_raw(publisher, &self.amqp().names().events(), &body)
            .await;
    }

    /// Publishes raw bytes to a queue (confirmed, persistent).
    ///
    /// # Panics
    /// When the broker does not confirm them.
    pub async fn publish_raw(&self, publisher: &Publisher, queue: &str, body: &[u8]) {
        publisher
            .publish(
                "",
                queue,
                body,
                BasicProperties::default().with_delivery_mode(2),
                true,
            )
            .await
            .expect("publish");
    }

    /// How many orders are in `state`.
    ///
    /// # Panics
    /// When the database cannot be read.
    pub async fn count(&self, state: ProcessState) -> i64 {
        self.store
            .reads()
            .count_by_state()
            .await
            .expect("count orders")
            .into_iter()
            .find(|(s, _)| *s == state)
            .map_or(0, |(_, n)| n)
    }

    /// Waits until `n` orders are in `state`, printing the spread by state if not.
    ///
    /// # Panics
    /// When the deadline passes.
    pub async fn wait_for_count(&self, state: ProcessState, n: i64, timeout: Duration) {
        crate::wait_until(&format!("{n} orders {state}"), timeout, || async {
            let counts = self
                .store
                .reads()
                .count_by_state()
                .await
                .map_err(|e| e.to_string())?;
            let have = counts
                .iter()
                .find(|(s, _)| *s == state)
                .map_or(0, |(_, n)| *n);
            if have >= n {
                Ok(())
            } else {
                Err(format!("{counts:?}"))
            }
        })
        .await;
    }
}

/// The deadline margins of a deployment whose steps have `step_timeout_ms`
/// (the defaults suit deadlines of seconds): what the services get
/// ([`TestEnv::base_settings`]), and sasctl too.
pub fn deadlines_for(step_timeout_ms: u64) -> DeadlineSettings {
    DeadlineSettings {
        start_margin_ms: step_timeout_ms / 10,
        grace_ms: step_timeout_ms / 5,
        max_clock_skew_ms: step_timeout_ms / 20,
    }
}

impl Drop for TestEnv {
    /// Drops the database and deletes the queues and exchanges, on a thread of
    /// its own (Drop cannot await), also when the test panicked.
    fn drop(&mut self) {
        let database = self.database.clone();
        let settings = self.amqp();
        let cleanup = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async move {
                if let Ok(mut admin) = sqlx::PgConnection::connect(&admin_url()).await {
                    if let Err(error) = sqlx::query(AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {database} WITH (FORCE)"
                    )))
                    .execute(&mut admin)
                    .await
                    {
                        eprintln!("could not drop {database}: {error}");
                    }
                }
                if let Ok(connection) = sas_broker::connect(&settings, "sas-tests-cleanup").await {
                    if let Err(error) = topology::delete_all(&connection, &settings, &AGENTS).await
                    {
                        eprintln!("could not delete queues of {}: {error}", settings.prefix);
                    }
                    let _ = connection.close(200, "cleanup".into()).await;
                }
            });
        });
        let _ = cleanup.join();
    }
}

/// Settings of the tests' own pool on the database at `url`: ad hoc
/// queries, so the planner makes its own choices (`index_plans` off).
pub fn database_settings(url: &str) -> DatabaseSettings {
    DatabaseSettings {
        url: url.to_owned(),
        password: None,
        max_connections: 4,
        acquire_timeout_ms: 10_000,
        statement_timeout_ms: 30_000,
        migrate: true,
        ssl_mode: SslMode::Prefer,
        ssl_root_cert: String::new(),
        index_plans: false,
        // Tests hold locks in transactions of their own on purpose, for
        // longer than a service may.
        idle_in_transaction_timeout_ms: 600_000,
        keepalive_secs: 10,
    }
}

/// A pool with the sessions a store with these settings would open (its
/// statement timeout, `jit`, planner settings), for queries of the tests'
/// and the benchmark's own: the store's pool is private to it.
///
/// # Panics
/// When the URL does not parse.
pub fn pool(settings: &DatabaseSettings, application_name: &str) -> PgPool {
    PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(Duration::from_millis(settings.acquire_timeout_ms))
        .connect_lazy_with(
            settings
                .connect_options(application_name)
                .expect("database settings"),
        )
}

/// Whether a database of this name exists (teardown checks).
///
/// # Panics
/// When Postgres cannot be reached.
pub async fn database_exists(name: &str) -> bool {
    let mut admin = sqlx::PgConnection::connect(&admin_url())
        .await
        .expect("admin connection");
    sqlx::query_scalar::<_, bool>("SELECT EXISTS (SELECT 1 FROM pg_database WHERE datname = $1)")
        .bind(name)
        .fetch_one(&mut admin)
        .await
        .expect("query pg_database")
}
