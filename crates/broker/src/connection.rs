//! Connecting to RabbitMQ, and the reconnect loop.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use lapin::{Connection, ConnectionProperties, Event};
use rand::RngExt;
use tokio_util::sync::CancellationToken;

use crate::error::timed;
use crate::publish::{Publisher, SharedPublisher};
use crate::settings::redact;
use crate::{AmqpSettings, BrokerError};

/// Opens one connection on the tokio runtime, within the operation timeout.
///
/// # Errors
/// When the broker is unreachable, refuses the credentials, or does not answer in time.
pub async fn connect(settings: &AmqpSettings, name: &str) -> Result<Connection, BrokerError> {
    // lapin 4 runs on the current tokio runtime through its `tokio` feature.
    // Its automatic recovery stays off (the default): Session::run is our recovery.
    let properties = ConnectionProperties::default().with_connection_name(name.into());
    timed(
        "connecting",
        settings.operation_timeout(),
        Connection::connect(&settings.url, properties),
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
}

impl Session {
    /// A session for the service instance `name` (shown in the management UI).
    pub fn new(settings: AmqpSettings, name: impl Into<String>) -> Self {
        Self {
            settings,
            name: name.into(),
            publisher: SharedPublisher::default(),
            connected: Arc::new(AtomicBool::new(false)),
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
                Ok((connection, publisher, lost)) => {
                    let connected_at = std::time::Instant::now();
                    tracing::info!(service = %self.name, url = %redact(&self.settings.url), "connected to RabbitMQ");
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
        let base = self.settings.reconnect_base_ms;
        let capped = base
            .saturating_mul(1u64 << failures.saturating_sub(1).min(16))
            .min(self.settings.reconnect_max_ms);
        Duration::from_millis(rand::rng().random_range(capped / 2..=capped))
    }

    async fn open(&self) -> Result<(Arc<Connection>, Publisher, CancellationToken), BrokerError> {
        let connection = connect(&self.settings, &self.name).await?;
        let lost = CancellationToken::new();
        watch_errors(&connection, lost.clone());
        // On failure, cancelling `lost` ends the listener task.
        let mut publisher = Publisher::open(&connection, self.settings.operation_timeout())
            .await
            .inspect_err(|_| lost.cancel())?;
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
