//! Secure by default, proven against the local RabbitMQ and Postgres:
//!
//! - RabbitMQ refuses a client identity, with the permissions
//!   deploy/rabbitmq/setup-users.sh gives it, that publishes anywhere but the
//!   orders exchange or reads another client's queue;
//! - the whole system runs under the role users and their permissions, and
//!   a forged reply and forged dead-letter headers change no order;
//! - a 40 MiB message on any queue we consume stops nothing;
//! - sas_app, as deploy/postgres/roles.sql creates it, cannot update or
//!   delete history, retire younger than the owner's floor, or write
//!   _sqlx_migrations, and still runs the services.
//!
//! Users and roles are created with the test's own names and prefix, and
//! removed at the end, also when a test fails.

use sqlx::AssertSqlSafe;
use std::process::Command;
use std::time::Duration;

use sas_broker::lapin::options::{
    BasicConsumeOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use sas_broker::lapin::types::{AMQPValue, FieldTable};
use sas_broker::lapin::{BasicProperties, Connection};
use sas_broker::{topology, AmqpSettings};
use sas_messages::{headers, StepOutcome, StepReply, SCHEMA_VERSION};
use sas_store::ProcessState;
use sas_tests::process::{free_port, metric, Service};
use sas_tests::Setting;
use sas_tests::{order, repo_root, wait_until, TestEnv};
use sqlx::Connection as _;

/// The role users of one test, made by deploy/rabbitmq/setup-users.sh with
/// the test's prefix; deleted on drop (also after a panic).
pub(crate) struct BrokerUsers {
    prefix: String,
    users: [String; 4],
    pub(crate) clients: Vec<String>,
    console: String,
    password: String,
}

impl BrokerUsers {
    pub(crate) fn create(env: &TestEnv, clients: &[&str]) -> Self {
        let id = &env.id;
        let users = BrokerUsers {
            prefix: env.prefix.clone(),
            users: [
                format!("{id}-scheduler"),
                format!("{id}-supervisor"),
                format!("{id}-agent"),
                format!("{id}-client"),
            ],
            clients: clients.iter().map(|c| format!("{id}-{c}")).collect(),
            console: format!("{id}-console"),
            password: uuid::Uuid::new_v4().simple().to_string(),
        };
        for client in &users.clients {
            let output = users.script(client, false);
            assert!(
                output.status.success(),
                "setup-users.sh failed: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        users
    }

    fn script(&self, client: &str, delete: bool) -> std::process::Output {
        let mut command = Command::new("sh");
        command
            .arg(repo_root().join("deploy/rabbitmq/setup-users.sh"))
            .env("SAS_AMQP_PREFIX", &self.prefix)
            .env("SAS_RABBITMQ_SCHEDULER_USER", &self.users[0])
            .env("SAS_RABBITMQ_SUPERVISOR_USER", &self.users[1])
            .env("SAS_RABBITMQ_AGENT_USER", &self.users[2])
            .env("SAS_RABBITMQ_CLIENT_USER", client)
            .env("SAS_RABBITMQ_CONSOLE_USER", &self.console);
        for role in ["SCHEDULER", "SUPERVISOR", "AGENT", "CLIENT", "CONSOLE"] {
            command.env(format!("SAS_RABBITMQ_{role}_PASSWORD"), &self.password);
        }
        if delete {
            command.env("SAS_RABBITMQ_DELETE", "1");
        }
        command
            .output()
            .expect("run setup-users.sh (needs rabbitmqctl)")
    }

    /// An AMQP URL logging in as `user`.
    pub(crate) fn url(&self, user: &str) -> String {
        format!(
            "amqp://{user}:{}@127.0.0.1:5672/%2f?heartbeat=5",
            self.password
        )
    }
}

impl Drop for BrokerUsers {
    fn drop(&mut self) {
        for client in &self.clients {
            let _ = self.script(client, true);
        }
    }
}

pub(crate) fn settings_as(env: &TestEnv, url: String) -> AmqpSettings {
    AmqpSettings { url, ..env.amqp() }
}

/// Whether `result` is RabbitMQ's ACCESS_REFUSED.
fn refused<T>(what: &str, result: Result<T, String>) {
    match result {
        Ok(_) => panic!("RabbitMQ allowed {what}"),
        Err(error) => assert!(
            error.contains("ACCESS_REFUSED") || error.contains("access to"),
            "{what}: not an access refusal: {error}"
        ),
    }
}

/// Publishes on a channel of its own (a refusal closes the channel) and
/// waits for the confirm.
pub(crate) async fn try_publish(
    connection: &Connection,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    properties: BasicProperties,
) -> Result<(), String> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    channel
        .confirm_select(Default::default())
        .await
        .map_err(|e| e.to_string())?;
    let confirm = channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions {
                mandatory: true,
                ..Default::default()
            },
            body,
            properties,
        )
        .await
        .map_err(|e| e.to_string())?;
    let confirmation = tokio::time::timeout(Duration::from_secs(10), confirm)
        .await
        .map_err(|_| "no confirm within 10 s".to_owned())?
        .map_err(|e| e.to_string())?;
    if confirmation.is_ack() && confirmation.take_message().is_none() {
        Ok(())
    } else {
        Err("not confirmed or returned".to_owned())
    }
}

async fn try_consume(connection: &Connection, queue: &str) -> Result<(), String> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    channel
        .basic_consume(
            queue.into(),
            "".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

pub(crate) async fn try_declare(connection: &Connection, queue: &str) -> Result<(), String> {
    let channel = connection
        .create_channel()
        .await
        .map_err(|e| e.to_string())?;
    channel
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map(|_| ())
        .map_err(|e| e.to_string())
}

#[tokio::test]
async fn rabbitmq_refuses_a_client_outside_its_documented_permissions() {
    // Alone on the broker while setup-users.sh runs rabbitmqctl, a whole
    // Erlang node each time.
    let env = TestEnv::exclusive(3000).await;
    let (_guest, _) = env.broker().await;
    let users = BrokerUsers::create(&env, &["client", "other"]);
    let names = env.amqp().names();
    let client = &users.clients[0];
    let other_queue = format!("{}sas.client.{}.replies", env.prefix, users.clients[1]);
    {
        let other = sas_broker::connect(&settings_as(&env, users.url(&users.clients[1])), "other")
            .await
            .expect("the other client logs in");
        try_declare(&other, &other_queue)
            .await
            .expect("a client declares a queue of its own");
        let connection = sas_broker::connect(&settings_as(&env, users.url(client)), "client")
            .await
            .expect("the client logs in");
        let own_queue = format!("{}sas.client.{client}.replies", env.prefix);
        let body = serde_json::to_vec(&order("perm-1")).unwrap();

        // What a client may do: publish an order to the orders exchange,
        // declare and read its own reply queue.
        try_publish(
            &connection,
            &topology::orders_exchange(&env.amqp()),
            "",
            &body,
            BasicProperties::default(),
        )
        .await
        .expect("a client publishes an order to the orders exchange");
        try_declare(&connection, &own_queue)
            .await
            .expect("a client declares its reply queue");
        try_consume(&connection, &own_queue)
            .await
            .expect("a client reads its reply queue");

        // What it may not.
        for agent in ["inventory", "payment"] {
            refused(
                "a client publishing to an agent queue",
                try_publish(
                    &connection,
                    "",
                    &names.agent_requests(agent),
                    &body,
                    BasicProperties::default(),
                )
                .await,
            );
        }
        refused(
            "a client publishing to the reply queue",
            try_publish(
                &connection,
                "",
                &names.scheduler_replies(),
                &body,
                BasicProperties::default(),
            )
            .await,
        );
        refused(
            "a client publishing to the dead-letter exchange",
            try_publish(
                &connection,
                &names.dead_letter_exchange(),
                "",
                &body,
                BasicProperties::default(),
            )
            .await,
        );
        refused(
            "a client reading another client's queue",
            try_consume(&connection, &other_queue).await,
        );
        refused(
            "a client reading an agent queue",
            try_consume(&connection, &names.agent_requests("payment")).await,
        );
        refused(
            "a client declaring a queue in another client's name",
            try_declare(
                &connection,
                &format!("{}sas.client.{}.mine", env.prefix, users.clients[1]),
            )
            .await,
        );
        let _ = connection.close(200, "done".into()).await;
        let _ = other.close(200, "done".into()).await;
    }
    // The other client's queue never had a consumer, so auto-delete never
    // took it, and it is no part of the topology the harness deletes.
    let (guest, _) = env.broker().await;
    guest
        .create_channel()
        .await
        .unwrap()
        .queue_delete(other_queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    drop(users);
    let listed = Command::new("rabbitmqctl")
        .args(["-q", "list_users"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&listed.stdout).contains(&env.id),
        "the test's users were not removed"
    );
}

/// The services of one system, with the HTTP port of each.
struct Running {
    services: Vec<(Service, u16)>,
}

impl Running {
    async fn assert_alive(&mut self) {
        for (service, port) in &mut self.services {
            assert!(
                service.is_running(),
                "{} exited (log {})",
                service.name,
                service.log.display()
            );
            let health = sas_tests::http_get(format!("http://127.0.0.1:{port}/healthz"))
                .await
                .map(|r| r.status().as_u16());
            assert_eq!(health.ok(), Some(200), "{} /healthz", service.name);
        }
    }

    fn port(&self, name: &str) -> u16 {
        self.services
            .iter()
            .find(|(s, _)| s.name == name)
            .map(|(_, port)| *port)
            .expect("a service of that name")
    }
}

/// Starts a scheduler, a supervisor and one agent per queue, each on a known
/// port, with `urls` (scheduler, supervisor, agent) and `vars` for the
/// scheduler and supervisor; the agents get `amqp.service_users` from
/// `vars`, if it is there.
fn start(
    env: &TestEnv,
    sim: &sas_tests::sim::SimClient,
    urls: [String; 3],
    vars: &[Setting],
) -> Running {
    let mut services = Vec::new();
    let listen = |port: u16| Setting::Listen(port);
    let port = free_port();
    let mut all = vec![listen(port), Setting::AmqpUrl(urls[0].clone())];
    all.extend(vars.iter().cloned());
    services.push((env.scheduler(0, &all), port));
    let port = free_port();
    let mut all = vec![listen(port), Setting::AmqpUrl(urls[1].clone())];
    all.extend(vars.iter().cloned());
    services.push((env.supervisor(0, &all), port));
    for agent in sas_tests::env::AGENTS {
        let port = free_port();
        let mut all = vec![listen(port), Setting::AmqpUrl(urls[2].clone())];
        all.extend(
            vars.iter()
                .filter(|var| matches!(var, Setting::AmqpServiceUsers(_)))
                .cloned(),
        );
        services.push((env.agent(agent, 0, sim, &all), port));
    }
    Running { services }
}

async fn dead_letters(env: &TestEnv) -> Vec<(Option<String>, String, i32)> {
    let mut connection = sqlx::PgConnection::connect(&env.database_url)
        .await
        .expect("connect");
    sqlx::query_as("SELECT source_queue, reason, length(body) FROM dead_letters ORDER BY id")
        .fetch_all(&mut connection)
        .await
        .expect("read dead_letters")
}

async fn running_attempt(env: &TestEnv, order_id: &str, step: &str) -> Option<uuid::Uuid> {
    let mut connection = sqlx::PgConnection::connect(&env.database_url).await.ok()?;
    sqlx::query_scalar(
        "SELECT attempt_id FROM steps WHERE order_id = $1 AND name = $2 AND state = 'running'",
    )
    .bind(order_id)
    .bind(step)
    .fetch_optional(&mut connection)
    .await
    .ok()
    .flatten()
    .flatten()
}

#[tokio::test]
async fn under_role_users_a_forged_reply_and_forged_dead_letter_headers_change_nothing() {
    // Alone on the broker while setup-users.sh runs rabbitmqctl.
    let env = TestEnv::exclusive(8000).await;
    let users = BrokerUsers::create(&env, &["client"]);
    let (_guest_connection, guest) = env.broker().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    sim.set_faults(
        Some("payment"),
        serde_json::json!({ "latency_ms": 2500, "transient_fault_rate": 0.0,
            "permanent_fault_rate": 0.0, "hang_rate": 0.0 }),
    )
    .await
    .expect("slow payments");
    let [scheduler_user, supervisor_user, agent_user, _] = users.users.clone();
    let identities = [
        Setting::AmqpAgentUsers(agent_user.clone()),
        Setting::AmqpServiceUsers(format!("{scheduler_user},{supervisor_user}")),
    ];
    let mut system = start(
        &env,
        &sim,
        [
            users.url(&scheduler_user),
            users.url(&supervisor_user),
            users.url(&agent_user),
        ],
        &identities,
    );

    // The client publishes its order as a client may: to the orders exchange.
    let client = sas_broker::connect(&settings_as(&env, users.url(&users.clients[0])), "client")
        .await
        .expect("the client logs in");
    try_publish(
        &client,
        &topology::orders_exchange(&env.amqp()),
        "",
        &serde_json::to_vec(&order("victim-1")).unwrap(),
        BasicProperties::default().with_delivery_mode(2),
    )
    .await
    .expect("the order is accepted");

    let attempt_id = wait_until(
        "the charge to be in flight",
        Duration::from_secs(20),
        || async {
            running_attempt(&env, "victim-1", "charge_payment")
                .await
                .ok_or_else(|| "not yet".to_owned())
        },
    )
    .await;

    // guest can write anywhere, but is not an agent: its "declined" reply,
    // which would compensate the order, is refused.
    let forger = guest.identified_as("guest");
    let reply = StepReply {
        queued_ms: None,
        slot_wait_ms: None,
        retry_after_ms: None,
        call_ms: None,
        schema_version: SCHEMA_VERSION,
        order_id: "victim-1".into(),
        step: "charge_payment".into(),
        attempt_id: attempt_id.into(),
        agent_id: "payment-0".into(),
        outcome: StepOutcome::Failed {
            error: "declined (forged)".into(),
            permanent: true,
            maybe_applied: false,
        },
    };
    let names = env.amqp().names();
    forger
        .publish(
            "",
            &names.scheduler_replies(),
            &serde_json::to_vec(&reply).unwrap(),
            BasicProperties::default().with_correlation_id(attempt_id.to_string().into()),
            true,
        )
        .await
        .expect("publish the forged reply");
    // And dead-letter headers claiming the charge request died, under a
    // queue name that would become a metric label.
    let forged_label = format!("{}sas.agent.forged-{}", env.prefix, env.id);
    let mut table = FieldTable::default();
    for (key, value) in [
        (headers::DEAD_LETTER_REASON, "poison (forged)"),
        (headers::DEAD_LETTER_SOURCE_QUEUE, forged_label.as_str()),
        (headers::ORDER_ID, "victim-1"),
    ] {
        table.insert(key.into(), AMQPValue::LongString(value.to_owned().into()));
    }
    forger
        .publish(
            &names.dead_letter_exchange(),
            "",
            b"{}",
            BasicProperties::default()
                .with_headers(table)
                .with_correlation_id(attempt_id.to_string().into()),
            true,
        )
        .await
        .expect("publish the forged dead letter");

    // Both are recorded for the operator, and the order completes through
    // its real agent.
    let scheduler_port = system.port("scheduler-0");
    let supervisor_port = system.port("supervisor-0");
    wait_until(
        "the forgeries to be recorded",
        Duration::from_secs(20),
        || async {
            let rows = dead_letters(&env).await;
            let forged_reply = rows.iter().any(|(source, reason, _)| {
                reason.contains("forged reply refused")
                    && reason.contains("\"guest\"")
                    && source.as_deref() == Some(names.scheduler_replies().as_str())
            });
            let forged_dead_letter = rows.iter().any(|(source, reason, _)| {
                source.is_none() && reason.starts_with("untrusted dead letter")
            });
            if forged_reply && forged_dead_letter {
                Ok(())
            } else {
                Err(format!("{rows:?}"))
            }
        },
    )
    .await;
    env.wait_for_count(ProcessState::Processed, 1, Duration::from_secs(30))
        .await;
    assert_eq!(env.count(ProcessState::Compensated).await, 0);
    assert_eq!(
        metric(scheduler_port, "sas_forged_replies_total").await,
        Some(1.0)
    );
    let metrics_text = sas_tests::http_get(format!("http://127.0.0.1:{supervisor_port}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        !metrics_text.contains(&forged_label),
        "a forged header became a metric label"
    );
    assert!(
        metrics_text.contains(r#"sas_dead_lettered_total{queue="untrusted"}"#),
        "{metrics_text}"
    );
    let effects = sim.effects_by_order().await;
    assert_eq!(effects.get("victim-1"), Some(&(3, 0)), "{effects:?}");

    // guest may write to the payment agent's queue (RabbitMQ cannot stop a
    // user that writes to the default exchange), but is neither a scheduler
    // nor a supervisor: its charge is dead-lettered unread, and no call made.
    let payment_port = system.port("agent-payment-0");
    crate::resilience::send_charge(
        &env,
        &forger,
        &names.scheduler_replies(),
        "forged-1",
        (Duration::from_secs(30), Duration::from_secs(60)),
    )
    .await;
    let payment_queue = names.agent_requests("payment");
    wait_until(
        "the forged request to be dead-lettered",
        Duration::from_secs(20),
        || async {
            let rows = dead_letters(&env).await;
            if rows.iter().any(|(source, reason, _)| {
                reason.starts_with("request refused unread")
                    && reason.contains("\"guest\"")
                    && source.as_deref() == Some(payment_queue.as_str())
            }) {
                Ok(())
            } else {
                Err(format!("{rows:?}"))
            }
        },
    )
    .await;
    assert_eq!(
        metric(
            payment_port,
            r#"sas_agent_refused_requests_total{agent="payment"}"#
        )
        .await,
        Some(1.0)
    );
    let effects = sim.effects_by_order().await;
    assert!(!effects.contains_key("forged-1"), "{effects:?}");
    system.assert_alive().await;
    let _ = client.close(200, "done".into()).await;
}

#[tokio::test]
async fn a_40_mib_message_on_any_queue_stops_nothing() {
    let env = TestEnv::new().await;
    let (_connection, publisher) = env.broker().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let url = env.amqp_url.clone();
    let mut system = start(&env, &sim, [url.clone(), url.clone(), url], &[]);
    let names = env.amqp().names();
    let size = 40 * 1024 * 1024;
    let mut body = br#"{"schema_version":1,"order_id":"huge-1","pad":""#.to_vec();
    body.resize(size - 2, b'x');
    body.extend_from_slice(b"\"}");
    let queues = [
        names.orders(),
        names.agent_requests("payment"),
        names.scheduler_replies(),
        names.dead_letter_records(),
    ];
    for queue in &queues {
        env.publish_raw(&publisher, queue, &body).await;
    }
    drop(body);

    wait_until(
        "four dead letters recorded",
        Duration::from_secs(60),
        || async {
            let rows = dead_letters(&env).await;
            if rows.len() >= queues.len() {
                Ok(rows)
            } else {
                Err(format!("{rows:?}"))
            }
        },
    )
    .await;
    let rows = dead_letters(&env).await;
    for queue in &queues[..3] {
        let row = rows
            .iter()
            .find(|(source, _, _)| source.as_deref() == Some(queue.as_str()))
            .unwrap_or_else(|| panic!("no record of {queue}: {rows:?}"));
        assert!(
            row.1
                .contains(&format!("message of {size} bytes is over the limit")),
            "{row:?}"
        );
    }
    // Published straight to the record queue: recorded in part, its size said.
    assert!(
        rows.iter()
            .any(|(_, reason, _)| reason.contains(&format!("body of {size} bytes"))),
        "{rows:?}"
    );
    for (_, _, length) in &rows {
        assert!(*length <= 65_536, "a record keeps {length} bytes: {rows:?}");
    }
    system.assert_alive().await;

    // The system still works.
    env.publish_order(&publisher, &order("after-huge-1")).await;
    env.wait_for_count(ProcessState::Processed, 1, Duration::from_secs(30))
        .await;
    system.assert_alive().await;
}

/// A Postgres role of one test, dropped on drop (after the test's
/// database, which holds its privileges, is gone: declare it first).
struct AppRole(String);

impl Drop for AppRole {
    fn drop(&mut self) {
        let role = self.0.clone();
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            runtime.block_on(async {
                let url = std::env::var("SAS_TEST_DATABASE_ADMIN_URL").unwrap_or_else(|_| {
                    "postgres://postgres:postgres@127.0.0.1:5432/postgres".into()
                });
                if let Ok(mut admin) = sqlx::PgConnection::connect(&url).await {
                    let _ = sqlx::query(AssertSqlSafe(format!("DROP ROLE IF EXISTS {role}")))
                        .execute(&mut admin)
                        .await;
                }
            });
        })
        .join();
    }
}

/// Runs `statement` as `role` on `connection` and requires Postgres to
/// refuse it for want of privilege (42501), whether a grant or a trigger
/// refuses it.
async fn assert_refused(
    connection: &mut sqlx::PgConnection,
    role: &str,
    what: &str,
    statement: &'static str,
) {
    let error = sqlx::query(statement)
        .execute(connection)
        .await
        .expect_err(what);
    let code = error
        .as_database_error()
        .and_then(|e| e.code().map(|c| c.into_owned()));
    assert_eq!(
        code.as_deref(),
        Some("42501"),
        "{role} may not {what}: {error}"
    );
}

/// `url` with its user and password replaced.
fn as_user(url: &str, user: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}:unused@{host}")
}

#[tokio::test]
async fn sas_app_cannot_rewrite_history_retire_early_or_write_migrations_and_still_runs_the_services(
) {
    let role = AppRole(format!(
        "sas_app_t{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    ));
    let reader = AppRole(format!(
        "sas_reader_t{}",
        &uuid::Uuid::new_v4().simple().to_string()[..10]
    ));
    let env = TestEnv::unmigrated(3000).await;
    // As init-roles.sh does, with the admin as the owner, before the migrations.
    let output = Command::new("psql")
        .arg(&env.database_url)
        .args(["-v", "ON_ERROR_STOP=1", "-q"])
        .args(["-v", "owner=postgres"])
        .args(["-v", &format!("db={}", env.database)])
        .args(["-v", &format!("app_role={}", role.0)])
        .args(["-v", "app_password=unused"])
        .args(["-v", &format!("reader_role={}", reader.0)])
        .args(["-v", "reader_password=unused"])
        .arg("-f")
        .arg(repo_root().join("deploy/postgres/roles.sql"))
        .output()
        .expect("run psql");
    assert!(
        output.status.success(),
        "roles.sql: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    env.store.migrate().await.expect("migrate as the owner");

    let app_url = as_user(&env.database_url, &role.0);
    let mut app = sqlx::PgConnection::connect(&app_url)
        .await
        .expect("sas_app logs in");
    for (what, statement) in [
        ("delete history", "DELETE FROM history"),
        ("truncate history", "TRUNCATE history"),
        (
            "insert into _sqlx_migrations",
            "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
             VALUES (99999, 'forged', true, '\\x00', 0)",
        ),
        (
            "update _sqlx_migrations",
            "UPDATE _sqlx_migrations SET success = false",
        ),
        ("delete orders", "DELETE FROM orders"),
        // History is append-only (migration 0022's trigger), and the
        // retention floor the owner's alone.
        ("update history", "UPDATE history SET detail = 'forged'"),
        (
            "retire with an age of a microsecond",
            "SELECT sas_retire_finished(interval '1 microsecond', 1000)",
        ),
        (
            "retire dead letters with an age of a microsecond",
            "SELECT sas_retire_dead_letters(interval '1 microsecond', 1000)",
        ),
        (
            "retire schedule runs with an age of a microsecond",
            "SELECT sas_retire_schedule_runs(interval '1 microsecond', 1000)",
        ),
        ("delete schedule runs", "DELETE FROM schedule_runs"),
        (
            "lower the retention floor",
            "UPDATE retention_floor SET min_age = interval '0'",
        ),
    ] {
        assert_refused(&mut app, "sas_app", what, statement).await;
    }
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM _sqlx_migrations")
        .fetch_one(&mut app)
        .await
        .expect("sas_app reads which migrations ran");
    let _ = app.close().await;

    // The services need nothing more: an order runs under sas_app.
    let (_connection, publisher) = env.broker().await;
    let (_sim_process, sim) = env.remote_sim(&[]).await;
    let app_vars = [
        Setting::DatabaseUrl(app_url.clone()),
        Setting::DatabaseMigrate(false),
    ];
    let url = env.amqp_url.clone();
    let mut system = start(&env, &sim, [url.clone(), url.clone(), url], &app_vars);
    env.publish_order(&publisher, &order("as-app-1")).await;
    env.wait_for_count(ProcessState::Processed, 1, Duration::from_secs(30))
        .await;
    system.assert_alive().await;

    // The gateway's role reads and changes nothing.
    let reader_url = as_user(&env.database_url, &reader.0);
    let mut read_only = sqlx::PgConnection::connect(&reader_url)
        .await
        .expect("sas_reader logs in");
    let stored: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
        .fetch_one(&mut read_only)
        .await
        .expect("sas_reader reads the orders");
    assert_eq!(stored, 1);
    for (what, statement) in [
        (
            "insert an order",
            "INSERT INTO orders (order_id, body) VALUES ('forged', '{}')",
        ),
        (
            "update a process",
            "UPDATE order_process SET state = 'error'",
        ),
        (
            "append to history",
            "INSERT INTO history (order_id, actor, event) SELECT order_id, 'x', 'x' FROM orders",
        ),
        (
            "retire",
            "SELECT sas_retire_finished(interval '30 days', 1)",
        ),
    ] {
        assert_refused(&mut read_only, "sas_reader", what, statement).await;
    }
    let _ = read_only.close().await;
    let (mut gateway, base) = crate::gateway::gateway(
        &env,
        &[
            Setting::DatabaseUrl(reader_url),
            Setting::DatabaseMigrate(false),
        ],
    )
    .await;
    let status = sas_tests::http_client()
        .get(format!("{base}/v1/orders/as-app-1"))
        .bearer_auth(crate::gateway::SECRET)
        .send()
        .await
        .expect("the gateway answers");
    assert_eq!(
        status.status(),
        reqwest::StatusCode::OK,
        "the gateway reads an order as sas_reader"
    );
    assert!(gateway.is_running());

    // A supervisor asked to retire younger than the floor (an hour) says so
    // at start rather than fail every pass.
    let mut refused = env.supervisor(
        1,
        &[
            Setting::DatabaseUrl(app_url.clone()),
            Setting::DatabaseMigrate(false),
            Setting::RetentionFinishedSecs(1),
        ],
    );
    wait_until(
        "the supervisor below the floor exits",
        Duration::from_secs(30),
        || {
            let running = refused.is_running();
            async move {
                if running {
                    Err("still running".to_string())
                } else {
                    Ok(())
                }
            }
        },
    )
    .await;
    let log = refused.log_text();
    assert!(
        log.contains(
            "retention.finished_secs = 1 is below the database's retention floor of 3600 s"
        ),
        "{log}"
    );
    // Retention deletes history only through the owner's function, which
    // deletes nothing but finished orders past their age: sas_app may run it
    // once the owner has lowered the floor.
    sqlx::query("UPDATE retention_floor SET min_age = interval '1 second'")
        .execute(&env.db)
        .await
        .expect("the owner lowers the floor");
    let mut retiring = env.supervisor(
        1,
        &[
            Setting::DatabaseUrl(app_url.clone()),
            Setting::DatabaseMigrate(false),
            Setting::RetentionFinishedSecs(1),
            Setting::RetentionIntervalMs(100),
        ],
    );
    env.wait_for_none(
        "history lines of the finished order",
        "SELECT count(*) FROM history",
        Duration::from_secs(30),
    )
    .await;
    assert!(retiring.is_running());
}
