//! The Supervisor of the Scheduler Agent Supervisor pattern.
//!
//! It never calls agents or remote services and knows nothing of the
//! business: every `interval_ms` it finds held orders whose complete-by has
//! passed ([`scan`]) and decides "retry this step after a wait" or "undo this
//! order"; it records every dead-lettered message ([`dead_letters`]); and it
//! deletes finished orders and dead letters past their age ([`retention`]).
//!
//! Several supervisors may run: they share the work through
//! `FOR UPDATE SKIP LOCKED`, so no step is ever recovered twice (see
//! `sas_store::writes::recovery`). This was chosen over a leader lease because it
//! needs no failover at all: every instance is always working, and one dying
//! leaves nothing to expire.

pub mod dead_letters;
mod key_gauges;
pub mod retention;
pub mod scan;
pub mod settings;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use sas_announce::Announcer;
use sas_broker::lapin::Connection;
use sas_broker::{topology, BrokerError, Publisher, Session};
use sas_messages::QueueNames;
use sas_store::Store;
use tokio_util::sync::CancellationToken;

pub use settings::Settings;

/// What the tasks of one supervisor instance share.
pub struct Supervisor {
    /// Instance id, recorded as the actor in history.
    pub id: String,
    /// The settings it was started with.
    pub settings: Settings,
    /// The state store.
    pub store: Store,
    /// The broker session (status messages, dead-letter records).
    pub session: Session,
    /// Queue and exchange names.
    pub names: QueueNames,
    /// Publishes the status messages of its decisions, and counts them.
    pub announcer: Announcer,
    /// Fired on SIGTERM.
    pub shutdown: CancellationToken,
    /// The key lines exported with a label last time (see `key_gauges`),
    /// set to zero once idle.
    pub labelled_keys: std::sync::Mutex<std::collections::BTreeSet<String>>,
}

/// Runs a supervisor until `shutdown`.
///
/// # Errors
/// When the settings are unusable. Outages are waited out.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let id = sas_runtime::instance_id("supervisor", &settings.supervisor.id);
    // Its deadlines decide when an undo may be sent after a dead letter.
    let store = Store::connect_lazy(&settings.database, &id)
        .context("database settings")?
        .with_deadlines(settings.deadlines)
        .with_max_request_bytes(settings.amqp.max_message_bytes);
    let session = Session::new(settings.amqp.broker.clone(), id.clone());
    sas_runtime::ops::serve(
        &settings.http,
        sas_runtime::ops::broker_and_database_readiness(
            session.connected_check(),
            store.reachable_check(),
        ),
        shutdown.clone(),
    )
    .await?;
    if !store
        .migrate_if_asked(&settings.database, &shutdown)
        .await
        .context("cannot apply database migrations")?
    {
        return Ok(());
    }

    tracing::info!(supervisor = %id, interval_ms = settings.supervisor.interval_ms, max_failures = settings.supervisor.max_failures, "supervisor starting");
    let supervisor = Arc::new(Supervisor {
        id,
        names: settings.amqp.names(),
        announcer: Announcer::new(&settings.amqp),
        settings,
        store,
        session: session.clone(),
        shutdown: shutdown.clone(),
        labelled_keys: std::sync::Mutex::default(),
    });
    let scanning = tokio::spawn(supervisor.clone().scan_loop());
    let retiring = tokio::spawn(supervisor.clone().retention_loop());
    session
        .run(shutdown, |connection, publisher| {
            let supervisor = supervisor.clone();
            async move { supervisor.work(connection, publisher).await }
        })
        .await;
    // The scan loop stops on the same shutdown token; wait for its last
    // transaction. Retention stops the supervisor when its ages are below
    // the database's floor: that is the supervisor's error.
    if let Ok((_, Ok(Err(error)))) = tokio::time::timeout(
        Duration::from_millis(supervisor.settings.supervisor.drain_ms),
        async { tokio::join!(scanning, retiring) },
    )
    .await
    {
        return Err(error);
    }
    Ok(())
}

impl Supervisor {
    async fn work(
        self: Arc<Self>,
        connection: Arc<Connection>,
        publisher: Publisher,
    ) -> Result<(), BrokerError> {
        let amqp = &self.settings.amqp;
        topology::declare(&connection, amqp, &[]).await?;
        let queue = self.names.dead_letter_records();
        let me = self.clone();
        sas_broker::consume::consume(
            &connection,
            amqp,
            &queue,
            publisher,
            self.shutdown.clone(),
            Duration::from_millis(self.settings.supervisor.drain_ms),
            move |delivery| {
                let me = me.clone();
                async move { me.record_dead_letter(delivery).await }
            },
        )
        .await
    }
}
