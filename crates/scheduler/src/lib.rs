//! The Scheduler of the Scheduler Agent Supervisor pattern.
//!
//! It owns the workflow: it takes in submitted orders ([`intake`]), sends each
//! step to its agent and advances on the agent's reply ([`replies`]), and
//! claims the orders the supervisor sent back for another try ([`claim`]),
//! and fires the durable schedules that are due ([`schedules`]).
//! Every state change is a transaction in the state store; requests and
//! status messages are published only after it commits (by
//! [`sas_announce::Announcer`], which the supervisor shares).
//!
//! Any number of schedulers may run: they compete on the orders queue, share
//! one durable reply queue, and the store's row locks make sure no two of them
//! change the same order at once.

pub mod audit;
pub mod catalog;
pub mod claim;
pub mod events;
pub mod intake;
mod quota;
pub mod refusal;
pub mod replies;
pub mod schedule_commands;
pub mod schedules;
pub mod senders;
pub mod settings;
pub mod workflow;

use std::sync::Arc;
use std::time::Duration;
use tracing::Instrument as _;

use anyhow::Context as _;
use sas_announce::Announcer;
use sas_broker::lapin::Connection;
use sas_broker::{topology, BrokerError, Publisher, Session, SharedPublisher};
use sas_messages::QueueNames;
use sas_messages::StepReply;
use sas_runtime::Batcher;
use sas_store::writes::intake::{Intake, Submission};
use sas_store::writes::progress::ReplyOutcome;
use sas_store::{Store, StoreError};
use tokio_util::sync::CancellationToken;

pub use catalog::Catalog;
pub use settings::Settings;
pub use workflow::Workflow;

/// What every handler of one scheduler instance shares.
pub struct Scheduler {
    /// Instance id, recorded as LockedBy and as the actor in history.
    pub id: String,
    /// The settings it was started with.
    pub settings: Settings,
    /// The workflows new orders may follow.
    pub workflows: Arc<Catalog>,
    /// Who belongs to which tenant, what each tenant may start, who holds
    /// which role (`scheduler.tenancy_file`).
    pub tenancy: sas_runtime::tenancy::Tenancy,
    /// The state store.
    pub store: Store,
    /// Queue and exchange names.
    pub names: QueueNames,
    /// Publishes what each committed transition asks for, and counts it.
    pub announcer: Announcer,
    /// Fired on SIGTERM: handlers stop retrying and hand their message back.
    pub shutdown: CancellationToken,
    /// The publisher of whichever broker connection is up: what a lost
    /// connection left unconfirmed is sent again on the next one.
    pub publishers: SharedPublisher,
    /// Stores the submitted orders of concurrent handlers together.
    pub intake: IntakeBatcher,
    /// Applies the replies of concurrent handlers together.
    pub replies: ReplyBatcher,
    /// Refused orders this instance answered lately, so that a redelivery
    /// is not answered twice.
    pub answered: refusal::Answered,
    /// The channel refusal answers go on, one at a time.
    pub answers: refusal::Answers,
    /// Wakes the claim loop before its interval: see [`Scheduler::slot_freed`].
    pub claim_wake: tokio::sync::Notify,
    /// When a claim last took an order (see [`Scheduler::slot_freed`]).
    pub last_claimed: claim::LastClaimed,
    /// The orders it acknowledged lately, checked against the database
    /// after it lost its connections ([`audit`]).
    pub acknowledged: audit::Acknowledged,
}

/// Runs a scheduler until `shutdown`, then drains in-flight messages.
///
/// # Errors
/// When the workflow file or the settings are unusable. Broker and database
/// outages are not errors: the scheduler waits for them to come back.
pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let id = sas_runtime::instance_id("scheduler", &settings.scheduler.id);
    let workflows = Arc::new(Catalog::load(
        &settings.scheduler.workflow_file,
        &settings.scheduler.workflow_dir,
    )?);
    let tenancy = sas_runtime::tenancy::Tenancy::load(&settings.scheduler.tenancy_file)
        .map_err(anyhow::Error::msg)?;
    settings
        .deadlines
        .validate(workflows.shortest_timeout())
        .map_err(anyhow::Error::msg)
        .context("the deadline margins do not fit the workflow")?;
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

    register_agents(&store, &workflows, &settings.scheduler, &shutdown).await;
    register_plans(&store, &workflows, &shutdown).await;
    register_tenants(&store, &tenancy, &shutdown).await;
    for entry in workflows.entries() {
        let workflow = &entry.workflow;
        tracing::info!(scheduler = %id, workflow = %workflow.name, version = workflow.version, steps = workflow.steps.len(), "running workflow");
    }
    let (intake, replies) = batchers(&store, &id, &workflows, &settings.scheduler);
    let scheduler = Arc::new(Scheduler {
        id,
        names: settings.amqp.names(),
        announcer: Announcer::new(&settings.amqp),
        settings,
        workflows,
        tenancy,
        store,
        shutdown: shutdown.clone(),
        publishers: session.publisher(),
        intake,
        replies,
        answered: refusal::Answered::default(),
        answers: refusal::Answers::default(),
        claim_wake: tokio::sync::Notify::new(),
        last_claimed: claim::LastClaimed::default(),
        acknowledged: audit::Acknowledged::default(),
    });
    tokio::spawn(audit::run(scheduler.clone()));
    tokio::spawn(scheduler.clone().schedule_loop());
    session
        .run(shutdown, |connection, publisher| {
            let scheduler = scheduler.clone();
            async move { scheduler.work(connection, publisher).await }
        })
        .await;
    Ok(())
}

/// Stores submitted orders together.
pub type IntakeBatcher = Batcher<Submission, Result<Intake, StoreError>>;
/// Applies agents' replies together.
pub type ReplyBatcher = Batcher<StepReply, Result<ReplyOutcome, StoreError>>;

/// The group commits of one scheduler: submitted orders stored together
/// (intake), and agents' replies applied together.
fn batchers(
    store: &Store,
    id: &str,
    workflows: &Arc<Catalog>,
    settings: &settings::SchedulerSettings,
) -> (IntakeBatcher, ReplyBatcher) {
    let (batch_max, batch_workers) = (settings.batch_max, settings.batch_workers);
    let intake = {
        let (store, actor, workflows) = (store.clone(), id.to_owned(), workflows.clone());
        Batcher::spawn(
            "intake",
            batch_max,
            batch_workers,
            move |submissions: Vec<Submission>| {
                let (store, actor, workflows) = (store.clone(), actor.clone(), workflows.clone());
                async move { store_by_workflow(store, &workflows, submissions, &actor).await }
            },
        )
    };
    let replies = {
        let (store, actor) = (store.clone(), id.to_owned());
        Batcher::spawn(
            "replies",
            batch_max,
            batch_workers,
            move |replies: Vec<StepReply>| {
                let (store, actor) = (store.clone(), actor.clone());
                async move { store.writes().record_replies(&replies, &actor).await }
            },
        )
    };
    (intake, replies)
}

/// Stores a batch of submissions, one statement per workflow they follow
/// (nearly always one), and returns their outcomes in order. Intake
/// refused every submission of a workflow the scheduler does not run before
/// it reached the batch.
async fn store_by_workflow(
    store: Store,
    workflows: &Catalog,
    submissions: Vec<Submission>,
    actor: &str,
) -> Vec<Result<Intake, StoreError>> {
    let mut groups: Vec<(&str, Vec<usize>)> = Vec::new();
    for (index, submission) in submissions.iter().enumerate() {
        let name = submission.order.workflow();
        match groups.iter_mut().find(|(group, _)| *group == name) {
            Some((_, members)) => members.push(index),
            None => groups.push((name, vec![index])),
        }
    }
    if let [(name, _)] = groups.as_slice() {
        if let Some(entry) = workflows.get(name) {
            return store
                .writes()
                .insert_orders(&submissions, entry.plan(), actor)
                .await;
        }
    }
    let mut outcomes: Vec<Option<Result<Intake, StoreError>>> =
        submissions.iter().map(|_| None).collect();
    for (name, members) in groups {
        let Some(entry) = workflows.get(name) else {
            for index in members {
                outcomes[index] = Some(Err(StoreError::Invariant(format!(
                    "workflow {name:?} is not run by this scheduler"
                ))));
            }
            continue;
        };
        let group: Vec<Submission> = members.iter().map(|&i| submissions[i].clone()).collect();
        let stored = store
            .writes()
            .insert_orders(&group, entry.plan(), actor)
            .await;
        for (index, outcome) in members.into_iter().zip(stored) {
            outcomes[index] = Some(outcome);
        }
    }
    outcomes
        .into_iter()
        .map(|outcome| outcome.unwrap_or_else(|| Err(stopping())))
        .collect()
}

/// `scheduler migrate`: applies the migrations and returns, for a one-shot
/// migration job that runs as the database owner.
///
/// # Errors
/// When the database stays unreachable for a minute or a migration fails.
pub async fn migrate(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let store = Store::connect_lazy(&settings.database, "scheduler-migrate")
        .context("database settings")?;
    let mut database = settings.database.clone();
    database.migrate = true;
    let deadline = CancellationToken::new();
    let expire = deadline.clone();
    tokio::spawn(async move {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(60)) => {}
            () = shutdown.cancelled() => {}
        }
        expire.cancel();
    });
    // Only an unreachable database is waited for; a migration that fails
    // (its SQL refused, or the database migrated by another build) fails
    // the same way every time, and ends the job at once with the reason.
    anyhow::ensure!(
        store
            .migrate_if_asked(&database, &deadline)
            .await
            .context("cannot apply database migrations")?,
        "the database was not reachable within 60 s"
    );
    tracing::info!(
        migrations = sas_store::MIGRATOR.iter().count(),
        "migrations applied"
    );
    Ok(())
}

impl Scheduler {
    /// Everything the scheduler does on one broker connection: declare its
    /// topology, then consume orders and replies and claim retries, until
    /// shutdown (Ok) or a failure of the connection (Err).
    async fn work(
        self: Arc<Self>,
        connection: Arc<Connection>,
        publisher: Publisher,
    ) -> Result<(), BrokerError> {
        self.declare(&connection).await?;
        self.answers
            .open(
                &connection,
                &publisher,
                self.settings.amqp.broker.operation_timeout(),
            )
            .await;
        let drain = Duration::from_millis(self.settings.scheduler.drain_ms);
        let orders = self.clone().consume_orders(&connection, &publisher, drain);
        let replies = self.clone().consume_replies(&connection, &publisher, drain);
        let events = self.clone().consume_events(&connection, &publisher, drain);
        let claims = self.clone().claim_loop(publisher.clone());
        tokio::try_join!(orders, replies, events, claims)?;
        Ok(())
    }

    /// Consumes the orders queue: each order handled by intake in its
    /// trace's `intake` span, and one refused unread (over the size limit)
    /// answered on its `reply_to` property. Until shutdown (Ok) or a failure
    /// of the connection (Err).
    async fn consume_orders(
        self: Arc<Self>,
        connection: &Connection,
        publisher: &Publisher,
        drain: Duration,
    ) -> Result<(), BrokerError> {
        let orders_queue = self.names.orders();
        // New orders are admitted through a narrower window than replies:
        // what is admitted competes with the orders already running.
        let intake_amqp = sas_broker::AmqpSettings {
            prefetch: self.settings.scheduler.intake_prefetch,
            ..self.settings.amqp.broker.clone()
        };
        let (me, answering) = (self.clone(), self.clone());
        let (publisher, answer_with) = (publisher.clone(), publisher.clone());
        sas_broker::consume::consume_answering(
            connection,
            &intake_amqp,
            &orders_queue,
            publisher.clone(),
            self.shutdown.clone(),
            drain,
            move |delivery| {
                let me = me.clone();
                let publisher = publisher.clone();
                async move {
                    // The order's trace: the client's, or a new one.
                    let parent = sas_broker::publish::traceparent_of(&delivery.properties)
                        .unwrap_or_else(sas_messages::TraceParent::new_root);
                    let span = tracing::info_span!("intake", trace_id = %parent.trace_id, order_id = tracing::field::Empty);
                    sas_runtime::telemetry::join_trace(&span, &parent.trace_id, &parent.span_id);
                    me.handle_order(delivery, &publisher, &parent.trace_id)
                        .instrument(span)
                        .await
                }
            },
            // A body over the size limit is refused unread: its client
            // still hears, on the reply_to property.
            move |delivery, reason| {
                let (me, publisher) = (answering.clone(), answer_with.clone());
                async move { me.answer_refusal(&delivery, &publisher, &reason).await }
            },
        )
        .await
    }

    /// Consumes the shared reply queue: each reply handled in a `reply`
    /// span, a child of the agent's in the order's trace. Until shutdown
    /// (Ok) or a failure of the connection (Err).
    async fn consume_replies(
        self: Arc<Self>,
        connection: &Connection,
        publisher: &Publisher,
        drain: Duration,
    ) -> Result<(), BrokerError> {
        let queue = self.names.scheduler_replies();
        self.consume_with(
            connection,
            publisher,
            drain,
            &queue,
            |me, delivery, publisher| async move {
                // In the order's trace, a child of the agent's span.
                let span = tracing::info_span!("reply");
                if let Some(parent) = sas_broker::publish::traceparent_of(&delivery.properties) {
                    sas_runtime::telemetry::join_trace(&span, &parent.trace_id, &parent.span_id);
                }
                me.handle_reply(delivery, &publisher).instrument(span).await
            },
        )
        .await
    }

    /// Consumes the events queue: each event handled in an `event` span.
    /// Until shutdown (Ok) or a failure of the connection (Err).
    async fn consume_events(
        self: Arc<Self>,
        connection: &Connection,
        publisher: &Publisher,
        drain: Duration,
    ) -> Result<(), BrokerError> {
        let queue = self.names.events();
        self.consume_with(
            connection,
            publisher,
            drain,
            &queue,
            |me, delivery, publisher| async move {
                let span = tracing::info_span!("event", order_id = tracing::field::Empty);
                me.handle_event(delivery, &publisher).instrument(span).await
            },
        )
        .await
    }

    /// Consumes `queue` with this scheduler's settings, each message handed
    /// to `handle` with the scheduler and the connection's publisher.
    async fn consume_with<H, Fut>(
        self: Arc<Self>,
        connection: &Connection,
        publisher: &Publisher,
        drain: Duration,
        queue: &str,
        handle: H,
    ) -> Result<(), BrokerError>
    where
        H: Fn(Arc<Self>, sas_broker::consume::Delivery, Publisher) -> Fut,
        Fut: std::future::Future<Output = sas_broker::consume::Consumed> + Send + 'static,
    {
        let me = self.clone();
        let for_handler = publisher.clone();
        sas_broker::consume::consume(
            connection,
            &self.settings.amqp,
            queue,
            publisher.clone(),
            self.shutdown.clone(),
            drain,
            move |delivery| handle(me.clone(), delivery, for_handler.clone()),
        )
        .await
    }

    /// Publishes what a committed transition asks for (see
    /// [`Announcer::announce_durably`]): through `publisher`, the handler's
    /// connection, and when that connection dies before the confirms came
    /// back, again on the next one.
    ///
    /// # Errors
    /// When the messages could not be confirmed within their window, or on shutdown.
    pub async fn announce(
        &self,
        publisher: Option<&Publisher>,
        progress: &sas_store::Progress,
    ) -> Result<(), BrokerError> {
        // A dispatch span: within intake's or a reply's span, or (a claim,
        // a resend) joined to the order's trace on its own.
        let step = progress
            .dispatches
            .iter()
            .map(|d| d.step.as_str())
            .collect::<Vec<_>>()
            .join(",");
        let span = tracing::info_span!("dispatch", step = %step);
        if let (Some(trace_id), None) = (
            progress.trace_id.as_deref(),
            sas_runtime::telemetry::current_traceparent(),
        ) {
            let parent = sas_messages::TraceParent::child_of(trace_id);
            sas_runtime::telemetry::join_trace(&span, trace_id, &parent.span_id);
        }
        self.announcer
            .announce_durably(&self.publishers, publisher, progress, &self.shutdown)
            .instrument(span)
            .await
    }

    async fn declare(&self, connection: &Connection) -> Result<(), BrokerError> {
        let mut queues = vec![
            self.names.orders(),
            self.names.events(),
            self.names.scheduler_replies(),
        ];
        queues.extend(
            self.workflows
                .agents()
                .into_iter()
                .map(|(agent, _)| self.names.agent_requests(&agent)),
        );
        topology::declare(connection, &self.settings.amqp, &queues).await
    }
}

/// The error a handler gets when its batch gave no answer: the batch
/// panicked (logged by the batcher), or the workers are gone because the
/// process stops. The message goes back to its queue.
fn stopping() -> StoreError {
    StoreError::Invariant(
        "the batch holding this message gave no answer (it panicked, or the scheduler is stopping)"
            .into(),
    )
}

/// Registers the plan (name, version, steps) of every workflow, so that an
/// operator can move waiting orders to it.
async fn register_plans(store: &Store, workflows: &Catalog, shutdown: &CancellationToken) {
    let plans: Vec<sas_store::Plan<'_>> = workflows.entries().map(catalog::Entry::plan).collect();
    register(
        shutdown,
        "the workflows' versions",
        "orders cannot be moved to them",
        || store.writes().register_plans(&plans),
    )
    .await;
}

/// Records the tenants' weights, so that their orders take turns in the
/// agents' lines.
async fn register_tenants(
    store: &Store,
    tenancy: &sas_runtime::tenancy::Tenancy,
    shutdown: &CancellationToken,
) {
    let weights = tenancy.weights();
    register(
        shutdown,
        "the tenants' weights",
        "their orders do not take turns in the agents' lines",
        || store.admission().register_tenants(&weights),
    )
    .await;
}

/// Gives every agent of the workflows its admission row (with its shortest
/// step deadline).
async fn register_agents(
    store: &Store,
    workflows: &Catalog,
    settings: &settings::SchedulerSettings,
    shutdown: &CancellationToken,
) {
    let agents = workflows.agents();
    register(
        shutdown,
        "the agents for admission control",
        "their requests are not limited",
        || {
            store.admission().register(
                &agents,
                settings.admission_initial,
                settings.admission_ceiling,
            )
        },
    )
    .await;
}

/// Runs one of the start's registrations (`what`), waiting out a database
/// that is not up yet; a lasting failure is logged with what it costs
/// (`without`), and the scheduler runs on.
async fn register<F, Fut>(shutdown: &CancellationToken, what: &str, without: &str, operation: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), sas_store::StoreError>>,
{
    let registered = sas_runtime::retry_transient(
        shutdown,
        &format!("registering {what}"),
        |e: &sas_store::StoreError| e.is_transient(),
        operation,
    )
    .await;
    if let Some(Err(error)) = registered {
        tracing::error!(error = %error, "cannot register {what}; {without}");
    }
}
