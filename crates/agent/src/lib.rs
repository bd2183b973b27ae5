//! An Agent of the Scheduler Agent Supervisor pattern.
//!
//! Each replica is a competing consumer on its agent's request queue. For one
//! request it calls the remote service with the step's idempotency key,
//! retries transient faults with exponential backoff and full jitter but
//! never past the request's complete-by, and publishes the reply to the
//! request's `reply_to` with the same correlation id. It acknowledges the
//! request only after the broker confirmed the reply.
//!
//! - [`remote`]: the HTTP call and how its answers are classified.
//! - [`circuit`]: the circuit breaker around the remote service.
//! - [`handler`]: one request, from delivery to acknowledgement.

pub mod circuit;
pub mod handler;
pub mod remote;
pub mod settings;

use std::sync::Arc;
use std::time::Duration;

use sas_broker::lapin::Connection;
use sas_broker::{topology, BrokerError, Publisher, Session};
use tokio_util::sync::CancellationToken;

pub use settings::Settings;

use crate::circuit::CircuitBreaker;
use crate::remote::RemoteClient;

/// What every request handled by one agent replica shares.
pub struct Agent {
    /// Instance id, sent in replies.
    pub id: String,
    /// The settings it was started with.
    pub settings: Settings,
    /// The remote service.
    pub remote: RemoteClient,
    /// The breaker around it.
    pub circuit: CircuitBreaker,
    /// Fired on SIGTERM: retries stop and the request goes back to the queue.
    pub shutdown: CancellationToken,
}

/// Runs an agent replica until `shutdown`, then drains in-flight requests.
///
/// # Errors
/// When the settings are unusable. Broker outages are waited out.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let id = if settings.agent.id.is_empty() {
        format!(
            "{}-{}",
            settings.agent.name,
            &uuid::Uuid::new_v4().simple().to_string()[..8]
        )
    } else {
        settings.agent.id.clone()
    };
    let session = Session::new(settings.amqp.clone(), id.clone());
    let readiness = session.clone();
    sas_runtime::ops::serve(
        &settings.http.listen,
        Arc::new(move || {
            let connected = readiness.is_connected();
            Box::pin(async move {
                if connected {
                    Ok(())
                } else {
                    Err("not connected to RabbitMQ".to_owned())
                }
            })
        }),
        shutdown.clone(),
    )
    .await?;
    let agent = Arc::new(Agent {
        remote: RemoteClient::new(&settings.agent.remote_url)?,
        circuit: CircuitBreaker::new(
            &settings.agent.name,
            settings.circuit.failure_threshold,
            Duration::from_millis(settings.circuit.cool_down_ms),
        ),
        id,
        settings,
        shutdown: shutdown.clone(),
    });
    tracing::info!(agent = %agent.id, remote = %agent.settings.agent.remote_url, "agent starting");
    session
        .run(shutdown, |connection, publisher| {
            let agent = agent.clone();
            async move { agent.work(connection, publisher).await }
        })
        .await;
    Ok(())
}

impl Agent {
    async fn work(
        self: Arc<Self>,
        connection: Arc<Connection>,
        publisher: Publisher,
    ) -> Result<(), BrokerError> {
        let amqp = &self.settings.amqp;
        let queue = amqp.names().agent_requests(&self.settings.agent.name);
        let channel = connection
            .create_channel()
            .await
            .map_err(|source| BrokerError::Amqp {
                doing: "opening a channel",
                source,
            })?;
        topology::declare_common(&channel, amqp).await?;
        topology::declare_work_queue(&channel, amqp, &queue).await?;
        let _ = channel.close(200, "declared").await;
        let me = self.clone();
        let reply_publisher = publisher.clone();
        sas_broker::consume::consume(
            &connection,
            amqp,
            &queue,
            publisher,
            self.shutdown.clone(),
            Duration::from_millis(self.settings.agent.drain_ms),
            move |delivery| {
                let me = me.clone();
                let publisher = reply_publisher.clone();
                async move { me.handle(delivery, &publisher).await }
            },
        )
        .await
    }
}
