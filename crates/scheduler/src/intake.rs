//! Intake: a submitted order becomes an order with its process record.

use sas_broker::consume::{Consumed, Delivery};
use sas_broker::Publisher;
use sas_messages::{decode, SubmitOrder};
use sas_store::intake::{Intake, Submission};

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
        // RabbitMQ's request/reply convention: reply_to and correlation_id as
        // message properties (the body's reply_to wins when both are set).
        let reply_to_property = delivery.reply_to().map(str::to_owned);
        let correlation_id = delivery.correlation_id().map(str::to_owned);
        if let Some(queue) = &reply_to_property {
            if !sas_messages::order::is_queue_name(queue) {
                let reason = "the reply_to property must be a queue name of 1 to 255 bytes without control characters";
                return self.refuse(&delivery, publisher, reason.into()).await;
            }
        }
        if let Some(queue) = order.reply_to.as_ref().or(reply_to_property.as_ref()) {
            if self.names.is_own_queue(queue) {
                let reason = format!("reply_to {queue:?} is one of the system's own queues: name a queue of your own for status messages");
                return self.refuse(&delivery, publisher, reason).await;
            }
        }
        tracing::Span::current().record("order_id", order.order_id.as_str());
        let trace_id = trace_id.to_owned();
        let stored = sas_runtime::retry_transient(
            &self.shutdown,
            "storing an order",
            |e: &sas_store::StoreError| e.is_transient(),
            || async {
                let submission = Submission {
                    order: order.clone(),
                    trace_id: trace_id.clone(),
                    reply_to_property: reply_to_property.clone(),
                    correlation_id: correlation_id.clone(),
                };
                self.intake
                    .submit(submission)
                    .await
                    .unwrap_or_else(|| Err(stopping()))
            },
        )
        .await;
        let intake = match stored {
            None => return Consumed::Requeue,
            Some(Ok(intake)) => intake,
            Some(Err(error)) => {
                tracing::error!(order_id = %order.order_id, error = %error, "cannot store order");
                return Consumed::Requeue;
            }
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
}
