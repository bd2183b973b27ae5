//! Declaring queues and exchanges.
//!
//! Every service declares what it uses, with the same arguments (a queue
//! declared twice with different arguments is refused by RabbitMQ), so the
//! services can start in any order.
//!
//! - Work queues (orders, agent requests, replies): quorum, delivery limit,
//!   dead-lettered to the dead-letter exchange.
//! - The dead-letter record queue (consumed by supervisors): quorum with a
//!   delivery limit and no dead-letter exchange (a message it gives up on is
//!   dropped; its copy stays in the operators' queue).
//! - The operators' dead-letter queue (consumed by nobody): quorum, bounded
//!   in length, bytes and age (7 days), oldest dropped first.
//! - The orders exchange, a fanout named like the orders queue and bound to
//!   it: clients publish orders there, so that their broker user needs no
//!   write permission on the default exchange, which reaches every queue.

use lapin::options::{
    ExchangeDeclareOptions, ExchangeDeleteOptions, QueueBindOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};
use lapin::{Channel, Connection, ExchangeKind};

use crate::error::timed;
use crate::{AmqpSettings, BrokerError};

/// Most messages kept in the operators' dead-letter queue (nobody consumes
/// it); the oldest go first.
pub const DEAD_LETTERS_MAX_LENGTH: i64 = 100_000;

/// Most bytes kept in the operators' dead-letter queue.
pub const DEAD_LETTERS_MAX_BYTES: i64 = 1 << 30;

/// How long the operators' dead-letter queue keeps a message: 7 days. The
/// record in Postgres (`dead_letters`) is what the console and `sasctl`
/// work from; this copy is for inspection with RabbitMQ's own tools.
pub const DEAD_LETTERS_TTL_MS: i64 = 7 * 24 * 60 * 60 * 1000;

/// What a queue is for, which decides its arguments.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum QueueKind {
    /// Consumed by a service; what fails there goes to the dead-letter exchange.
    Work,
    /// The dead-letter record queue: consumed, but dead-lettering from it
    /// would feed it again.
    Record,
    /// The operators' dead-letter queue: consumed by nobody.
    Kept,
}

fn quorum_arguments(settings: &AmqpSettings, kind: QueueKind) -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert(
        ShortString::from("x-queue-type"),
        AMQPValue::LongString(LongString::from("quorum")),
    );
    let delivery_limit =
        AMQPValue::LongInt(i32::try_from(settings.delivery_limit).unwrap_or(i32::MAX));
    match kind {
        QueueKind::Work => {
            arguments.insert(ShortString::from("x-delivery-limit"), delivery_limit);
            arguments.insert(
                ShortString::from("x-dead-letter-exchange"),
                AMQPValue::LongString(LongString::from(settings.names().dead_letter_exchange())),
            );
        }
        QueueKind::Record => {
            arguments.insert(ShortString::from("x-delivery-limit"), delivery_limit);
        }
        QueueKind::Kept => {
            arguments.insert(
                ShortString::from("x-max-length"),
                AMQPValue::LongLongInt(DEAD_LETTERS_MAX_LENGTH),
            );
            arguments.insert(
                ShortString::from("x-max-length-bytes"),
                AMQPValue::LongLongInt(DEAD_LETTERS_MAX_BYTES),
            );
            arguments.insert(
                ShortString::from("x-message-ttl"),
                AMQPValue::LongLongInt(DEAD_LETTERS_TTL_MS),
            );
        }
    }
    arguments
}

async fn declare_queue(
    channel: &Channel,
    settings: &AmqpSettings,
    name: &str,
    kind: QueueKind,
) -> Result<(), BrokerError> {
    timed(
        "declaring a queue",
        settings.operation_timeout(),
        channel.queue_declare(
            name.into(),
            QueueDeclareOptions {
                durable: true,
                ..QueueDeclareOptions::default()
            },
            quorum_arguments(settings, kind),
        ),
    )
    .await?;
    Ok(())
}

async fn declare_exchange(
    channel: &Channel,
    settings: &AmqpSettings,
    name: &str,
    kind: ExchangeKind,
) -> Result<(), BrokerError> {
    timed(
        "declaring an exchange",
        settings.operation_timeout(),
        channel.exchange_declare(
            name.into(),
            kind,
            ExchangeDeclareOptions {
                durable: true,
                ..ExchangeDeclareOptions::default()
            },
            FieldTable::default(),
        ),
    )
    .await
}

async fn bind(
    channel: &Channel,
    settings: &AmqpSettings,
    queue: &str,
    exchange: &str,
    routing_key: &str,
) -> Result<(), BrokerError> {
    timed(
        "binding a queue",
        settings.operation_timeout(),
        channel.queue_bind(
            queue.into(),
            exchange.into(),
            routing_key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        ),
    )
    .await
}

/// Declares what every service shares: the dead-letter exchange with its two
/// queues (one kept for operators, one the supervisor records from) and the
/// status exchange.
///
/// # Errors
/// When a declaration is refused or times out.
pub async fn declare_common(channel: &Channel, settings: &AmqpSettings) -> Result<(), BrokerError> {
    let names = settings.names();
    let exchange = names.dead_letter_exchange();
    declare_exchange(channel, settings, &exchange, ExchangeKind::Fanout).await?;
    for (queue, kind) in [
        (names.dead_letters(), QueueKind::Kept),
        (names.dead_letter_records(), QueueKind::Record),
    ] {
        declare_queue(channel, settings, &queue, kind).await?;
        bind(channel, settings, &queue, &exchange, "").await?;
    }
    declare_exchange(
        channel,
        settings,
        &names.status_exchange(),
        ExchangeKind::Topic,
    )
    .await
}

/// Declares a work queue: a durable quorum queue with the delivery limit and
/// the dead-letter exchange, so a poison message never blocks it.
///
/// # Errors
/// When the declaration is refused (for example, the queue exists with other
/// arguments) or times out.
pub async fn declare_work_queue(
    channel: &Channel,
    settings: &AmqpSettings,
    name: &str,
) -> Result<(), BrokerError> {
    declare_queue(channel, settings, name, QueueKind::Work).await?;
    declare_its_exchange(channel, settings, name).await
}

/// The exchange clients publish to a work queue through, for the orders and
/// events queues: declared and bound to it.
async fn declare_its_exchange(
    channel: &Channel,
    settings: &AmqpSettings,
    name: &str,
) -> Result<(), BrokerError> {
    let names = settings.names();
    if name == names.orders() || name == names.events() {
        // Clients publish to the exchange of the same name, never to the
        // default exchange (which reaches every queue).
        declare_exchange(channel, settings, name, ExchangeKind::Fanout).await?;
        bind(channel, settings, name, name, "").await?;
    }
    Ok(())
}

/// The exchange clients publish orders to: a fanout bound to the orders
/// queue, with the same name (`sas.orders`; exchanges and queues have
/// separate names in RabbitMQ). Declared with the orders queue.
pub fn orders_exchange(settings: &AmqpSettings) -> String {
    settings.names().orders()
}

/// The exchange clients publish order events to: a fanout bound to the
/// events queue, with the same name (`sas.events`). Declared with the
/// events queue.
pub fn events_exchange(settings: &AmqpSettings) -> String {
    settings.names().events()
}

/// Deletes every queue and exchange of a prefix: test teardown, and operators
/// removing a deployment.
///
/// # Errors
/// When the broker cannot be reached.
pub async fn delete_all(
    connection: &Connection,
    settings: &AmqpSettings,
    agents: &[&str],
) -> Result<(), BrokerError> {
    let names = settings.names();
    let timeout = settings.operation_timeout();
    let channel = timed("opening a channel", timeout, connection.create_channel()).await?;
    for queue in names.all_queues(agents.iter().copied()) {
        timed(
            "deleting a queue",
            timeout,
            channel.queue_delete(queue.into(), QueueDeleteOptions::default()),
        )
        .await?;
    }
    for exchange in names
        .all_exchanges()
        .into_iter()
        .chain([orders_exchange(settings), events_exchange(settings)])
    {
        timed(
            "deleting an exchange",
            timeout,
            channel.exchange_delete(exchange.into(), ExchangeDeleteOptions::default()),
        )
        .await?;
    }
    Ok(())
}

/// A private, auto-deleted queue, bound to the status exchange with each of
/// `routing_keys` (`order.<id>` for one order, `order.*` for all),
/// consumed without acknowledgements: how a client follows orders live
/// (unbound, it serves as an order's `reply_to`). Returns its name too.
///
/// # Errors
/// When the broker refuses or does not answer in time.
pub async fn status_consumer(
    connection: &Connection,
    settings: &AmqpSettings,
    routing_keys: &[&str],
) -> Result<(String, lapin::Consumer), BrokerError> {
    let timeout = settings.operation_timeout();
    let channel = timed("opening a channel", timeout, connection.create_channel()).await?;
    // The status exchange alone: the dead-letter queues may exist with
    // another delivery limit than this client's settings give
    // ([`declare`] keeps them as they are), and a watcher needs none of them.
    declare_exchange(
        &channel,
        settings,
        &settings.names().status_exchange(),
        ExchangeKind::Topic,
    )
    .await?;
    let queue = timed(
        "declaring a status queue",
        timeout,
        channel.queue_declare(
            "".into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        ),
    )
    .await?;
    for routing_key in routing_keys {
        bind(
            &channel,
            settings,
            queue.name().as_str(),
            &settings.names().status_exchange(),
            routing_key,
        )
        .await?;
    }
    let consumer = timed(
        "consuming status messages",
        timeout,
        channel.basic_consume(
            queue.name().clone(),
            "".into(),
            lapin::options::BasicConsumeOptions {
                no_ack: true,
                ..Default::default()
            },
            FieldTable::default(),
        ),
    )
    .await?;
    Ok((queue.name().to_string(), consumer))
}

/// Declares queue `name` of `kind` on `channel`; when it exists with other
/// arguments (an earlier version's delivery limit: arguments cannot change
/// once a queue exists), uses it as it is, with a warning saying how to
/// change it, on a new channel (RabbitMQ closed the first). Returns the
/// channel to go on with.
///
/// # Errors
/// When the declaration is refused for another reason, the queue is not
/// there after all, or the broker does not answer in time.
async fn declare_or_keep(
    connection: &Connection,
    channel: Channel,
    settings: &AmqpSettings,
    name: &str,
    kind: QueueKind,
) -> Result<Channel, BrokerError> {
    let error = match declare_queue(&channel, settings, name, kind).await {
        Ok(()) => return Ok(channel),
        Err(error) if is_inequivalent_argument(&error) => error,
        Err(error) => return Err(error),
    };
    tracing::warn!(queue = %name, error = %error, delivery_limit = settings.delivery_limit, "the queue exists with other arguments than these settings give it (amqp.delivery_limit); using it as it is. To give it the new delivery limit, delete the queue once it is empty and start a service again (a delivery-limit policy cannot raise it: RabbitMQ takes the lower of the two; deploy/README.md, Bounds)");
    let timeout = settings.operation_timeout();
    let channel = timed("opening a channel", timeout, connection.create_channel()).await?;
    timed(
        "checking a queue",
        timeout,
        channel.queue_declare(
            name.into(),
            QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            },
            FieldTable::default(),
        ),
    )
    .await?;
    Ok(channel)
}

/// Whether `error` is RabbitMQ refusing a declaration because the queue
/// exists with other arguments (406 PRECONDITION_FAILED, "inequivalent arg").
fn is_inequivalent_argument(error: &BrokerError) -> bool {
    match error {
        BrokerError::Amqp { source, .. } => match source.kind() {
            lapin::ErrorKind::ProtocolError(amqp) => {
                amqp.get_id() == 406 && amqp.get_message().as_str().contains("inequivalent arg")
            }
            _ => false,
        },
        _ => false,
    }
}

/// Declares the common topology and the work queues `queues` on a channel of
/// its own, every step within the operation timeout: what each service does
/// on every new connection.
///
/// # Errors
/// When a declaration is refused or the broker does not answer in time.
pub async fn declare(
    connection: &Connection,
    settings: &AmqpSettings,
    queues: &[String],
) -> Result<(), BrokerError> {
    let timeout = settings.operation_timeout();
    let mut channel = timed("opening a channel", timeout, connection.create_channel()).await?;
    let names = settings.names();
    let exchange = names.dead_letter_exchange();
    declare_exchange(&channel, settings, &exchange, ExchangeKind::Fanout).await?;
    for (queue, kind) in [
        (names.dead_letters(), QueueKind::Kept),
        (names.dead_letter_records(), QueueKind::Record),
    ] {
        channel = declare_or_keep(connection, channel, settings, &queue, kind).await?;
        bind(&channel, settings, &queue, &exchange, "").await?;
    }
    declare_exchange(
        &channel,
        settings,
        &names.status_exchange(),
        ExchangeKind::Topic,
    )
    .await?;
    for queue in queues {
        channel = declare_or_keep(connection, channel, settings, queue, QueueKind::Work).await?;
        declare_its_exchange(&channel, settings, queue).await?;
    }
    let _ = timed(
        "closing a channel",
        timeout,
        channel.close(200, "declared".into()),
    )
    .await;
    Ok(())
}
