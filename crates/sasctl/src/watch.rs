//! `sasctl watch`: follow one order's status messages live.

use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use futures_util::StreamExt;
use sas_broker::lapin::{Connection, Consumer};
use sas_broker::{topology, AmqpSettings};
use sas_messages::{OrderStatus, QueueNames, StatusEvent};

use crate::Target;

/// A private, auto-deleted queue bound to one order's status messages.
pub struct Watcher {
    consumer: Consumer,
}

impl Watcher {
    /// Binds a private queue to the status exchange for `order_id`: bind
    /// before submitting, so that no event is missed.
    ///
    /// # Errors
    /// When the broker refuses.
    pub async fn start(
        connection: &Connection,
        settings: &AmqpSettings,
        order_id: &str,
    ) -> anyhow::Result<Self> {
        let (_, consumer) = topology::status_consumer(
            connection,
            settings,
            &[&QueueNames::status_routing_key(order_id)],
        )
        .await?;
        Ok(Self { consumer })
    }

    /// Prints status messages until a terminal one (exit 0 for processed,
    /// 3 otherwise) or `timeout` (exit 4).
    ///
    /// # Errors
    /// When the connection fails.
    pub async fn follow(mut self, timeout: Duration) -> anyhow::Result<ExitCode> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let next = tokio::time::timeout_at(deadline, self.consumer.next()).await;
            let delivery = match next {
                Err(_) => {
                    eprintln!("no terminal status within {timeout:?}");
                    return Ok(ExitCode::from(4));
                }
                Ok(None) => anyhow::bail!("the broker closed the watch"),
                Ok(Some(delivery)) => delivery.context("watching")?,
            };
            let Ok(status) = serde_json::from_slice::<OrderStatus>(&delivery.data) else {
                continue;
            };
            print_status(&status);
            if status.event.is_terminal() {
                return Ok(exit_code(status.event));
            }
        }
    }
}

fn exit_code(event: StatusEvent) -> ExitCode {
    if event == StatusEvent::Processed {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(3)
    }
}

fn print_status(status: &OrderStatus) {
    println!(
        "{}  {}  {:<15} {} {}",
        status.at.format("%H:%M:%S%.3f"),
        status.order_id,
        status.event.as_str(),
        status.step.as_deref().unwrap_or(""),
        status.detail.as_deref().unwrap_or(""),
    );
}

/// Shows the order's history so far (if the state store is reachable), then
/// follows it live until it ends.
///
/// # Errors
/// When the broker cannot be reached.
pub async fn run(target: &Target, order_id: &str, timeout: Duration) -> anyhow::Result<ExitCode> {
    let settings = target.amqp();
    let connection = sas_broker::connect(&settings, "sasctl-watch")
        .await
        .context("cannot connect to RabbitMQ")?;
    let watcher = Watcher::start(&connection, &settings, order_id).await?;
    // Bound first, then read the record: an event in between is not lost.
    if let Ok(store) = target.store() {
        match store.reads().order_detail(order_id).await {
            Ok(Some(detail)) => {
                for entry in &detail.history {
                    println!(
                        "{}  {}  {:<15} {} {}",
                        entry.at.format("%H:%M:%S%.3f"),
                        order_id,
                        entry.event,
                        entry.step.as_deref().unwrap_or(""),
                        entry.detail.as_deref().unwrap_or("")
                    );
                }
                let state = detail.summary.state;
                if state.is_terminal() {
                    println!("order {order_id} is {state}");
                    return Ok(if state == sas_store::ProcessState::Processed {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::from(3)
                    });
                }
            }
            Ok(None) => {
                eprintln!("order {order_id} is not (yet) in the state store; waiting for it")
            }
            Err(error) => {
                eprintln!("cannot read the state store ({error}); following live messages only")
            }
        }
    }
    watcher.follow(timeout).await
}
