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
//! - [`circuit`]: the circuit breaker around the remote service (its gauges
//!   set again every [`CIRCUIT_TICK`]).
//! - [`handler`]: one request, from delivery to acknowledgement.
//! - [`clock`]: this agent's estimate of the database clock.

pub mod circuit;
pub mod clock;
pub mod handler;
pub mod pause;
pub mod remote;
pub mod settings;
pub mod turns;

use std::sync::Arc;
use std::time::Duration;

use sas_broker::lapin::Connection;
use sas_broker::{topology, BrokerError, Publisher, Session, SharedPublisher};
use tokio_util::sync::CancellationToken;

pub use settings::Settings;

use crate::circuit::CircuitBreaker;
use crate::clock::Clock;
use crate::remote::RemoteClient;

/// One remote service this replica calls, with its own breaker.
pub struct Lane {
    /// Agent name (`inventory`): the queue is `<prefix>sas.agent.<name>`.
    pub name: String,
    /// The remote service.
    pub remote: RemoteClient,
    /// The breaker around it.
    pub circuit: CircuitBreaker,
    /// Calls to the service in flight at once from this replica (a bulkhead,
    /// apart from the broker's prefetch, so that the next requests wait here
    /// already delivered while the service works). A freed slot goes to the
    /// most urgent request waiting ([`handler::slot_priority`]), tenants
    /// taking turns among equals: the agent's queue is first come, first
    /// served, and this is where priority and fairness can still count.
    pub calls: Arc<priority_semaphore::PrioritySemaphore>,
    /// The tenants' turns for the call slots.
    pub turns: Arc<turns::Turns>,
    /// Until when the service asked not to be called (`Retry-After`).
    pub pause: pause::Pause,
}

/// What every request handled by one agent replica shares.
pub struct Agent {
    /// Instance id, sent in replies.
    pub id: String,
    /// The settings it was started with.
    pub settings: Settings,
    /// The agents this replica serves (usually one; a comma-separated
    /// `agent.name` makes one replica serve several queues).
    pub lanes: Vec<Arc<Lane>>,
    /// Fired on SIGTERM: retries stop and the request goes back to the queue.
    pub shutdown: CancellationToken,
    /// The publisher of whichever broker connection is up: a reply a lost
    /// connection left unconfirmed is sent again on the next one.
    pub publishers: SharedPublisher,
    /// The local clock and how far it runs behind the database clock.
    pub clock: Clock,
}

/// Runs an agent replica until `shutdown`, then drains in-flight requests.
///
/// # Errors
/// When the settings are unusable. Broker outages are waited out.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let names = settings.agent.names();
    let kind = if names.len() == 1 {
        names[0].as_str()
    } else {
        "agent"
    };
    let id = sas_runtime::instance_id(kind, &settings.agent.id);
    if settings.amqp.service_users.is_empty() {
        tracing::warn!("amqp.service_users is empty: this agent obeys a step request from any broker user that may publish to its queue; set it to the schedulers' and supervisors' broker users");
    }
    let session = Session::new(settings.amqp.broker.clone(), id.clone());
    let readiness = session.clone();
    sas_runtime::ops::serve(
        &settings.http,
        sas_runtime::ops::broker_readiness(move || readiness.is_connected()),
        shutdown.clone(),
    )
    .await?;
    let mut lanes = Vec::with_capacity(names.len());
    for name in names {
        let url = settings.agent.remote_url_for(&name);
        tracing::info!(agent = %name, remote = %url, "serving agent queue");
        lanes.push(Arc::new(Lane {
            remote: RemoteClient::new(&name, &url, &settings.agent)?,
            circuit: CircuitBreaker::new(
                &name,
                settings.circuit.failure_threshold,
                Duration::from_millis(settings.circuit.cool_down_ms),
            ),
            calls: Arc::new(priority_semaphore::PrioritySemaphore::new(
                settings.agent.concurrency,
            )),
            turns: Arc::default(),
            pause: pause::Pause::new(&name, Duration::from_millis(settings.agent.max_pause_ms)),
            name,
        }));
    }
    tokio::spawn(publish_circuits(lanes.clone(), shutdown.clone()));
    let agent = Arc::new(Agent {
        id,
        clock: Clock::new(settings.agent.clock_offset_ms),
        settings,
        lanes,
        shutdown: shutdown.clone(),
        publishers: session.publisher(),
    });
    tracing::info!(agent = %agent.id, "agent starting");
    session
        .run(shutdown, |connection, publisher| {
            let agent = agent.clone();
            async move { agent.work(connection, publisher).await }
        })
        .await;
    Ok(())
}

/// How often each lane's circuit gauges are set again
/// ([`CircuitBreaker::publish`]), so that `sas_circuit_open_seconds` keeps
/// counting while no call decides anything.
pub const CIRCUIT_TICK: Duration = Duration::from_secs(1);

/// Sets the circuit gauges of `lanes` every [`CIRCUIT_TICK`] until
/// `shutdown`: a circuit that stays out of closed shows it, growing, even
/// when no request comes to ask it.
async fn publish_circuits(lanes: Vec<Arc<Lane>>, shutdown: CancellationToken) {
    let Ok(()) = sas_runtime::every(CIRCUIT_TICK, &shutdown, || {
        for lane in &lanes {
            lane.circuit.publish();
        }
        std::future::ready(Ok::<_, std::convert::Infallible>(sas_runtime::Next::Wait))
    })
    .await;
}

impl Agent {
    async fn work(
        self: Arc<Self>,
        connection: Arc<Connection>,
        publisher: Publisher,
    ) -> Result<(), BrokerError> {
        let amqp = &self.settings.amqp;
        let queues: Vec<String> = self
            .lanes
            .iter()
            .map(|lane| amqp.names().agent_requests(&lane.name))
            .collect();
        topology::declare(&connection, amqp, &queues).await?;
        let drain = Duration::from_millis(self.settings.agent.drain_ms);
        // Fired when this connection's work ends: dropped by the session when
        // the connection is lost, or done after the drain at shutdown. Calls
        // still running for its deliveries stop (the broker requeues them).
        let connection_lost = tokio_util::sync::CancellationToken::new();
        let _cancel_calls = connection_lost.clone().drop_guard();
        let consumers = self.lanes.iter().map(|lane| {
            let queue = amqp.names().agent_requests(&lane.name);
            let (me, lane, reply_publisher) = (self.clone(), lane.clone(), publisher.clone());
            let connection = connection.clone();
            let publisher = publisher.clone();
            let connection_lost = connection_lost.clone();
            async move {
                sas_broker::consume::consume(
                    &connection,
                    &me.settings.amqp.clone(),
                    &queue,
                    publisher,
                    me.shutdown.clone(),
                    drain,
                    move |delivery| {
                        let (me, lane, publisher, lost) = (
                            me.clone(),
                            lane.clone(),
                            reply_publisher.clone(),
                            connection_lost.clone(),
                        );
                        async move { me.handle(&lane, delivery, &publisher, &lost).await }
                    },
                )
                .await
            }
        });
        futures_util::future::try_join_all(consumers).await?;
        Ok(())
    }
}
