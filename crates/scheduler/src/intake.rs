//! Intake: a submitted order becomes an order with its process record.

use sas_broker::consume::{Consumed, Delivery};
use sas_broker::Publisher;
use sas_messages::order::{first_control_character, first_nul, MAX_PROPERTY_BYTES};
use sas_messages::{decode, SubmitOrder};
use sas_store::writes::intake::{Intake, Submission};

use crate::quota::QuotaVerdict;
use crate::{stopping, Scheduler};

/// Why intake refuses to store the message property `name` (one it keeps
/// with the order: `correlation_id`, `reply_to`), if it does: a control
/// character (Postgres `text` cannot hold U+0000, and a status message
/// echoes the property to the client), or more than
/// [`MAX_PROPERTY_BYTES`] (an AMQP short string cannot be longer, so this
/// holds whatever built the message). The reason names the property and
/// where, never the value itself: it is stored with the dead letter.
fn property_refusal(name: &str, value: &str) -> Option<String> {
    if let Some((at, character)) = first_control_character(value) {
        return Some(format!(
            "the {name} property holds a control character (U+{:04X} at byte {at}); name it with printable characters",
            u32::from(character)
        ));
    }
    if value.len() > MAX_PROPERTY_BYTES {
        return Some(format!(
            "the {name} property is {} bytes long; keep it to at most {MAX_PROPERTY_BYTES} bytes",
            value.len()
        ));
    }
    None
}

/// Why intake refuses the order for its `attributes`, if it does: they
/// hold U+0000 in a string or a key, which `jsonb` cannot store (one such
/// order failed the batched statement of every order beside it, and came
/// back on every delivery of its message).
fn attributes_refusal(order: &SubmitOrder) -> Option<String> {
    let at = first_nul(order.attributes.as_ref()?)?;
    Some(format!(
        "attributes hold a NUL character (U+0000) at {at}, which the state store cannot keep; send the text without it"
    ))
}

impl Scheduler {
    /// The workflow `order` starts, or why intake refuses it for what it
    /// says: an invalid field, attributes the store cannot keep, a workflow
    /// this scheduler does not run or attributes its schema refuses.
    /// Submitted orders and schedules' runs alike.
    ///
    /// # Errors
    /// The reason, for the refusal.
    pub fn workflow_of(&self, order: &SubmitOrder) -> Result<String, String> {
        order.validate().map_err(|error| error.to_string())?;
        if let Some(reason) = attributes_refusal(order) {
            return Err(reason);
        }
        Ok(self.workflows.entry_for(order)?.workflow.name.clone())
    }

    /// Whether `tenant` may start `order` of `workflow` (its tenancy rules:
    /// the workflows and priorities it may use).
    ///
    /// # Errors
    /// Why not, for the refusal.
    pub fn may_start(
        &self,
        order: &SubmitOrder,
        tenant: &str,
        workflow: &str,
    ) -> Result<(), String> {
        self.tenancy.may_start(tenant, workflow, order.priority())
    }

    /// Handles one message of the orders queue.
    ///
    /// Invalid input is answered `rejected` on the `reply_to` it named (see
    /// [`crate::refusal`]) and dead-lettered with the reason: so is an order
    /// whose stored properties or attributes Postgres would refuse, before
    /// it joins a batch (see `property_refusal` and `attributes_refusal`).
    /// An order of a tenant with a quota takes a turn of it: over it, the
    /// order is refused, or stored to start later (`crate::quota`).
    /// A valid order is stored
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
        let workflow = match self.workflow_of(&order) {
            Ok(workflow) => workflow,
            Err(reason) => return self.refuse(&delivery, publisher, reason).await,
        };
        // Who sent it, from the broker's validated user_id, never the body;
        // its tenant's rights; its id qualified by the tenant.
        let sender = match self.sender_of(&delivery) {
            Ok(sender) => sender,
            Err(reason) => return self.refuse(&delivery, publisher, reason).await,
        };
        let Some(tenant) = sender.tenant.clone() else {
            let reason = format!(
                "{} belongs to no tenant: an operator adds it to a tenant's members in the tenancy file (scheduler.tenancy_file)",
                sender.identity
            );
            return self.refuse(&delivery, publisher, reason).await;
        };
        if let Err(reason) = self.may_start(&order, &tenant, &workflow) {
            return self.refuse(&delivery, publisher, reason).await;
        }
        let mut order = order;
        order.order_id = order.order_id.qualified(&tenant);
        // RabbitMQ's request/reply convention: reply_to and correlation_id as
        // message properties (the body's reply_to wins when both are set).
        // Both are stored with the order, so each is checked here: a value
        // Postgres refuses would fail the batched statement of every order
        // beside it, and come back on every delivery of its message.
        let reply_to_property = delivery.reply_to();
        let correlation_id = delivery.correlation_id();
        let stored = [
            ("correlation_id", correlation_id),
            ("reply_to", reply_to_property),
        ];
        for (name, value) in stored {
            if let Some(reason) = value.and_then(|value| property_refusal(name, value)) {
                return self.refuse(&delivery, publisher, reason).await;
            }
        }
        if let Some(reason) = self.reply_to_refusal(&order, reply_to_property) {
            return self.refuse(&delivery, publisher, reason).await;
        }
        if let Some(queue) = order.reply_to.as_deref().or(reply_to_property) {
            if let Some(reason) = self.foreign_reply_queue(&delivery, queue) {
                return self.refuse(&delivery, publisher, reason).await;
            }
        }
        tracing::Span::current().record("order_id", order.order_id.as_str());
        // Last, so that an order refused for anything else takes no turn.
        let start_at = match self.quota_turn(&tenant, order.order_id.as_str()).await {
            QuotaVerdict::Store(start_at) => start_at,
            QuotaVerdict::Refuse(reason) => return self.refuse(&delivery, publisher, reason).await,
            QuotaVerdict::GiveBack(consumed) => return consumed,
        };
        let intake = match self
            .store_order(
                &order,
                trace_id,
                (reply_to_property, correlation_id),
                &sender.identity,
                start_at,
            )
            .await
        {
            Ok(intake) => intake,
            Err(consumed) => return consumed,
        };
        match intake {
            Intake::Accepted(progress) => {
                metrics::counter!("sas_orders_received_total").increment(1);
                tracing::info!(order_id = %order.order_id, trace_id = %trace_id, redelivered = delivery.redelivered, "order received");
                let parked = progress
                    .statuses
                    .iter()
                    .any(|status| status.event == sas_messages::StatusEvent::Waiting);
                if progress.dispatches.is_empty() && !parked && self.tenancy.is_configured() {
                    // It joined a line: with tenants, a claim
                    // lets it pass a full limit now if its tenant has
                    // nothing in flight there (the store's `Head::fresh`),
                    // rather than after the next round of replies.
                    self.claim_wake.notify_one();
                }
                match self.announce(Some(publisher), &progress).await {
                    Ok(()) => {
                        let keep = std::time::Duration::from_secs(
                            self.settings.scheduler.acknowledged_audit_secs,
                        );
                        self.acknowledged.record(&order.order_id, keep);
                        Consumed::Ack
                    }
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
                    order.order_id.client_id()
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
        (reply_to_property, correlation_id): (Option<&str>, Option<&str>),
        submitted_by: &str,
        start_at: Option<chrono::DateTime<chrono::Utc>>,
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
                    submitted_by: Some(submitted_by.to_owned()),
                    start_at,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_property_with_a_control_character_is_refused_naming_the_property_and_where() {
        assert_eq!(
            property_refusal("correlation_id", "c-\u{0}31").as_deref(),
            Some("the correlation_id property holds a control character (U+0000 at byte 2); name it with printable characters")
        );
        for (value, shown) in [
            ("q\u{7f}", "U+007F at byte 1"),
            ("é\u{85}", "U+0085 at byte 2"),
            ("tab\there", "U+0009 at byte 3"),
        ] {
            let reason = property_refusal("reply_to", value).expect("refused");
            assert!(
                reason.starts_with("the reply_to property") && reason.contains(shown),
                "{reason}"
            );
            assert!(!reason.contains(value), "the value is not quoted: {reason}");
        }
    }

    #[test]
    fn a_stored_property_over_255_bytes_is_refused_and_a_printable_one_is_kept() {
        let long = "é".repeat(128);
        assert_eq!(
            property_refusal("correlation_id", &long).as_deref(),
            Some("the correlation_id property is 256 bytes long; keep it to at most 255 bytes")
        );
        for kept in ["", "c-1", "ord-1:é ü", &"x".repeat(MAX_PROPERTY_BYTES)] {
            assert_eq!(property_refusal("correlation_id", kept), None, "{kept:?}");
        }
    }

    #[test]
    fn attributes_with_a_nul_are_refused_naming_where_and_other_orders_are_not() {
        let mut order: SubmitOrder = serde_json::from_value(serde_json::json!({
            "schema_version": 1, "order_id": "o-1", "customer_id": "c-1",
            "items": [{"sku": "s", "quantity": 1}], "amount_cents": 1, "currency": "EUR",
        }))
        .unwrap();
        assert_eq!(attributes_refusal(&order), None, "no attributes");
        let attributes = |value: serde_json::Value| match value {
            serde_json::Value::Object(map) => Some(map),
            _ => None,
        };
        order.attributes = attributes(serde_json::json!({ "note": "two\nlines" }));
        assert_eq!(attributes_refusal(&order), None, "a newline is stored");
        order.attributes = attributes(serde_json::json!({ "lines": ["a", "b\u{0}"] }));
        assert_eq!(
            attributes_refusal(&order).as_deref(),
            Some("attributes hold a NUL character (U+0000) at /lines/1, which the state store cannot keep; send the text without it")
        );
    }
}
