//! `sasctl signal`: send an event to an order's wait step (an approval, a
//! warehouse's "picked"), through the events exchange with a confirm.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use sas_announce::event::{event_message, EventAddress, NewEvent};

use crate::Target;

/// Arguments of `sasctl signal`.
#[derive(Debug, Args)]
pub struct SignalArgs {
    /// The order the event is for; with `--key`, the business key of the
    /// orders waiting with it (a payment id, an invoice number).
    pub order_id: String,
    /// Address the event by correlation key instead of order id: it goes
    /// to every order parked at a wait that gave this key, or is kept
    /// until one does.
    #[arg(long)]
    pub key: bool,
    /// The event's name, as the wait step names it (`approved`).
    pub name: String,
    /// What the event says: a JSON object, the wait step's result, which
    /// later steps read as `/results/<step>/...`
    #[arg(long, value_parser = crate::submit::parse_json_object)]
    pub data: Option<serde_json::Map<String, serde_json::Value>>,
    /// The event's id: the same id twice is one event (default: a new one).
    #[arg(long)]
    pub event_id: Option<String>,
}

/// Publishes the event and prints its id once the broker confirmed it. The
/// order, if it waits for the event, moves on; if it has not reached its
/// wait yet, or does not exist yet, the event is kept for it.
///
/// # Errors
/// When the event is invalid or the broker does not confirm it.
pub async fn run(target: &Target, args: SignalArgs) -> anyhow::Result<ExitCode> {
    let address = if args.key {
        EventAddress::Key(args.order_id)
    } else {
        EventAddress::Order(args.order_id)
    };
    let settings = target.amqp();
    let (event, message) = event_message(
        &settings.names(),
        NewEvent {
            address,
            name: args.name,
            event_id: args.event_id,
            data: args.data,
            origin: "sasctl",
            // Sent as sasctl's own broker user: the schedulers name it so.
            on_behalf_of: None,
            tenant: None,
        },
    )?;
    let (_connection, publisher) =
        crate::submit::open_publisher(&settings, &settings.names().events()).await?;
    publisher
        .send_batch(std::slice::from_ref(&message))
        .await
        .with_context(|| format!("event {} was not confirmed", event.event_id))?;
    println!("{}", event.event_id);
    Ok(ExitCode::SUCCESS)
}
