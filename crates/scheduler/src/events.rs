//! Events for wait steps: each message of the events queue is kept in its
//! order's durable mailbox (or, for a correlation key, in the mailbox of
//! each order waiting with it, or by key until one does) and, when the
//! order waits for it, moves the order on (see [`sas_store::writes::events`]).

use std::time::Duration;

use sas_broker::consume::{Consumed, Delivery};
use sas_broker::Publisher;
use sas_messages::{decode, OrderEvent};
use sas_runtime::tenancy::Sender;
use sas_store::writes::events::{EventOutcome, EventSender};

use crate::Scheduler;

impl Scheduler {
    /// Who sent `event`, and the event addressed within the sender's
    /// tenant: a client's order id and correlation key are qualified by its
    /// tenant (it can reach no other tenant's order, and learns nothing of
    /// one); an operator (a console user) addresses any order by its
    /// stored id.
    ///
    /// # Errors
    /// Why the event is refused: the sender cannot be told, belongs to no
    /// tenant, or names a stored id without being an operator.
    fn address_event(
        &self,
        delivery: &Delivery,
        mut event: OrderEvent,
    ) -> Result<(OrderEvent, Sender), String> {
        let sender = self.sender_of(delivery)?;
        if sender.is_operator() {
            return Ok((event, sender));
        }
        let Some(tenant) = sender.tenant.clone() else {
            return Err(format!(
                "{} belongs to no tenant and is no operator: an operator adds it to a tenant's members in the tenancy file (scheduler.tenancy_file)",
                sender.identity
            ));
        };
        let separator = sas_messages::ids::TENANT_SEPARATOR;
        if event.names_a_tenant() {
            return Err(format!(
                "{} named an order or a key with '{separator}': only operators name a tenant; name the order by the id you submitted, the key as your orders give it",
                sender.identity
            ));
        }
        event.order_id = event.order_id.map(|id| id.qualified(&tenant));
        event.correlation_key = event
            .correlation_key
            .map(|key| sas_messages::ids::qualified_key(&key, &tenant));
        Ok((event, sender))
    }

    /// Handles one message of the events queue. An invalid one is
    /// dead-lettered with the reason; a valid one is kept and, if its order
    /// waits for it, used, in one transaction; the message is acknowledged
    /// after that commit and after what the order does next is confirmed
    /// by the broker.
    /// A [`sas_messages::ScheduleCommand`] (told by its `type`) shares the
    /// queue: it goes to [`Scheduler::handle_schedule_command`].
    pub async fn handle_event(&self, delivery: Delivery, publisher: &Publisher) -> Consumed {
        if delivery
            .properties
            .kind()
            .as_ref()
            .map(|kind| kind.as_str())
            == Some(sas_messages::schedule::SCHEDULE_COMMAND_TYPE)
        {
            return self.handle_schedule_command(&delivery).await;
        }
        let event: OrderEvent = match decode(&delivery.body, self.settings.amqp.max_message_bytes) {
            Ok(event) => event,
            Err(error) => return Consumed::DeadLetter(format!("invalid event: {error}")),
        };
        if let Err(error) = event.validate() {
            return Consumed::DeadLetter(format!("invalid event: {}", error.0));
        }
        let (event, sender) = match self.address_event(&delivery, event) {
            Ok(addressed) => addressed,
            Err(reason) => {
                metrics::counter!("sas_events_total", "outcome" => "refused").increment(1);
                tracing::warn!(reason = %reason, "event refused");
                return Consumed::DeadLetter(format!("event refused: {reason}"));
            }
        };
        // An event for a key has no order id: the key stands in the logs.
        let about = event.order_id.as_ref().map_or_else(
            || event.correlation_key.clone().unwrap_or_default(),
            |id| id.as_str().to_owned(),
        );
        tracing::Span::current().record("order_id", about.as_str());
        let ttl = Duration::from_secs(self.settings.scheduler.event_ttl_secs);
        // Kept for an order still to come only when some wait would take
        // it from this sender (an operator's is always kept).
        let tenant = sender.tenant.as_deref().unwrap_or_default();
        let early_refusal = (!sender.is_operator()
            && !self
                .workflows
                .some_wait_accepts(&event.name, &sender.principals, tenant))
        .then(|| {
            format!(
                "event {} ({}) from {} refused: no wait for it in this deployment's workflows accepts it from this sender, so it is not kept for an order to come",
                event.name, event.event_id, sender.identity
            )
        });
        let delivered = sas_runtime::retry_transient(
            &self.shutdown,
            "keeping an event",
            |e: &sas_store::StoreError| e.is_transient(),
            || {
                let from = EventSender {
                    identity: &sender.identity,
                    principals: &sender.principals,
                    early_refusal: early_refusal.as_deref(),
                };
                self.store
                    .writes()
                    .deliver_event(&event, from, ttl, &self.id)
            },
        )
        .await;
        let outcome = match delivered {
            None => return Consumed::Requeue,
            Some(Ok(outcome)) => outcome,
            Some(Err(error)) => {
                tracing::error!(order_id = %about, event = %event.name, error = %error, "cannot keep an event");
                return Consumed::Requeue;
            }
        };
        let label = match &outcome {
            EventOutcome::Used(_) => "used",
            EventOutcome::Kept { order_exists: true } => "kept",
            EventOutcome::Kept {
                order_exists: false,
            } => "kept_for_a_later_order",
            EventOutcome::Duplicate => "duplicate",
            EventOutcome::Refused { .. } => "refused",
        };
        metrics::counter!("sas_events_total", "outcome" => label).increment(1);
        tracing::info!(order_id = %about, event = %event.name, event_id = %event.event_id, sender = %sender.identity, outcome = label, "event received");
        if let EventOutcome::Refused { reason } = outcome {
            return Consumed::DeadLetter(format!("event refused: {reason}"));
        }
        if let EventOutcome::Used(used) = outcome {
            // Every order the event moved is announced, all at once: a
            // redelivery would find the event used (a duplicate) and
            // announce none of them.
            let announced = futures_util::future::join_all(
                used.iter()
                    .map(|progress| self.announce(Some(publisher), progress)),
            )
            .await;
            let unconfirmed = announced.iter().filter(|result| result.is_err()).count();
            if let Some(Err(error)) = announced.into_iter().find(Result::is_err) {
                // Committed; what those orders do next was not confirmed:
                // the redelivery finds the event used, and the supervisor
                // retries the steps they started.
                tracing::warn!(order_id = %about, error = %error, unconfirmed, "event used but some next requests were not confirmed; the supervisor will retry them");
                return Consumed::Requeue;
            }
        }
        Consumed::Ack
    }
}
