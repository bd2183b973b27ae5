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
