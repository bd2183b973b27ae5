//! `sasctl signal`: send an event to an order's wait step (an approval, a
//! warehouse's "picked"), through the events exchange with a confirm.

use std::process::ExitCode;

use anyhow::Context;
use clap::Args;
use sas_announce::event::{event_message, EventAddress, NewEvent};
use sas_messages::OrderEvent;
use sas_runtime::tenancy::Tenancy;

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
    /// The schedulers' tenancy file, where the deployment has one: sasctl
    /// then checks the event as the schedulers will, for the order of its
    /// broker user's tenant and against the wait's `senders`. Without it,
    /// tenancy is open (one tenant, every sender accepted), as the
    /// schedulers' is without one.
    #[arg(long, env = "SAS_SCHEDULER__TENANCY_FILE", default_value = "")]
    pub tenancy_file: String,
}

/// Publishes the event and prints its id once the broker confirmed it. The
/// order, if it waits for the event, moves on; if it has not reached its
/// wait yet, or does not exist yet, the event is kept for it. An event for
/// an order is checked first, by the rule the console and the gateway
/// follow ([`sas_store::machine::wait::admission`]): nothing is sent when
/// every wait of the order for it refuses sasctl's broker user, or when
/// nothing in the order will use it (it ended, or no wait for it is
/// ahead).
///
/// # Errors
/// When the event is invalid, the order will not take it, the state store
/// cannot be read or the broker does not confirm it.
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
    anyhow::ensure!(
        !event.names_a_tenant(),
        "name the order by the id its tenant's clients sent, without '{}' (the schedulers qualify it by your broker user's tenant)",
        sas_messages::ids::TENANT_SEPARATOR
    );
    if let Some(order_id) = &event.order_id {
        let tenancy = Tenancy::load(&args.tenancy_file).map_err(anyhow::Error::msg)?;
        let identity = format!("amqp:{}", settings.user().unwrap_or_default());
        let sender = tenancy.sender(&identity);
        let tenant = sender.tenant.as_deref().with_context(|| {
            format!("{identity} belongs to no tenant in {}: the schedulers would refuse its event, so nothing was sent", args.tenancy_file)
        })?;
        let stored_id = order_id.qualified(tenant);
        check(
            target,
            stored_id.as_str(),
            &event,
            &identity,
            &sender.principals,
        )
        .await?;
    }
    let (_connection, publisher) =
        crate::submit::open_publisher(&settings, &settings.names().events()).await?;
    publisher
        .send_batch(std::slice::from_ref(&message))
        .await
        .with_context(|| format!("event {} was not confirmed", event.event_id))?;
    println!("{}", event.event_id);
    Ok(ExitCode::SUCCESS)
}

/// Refuses, before anything is sent, an event order `order_id` (its stored
/// id) would not take from `identity`, known by `principals`; says on
/// stderr what the order will do with one it takes.
///
/// # Errors
/// When the order will not take it, or the state store cannot be read.
async fn check(
    target: &Target,
    order_id: &str,
    event: &OrderEvent,
    identity: &str,
    principals: &[String],
) -> anyhow::Result<()> {
    let admission = target
        .store()?
        .reads()
        .event_admission(order_id, &event.name, &event.event_id, principals)
        .await
        .with_context(|| {
            format!("order {order_id} could not be read from the state store (sasctl checks the order before it sends an event: --database-url, SAS_DATABASE__URL): nothing was sent")
        })?;
    let said = admission.describe(order_id, &event.name, identity);
    anyhow::ensure!(admission.sendable(), "{said}");
    eprintln!("{said}");
    Ok(())
}
