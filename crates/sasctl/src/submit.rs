//! `sasctl submit`: publish orders to the orders queue with confirms.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use futures_util::{stream, StreamExt};
use sas_broker::publish::json_properties;
use sas_broker::{topology, AmqpSettings, Publisher};
use sas_messages::{OrderId, OrderLine, SubmitOrder, SCHEMA_VERSION};

use crate::Target;

/// Arguments of `sasctl submit`.
#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// How many orders to generate.
    #[arg(long, default_value_t = 1)]
    pub count: usize,
    /// Submit the orders in this JSON file (one object, or an array) instead of generating them.
    #[arg(long, conflicts_with = "count")]
    pub file: Option<PathBuf>,
    /// Order id of a single generated order (default: `ord-<uuid>`).
    #[arg(long)]
    pub order_id: Option<String>,
    /// Customer of generated orders.
    #[arg(long, default_value = "cust-1")]
    pub customer_id: String,
    /// SKU of generated orders (one starting OUT-OF-STOCK is refused by inventory).
    #[arg(long, default_value = "SKU-1")]
    pub sku: String,
    /// Quantity of generated orders.
    #[arg(long, default_value_t = 1)]
    pub quantity: u32,
    /// Amount of generated orders, in cents (above the payment limit it is declined).
    #[arg(long, default_value_t = 2499)]
    pub amount_cents: i64,
    /// Currency of generated orders.
    #[arg(long, default_value = "EUR")]
    pub currency: String,
    /// Queue that receives the orders' status messages.
    #[arg(long)]
    pub reply_to: Option<String>,
    /// Priority of generated orders, 0 (lowest) to 9; 5 when not given.
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=9))]
    pub priority: Option<u8>,
    /// Workflow of generated orders (default: order).
    #[arg(long)]
    pub workflow: Option<String>,
    /// Attributes of generated orders: a JSON object, checked against the
    /// workflow's schema at intake.
    #[arg(long, value_parser = parse_json_object)]
    pub attributes: Option<serde_json::Map<String, serde_json::Value>>,
    /// Follow the order until it ends (a single order only).
    #[arg(long)]
    pub watch: bool,
    /// Publishes awaiting confirmation at once.
    #[arg(long, default_value_t = 64)]
    pub concurrency: usize,
    /// Orders per second; 0 publishes as fast as the broker confirms.
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
}

fn generated(args: &SubmitArgs, index: usize) -> SubmitOrder {
    let order_id = match (&args.order_id, args.count) {
        (Some(id), 1) => id.clone(),
        (Some(id), _) => format!("{id}-{index}"),
        (None, _) => format!("ord-{}", uuid::Uuid::now_v7().simple()),
    };
    SubmitOrder {
        schema_version: SCHEMA_VERSION,
        order_id: order_id.into(),
        customer_id: args.customer_id.clone(),
        items: vec![OrderLine {
            sku: args.sku.clone(),
            quantity: args.quantity,
        }],
        amount_cents: args.amount_cents,
        currency: args.currency.clone(),
        reply_to: args.reply_to.clone(),
        priority: args.priority,
        workflow: args.workflow.clone(),
        attributes: args.attributes.clone(),
    }
}

/// `--attributes`, `--data`: a JSON object.
///
/// # Errors
/// Text that is not JSON, or JSON that is not an object.
pub fn parse_json_object(text: &str) -> Result<serde_json::Map<String, serde_json::Value>, String> {
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Object(object)) => Ok(object),
        Ok(_) => Err("must be a JSON object, such as '{\"channel\": \"web\"}'".into()),
        Err(error) => Err(format!("not JSON: {error}")),
    }
}

fn from_file(path: &PathBuf) -> anyhow::Result<Vec<SubmitOrder>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{} is not JSON", path.display()))?;
    let items = match value {
        serde_json::Value::Array(items) => items,
        one => vec![one],
    };
    items
        .into_iter()
        .enumerate()
        .map(|(index, item)| {
            serde_json::from_value(item)
                .with_context(|| format!("order {index} of {}", path.display()))
        })
        .collect()
}

/// Publishes the orders; prints each order id on stdout as the broker
/// confirms it, with a progress bar on stderr when it is a terminal.
///
/// # Errors
/// When an order is invalid or the broker does not confirm it.
pub async fn run(target: &Target, args: SubmitArgs) -> anyhow::Result<ExitCode> {
    let orders = orders_to_submit(&args)?;

    let settings = target.amqp();
    let (connection, publisher) = open_publisher(&settings, &settings.names().orders()).await?;

    let watcher = if args.watch {
        Some(crate::watch::Watcher::start(&connection, &settings, &orders[0].order_id).await?)
    } else {
        None
    };
    publish_all(&publisher, &settings, orders, &args).await?;
    match watcher {
        Some(watcher) => watcher.follow(Duration::from_secs(300)).await,
        None => Ok(ExitCode::SUCCESS),
    }
}

/// A connection to RabbitMQ with the common topology and the work queue
/// `queue` (with its exchange) declared, and a publisher on it.
///
/// # Errors
/// When RabbitMQ cannot be reached or refuses a declaration.
pub(crate) async fn open_publisher(
    settings: &AmqpSettings,
    queue: &str,
) -> anyhow::Result<(sas_broker::lapin::Connection, Publisher)> {
    let connection = sas_broker::connect(settings, "sasctl")
        .await
        .context("cannot connect to RabbitMQ")?;
    topology::declare(&connection, settings, &[queue.to_owned()]).await?;
    let mut publisher = Publisher::open(&connection, settings.operation_timeout()).await?;
    // The system knows a client by its validated user_id (tenants, who
    // sent an event): stamp the user logged in on every message.
    if let Some(user) = settings.user() {
        publisher = publisher.identified_as(user);
    }
    Ok((connection, publisher))
}

/// The orders the arguments ask for (read from `--file`, or generated),
/// each valid, and one only when it is to be watched.
///
/// # Errors
/// When the file cannot be read, an order is invalid, or `--watch` is
/// given with other than one order.
fn orders_to_submit(args: &SubmitArgs) -> anyhow::Result<Vec<SubmitOrder>> {
    let orders = match &args.file {
        Some(path) => from_file(path)?,
        None => (0..args.count)
            .map(|index| generated(args, index))
            .collect(),
    };
    for order in &orders {
        order
            .validate()
            .with_context(|| format!("order {}", order.order_id))?;
    }
    anyhow::ensure!(
        !(args.watch && orders.len() != 1),
        "--watch follows a single order"
    );
    Ok(orders)
}

/// Publishes `orders` at `--rate`, `--concurrency` awaiting confirmation at
/// once, printing each id as the broker confirms its order, then how many
/// went and how fast.
///
/// # Errors
/// The first order the broker did not confirm (the rest are not awaited).
async fn publish_all(
    publisher: &Publisher,
    settings: &AmqpSettings,
    orders: Vec<SubmitOrder>,
    args: &SubmitArgs,
) -> anyhow::Result<()> {
    // Through the orders exchange: a client's broker user may write there
    // and nowhere else (see deploy/README.md, broker users).
    let (exchange, queue) = (
        topology::orders_exchange(settings),
        settings.names().orders(),
    );
    let started = Instant::now();
    let pace = (args.rate > 0).then(|| Duration::from_secs_f64(1.0 / args.rate as f64));
    // Each id is printed as soon as the broker confirms its order; the bar
    // (on stderr, drawn only on a terminal) counts them.
    let bar = progress_bar(orders.len());
    let mut confirmed = stream::iter(orders.into_iter().enumerate())
        .map(|(index, order)| {
            let (publisher, exchange, queue) = (publisher.clone(), exchange.clone(), queue.clone());
            async move {
                if let Some(pace) = pace {
                    tokio::time::sleep_until((started + pace * index as u32).into()).await;
                }
                publisher
                    .publish_json(
                        &exchange,
                        &queue,
                        &order,
                        json_properties(&order.order_id),
                        true,
                    )
                    .await
                    .with_context(|| format!("order {} was not confirmed", order.order_id))?;
                Ok::<OrderId, anyhow::Error>(order.order_id)
            }
        })
        .buffer_unordered(args.concurrency.max(1));
    let mut submitted = 0usize;
    while let Some(result) = confirmed.next().await {
        let order_id = match result {
            Ok(order_id) => order_id,
            Err(error) => {
                bar.abandon();
                return Err(error);
            }
        };
        bar.suspend(|| println!("{order_id}"));
        bar.inc(1);
        submitted += 1;
    }
    bar.finish_and_clear();
    let elapsed = started.elapsed().as_secs_f64();
    eprintln!(
        "submitted {submitted} order(s) to {queue} in {elapsed:.2}s ({:.0}/s)",
        submitted as f64 / elapsed.max(1e-9)
    );
    Ok(())
}

/// The bar counting confirmed orders out of `len`, on stderr.
fn progress_bar(len: usize) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} confirmed, {per_sec}, {eta} left",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    bar
}
