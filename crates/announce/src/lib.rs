//! Announcing committed transitions.
//!
//! Every transition of the state store commits first and then hands back a
//! [`Progress`]: the status messages a client should see and, at most, one
//! step request for an agent. Both the scheduler and the supervisor commit
//! transitions; this crate is the one place that turns a [`Progress`] into
//! messages and metrics, so that neither can forget a counter or send the
//! messages in another order than the other.
//!
//! - [`Announcer::announce`]: count what the transition finished, then
//!   publish its status messages and its step request, and await the
//!   broker's confirms.
//! - [`Announcer::announce_durably`]: the same, sending again on the next
//!   connection what a lost one left unconfirmed.
//! - [`request_message`]: one step request for its agent's queue.
//! - [`replay::replay_dead_letter`]: a dead letter published again, for
//!   the console and `sasctl` alike.
//! - [`bulk::run_bulk`]: resubmitting, resuming or cancelling every order a
//!   filter selects, for the console and `sasctl` alike.
//! - [`event::event_message`]: an event for orders' wait steps, for the
//!   console, `sasctl` and the gateway alike.
//!
//! Metrics, under the names operators and the benchmark read:
//! `sas_orders_finished_total{event}` (processed, compensated, failed),
//! `sas_status_messages_total{event}` and `sas_step_requests_total{agent,kind}`.
//!
//! The broker crate below stays generic (channels, confirms, properties);
//! what a status message or a step request is belongs here.

pub mod bulk;
pub mod event;
pub mod replay;

use std::time::Duration;

use sas_broker::publish::{json_properties, order_headers, Outgoing};
use sas_broker::{AmqpSettings, BrokerError, Publisher, SharedPublisher};
use sas_messages::{OrderStatus, QueueNames, StepRequest, SCHEMA_VERSION};
use sas_store::{Dispatch, Progress};
use tokio_util::sync::CancellationToken;

/// Publishes what committed transitions ask for, on behalf of one service.
///
/// It holds the deployment's names and whether status messages also go to
/// the status exchange, so that callers only pass the publisher of the
/// connection that is up (if any) and the transition's [`Progress`].
#[derive(Debug, Clone)]
pub struct Announcer {
    /// Queue and exchange names of the deployment (its prefix).
    names: QueueNames,
    /// Whether every status message also goes to the status exchange, where
    /// `sasctl watch` listens (`amqp.status_exchange`); a client's own
    /// `reply_to` gets it either way.
    status_exchange: bool,
}

impl Announcer {
    /// An announcer for the deployment described by `settings`.
    pub fn new(settings: &AmqpSettings) -> Self {
        Self {
            names: settings.names(),
            status_exchange: settings.status_exchange,
        }
    }

    /// Announces a committed transition: counts the orders it finished, then
    /// publishes its status messages and its step request through
    /// `publisher` and awaits the broker's confirms.
    ///
    /// Finished orders are counted first, whatever happens to the messages:
    /// the transition is committed, and the supervisor's gauges count only
    /// open orders, so a finish not counted here is never counted. Pass
    /// `None` for `publisher` while no broker connection is up: the count
    /// still happens, and the result says the messages were not sent.
    ///
    /// The step request is mandatory (a missing agent queue is an error, not
    /// a silently dropped step); status messages are not (nobody may be
    /// listening). Status messages are handed to the channel before the
    /// request, so a client sees `received` before the first
    /// `step_completed`. Services use [`Announcer::announce_durably`], which
    /// also sends again what a lost connection left unconfirmed.
    ///
    /// # Errors
    /// [`BrokerError::NotConnected`] without a publisher (when there is
    /// something to send), or when the broker does not take or confirm a
    /// message. The transition stays committed either way: a request that
    /// was never sent is retried by the supervisor once its deadline passes,
    /// and status messages are notifications (the state store is the record).
    pub async fn announce(
        &self,
        publisher: Option<&Publisher>,
        progress: &Progress,
    ) -> Result<(), BrokerError> {
        count_finished(progress);
        let messages = self.messages(progress);
        if messages.is_empty() {
            return Ok(());
        }
        let publisher = publisher.ok_or(BrokerError::NotConnected)?;
        // Everything is sent together and the confirms awaited together: one
        // round trip to the broker per transition, not one per message.
        publisher.send_batch(&messages).await?;
        self.count_sent(progress);
        Ok(())
    }

    /// [`Announcer::announce`], and when the connection is lost before every
    /// confirm came back (or none is up), the same messages are sent again,
    /// unchanged but for their publish-time stamp, on the session's next connection (see
    /// [`SharedPublisher::deliver`]): a step request is not left to the
    /// supervisor's deadline because a broker node died after the commit.
    /// It tries until the request's `start_by` (after which no agent would
    /// start it), or for [`STATUS_RESEND_WINDOW`] when there is only status
    /// to send, or until `shutdown`.
    ///
    /// `first` is the publisher of the connection the caller works on (the
    /// one its delivery came on), tried first; `publishers` gives the later ones.
    ///
    /// # Errors
    /// As [`Announcer::announce`], once the window has passed.
    pub async fn announce_durably(
        &self,
        publishers: &SharedPublisher,
        first: Option<&Publisher>,
        progress: &Progress,
        shutdown: &CancellationToken,
    ) -> Result<(), BrokerError> {
        count_finished(progress);
        let messages = self.messages(progress);
        if messages.is_empty() {
            return Ok(());
        }
        // Until the first request's start_by: a request sent later would
        // only be answered "not started".
        let window = every(progress)
            .flat_map(|progress| &progress.dispatches)
            .map(|dispatch| dispatch.start_by)
            .min()
            .map_or(STATUS_RESEND_WINDOW, |start_by| {
                (start_by - chrono::Utc::now())
                    .to_std()
                    .unwrap_or_default()
                    .max(MIN_RESEND_WINDOW)
            });
        let give_up = tokio::time::Instant::now() + window;
        publishers
            .deliver(first, &messages, give_up, shutdown)
            .await?;
        self.count_sent(progress);
        Ok(())
    }

    /// Every message of `progress`, in the order they are sent: each status
    /// to each of its destinations, then the step request. Built once, so a
    /// resend carries the same bytes and message ids.
    pub fn messages(&self, progress: &Progress) -> Vec<Outgoing> {
        let trace_id = progress.trace_id.as_deref();
        let reply = progress
            .reply_to
            .as_deref()
            .map(|queue| (queue, progress.correlation_id.as_deref()));
        let mut messages: Vec<Outgoing> = progress
            .statuses
            .iter()
            .flat_map(|status| self.status_messages(reply, trace_id, status))
            .collect();
        for dispatch in &progress.dispatches {
            messages.push(request_message(&self.names, dispatch, trace_id));
        }
        // Other orders the transition moved (a child started, a parent
        // told its child ended): each to its own client.
        for other in &progress.others {
            messages.extend(self.messages(other));
        }
        messages
    }

    /// Counts what a delivered transition sent.
    fn count_sent(&self, progress: &Progress) {
        for other in &progress.others {
            self.count_sent(other);
        }
        let per_status = self.status_destinations(progress.reply_to.is_some()) as u64;
        for status in &progress.statuses {
            metrics::counter!("sas_status_messages_total", "event" => status.event.as_str())
                .increment(per_status);
        }
        for dispatch in &progress.dispatches {
            metrics::counter!("sas_step_requests_total", "agent" => dispatch.agent.clone(), "kind" => format!("{:?}", dispatch.kind)).increment(1);
            tracing::debug!(order_id = %dispatch.order_id, correlation_id = %dispatch.attempt_id, step = %dispatch.step, agent = %dispatch.agent, "step request sent");
        }
    }

    /// How many messages one status makes: the status exchange (if on) and the client's queue (if any).
    fn status_destinations(&self, has_reply_to: bool) -> usize {
        usize::from(self.status_exchange) + usize::from(has_reply_to)
    }

    /// The messages of one status: to the status exchange (routing key
    /// `order.<id>`, where `sasctl watch` listens) and to the client's
    /// `reply_to` queue, if the order named one, with the client's
    /// `correlation_id` if it gave one (RabbitMQ's request/reply
    /// convention). Neither is mandatory: nobody may be listening.
    fn status_messages(
        &self,
        reply: Option<(&str, Option<&str>)>,
        trace_id: Option<&str>,
        status: &OrderStatus,
    ) -> Vec<Outgoing> {
        let body = serde_json::to_vec(status).expect("wire types always serialize");
        let properties = || {
            json_properties(&uuid::Uuid::now_v7().to_string())
                .with_headers(order_headers(&status.order_id, trace_id))
        };
        let mut messages = Vec::with_capacity(2);
        if self.status_exchange {
            messages.push(Outgoing {
                exchange: self.names.status_exchange(),
                routing_key: QueueNames::status_routing_key(&status.order_id),
                body: body.clone(),
                properties: properties(),
                mandatory: false,
            });
        }
        if let Some((queue, correlation_id)) = reply {
            // The client hears of its order by the id it sent: a tenant's
            // stored id (`ord-1@shop`) without the tenant.
            let client_id = status.order_id.client_id();
            let (body, properties) = if client_id == status.order_id.as_str() {
                (body, properties())
            } else {
                let status = OrderStatus {
                    order_id: client_id.into(),
                    ..status.clone()
                };
                (
                    serde_json::to_vec(&status).expect("wire types always serialize"),
                    json_properties(&uuid::Uuid::now_v7().to_string())
                        .with_headers(order_headers(client_id, trace_id)),
                )
            };
            let properties = match correlation_id {
                Some(id) => properties.with_correlation_id(id.into()),
                None => properties,
            };
            messages.push(Outgoing {
                exchange: String::new(),
                routing_key: queue.to_owned(),
                body,
                properties,
                mandatory: false,
            });
        }
        messages
    }
}

/// How long status messages alone are sent again after a lost connection.
pub const STATUS_RESEND_WINDOW: Duration = Duration::from_secs(60);

/// The shortest resend window of a step request, even when its `start_by`
/// is nearer: an agent answers a late request `not_started`, which puts the
/// order back in line at once rather than after its deadline.
pub const MIN_RESEND_WINDOW: Duration = Duration::from_secs(5);

/// Counts the orders that a committed transition's `statuses` finish in
/// `sas_orders_finished_total{event}` (processed, compensated, failed),
/// whether or not anybody listens and whether or not the broker is up.
fn count_finished(progress: &Progress) {
    let statuses = every(progress).flat_map(|progress| &progress.statuses);
    for status in statuses.filter(|status| status.event.is_terminal()) {
        metrics::counter!("sas_orders_finished_total", "event" => status.event.as_str())
            .increment(1);
    }
}

/// `progress` and the progress of every other order its transition moved
/// (see [`Progress::others`]), depth first.
fn every(progress: &Progress) -> Box<dyn Iterator<Item = &Progress> + '_> {
    Box::new(std::iter::once(progress).chain(progress.others.iter().flat_map(every)))
}

/// The step request of `dispatch` for its agent's queue, with
/// `correlation_id` = attempt id and `reply_to` = the shared scheduler reply
/// queue. It is mandatory: a missing agent queue is an error.
///
/// The order's priority goes in the message's `priority` property, not in
/// the body: agents order their waits for a call slot by it, and an agent
/// older than the property reads the body unchanged.
pub fn request_message(
    names: &QueueNames,
    dispatch: &Dispatch,
    trace_id: Option<&str>,
) -> Outgoing {
    let request = StepRequest {
        schema_version: SCHEMA_VERSION,
        order_id: dispatch.order_id.clone(),
        step: dispatch.step.clone(),
        kind: dispatch.kind,
        action: dispatch.action.clone(),
        attempt_id: dispatch.attempt_id,
        attempt: u32::try_from(dispatch.attempt).unwrap_or(0),
        idempotency_key: dispatch.idempotency_key.clone(),
        complete_by: dispatch.complete_by,
        start_by: Some(dispatch.start_by),
        dispatched_at: Some(dispatch.dispatched_at),
        payload: dispatch.payload.clone(),
        method: dispatch.method.clone(),
        path: dispatch.path.clone(),
        limit_key: dispatch.limit_key.clone(),
    };
    let attempt_id = dispatch.attempt_id.to_string();
    let properties = json_properties(&attempt_id)
        .with_correlation_id(attempt_id.as_str().into())
        .with_reply_to(names.scheduler_replies().into())
        .with_priority(u8::try_from(dispatch.priority).unwrap_or_default())
        .with_headers(order_headers(&dispatch.order_id, trace_id));
    Outgoing {
        exchange: String::new(),
        routing_key: names.agent_requests(&dispatch.agent),
        body: serde_json::to_vec(&request).expect("wire types always serialize"),
        properties,
        mandatory: true,
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::{Arc, Mutex};

    use futures_util::FutureExt as _;
    use metrics::{
        Counter, CounterFn, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };
    use sas_broker::{AmqpSettings, BrokerError};
    use sas_messages::{OrderStatus, StatusEvent, SCHEMA_VERSION};
    use sas_store::Progress;

    use super::Announcer;

    /// Counters by `name{label=value,...}`, for asserting what was counted.
    #[derive(Default)]
    struct Counts(Arc<Mutex<BTreeMap<String, u64>>>);

    struct Cell {
        key: String,
        counts: Arc<Mutex<BTreeMap<String, u64>>>,
    }

    impl CounterFn for Cell {
        fn increment(&self, value: u64) {
            *self
                .counts
                .lock()
                .unwrap()
                .entry(self.key.clone())
                .or_default() += value;
        }

        fn absolute(&self, value: u64) {
            self.counts.lock().unwrap().insert(self.key.clone(), value);
        }
    }

    impl Recorder for Counts {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}

        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            let labels: Vec<String> = key
                .labels()
                .map(|label| format!("{}={}", label.key(), label.value()))
                .collect();
            Counter::from_arc(Arc::new(Cell {
                key: format!("{}{{{}}}", key.name(), labels.join(",")),
                counts: self.0.clone(),
            }))
        }

        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }

        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    fn settings() -> AmqpSettings {
        AmqpSettings {
            url: "amqp://127.0.0.1:5672/%2f".into(),
            nodes: Vec::new(),
            prefix: "t.".into(),
            prefetch: 1,
            operation_timeout_ms: 1_000,
            delivery_limit: 3,
            max_message_bytes: 65_536,
            reconnect_base_ms: 100,
            reconnect_max_ms: 1_000,
            status_exchange: true,
            tls_ca_file: String::new(),
        }
    }

    fn status(event: StatusEvent) -> OrderStatus {
        OrderStatus {
            schema_version: SCHEMA_VERSION,
            order_id: "ord-1".into(),
            event,
            step: None,
            detail: None,
            at: chrono::Utc::now(),
        }
    }

    /// Runs `announce` without a broker (it awaits nothing then) under a
    /// recorder of its own, and returns its result and what it counted.
    fn announce_without_broker(
        progress: &Progress,
    ) -> (Result<(), BrokerError>, BTreeMap<String, u64>) {
        let counts = Counts::default();
        let announcer = Announcer::new(&settings());
        let result = metrics::with_local_recorder(&counts, || {
            announcer
                .announce(None, progress)
                .now_or_never()
                .expect("nothing to wait for without a publisher")
        });
        let counted = counts.0.lock().unwrap().clone();
        (result, counted)
    }

    #[test]
    fn a_finished_order_is_counted_even_when_the_broker_is_away() {
        let progress = Progress {
            statuses: vec![
                status(StatusEvent::StepCompleted),
                status(StatusEvent::Compensated),
            ],
            ..Progress::default()
        };
        let (result, counted) = announce_without_broker(&progress);
        assert!(
            matches!(result, Err(BrokerError::NotConnected)),
            "{result:?}"
        );
        assert_eq!(
            counted,
            BTreeMap::from([("sas_orders_finished_total{event=compensated}".to_owned(), 1)]),
            "the finish is counted, and no message is counted as sent"
        );
    }

    #[test]
    fn only_processed_compensated_and_failed_count_as_finished() {
        let progress = Progress {
            statuses: [
                StatusEvent::Received,
                StatusEvent::StepCompleted,
                StatusEvent::Compensating,
                StatusEvent::Processed,
                StatusEvent::Failed,
            ]
            .into_iter()
            .map(status)
            .collect(),
            ..Progress::default()
        };
        let (_, counted) = announce_without_broker(&progress);
        assert_eq!(
            counted.keys().collect::<Vec<_>>(),
            [
                "sas_orders_finished_total{event=failed}",
                "sas_orders_finished_total{event=processed}"
            ]
        );
    }

    #[test]
    fn a_transition_that_asks_for_nothing_needs_no_broker() {
        let (result, counted) = announce_without_broker(&Progress::default());
        assert!(result.is_ok(), "{result:?}");
        assert!(counted.is_empty(), "{counted:?}");
    }
}
