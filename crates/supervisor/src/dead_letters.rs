//! Recording dead letters, and trusting only what a service or RabbitMQ said.
//!
//! A dead letter's headers (`x-sas-source-queue`, `x-sas-order-id`, the
//! reason) are what decide whether an order is settled, and which metric
//! label is counted. A client that may publish to the dead-letter exchange
//! could set them to anything. So they count only when the message's
//! provenance, read from the `user_id` that RabbitMQ validated, is ours:
//!
//! - dead-lettered by one of our services: it carries our `x-sas-reason`,
//!   its `user_id` is a service identity (`amqp.service_users` or
//!   `amqp.agent_users`), and the message it copies was published by
//!   `x-sas-original-user` (written by that service, see
//!   [`sas_broker::consume::ORIGINAL_USER_HEADER`]);
//! - dead-lettered by RabbitMQ itself (a delivery limit): no `x-sas-reason`,
//!   and the `user_id` is the original publisher's, kept by RabbitMQ.
//!
//! Settlement of a step also needs that original publisher to be one of
//! ours: a scheduler for a request, an agent for a reply. Anything else is
//! recorded as untrusted, with what it claimed in the reason, and changes
//! no order. With no identities configured (both lists empty) everyone is
//! trusted, as before user ids were checked.
//!
//! A dead letter is read before it is judged:
//! - a trusted reply that still reads as the reply of its attempt (its
//!   `correlation_id` is its attempt id) is applied as the reply it is: a
//!   success that went round the reply queue's delivery limit (our own
//!   requeues count towards it: a scheduler stopping, or waiting out a
//!   database outage past RabbitMQ's `consumer_timeout`) completes its step
//!   and keeps its result, instead of compensating the order;
//! - a request an agent dead-lettered itself (with our reason) was refused
//!   unread: no call was made for it, so its attempt applied nothing;
//! - anything else leaves its attempt's outcome unknown, and the order is
//!   compensated once no call of it can still land.
//!
//! Every record is bounded: at most `amqp.max_message_bytes` of the body
//! (the size is in the reason) and short header values.

use sas_broker::consume::{Consumed, Delivery, ORIGINAL_USER_HEADER};
use sas_broker::ServiceAmqpSettings;
use sas_messages::{headers, QueueNames};

use crate::Supervisor;

/// Longest header value copied into a record or a log line.
const MAX_HEADER_CHARS: usize = 512;

/// Metric label of dead letters whose source cannot be trusted.
pub const UNTRUSTED_LABEL: &str = "untrusted";

/// What a dead letter may be taken to say.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Judged {
    /// Why it was dead-lettered, as recorded.
    pub reason: String,
    /// The queue it came from, when trusted.
    pub source: Option<String>,
    /// The order it belongs to, when trusted.
    pub order_id: Option<String>,
    /// The `queue` label of `sas_dead_lettered_total`.
    pub label: String,
    /// Whether it may settle its order's step.
    pub may_settle: bool,
    /// A request its agent dead-lettered itself, unread: no call was made
    /// for its attempt.
    pub no_call: bool,
    /// How many bytes of the body to record.
    pub kept_bytes: usize,
    /// Who published the message that died, when one of our services
    /// vouches for it (or RabbitMQ validated it on the message itself).
    pub publisher: Option<String>,
}

/// A header value as it may be recorded and logged: at most
/// [`MAX_HEADER_CHARS`] characters, without U+0000 (which Postgres text
/// cannot hold: a client's `message_id` with one would fail the record).
fn bounded(value: String) -> String {
    let value = sas_messages::storable::storable_text(&value);
    match value.char_indices().nth(MAX_HEADER_CHARS) {
        Some((cut, _)) => format!("{}...", &value[..cut]),
        None => value,
    }
}

/// Decides what a dead letter may be taken to say (see the module docs).
pub fn judge(delivery: &Delivery, amqp: &ServiceAmqpSettings, names: &QueueNames) -> Judged {
    let header = |key: &str| delivery.header(key).map(bounded);
    let user_id = delivery
        .properties
        .user_id()
        .as_ref()
        .map(|user| bounded(user.as_str().to_owned()));
    let our_reason = header(headers::DEAD_LETTER_REASON);
    // Who published the message that died, and whether we may believe it.
    let (trusted, origin) = match &our_reason {
        Some(_) => (
            amqp.is_service(user_id.as_deref()),
            header(ORIGINAL_USER_HEADER),
        ),
        None => (amqp.is_service(user_id.as_deref()), user_id.clone()),
    };
    let reason = our_reason
        .clone()
        .or_else(|| {
            header(headers::FIRST_DEATH_REASON).map(|r| format!("rejected by RabbitMQ: {r}"))
        })
        .unwrap_or_else(|| "unknown".to_owned());
    let claimed_source = match &our_reason {
        Some(_) => header(headers::DEAD_LETTER_SOURCE_QUEUE),
        None => header(headers::FIRST_DEATH_QUEUE),
    };
    let limit = amqp.max_message_bytes;
    let size = delivery.body.len();
    let claimed_order = header(headers::ORDER_ID).or_else(|| {
        // An oversized body is not parsed.
        (size <= limit)
            .then(|| serde_json::from_slice::<serde_json::Value>(&delivery.body).ok())
            .flatten()
            .and_then(|v| v.get("order_id")?.as_str().map(|id| bounded(id.to_owned())))
    });
    // A client's message (an order, an event) names a tenant's stored id
    // (`ord-1@shop`) believably only from a service that sends on a
    // client's behalf (the gateway, which names the id its client's GET
    // looks up); from any other client it is taken as the bare id, so no
    // client can mark another tenant's order as refused. The services'
    // own messages (step requests, replies) name the stored id, always.
    let delegated = origin
        .as_deref()
        .is_some_and(|user| amqp.delegating_users.iter().any(|d| d == user));
    let from_clients = claimed_source
        .as_deref()
        .is_none_or(|queue| queue == names.orders() || queue == names.events());
    let claimed_order = claimed_order.map(|id| {
        if delegated || !from_clients {
            id
        } else {
            sas_messages::ids::client_id(&id).to_owned()
        }
    });
    let size_note = if size > limit {
        format!(" (body of {size} bytes; the first {limit} recorded)")
    } else {
        String::new()
    };
    if !trusted {
        let publisher = user_id.as_deref().unwrap_or("(no user_id)");
        return Judged {
            reason: format!(
                "untrusted dead letter: published by broker user {publisher:?}, not one of our \
                 services; it claimed reason {reason:?}, queue {:?}, order {:?}{size_note}",
                claimed_source.as_deref().unwrap_or(""),
                claimed_order.as_deref().unwrap_or(""),
            ),
            source: None,
            order_id: None,
            label: UNTRUSTED_LABEL.to_owned(),
            may_settle: false,
            no_call: false,
            kept_bytes: size.min(limit),
            publisher: None,
        };
    }
    let from_agent_queue = claimed_source
        .as_deref()
        .is_some_and(|source| source.starts_with(&names.agent_requests("")));
    let may_settle = match claimed_source.as_deref() {
        Some(source) if source == names.scheduler_replies() => {
            amqp.accepts_reply_from(origin.as_deref())
        }
        Some(_) if from_agent_queue => amqp.is_service(origin.as_deref()),
        _ => false,
    };
    Judged {
        reason: format!("{reason}{size_note}"),
        label: claimed_source.clone().unwrap_or_default(),
        source: claimed_source,
        order_id: claimed_order,
        may_settle,
        // Only an agent consumes an agent's queue, and it dead-letters a
        // request (with our reason) only before any call: unreadable, too
        // large, naming no call it may make, or without reply_to.
        no_call: from_agent_queue && our_reason.is_some(),
        kept_bytes: size.min(limit),
        publisher: origin,
    }
}

impl Supervisor {
    /// Records one message from the dead-letter record queue in the state
    /// store: the reason (ours, or RabbitMQ's such as `delivery_limit`), the
    /// queue it came from, and the order it belongs to when that can be told
    /// and trusted; then settles the order's step if the message may (see
    /// the module docs).
    pub async fn record_dead_letter(&self, delivery: Delivery) -> Consumed {
        let judged = judge(&delivery, &self.settings.amqp, &self.names);
        let message_id = delivery
            .properties
            .message_id()
            .as_ref()
            .map(|id| bounded(id.to_string()));
        let body = &delivery.body[..judged.kept_bytes];
        let recorded = sas_runtime::retry_transient(
            &self.shutdown,
            "recording a dead letter",
            |e: &sas_store::StoreError| e.is_transient(),
            || {
                self.store.writes().record_dead_letter(
                    judged.source.as_deref(),
                    &judged.reason,
                    judged.order_id.as_deref(),
                    (message_id.as_deref(), judged.publisher.as_deref()),
                    body,
                )
            },
        )
        .await;
        match recorded {
            Some(Ok(())) => {
                metrics::counter!("sas_dead_lettered_total", "queue" => judged.label.clone())
                    .increment(1);
                tracing::warn!(order_id = judged.order_id.as_deref().unwrap_or(""), queue = judged.source.as_deref().unwrap_or(""), reason = %judged.reason, "dead letter recorded");
                if let (true, Some(order_id), Some(source)) =
                    (judged.may_settle, &judged.order_id, &judged.source)
                {
                    self.settle(order_id, source, &delivery, &judged).await;
                }
                Consumed::Ack
            }
            Some(Err(error)) => {
                // Retrying cannot help, and the operator's copy of the
                // message stays in the dead-letter queue: drop this one.
                tracing::error!(error = %error, queue = judged.source.as_deref().unwrap_or(""), "cannot record a dead letter; it stays only in the dead-letter queue");
                Consumed::Ack
            }
            None => Consumed::Requeue,
        }
    }
}

impl Supervisor {
    /// Settles the order of a dead-lettered step request or reply, which
    /// would otherwise wait for its deadline only to be retried into the
    /// same failure: a reply that can still be read is applied as the
    /// reply it is ([`Supervisor::apply_dead_reply`]); anything else
    /// settles its attempt as dead-lettered. A dead-lettered submission
    /// needs nothing: either it was never stored, or its order runs
    /// normally.
    async fn settle(&self, order_id: &str, source: &str, delivery: &Delivery, judged: &Judged) {
        let agent_queue = self.names.agent_requests("");
        let is_reply = source == self.names.scheduler_replies();
        if !(source.starts_with(&agent_queue) || is_reply) {
            return;
        }
        let Some(attempt_id) = delivery
            .correlation_id()
            .and_then(|id| id.parse::<sas_messages::AttemptId>().ok())
        else {
            return;
        };
        if is_reply && self.apply_dead_reply(order_id, attempt_id, delivery).await {
            return;
        }
        let reason = judged.reason.as_str();
        let settled = sas_runtime::retry_transient(
            &self.shutdown,
            "settling a dead-lettered order",
            |e: &sas_store::StoreError| e.is_transient(),
            || {
                self.store.writes().settle_dead_letter(
                    order_id,
                    attempt_id,
                    reason,
                    judged.no_call,
                    &self.id,
                )
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

impl Supervisor {
    /// Applies a dead-lettered reply of attempt `attempt_id` of order
    /// `order_id` as the reply it is, when it still reads as one: it decodes
    /// within `amqp.max_message_bytes`, names that order and attempt, and
    /// its publisher was judged an agent. A success then completes its step
    /// with its result, as the scheduler would have. Returns whether it was
    /// read (applied, or found stale); false leaves the dead letter to
    /// settle its attempt as unreadable.
    async fn apply_dead_reply(
        &self,
        order_id: &str,
        attempt_id: sas_messages::AttemptId,
        delivery: &Delivery,
    ) -> bool {
        let reply: sas_messages::StepReply = match sas_messages::decode(
            &delivery.body,
            self.settings.amqp.max_message_bytes,
        ) {
            Ok(reply) => reply,
            Err(error) => {
                tracing::warn!(order_id, correlation_id = %attempt_id, error = %error, "dead-lettered reply cannot be read: its attempt is settled as dead-lettered");
                return false;
            }
        };
        if reply.attempt_id != attempt_id || reply.order_id.as_str() != order_id {
            tracing::warn!(order_id, correlation_id = %attempt_id, "dead-lettered reply names another order or attempt than its headers: settled as dead-lettered");
            return false;
        }
        let applied = sas_runtime::retry_transient(
            &self.shutdown,
            "applying a dead-lettered reply",
            |e: &sas_store::StoreError| e.is_transient(),
            || self.store.writes().record_reply(&reply, &self.id),
        )
        .await;
        match applied {
            Some(Ok(sas_store::writes::progress::ReplyOutcome::Applied { progress, .. })) => {
                metrics::counter!("sas_dead_replies_applied_total").increment(1);
                tracing::warn!(order_id, correlation_id = %attempt_id, step = %reply.step, "dead-lettered reply applied as the reply it is");
                self.announce(&progress).await;
                true
            }
            Some(Ok(sas_store::writes::progress::ReplyOutcome::Stale { reason })) => {
                tracing::info!(order_id, correlation_id = %attempt_id, reason = %reason, "dead-lettered reply is stale: nothing to settle");
                true
            }
            // Stopping, as for any settlement: the order's deadline covers it.
            None => true,
            Some(Err(error)) => {
                tracing::error!(order_id, correlation_id = %attempt_id, error = %error, "cannot apply a dead-lettered reply; its order waits for its deadline");
                true
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use sas_broker::lapin::types::{AMQPValue, FieldTable};
    use sas_broker::lapin::BasicProperties;

    use super::*;

    fn amqp(agents: &str, services: &str) -> ServiceAmqpSettings {
        toml::from_str(&format!(
            "url = \"amqp://x\"\nprefix = \"\"\nprefetch = 1\noperation_timeout_ms = 1\n\
             delivery_limit = 3\nmax_message_bytes = 1024\nreconnect_base_ms = 1\n\
             reconnect_max_ms = 1\nagent_users = \"{agents}\"\nservice_users = \"{services}\""
        ))
        .unwrap()
    }

    fn dead_letter(user: Option<&str>, pairs: &[(&str, &str)], body: &[u8]) -> Delivery {
        let mut table = FieldTable::default();
        for (key, value) in pairs {
            table.insert(
                (*key).into(),
                AMQPValue::LongString((*value).to_owned().into()),
            );
        }
        let mut properties = BasicProperties::default()
            .with_headers(table)
            .with_correlation_id("0193a8c2-8a4e-7000-8000-000000000001".into());
        if let Some(user) = user {
            properties = properties.with_user_id(user.into());
        }
        Delivery {
            queue: "sas.dead-letters.record".into(),
            body: body.to_vec(),
            properties,
            redelivered: false,
        }
    }

    const FORGED: &[(&str, &str)] = &[
        (headers::DEAD_LETTER_REASON, "whatever"),
        (
            headers::DEAD_LETTER_SOURCE_QUEUE,
            "sas.agent.payment-evil-label",
        ),
        (headers::ORDER_ID, "ord-victim"),
    ];

    #[test]
    fn forged_headers_from_a_client_settle_nothing_and_label_nothing() {
        let names = QueueNames::new("");
        let judged = judge(
            &dead_letter(Some("client"), FORGED, b"{}"),
            &amqp("sas-agent", "sas-scheduler"),
            &names,
        );
        assert!(!judged.may_settle);
        assert_eq!(judged.label, UNTRUSTED_LABEL);
        assert_eq!((judged.source, judged.order_id), (None, None));
        assert!(
            judged.reason.starts_with("untrusted dead letter"),
            "{}",
            judged.reason
        );
        // A message with no user_id at all is no better.
        assert!(
            !judge(
                &dead_letter(None, FORGED, b"{}"),
                &amqp("sas-agent", ""),
                &names
            )
            .may_settle
        );
    }

    #[test]
    fn a_service_dead_letter_of_a_forged_reply_settles_nothing() {
        let names = QueueNames::new("");
        let headers = [
            (headers::DEAD_LETTER_REASON, "forged reply refused"),
            (headers::DEAD_LETTER_SOURCE_QUEUE, "sas.scheduler.replies"),
            (headers::ORDER_ID, "ord-1"),
            (ORIGINAL_USER_HEADER, "client"),
        ];
        let judged = judge(
            &dead_letter(Some("sas-scheduler"), &headers, b"{}"),
            &amqp("sas-agent", "sas-scheduler"),
            &names,
        );
        assert_eq!(judged.source.as_deref(), Some("sas.scheduler.replies"));
        assert!(!judged.may_settle);
        let genuine = [
            (headers::DEAD_LETTER_REASON, "malformed"),
            (headers::DEAD_LETTER_SOURCE_QUEUE, "sas.scheduler.replies"),
            (headers::ORDER_ID, "ord-1"),
            (ORIGINAL_USER_HEADER, "sas-agent"),
        ];
        let judged = judge(
            &dead_letter(Some("sas-scheduler"), &genuine, b"{}"),
            &amqp("sas-agent", "sas-scheduler"),
            &names,
        );
        assert!(judged.may_settle);
        assert_eq!(judged.order_id.as_deref(), Some("ord-1"));
    }

    #[test]
    fn a_request_dead_lettered_by_rabbitmq_settles_when_a_scheduler_sent_it() {
        let names = QueueNames::new("");
        let headers = [
            (headers::FIRST_DEATH_REASON, "delivery_limit"),
            (headers::FIRST_DEATH_QUEUE, "sas.agent.payment"),
            (headers::ORDER_ID, "ord-1"),
        ];
        let strict = amqp("sas-agent", "sas-scheduler");
        let judged = judge(
            &dead_letter(Some("sas-scheduler"), &headers, b"{}"),
            &strict,
            &names,
        );
        assert!(judged.may_settle);
        assert_eq!(judged.reason, "rejected by RabbitMQ: delivery_limit");
        assert_eq!(judged.label, "sas.agent.payment");
        assert!(
            !judge(
                &dead_letter(Some("client"), &headers, b"{}"),
                &strict,
                &names
            )
            .may_settle
        );
        // Without identities configured, everyone is trusted, as before.
        assert!(judge(&dead_letter(None, &headers, b"{}"), &amqp("", ""), &names).may_settle);
    }

    #[test]
    fn a_tenant_s_stored_id_is_kept_for_our_messages_and_cut_from_a_client_s() {
        let names = QueueNames::new("");
        let strict = amqp("sas-agent", "sas-scheduler");
        // A step request of a tenant's order, dead-lettered by RabbitMQ.
        let request = [
            (headers::FIRST_DEATH_REASON, "delivery_limit"),
            (headers::FIRST_DEATH_QUEUE, "sas.agent.payment"),
            (headers::ORDER_ID, "ord-1@shop"),
        ];
        let judged = judge(
            &dead_letter(Some("sas-scheduler"), &request, b"{}"),
            &strict,
            &names,
        );
        assert_eq!(judged.order_id.as_deref(), Some("ord-1@shop"));
        // A client's order naming another tenant's stored id, refused at
        // intake: taken as the bare id.
        let order = [
            (headers::DEAD_LETTER_REASON, "refused"),
            (headers::DEAD_LETTER_SOURCE_QUEUE, "sas.orders"),
            (headers::ORDER_ID, "ord-1@shop"),
            (ORIGINAL_USER_HEADER, "rival"),
        ];
        let judged = judge(
            &dead_letter(Some("sas-scheduler"), &order, b"{}"),
            &strict,
            &names,
        );
        assert_eq!(judged.order_id.as_deref(), Some("ord-1"));
    }

    #[test]
    fn a_large_body_is_recorded_in_part_and_not_parsed() {
        let names = QueueNames::new("");
        let mut body = br#"{"order_id":"ord-big","pad":""#.to_vec();
        body.resize(50_000, b'x');
        body.extend_from_slice(b"\"}");
        let judged = judge(
            &dead_letter(None, &[(headers::FIRST_DEATH_REASON, "x")], &body),
            &amqp("", ""),
            &names,
        );
        assert_eq!(judged.kept_bytes, 1024);
        assert_eq!(judged.order_id, None);
        assert!(
            judged
                .reason
                .contains("body of 50002 bytes; the first 1024 recorded"),
            "{}",
            judged.reason
        );
    }
}
