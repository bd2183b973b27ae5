//! Events for wait steps: each message of the events queue is kept in its
//! order's durable mailbox (or, for a correlation key, in the mailbox of
//! each order waiting with it, or by key until one does) and, when the
//! order waits for it, moves the order on (see [`sas_store::writes::events`]).

use std::time::Duration;

use sas_broker::consume::{Consumed, Delivery};
use sas_broker::Publisher;
use sas_messages::{decode, OrderEvent};
use sas_store::writes::events::EventOutcome;

use crate::Scheduler;

impl Scheduler {
    /// Handles one message of the events queue. An invalid one is
    /// dead-lettered with the reason; a valid one is kept and, if its order
    /// waits for it, used, in one transaction; the message is acknowledged
    /// after that commit and after what the order does next is confirmed
    /// by the broker.
    pub async fn handle_event(&self, delivery: Delivery, publisher: &Publisher) -> Consumed {
        let event: OrderEvent = match decode(&delivery.body, self.settings.amqp.max_message_bytes) {
            Ok(event) => event,
            Err(error) => return Consumed::DeadLetter(format!("invalid event: {error}")),
        };
        if let Err(error) = event.validate() {
            return Consumed::DeadLetter(format!("invalid event: {}", error.0));
        }
        // An event for a key has no order id: the key stands in the logs.
        let about = event.order_id.as_ref().map_or_else(
            || event.correlation_key.clone().unwrap_or_default(),
            |id| id.as_str().to_owned(),
        );
        tracing::Span::current().record("order_id", about.as_str());
        let ttl = Duration::from_secs(self.settings.scheduler.event_ttl_secs);
        let delivered = sas_runtime::retry_transient(
            &self.shutdown,
            "keeping an event",
            |e: &sas_store::StoreError| e.is_transient(),
            || self.store.writes().deliver_event(&event, ttl, &self.id),
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
        };
        metrics::counter!("sas_events_total", "outcome" => label).increment(1);
        tracing::info!(order_id = %about, event = %event.name, event_id = %event.event_id, outcome = label, "event received");
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
