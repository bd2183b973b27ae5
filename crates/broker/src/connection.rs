//! Connecting to RabbitMQ, and the reconnect loop.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::uri::AMQPUri;
use lapin::{Connection, ConnectionProperties, Event};
use rand::RngExt;
use tokio_util::sync::CancellationToken;

use crate::error::timed;
use crate::publish::{Publisher, SharedPublisher};
use crate::settings::redact;
use crate::{AmqpSettings, BrokerError};

/// Opens one connection to the first node that answers, in the order of
/// [`AmqpSettings::node_uris`] (the url's, then `amqp.nodes`), each within the
/// operation timeout: for short-lived clients such as `sasctl`. Services use
/// a [`Session`], which also reconnects.
///
/// # Errors
/// When no node is reachable, refuses the credentials, or answers in time.
pub async fn connect(settings: &AmqpSettings, name: &str) -> Result<Connection, BrokerError> {
    let uris = settings
        .node_uris()
        .map_err(|reason| BrokerError::Settings { reason })?;
    let mut last_error = BrokerError::NotConnected;
    for uri in uris {
        match connect_node(settings, uri, name).await {
            Ok(connection) => return Ok(connection),
            Err(error) => last_error = error,
        }
    }
    Err(last_error)
}

/// Opens one connection to the node `uri` on the tokio runtime, within the
/// operation timeout.
async fn connect_node(
    settings: &AmqpSettings,
    uri: AMQPUri,
    name: &str,
) -> Result<Connection, BrokerError> {
    // lapin 4 runs on the current tokio runtime through its `tokio` feature.
    // Its automatic recovery stays off (the default): Session::run is our recovery.
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    let tls = settings
        .tls_config()
        .map_err(|reason| BrokerError::Settings { reason })?;
    let runtime = lapin::runtime::default_runtime().map_err(|source| BrokerError::Amqp {
        doing: "finding the tokio runtime",
        source,
    })?;
    timed(
        "connecting",
        settings.operation_timeout(),
        Connection::connect_uri_with_config(uri, properties, tls, runtime),
    )
    .await
}

/// The broker side of one service: a connection that is made again whenever
/// it is lost, a confirmed publisher shared with tasks that run outside the
/// session (such as the supervisor's scan), and a readiness flag.
#[derive(Clone)]
pub struct Session {
    settings: AmqpSettings,
    name: String,
    publisher: SharedPublisher,
    connected: Arc<AtomicBool>,
    /// The node the next connection tries first (an index into
    /// [`AmqpSettings::node_uris`]): a random one at start, so that a
    /// cluster's clients spread over its nodes, then the one after the node
    /// last connected to or tried.
    next_node: Arc<AtomicUsize>,
    /// Connections made so far: each publisher carries its number, so that
    /// a message left unconfirmed by one connection is sent again on a later one.
    generation: Arc<AtomicU64>,
}

impl Session {
    /// A session for the service instance `name` (shown in the management UI).
    pub fn new(settings: AmqpSettings, name: impl Into<String>) -> Self {
        Self {
            settings,
            name: name.into(),
            publisher: SharedPublisher::default(),
            connected: Arc::new(AtomicBool::new(false)),
            next_node: Arc::new(AtomicUsize::new(rand::rng().random_range(0..1024))),
            generation: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The publisher of the current connection, for tasks outside [`Session::run`].
    pub fn publisher(&self) -> SharedPublisher {
        self.publisher.clone()
    }

    /// True while a connection is up: the broker half of readiness.
    pub fn is_connected(&self) -> bool {
        self.connected.load(Ordering::Relaxed)
    }

    /// [`Session::is_connected`] as a check the operations endpoint can
    /// hold (see `sas_runtime::ops::broker_and_database_readiness`).
    pub fn connected_check(&self) -> impl Fn() -> bool + Send + Sync + 'static {
        let session = self.clone();
        move || session.is_connected()
    }

    /// Runs `work` on a fresh connection, again and again, until `shutdown`.
    ///
    /// `work` gets the connection and a confirmed publisher on it. When the
    /// connection fails (lapin reports a connection error, or `work` returns
    /// one), the work is dropped, and after a jittered, growing wait a new
    /// connection is made and `work` starts again. Deliveries that were
    /// unacknowledged on the lost connection are requeued by the broker.
    /// `work` returning `Ok` ends the loop: it does so after it has drained on
    /// shutdown.
    pub async fn run<F, Fut>(&self, shutdown: CancellationToken, mut work: F)
    where
        F: FnMut(Arc<Connection>, Publisher) -> Fut,
        Fut: Future<Output = Result<(), BrokerError>>,
    {
        let mut failures: u32 = 0;
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            match self.open().await {
                Ok((connection, publisher, lost, node)) => {
                    let connected_at = std::time::Instant::now();
                    tracing::info!(service = %self.name, url = %redact(&self.settings.url), node = %node, "connected to RabbitMQ");
                    self.publisher.set(Some(publisher.clone()));
                    self.connected.store(true, Ordering::Relaxed);
                    let result = tokio::select! {
                        result = work(connection.clone(), publisher) => result,
                        () = lost.cancelled() => Err(BrokerError::NotConnected),
                    };
                    self.connected.store(false, Ordering::Relaxed);
                    self.publisher.set(None);
                    let _ = tokio::time::timeout(
                        self.settings.operation_timeout(),
                        connection.close(200, "closing".into()),
                    )
                    .await;
                    // Ends this connection's event listener task (see `open`).
                    lost.cancel();
                    // A connection that fails again at once (a refused
                    // declaration, revoked rights) keeps the backoff growing.
                    if connected_at.elapsed() >= std::time::Duration::from_secs(10) {
                        failures = 0;
                    }
                    match result {
                        Ok(()) => return,
                        Err(error) => {
                            tracing::warn!(service = %self.name, error = %error, "lost RabbitMQ connection; reconnecting");
                        }
                    }
                }
                Err(error) => {
                    tracing::warn!(service = %self.name, error = %error, attempt = failures + 1, "cannot connect to RabbitMQ; retrying");
                }
            }
            failures = failures.saturating_add(1);
            let wait = self.reconnect_wait(failures);
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = shutdown.cancelled() => return,
            }
        }
    }

    fn reconnect_wait(&self, failures: u32) -> Duration {
        sas_runtime::Backoff::new(
            Duration::from_millis(self.settings.reconnect_base_ms),
            Duration::from_millis(self.settings.reconnect_max_ms),
            sas_runtime::Jitter::Equal,
        )
        .wait(failures)
    }

    /// Connects to the first node that answers, starting at `next_node`
    /// and going round the list once (no wait between nodes: a node that is
    /// down must not cost a backoff), and opens the publisher. Returns the
    /// node connected to, as `host:port`.
    async fn open(
        &self,
    ) -> Result<(Arc<Connection>, Publisher, CancellationToken, String), BrokerError> {
        let uris = self
            .settings
            .node_uris()
            .map_err(|reason| BrokerError::Settings { reason })?;
        let start = self.next_node.load(Ordering::Relaxed);
        let mut last_error = None;
        for offset in 0..uris.len() {
            let index = (start + offset) % uris.len();
            let uri = uris[index].clone();
            let node = format!("{}:{}", uri.authority.host, uri.authority.port);
            // Whatever happens, the next connection starts at the next node:
            // after a loss, the node that was lost is tried last.
            self.next_node.store(index + 1, Ordering::Relaxed);
            match self.open_node(uri).await {
                Ok((connection, publisher, lost)) => {
                    return Ok((connection, publisher, lost, node));
                }
                Err(error) => {
                    if uris.len() > 1 {
                        tracing::warn!(service = %self.name, node = %node, error = %error, "cannot connect to this RabbitMQ node; trying the next");
                    }
                    last_error = Some(error);
                }
            }
        }
        Err(last_error.unwrap_or(BrokerError::NotConnected))
    }

    async fn open_node(
        &self,
        uri: AMQPUri,
    ) -> Result<(Arc<Connection>, Publisher, CancellationToken), BrokerError> {
        let connection = connect_node(&self.settings, uri, &self.name).await?;
        let lost = CancellationToken::new();
        watch_errors(&connection, lost.clone());
        // On failure, cancelling `lost` ends the listener task.
        let generation = self.generation.fetch_add(1, Ordering::Relaxed) + 1;
        let mut publisher = Publisher::open(&connection, self.settings.operation_timeout())
            .await
            .inspect_err(|_| lost.cancel())?
            .of_generation(generation)
            .losing(lost.clone());
        if let Some(user) = self.settings.user() {
            publisher = publisher.identified_as(user);
        }
        Ok((Arc::new(connection), publisher, lost))
    }
}

/// Spawns a task that cancels `lost` when `connection` fails. The task ends
/// then, or when the owner of `lost` cancels it after closing the connection.
///
/// lapin 4 reports errors as events, and its stream also carries the errors of
/// single channels the broker closed (a passive declare's NOT_FOUND, an
/// ACCESS_REFUSED), which lapin 2's `on_error` did not. Those leave the
/// connection up (the call that caused them has already failed), so they must
/// not tear the session down. lapin marks the connection as failed before it
/// sends a connection error, so a soft error while still connected is a
/// channel's. Call it before anything can fail: lapin only sends events while
/// a listener exists.
fn watch_errors(connection: &Connection, lost: CancellationToken) {
    let mut events = Box::pin(connection.events_listener());
    let status = connection.status().clone();
    tokio::spawn(async move {
        loop {
            let event = tokio::select! {
                () = lost.cancelled() => return,
                event = events.next() => event,
            };
            match event {
                None => return,
                Some(Event::Error(error)) if status.connected() && error.is_amqp_soft_error() => {
                    tracing::debug!(error = %error, "RabbitMQ closed a channel");
                }
                Some(Event::Error(error)) => {
                    tracing::warn!(error = %error, "RabbitMQ connection error");
                    lost.cancel();
                    return;
                }
                Some(_) => {} // Connected, ConnectionBlocked, SendFlow, ... (non_exhaustive)
            }
        }
    });
}
