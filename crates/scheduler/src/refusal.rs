//! Answering a refused order: a `rejected` status to the `reply_to` it named.
//!
//! Intake refuses what it can never store: a message that is malformed, of
//! another schema version, with an unknown field or an invalid value, over
//! the size limit, with a `correlation_id` or `reply_to` property holding a
//! control character or attributes holding U+0000, or an order id already
//! used with other content. Before it is dead-lettered (as before), its
//! client hears why, so that no client waits for ever:
//!
//! - **Where.** The body's `reply_to` when the body is a JSON object that
//!   names a usable one, else the `reply_to` property (always readable, even
//!   from a body refused unread). Usable: 1 to 255 bytes without control
//!   characters, and not one of the deployment's own queues. None usable:
//!   nobody is answered.
//! - **What.** An [`OrderStatus`] of event `rejected`, the reason in
//!   `detail` (at most [`MAX_DETAIL`] bytes), the `order_id` the body
//!   carried (`""` when it had none as a string of at most 255 bytes), and
//!   the message's `correlation_id` property, as it came (a short string
//!   can carry any character; only the store cannot).
//! - **How.** Default exchange, mandatory, confirmed: a queue that does not
//!   exist is reported by the broker (the message comes back) and counted,
//!   never waited on. Answers go one at a time on a channel of their own
//!   ([`Answers`]): lapin hands a returned message to whichever confirm of
//!   its channel an ack (possibly covering several) resolves first, so on
//!   the shared channel a returned answer was counted as sent, and another
//!   message taken for unroutable. Whatever happens to the answer, the message is
//!   dead-lettered as before: an answer that cannot be sent never holds up
//!   intake nor brings the message back.
//! - **Once.** The answer's `message_id` is a digest of the refused message,
//!   the same on every answer about it, so a client can drop a repeat. A
//!   refused message comes back (redelivered) when dead-lettering it failed
//!   or its handler's connection died: a scheduler that already answered it
//!   does not answer again, and the queue's delivery limit bounds the
//!   answers of the others.
//!
//! Counted in `sas_rejected_answers_total{outcome}`: `sent`, `unroutable`
//! (no such queue), `failed` (broker refused or did not confirm), `repeat`
//! (redelivered and already answered here), `nowhere` (no usable reply_to).

use std::collections::{HashSet, VecDeque};
use std::sync::Mutex;

use sas_broker::consume::{Consumed, Delivery};
use sas_broker::publish::{json_properties, string_headers, trace_id_of};
use sas_broker::{BrokerError, Publisher};
use sas_messages::{headers, OrderId, OrderStatus, QueueNames, StatusEvent, SCHEMA_VERSION};
use serde_json::{Map, Value};
use sha2::{Digest, Sha256};

use crate::Scheduler;

/// Longest `detail` of a rejected status, in bytes: a reason may quote the
/// offending value, which may be as long as the message.
pub const MAX_DETAIL: usize = 1024;
/// Longest `order_id` echoed in a rejected status, in bytes (an AMQP short
/// string's limit; valid ids have at most 64).
pub const MAX_ECHOED_ID: usize = 255;
/// Refused messages whose answer a scheduler remembers, to answer a
/// redelivery only once.
const REMEMBERED: usize = 4096;

/// The digest of a refused message: its answer's `message_id`, and what a
/// scheduler remembers of answers it sent.
type Fingerprint = [u8; 16];

/// The refused messages this scheduler answered lately (bounded, oldest
/// forgotten first).
#[derive(Debug, Default)]
pub struct Answered {
    recent: Mutex<(VecDeque<Fingerprint>, HashSet<Fingerprint>)>,
}

impl Answered {
    /// Whether a refused message is to be answered: always, unless it is a
    /// redelivery of one this scheduler answered already. A client that
    /// sends the same bad message again (not a redelivery) hears again.
    fn should_answer(&self, fingerprint: &Fingerprint, redelivered: bool) -> bool {
        let recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        !(redelivered && recent.1.contains(fingerprint))
    }

    /// Remembers that `fingerprint` was answered.
    fn remember(&self, fingerprint: Fingerprint) {
        let mut recent = self.recent.lock().unwrap_or_else(|e| e.into_inner());
        let (order, set) = &mut *recent;
        if set.insert(fingerprint) {
            order.push_back(fingerprint);
            if order.len() > REMEMBERED {
                if let Some(oldest) = order.pop_front() {
                    set.remove(&oldest);
                }
            }
        }
    }
}

/// Where and how to answer one refused message.
#[derive(Debug, Clone, PartialEq)]
struct Answer {
    reply_to: String,
    status: OrderStatus,
}

/// The body as a JSON object, when it is one and within the size limit.
fn body_object(body: &[u8], limit: usize) -> Option<Map<String, Value>> {
    if body.len() > limit {
        return None;
    }
    match serde_json::from_slice(body) {
        Ok(Value::Object(map)) => Some(map),
        _ => None,
    }
}

/// A queue a rejected status may go to.
fn usable(names: &QueueNames, queue: &str) -> bool {
    sas_messages::order::is_queue_name(queue) && !names.is_own_queue(queue)
}

/// `text` cut to at most `max` bytes on a character boundary, with `…`
/// when cut.
fn bounded(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_owned();
    }
    let mut end = max - '…'.len_utf8();
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &text[..end])
}

/// Where to answer a message refused with `reason`, and the status to
/// send, or `None` when it named no usable queue.
fn answer_for(
    names: &QueueNames,
    body: Option<&Map<String, Value>>,
    reply_to_property: Option<&str>,
    reason: &str,
) -> Option<Answer> {
    let from_body = body
        .and_then(|body| body.get("reply_to"))
        .and_then(Value::as_str);
    let reply_to = [from_body, reply_to_property]
        .into_iter()
        .flatten()
        .find(|queue| usable(names, queue))?;
    let order_id = body
        .and_then(|body| body.get("order_id"))
        .and_then(Value::as_str)
        .filter(|id| id.len() <= MAX_ECHOED_ID)
        .unwrap_or_default();
    Some(Answer {
        reply_to: reply_to.to_owned(),
        status: OrderStatus {
            schema_version: SCHEMA_VERSION,
            order_id: OrderId::from(order_id),
            event: StatusEvent::Rejected,
            step: None,
            detail: Some(bounded(reason, MAX_DETAIL)),
            at: chrono::Utc::now(),
        },
    })
}

/// The digest of a refused delivery: its reason, body and the properties a
/// client sets. A redelivery has the same; another message almost surely not.
fn fingerprint(delivery: &Delivery, reason: &str) -> Fingerprint {
    let mut digest = Sha256::new();
    for part in [
        reason.as_bytes(),
        &delivery.body,
        delivery.reply_to().unwrap_or_default().as_bytes(),
        delivery.correlation_id().unwrap_or_default().as_bytes(),
        delivery
            .properties
            .message_id()
            .as_ref()
            .map_or(&b""[..], |id| id.as_str().as_bytes()),
    ] {
        digest.update((part.len() as u64).to_be_bytes());
        digest.update(part);
    }
    let mut fingerprint = Fingerprint::default();
    fingerprint.copy_from_slice(&digest.finalize()[..16]);
    fingerprint
}

impl Scheduler {
    /// Refuses an order message for `reason`: answers its client (see the
    /// module docs), then has it dead-lettered.
    pub async fn refuse(
        &self,
        delivery: &Delivery,
        publisher: &Publisher,
        reason: String,
    ) -> Consumed {
        self.answer_refusal(delivery, publisher, &reason).await;
        Consumed::DeadLetter(reason)
    }

    /// Answers the client of a message refused for `reason`, if it named a
    /// usable queue, and counts the refusal. Never fails: the outcome is
    /// logged and counted.
    pub async fn answer_refusal(&self, delivery: &Delivery, publisher: &Publisher, reason: &str) {
        metrics::counter!("sas_orders_rejected_total").increment(1);
        let body = body_object(&delivery.body, self.settings.amqp.max_message_bytes);
        let answer = answer_for(&self.names, body.as_ref(), delivery.reply_to(), reason)
            // Never on another client's queue (tenancy configured).
            .filter(|answer| {
                self.foreign_reply_queue(delivery, &answer.reply_to)
                    .is_none()
            });
        let Some(answer) = answer else {
            tracing::info!(
                reason,
                "order refused; it named no usable reply_to, so nobody is answered"
            );
            return count("nowhere");
        };
        let fingerprint = fingerprint(delivery, reason);
        if !self
            .answered
            .should_answer(&fingerprint, delivery.redelivered)
        {
            tracing::info!(reply_to = %answer.reply_to, "refused order redelivered; already answered rejected");
            return count("repeat");
        }
        let mut properties = json_properties(&format!("rejected-{}", hex::encode(fingerprint)));
        if let Some(correlation_id) = delivery.correlation_id() {
            properties = properties.with_correlation_id(correlation_id.into());
        }
        let traceparent = trace_id_of(&delivery.properties)
            .map(|trace| sas_messages::TraceParent::child_of(&trace).to_string());
        let mut pairs = Vec::new();
        if !answer.status.order_id.is_empty() {
            pairs.push((headers::ORDER_ID, answer.status.order_id.as_str()));
        }
        if let Some(traceparent) = &traceparent {
            pairs.push((headers::TRACEPARENT, traceparent.as_str()));
        }
        let properties = properties.with_headers(string_headers(pairs));
        let own = self.answers.channel.lock().await;
        let via = own
            .as_ref()
            .filter(|own| own.is_open())
            .unwrap_or(publisher);
        let sent = via
            .publish_json("", &answer.reply_to, &answer.status, properties, true)
            .await;
        drop(own);
        let order_id = answer.status.order_id.as_str();
        match sent {
            Ok(()) => {
                self.answered.remember(fingerprint);
                tracing::info!(order_id, reply_to = %answer.reply_to, "order refused; answered rejected");
                count("sent");
            }
            Err(BrokerError::Unroutable { .. }) => {
                tracing::info!(order_id, reply_to = %answer.reply_to, "order refused; its reply_to queue does not exist, so the rejection was dropped");
                count("unroutable");
            }
            Err(error) => {
                tracing::warn!(order_id, reply_to = %answer.reply_to, error = %error, "order refused; the rejected status was not confirmed");
                count("failed");
            }
        }
    }
}

/// The channel refusal answers are published on, one at a time (see the
/// module docs): opened by [`Answers::open`] on each broker connection.
#[derive(Default)]
pub struct Answers {
    channel: tokio::sync::Mutex<Option<Publisher>>,
}

impl Answers {
    /// Opens the answers' channel on `connection` (with `like`'s identity),
    /// in place of the last connection's. When it cannot be opened, answers
    /// go on the shared channel, as before.
    pub async fn open(
        &self,
        connection: &sas_broker::lapin::Connection,
        like: &Publisher,
        timeout: std::time::Duration,
    ) {
        let opened = match Publisher::open(connection, timeout).await {
            Ok(publisher) => Some(match like.user_id() {
                Some(user) => publisher.identified_as(user),
                None => publisher,
            }),
            Err(error) => {
                tracing::warn!(error = %error, "cannot open a channel for refusal answers; they go on the shared channel");
                None
            }
        };
        *self.channel.lock().await = opened;
    }
}

fn count(outcome: &'static str) {
    metrics::counter!("sas_rejected_answers_total", "outcome" => outcome).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names() -> QueueNames {
        QueueNames::new("p.")
    }

    fn object(json: &str) -> Map<String, Value> {
        body_object(json.as_bytes(), 1 << 16).expect("an object")
    }

    #[test]
    fn the_bodys_reply_to_wins_and_the_property_is_the_fallback() {
        let body = object(r#"{"order_id":"o-1","reply_to":"mine"}"#);
        let answer = answer_for(&names(), Some(&body), Some("prop"), "why").unwrap();
        assert_eq!(answer.reply_to, "mine");
        assert_eq!(answer.status.order_id, "o-1");
        assert_eq!(answer.status.event, StatusEvent::Rejected);
        assert_eq!(answer.status.detail.as_deref(), Some("why"));
        // Unusable in the body (empty, one of ours, not a string): the property.
        for bad in [
            r#""""#,
            r#""p.sas.orders""#,
            r#""p.sas.agent.payment""#,
            "7",
        ] {
            let body = object(&format!(r#"{{"reply_to":{bad}}}"#));
            let answer = answer_for(&names(), Some(&body), Some("prop"), "why").unwrap();
            assert_eq!(answer.reply_to, "prop", "{bad}");
        }
    }

    #[test]
    fn an_unreadable_body_is_answered_on_the_property_with_an_empty_order_id() {
        assert!(body_object(b"{\"order_id\": ", 1024).is_none());
        assert!(body_object(b"[1]", 1024).is_none());
        assert!(
            body_object(br#"{"a":1}"#, 3).is_none(),
            "over the limit: unread"
        );
        let answer = answer_for(&names(), None, Some("prop"), "malformed").unwrap();
        assert_eq!(
            (answer.reply_to.as_str(), answer.status.order_id.as_str()),
            ("prop", "")
        );
        // An id that is no string, or too long to echo, is not echoed either.
        for id in [
            "42".to_owned(),
            format!("\"{}\"", "x".repeat(MAX_ECHOED_ID + 1)),
        ] {
            let body = object(&format!(r#"{{"order_id":{id}}}"#));
            let answer = answer_for(&names(), Some(&body), Some("prop"), "why").unwrap();
            assert_eq!(answer.status.order_id, "");
        }
    }

    #[test]
    fn no_usable_queue_means_no_answer() {
        assert!(answer_for(&names(), None, None, "why").is_none());
        assert!(answer_for(&names(), None, Some("p.sas.scheduler.replies"), "why").is_none());
        let long = "q".repeat(256);
        let body = object(&format!(r#"{{"reply_to":"{long}"}}"#));
        assert!(answer_for(&names(), Some(&body), None, "why").is_none());
    }

    #[test]
    fn a_long_reason_is_cut_on_a_character_boundary() {
        let reason = "é".repeat(MAX_DETAIL);
        let detail = answer_for(&names(), None, Some("q"), &reason)
            .unwrap()
            .status
            .detail
            .unwrap();
        assert!(
            detail.len() <= MAX_DETAIL && detail.ends_with('…'),
            "{}",
            detail.len()
        );
    }

    #[test]
    fn a_redelivery_already_answered_here_is_not_answered_again() {
        let answered = Answered::default();
        let (one, two) = ([1; 16], [2; 16]);
        assert!(answered.should_answer(&one, true), "never answered: answer");
        answered.remember(one);
        assert!(
            !answered.should_answer(&one, true),
            "a redelivery: once is enough"
        );
        assert!(
            answered.should_answer(&one, false),
            "the client sent it again: answer"
        );
        assert!(answered.should_answer(&two, true));
        for n in 0..REMEMBERED as u32 {
            let mut other = [0; 16];
            other[..4].copy_from_slice(&n.to_be_bytes());
            other[15] = 9;
            answered.remember(other);
        }
        assert!(
            answered.should_answer(&one, true),
            "forgotten once enough others came"
        );
    }

    #[test]
    fn the_fingerprint_tells_messages_apart_and_a_redelivery_has_the_same() {
        let delivery = |body: &[u8], correlation: &str| Delivery {
            queue: "q".into(),
            body: body.to_vec(),
            properties: sas_broker::lapin::BasicProperties::default()
                .with_correlation_id(correlation.into()),
            redelivered: false,
        };
        let first = fingerprint(&delivery(b"{}", "c-1"), "why");
        let mut again = delivery(b"{}", "c-1");
        again.redelivered = true;
        assert_eq!(first, fingerprint(&again, "why"));
        assert_ne!(first, fingerprint(&delivery(b"{}", "c-2"), "why"));
        assert_ne!(first, fingerprint(&delivery(b"{ }", "c-1"), "why"));
    }
}
