//! Recording dead letters.

use sas_broker::consume::{Consumed, Delivery};
use sas_messages::headers;

use crate::Supervisor;

impl Supervisor {
    /// Records one message from the dead-letter record queue in the state
    /// store: the reason (ours, or RabbitMQ's such as `delivery_limit`), the
    /// queue it came from, and the order it belongs to when that can be told.
    pub async fn record_dead_letter(&self, delivery: Delivery) -> Consumed {
        let reason = delivery
            .header(headers::DEAD_LETTER_REASON)
            .or_else(|| {
                delivery
                    .header(headers::FIRST_DEATH_REASON)
                    .map(|r| format!("rejected by RabbitMQ: {r}"))
            })
            .unwrap_or_else(|| "unknown".to_owned());
        let source = delivery
            .header(headers::DEAD_LETTER_SOURCE_QUEUE)
            .or_else(|| delivery.header(headers::FIRST_DEATH_QUEUE));
        let order_id = delivery.header(headers::ORDER_ID).or_else(|| {
            serde_json::from_slice::<serde_json::Value>(&delivery.body)
                .ok()
                .and_then(|v| {
                    v.get("order_id")
                        .and_then(|id| id.as_str())
                        .map(str::to_owned)
                })
        });
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| id.to_string());
        let recorded = sas_runtime::retry_transient(
            &self.shutdown,
            "recording a dead letter",
            |e: &sas_store::StoreError| e.is_transient(),
            || {
                self.store.record_dead_letter(
                    source.as_deref(),
                    &reason,
                    order_id.as_deref(),
                    message_id.as_deref(),
                    &delivery.body,
                )
            },
        )
        .await;
        match recorded {
            Some(Ok(())) => {
                metrics::counter!("sas_dead_lettered_total", "queue" => source.clone().unwrap_or_default()).increment(1);
                tracing::warn!(order_id = order_id.as_deref().unwrap_or(""), queue = source.as_deref().unwrap_or(""), reason = %reason, "dead letter recorded");
                if let (Some(order_id), Some(source)) = (&order_id, &source) {
                    self.settle(order_id, source, &delivery, &reason).await;
                }
                Consumed::Ack
            }
            Some(Err(error)) => {
                // Retrying cannot help, and the operator's copy of the
                // message stays in the dead-letter queue: drop this one.
                tracing::error!(error = %error, queue = source.as_deref().unwrap_or(""), "cannot record a dead letter; it stays only in the dead-letter queue");
                Consumed::Ack
            }
            None => Consumed::Requeue,
        }
    }
}

impl Supervisor {
    /// Settles the order of a dead-lettered step request or reply, which
    /// would otherwise wait for its deadline only to be retried into the
    /// same failure. A dead-lettered submission needs nothing: either it was
    /// never stored, or its order runs normally.
    async fn settle(&self, order_id: &str, source: &str, delivery: &Delivery, reason: &str) {
        let agent_queue = self.names.agent_requests("");
        if !(source.starts_with(&agent_queue) || source == self.names.scheduler_replies()) {
            return;
        }
        let Some(attempt_id) = delivery
            .correlation_id()
            .and_then(|id| id.parse::<sas_messages::AttemptId>().ok())
        else {
            return;
        };
        let settled = sas_runtime::retry_transient(
            &self.shutdown,
            "settling a dead-lettered order",
            |e: &sas_store::StoreError| e.is_transient(),
            || {
                self.store
                    .settle_dead_letter(order_id, attempt_id, reason, &self.id)
            },
        )
        .await;
        match settled {
            Some(Ok(Some(progress))) => {
                tracing::warn!(order_id, correlation_id = %attempt_id, "order settled after its message was dead-lettered");
                self.announce(&progress).await;
            }
            Some(Ok(None)) | None => {}
            Some(Err(error)) => {
                tracing::error!(order_id, error = %error, "cannot settle a dead-lettered order")
            }
        }
    }
}
