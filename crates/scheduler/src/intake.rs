//! Intake: a submitted order becomes an order with its process record.

use sas_broker::consume::{Consumed, Delivery};
use sas_broker::Publisher;
use sas_messages::{decode, SubmitOrder};
use sas_store::writes::intake::{Intake, Submission};

use crate::{stopping, Scheduler};

impl Scheduler {
    /// Handles one message of the orders queue.
    ///
    /// Invalid input is answered `rejected` on the `reply_to` it named (see
    /// [`crate::refusal`]) and dead-lettered with the reason. A valid order is stored
    /// with its process record and its first step started, in one statement
    /// (together with the orders other handlers hold at the same moment)
    /// idempotent on the order id; the message is acknowledged only after
    /// that commit and after the first request is confirmed by the broker.
    /// `trace_id` is the order's trace: its client's, or a new one.
    pub async fn handle_order(
        &self,
        delivery: Delivery,
        publisher: &Publisher,
        trace_id: &str,
    ) -> Consumed {
        let order: SubmitOrder = match decode(&delivery.body, self.settings.amqp.max_message_bytes)
        {
            Ok(order) => order,
            Err(error) => return self.refuse(&delivery, publisher, error.to_string()).await,
        };
        if let Err(error) = order.validate() {
            return self.refuse(&delivery, publisher, error.to_string()).await;
        }
        if let Err(reason) = self.workflows.entry_for(&order) {
            return self.refuse(&delivery, publisher, reason).await;
        }
        // RabbitMQ's request/reply convention: reply_to and correlation_id as
        // message properties (the body's reply_to wins when both are set).
        let reply_to_property = delivery.reply_to();
        let correlation_id = delivery.correlation_id();
        if let Some(reason) = self.reply_to_refusal(&order, reply_to_property) {
            return self.refuse(&delivery, publisher, reason).await;
        }
        tracing::Span::current().record("order_id", order.order_id.as_str());
        let intake = match self
            .store_order(&order, trace_id, reply_to_property, correlation_id)
            .await
        {
            Ok(intake) => intake,
            Err(consumed) => return consumed,
        };
        match intake {
            Intake::Accepted(progress) => {
                metrics::counter!("sas_orders_received_total").increment(1);
                tracing::info!(order_id = %order.order_id, trace_id = %trace_id, redelivered = delivery.redelivered, "order received");
                match self.announce(Some(publisher), &progress).await {
                    Ok(()) => Consumed::Ack,
                    Err(error) => {
                        // Committed, and not confirmed even on a later
                        // connection within the request's start window (or
                        // shutdown came first): the redelivery will be a
                        // duplicate, and the supervisor retries the first
                        // step once its deadline passes.
                        tracing::warn!(order_id = %order.order_id, error = %error, "order stored but its first request was not confirmed; the supervisor will retry it");
                        Consumed::Requeue
                    }
                }
            }
            Intake::Duplicate => {
                metrics::counter!("sas_orders_duplicate_total").increment(1);
                tracing::info!(order_id = %order.order_id, "duplicate submission ignored");
                Consumed::Ack
            }
            Intake::Conflict => {
                let reason = format!(
                    "order_id {:?} is already used by an order with different content",
                    order.order_id.as_str()
                );
                self.refuse(&delivery, publisher, reason).await
            }
        }
    }

    /// Why the order is refused for where its status messages would go, if
    /// it is: a `reply_to` property that is no queue name, or a reply queue
    /// (the body's, else the property's) that is one of the system's own.
    fn reply_to_refusal(
        &self,
        order: &SubmitOrder,
        reply_to_property: Option<&str>,
    ) -> Option<String> {
        if let Some(queue) = reply_to_property {
            if !sas_messages::order::is_queue_name(queue) {
                let reason = "the reply_to property must be a queue name of 1 to 255 bytes without control characters";
                return Some(reason.into());
            }
        }
        if let Some(queue) = order.reply_to.as_deref().or(reply_to_property) {
            if self.names.is_own_queue(queue) {
                return Some(format!("reply_to {queue:?} is one of the system's own queues: name a queue of your own for status messages"));
            }
        }
        None
    }

    /// Stores the order with its process record (through the intake batch),
    /// retrying while the store's failures are transient: `Err` with
    /// [`Consumed::Requeue`] when the scheduler stops first or the store
    /// fails for good (logged).
    async fn store_order(
        &self,
        order: &SubmitOrder,
        trace_id: &str,
        reply_to_property: Option<&str>,
        correlation_id: Option<&str>,
    ) -> Result<Intake, Consumed> {
        let stored = sas_runtime::retry_transient(
            &self.shutdown,
            "storing an order",
            |e: &sas_store::StoreError| e.is_transient(),
            || async {
                let submission = Submission {
                    order: order.clone(),
                    trace_id: trace_id.to_owned(),
                    reply_to_property: reply_to_property.map(str::to_owned),
                    correlation_id: correlation_id.map(str::to_owned),
                };
                self.intake
                    .submit(submission)
                    .await
                    .unwrap_or_else(|| Err(stopping()))
            },
        )
        .await;
        match stored {
            None => Err(Consumed::Requeue),
            Some(Ok(intake)) => Ok(intake),
            Some(Err(error)) => {
                tracing::error!(order_id = %order.order_id, error = %error, "cannot store order");
                Err(Consumed::Requeue)
            }
        }
    }
}
