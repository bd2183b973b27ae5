//! One request, from delivery to acknowledgement.

use std::time::{Duration, Instant};

use sas_broker::consume::{Consumed, Delivery};
use sas_broker::publish::{json_properties, Outgoing};
use sas_broker::Publisher;
use sas_messages::{
    decode, StepKind, StepOutcome, StepReply, StepRequest, DEFAULT_PRIORITY, MAX_PRIORITY,
    PRIORITY_STEP, SCHEMA_VERSION, UNDO_HEAD_START,
};
use tracing::Instrument;

use chrono::{DateTime, Utc};
use tokio_util::sync::CancellationToken;

use crate::circuit::Permit;
use crate::remote::{bounded_text, check_request, CallResult};
use crate::{Agent, Lane};

/// How long a reply the broker did not confirm is sent again before the
/// request is handed back: long enough to ride out a quorum queue's leader
/// election or a reconnection to another node.
pub const REPLY_RESEND_WINDOW: Duration = Duration::from_secs(10);

/// The dead-lettering, unread, of a request its `user_id` (validated by
/// RabbitMQ against the publishing user) does not name as a scheduler or
/// supervisor (`amqp.service_users`): counted and logged; `None` for one
/// that does.
fn refuse_unknown_sender(
    lane: &Lane,
    delivery: &Delivery,
    amqp: &sas_broker::ServiceAmqpSettings,
) -> Option<Consumed> {
    let user_id = delivery
        .properties
        .user_id()
        .as_ref()
        .map(|user| user.as_str().to_owned());
    if amqp.accepts_request_from(user_id.as_deref()) {
        return None;
    }
    metrics::counter!("sas_agent_refused_requests_total", "agent" => lane.name.clone())
        .increment(1);
    let sender = user_id.as_deref().unwrap_or("(no user_id)");
    tracing::warn!(
        agent = %lane.name,
        user_id = sender,
        correlation_id = delivery.correlation_id().unwrap_or(""),
        "request refused unread: not published by a scheduler or supervisor (amqp.service_users)"
    );
    Some(Consumed::DeadLetter(format!(
        "request refused unread: published by broker user {sender:?}, which is not one of amqp.service_users"
    )))
}

/// What a reply's headers carry beside its body (see
/// [`sas_messages::headers`]).
struct ReplyHeaders {
    /// [`StepReply::queued_ms`].
    queued_ms: Option<u64>,
    /// [`StepReply::slot_wait_ms`].
    slot_wait_ms: Option<u64>,
    /// [`StepReply::retry_after_ms`].
    retry_after_ms: Option<u64>,
    /// [`StepReply::call_ms`].
    call_ms: Option<u64>,
}

/// How a request ended, before the reply.
enum Finished {
    /// Send this outcome.
    Reply(StepOutcome),
    /// The start deadline passed after calls that failed without reaching
    /// the service, or while its circuit was open: the supervisor owns the
    /// step now (a failure of the service); send nothing.
    Expired,
    /// The start deadline passed before this replica made any call for the
    /// request (it waited in the queue, for a call slot, or out the
    /// service's pause), or after calls the service only answered "slow
    /// down" (429: nothing applied, `throttled` says so): say so, so the
    /// order goes back to its line without counting a failure.
    NotStarted {
        /// The service's last "slow down", when it answered one.
        throttled: Option<String>,
        /// A request limited by key that the service answered 429 with
        /// `Retry-After`: how long its key must rest (the scheduler pauses
        /// the key; this replica's lane does not pause).
        retry_after: Option<Duration>,
    },
    /// Shutting down, or the broker connection is lost: hand the request back.
    Interrupted,
}

impl Agent {
    /// Handles one request: calls the remote service (with retries inside the
    /// deadline), then publishes the reply and acknowledges.
    ///
    /// `connection_lost` fires when the broker connection the delivery came
    /// on is gone: calls for it stop (the delivery comes back to the queue).
    pub async fn handle(
        &self,
        lane: &Lane,
        delivery: Delivery,
        publisher: &Publisher,
        connection_lost: &CancellationToken,
    ) -> Consumed {
        if let Some(refused) = refuse_unknown_sender(lane, &delivery, &self.settings.amqp) {
            return refused;
        }
        let received = self.clock.local_now();
        let request: StepRequest =
            match decode(&delivery.body, self.settings.amqp.max_message_bytes) {
                Ok(request) => request,
                Err(error) => return Consumed::DeadLetter(error.to_string()),
            };
        // A request naming an action, method or path the agent may not
        // call is dead-lettered unanswered: no call made.
        if let Err(reason) = check_request(&request) {
            tracing::warn!(order_id = %request.order_id, reason = %reason, "request names no call this agent may make");
            return Consumed::DeadLetter(reason);
        }
        if let Some(dispatched_at) = request.dispatched_at {
            self.clock.observe(dispatched_at, received);
        }
        let Some(reply_to) = delivery.reply_to().map(str::to_owned) else {
            return Consumed::DeadLetter("request has no reply_to".into());
        };
        let correlation_id = request.attempt_id.to_string();
        let traceparent = sas_broker::publish::traceparent_of(&delivery.properties);
        let trace_id = traceparent.as_ref().map(|parent| parent.trace_id.clone());
        let span = tracing::info_span!("step", order_id = %request.order_id, correlation_id = %correlation_id, trace_id = trace_id.as_deref().unwrap_or(""), step = %request.step, action = %request.action);
        // In the order's trace, a child of the scheduler's dispatch.
        if let Some(parent) = &traceparent {
            sas_runtime::telemetry::join_trace(&span, &parent.trace_id, &parent.span_id);
        }
        if delivery.redelivered {
            span.in_scope(|| {
                tracing::info!(
                    "redelivered request; the idempotency key makes the call safe to repeat"
                );
            });
        }
        let priority = *delivery.properties.priority();
        let turn = lane.turns.take(
            sas_messages::ids::tenant_of(request.order_id.as_str()),
            head_start(request.kind, priority),
        );
        let received = Received {
            slot_priority: slot_priority(request.kind, priority, turn.at),
            turn,
            request,
            redelivered: delivery.redelivered,
            reply_to,
            trace_id,
        };
        self.handle_request(lane, &received, publisher, connection_lost)
            .instrument(span)
            .await
    }

    /// Calls the service for `received`'s request, then replies.
    async fn handle_request(
        &self,
        lane: &Lane,
        received: &Received,
        publisher: &Publisher,
        connection_lost: &CancellationToken,
    ) -> Consumed {
        let request = &received.request;
        if received.redelivered && request.limit_key.is_some() {
            // The earlier delivery's call may still be running at the
            // remote (its agent died, or lost its broker connection,
            // mid-call): calling again now would put two calls of one
            // attempt in the key at once, one over the key's limit. The
            // attempt keeps its slot until its deadline, and the
            // supervisor then retries it under its idempotency key.
            metrics::counter!("sas_agent_redelivered_keyed_total").increment(1);
            tracing::warn!(limit_key = request.limit_key.as_deref().unwrap_or_default(), complete_by = %request.complete_by, "a redelivered request limited by key is not called again: its earlier delivery's call may still hold a slot of the key at the remote; the supervisor retries it after its deadline");
            return Consumed::Ack;
        }
        metrics::gauge!("sas_agent_requests_in_flight").increment(1.0);
        let started = Instant::now();
        let mut tries = Tries::new(received.redelivered);
        let finished = self
            .call_until_deadline(lane, received, &mut tries, connection_lost)
            .await;
        metrics::gauge!("sas_agent_requests_in_flight").decrement(1.0);
        let retry_after_ms = match &finished {
            Finished::NotStarted {
                retry_after: Some(rest),
                ..
            } => Some(u64::try_from(rest.as_millis()).unwrap_or(u64::MAX)),
            _ => None,
        };
        let outcome = match self.outcome_of(finished, request) {
            Ok(outcome) => outcome,
            Err(consumed) => return consumed,
        };
        let label = outcome_label(&outcome);
        metrics::histogram!("sas_agent_step_duration_seconds", "action" => request.action.clone(), "outcome" => label)
            .record(started.elapsed().as_secs_f64());
        let failure = match &outcome {
            StepOutcome::Failed { error, .. } => Some(error.clone()),
            StepOutcome::Succeeded { .. } | StepOutcome::NotStarted { .. } => None,
        };
        let (queued_ms, slot_wait_ms) = self.queue_times(request, &tries);
        let headers = ReplyHeaders {
            queued_ms,
            slot_wait_ms,
            retry_after_ms,
            call_ms: tries
                .first_call
                .map(|_| u64::try_from(tries.calling.as_millis()).unwrap_or(u64::MAX)),
        };
        match self.reply(received, outcome, headers, publisher).await {
            Ok(()) => {
                match failure {
                    Some(error) => tracing::warn!(outcome = label, error = %error, "replied"),
                    None => tracing::info!(outcome = label, "replied"),
                }
                Consumed::Ack
            }
            Err(error) => {
                // Still not confirmed: hand the request back; the repeat call
                // is deduplicated by the idempotency key.
                tracing::warn!(error = %error, "reply not confirmed; requeueing the request");
                Consumed::Requeue
            }
        }
    }

    /// The reply's outcome for how the calls ended, or what to do with the
    /// request when there is no reply to send.
    fn outcome_of(
        &self,
        finished: Finished,
        request: &StepRequest,
    ) -> Result<StepOutcome, Consumed> {
        match finished {
            Finished::Reply(outcome) => Ok(outcome),
            Finished::Expired => {
                metrics::counter!("sas_agent_deadline_expired_total").increment(1);
                tracing::warn!(complete_by = %request.complete_by, start_by = ?request.start_by, "start deadline passed and no call can have reached the service; stopping without a reply");
                Err(Consumed::Ack)
            }
            Finished::NotStarted { .. } if request.start_by.is_none() => {
                // Only schedulers that know this answer send start_by
                // (docs/messages.md, Upgrades): an older one gets silence,
                // as before the answer existed, and its supervisor retries
                // the step at its deadline.
                metrics::counter!("sas_agent_deadline_expired_total").increment(1);
                tracing::warn!(complete_by = %request.complete_by, "start deadline passed before any call; the request has no start_by, so its sender may not know not_started: no reply");
                Err(Consumed::Ack)
            }
            Finished::NotStarted {
                throttled,
                retry_after,
            } => {
                metrics::counter!("sas_agent_deadline_expired_total").increment(1);
                let waited = (self.clock.database_now()
                    - request.dispatched_at.unwrap_or(request.complete_by))
                .num_milliseconds()
                .max(0);
                tracing::info!(start_by = ?request.start_by, waited_ms = waited, throttled = throttled.is_some(), "start deadline passed before any call was applied; replying not started");
                let reason = match throttled {
                    Some(error) if retry_after.is_some() => format!(
                        "the service asked key {} to rest (429 with Retry-After), nothing applied: {error}",
                        request.limit_key.as_deref().unwrap_or_default()
                    ),
                    Some(error) => format!(
                        "start-by passed while the service asked to slow down, nothing applied (waited {waited} ms since dispatch): {error}"
                    ),
                    None => format!(
                        "start-by passed before any call was made (waited {waited} ms since dispatch for the queue, a call slot or the service's pause)"
                    ),
                };
                Ok(StepOutcome::NotStarted { reason })
            }
            Finished::Interrupted => Err(Consumed::Requeue),
        }
    }

    /// Publishes the reply to the request's `reply_to`, with its
    /// correlation id and the order's headers, and waits for the confirm.
    ///
    /// A reply the broker did not confirm (a quorum queue electing a leader
    /// nacks; a node that died takes its confirms with it) is sent again,
    /// unchanged, on this connection after a pause or on the next one, for
    /// [`REPLY_RESEND_WINDOW`]: handing the request back at once would call
    /// the remote service again and, in a tight loop, spend the request's
    /// delivery limit in a second.
    ///
    /// # Errors
    /// When it is still not confirmed at the end of the window.
    async fn reply(
        &self,
        received: &Received,
        outcome: StepOutcome,
        ReplyHeaders {
            queued_ms,
            slot_wait_ms,
            retry_after_ms,
            call_ms,
        }: ReplyHeaders,
        publisher: &Publisher,
    ) -> Result<(), sas_broker::BrokerError> {
        let request = &received.request;
        let reply = StepReply {
            queued_ms,
            slot_wait_ms,
            retry_after_ms,
            call_ms,
            schema_version: SCHEMA_VERSION,
            order_id: request.order_id.clone(),
            step: request.step.clone(),
            attempt_id: request.attempt_id,
            agent_id: self.id.clone(),
            outcome,
        };
        // The queue times and a key's rest go in headers: a scheduler that
        // does not know them ignores headers, where it refuses unknown body
        // fields.
        let mut headers =
            sas_broker::publish::order_headers(&request.order_id, received.trace_id.as_deref());
        for (key, value) in [
            (sas_messages::headers::QUEUED_MS, queued_ms),
            (sas_messages::headers::SLOT_WAIT_MS, slot_wait_ms),
            (sas_messages::headers::RETRY_AFTER_MS, retry_after_ms),
            (sas_messages::headers::CALL_MS, call_ms),
        ] {
            if let Some(value) = value {
                headers = sas_broker::publish::with_number_header(headers, key, value);
            }
        }
        let properties = json_properties(&uuid::Uuid::now_v7().to_string())
            .with_correlation_id(request.attempt_id.to_string().into())
            .with_headers(headers);
        let message = Outgoing {
            exchange: String::new(),
            routing_key: received.reply_to.clone(),
            body: reply_body(reply, self.settings.amqp.max_message_bytes),
            properties,
            mandatory: true,
        };
        let give_up = tokio::time::Instant::now() + REPLY_RESEND_WINDOW;
        self.publishers
            .deliver(Some(publisher), &[message], give_up, &self.shutdown)
            .await
    }

    /// Calls the service for the request, retrying what did not settle with
    /// the same idempotency key, until an answer settles it or its start
    /// deadline passes.
    async fn call_until_deadline(
        &self,
        lane: &Lane,
        received: &Received,
        tries: &mut Tries,
        connection_lost: &CancellationToken,
    ) -> Finished {
        let deadlines = self.deadlines(&received.request);
        let retries = sas_runtime::Backoff::new(
            Duration::from_millis(self.settings.agent.retry_base_ms),
            Duration::from_millis(self.settings.agent.retry_max_ms),
            sas_runtime::Jitter::Full,
        );
        loop {
            let Some(left) = self.time_left(deadlines.start_by) else {
                return tries.expired();
            };
            if let Some(paused) = lane.pause.remaining() {
                // The service asked for quiet: no call before then, and no
                // failure for waiting. A pause past the start deadline is
                // waited out to the deadline (answering at once would send
                // the order back to be dispatched again at once).
                tokio::select! {
                    () = tokio::time::sleep(paused.min(left)) => {}
                    () = self.interrupted(connection_lost) => return Finished::Interrupted,
                }
                if paused >= left {
                    return tries.expired();
                }
                continue;
            }
            let Some(permit) = lane.circuit.allow() else {
                if let Err(finished) = self
                    .wait_for_circuit(lane, left, tries, connection_lost)
                    .await
                {
                    return finished;
                }
                continue;
            };
            // Every way out of the call hands its outcome to the permit; a
            // return without one drops it, which hands a probe back to the
            // circuit (the next call probes).
            let result = match self
                .call_once(lane, received, &deadlines, left, tries, connection_lost)
                .await
            {
                Ok(Some(result)) => result,
                // The lane paused while it waited for a slot: look again.
                Ok(None) => continue,
                Err(finished) => return finished,
            };
            let class = result.class();
            metrics::counter!("sas_agent_calls_total", "agent" => lane.name.clone(), "class" => class).increment(1);
            let keyed = received.request.limit_key.is_some();
            let (mut paused, key_rests) = match &result {
                CallResult::Throttled {
                    retry_after,
                    maybe_applied,
                    ..
                } => {
                    metrics::counter!("sas_agent_throttled_total", "agent" => lane.name.clone())
                        .increment(1);
                    match retry_after {
                        // A request limited by key: the service asked
                        // that key to rest, not the whole lane; a 429
                        // applied nothing, and the scheduler holds the
                        // key's orders until then.
                        Some(asked) if keyed && !maybe_applied && !asked.is_zero() => {
                            (None, Some((*asked).min(lane.pause.longest())))
                        }
                        Some(asked) => (Some(lane.pause.extend(*asked)), None),
                        None => (None, None),
                    }
                }
                _ => (None, None),
            };
            let (error, logged) = match tries.settle(permit, result) {
                Ok(finished) => return finished,
                Err(unsettled) => unsettled,
            };
            if let Some(rest) = key_rests {
                if let Some(finished) = tries.key_rests(rest) {
                    return finished;
                }
                // An earlier call may have applied (or this is a
                // redelivery): the request cannot answer "not started",
                // so it waits out the remote's time here, as the lane.
                paused = Some(lane.pause.extend(rest));
            }
            let backoff = tries.count_retry(&retries, class, error, logged);
            // A pause the service named replaces the backoff: the loop
            // waits it out (every request of the lane does).
            let wait = if paused.is_some_and(|pause| !pause.is_zero()) {
                Duration::ZERO
            } else {
                backoff
            };
            match self.time_left(deadlines.start_by) {
                Some(left) if left > wait => {}
                _ => return tries.expired(),
            }
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = self.interrupted(connection_lost) => return Finished::Interrupted,
            }
        }
    }

    /// Waits while the lane's circuit is open, `left` being the time to the
    /// start deadline: `Ok` when it is time to look again, `Err` with how
    /// the request ends when the deadline comes first or it is interrupted.
    ///
    /// Fail fast: no call to a service that keeps failing. The request
    /// waits here for the probe (or its deadline), rather than answering at
    /// once and using up the order's failures in a few seconds of outage.
    async fn wait_for_circuit(
        &self,
        lane: &Lane,
        left: Duration,
        tries: &mut Tries,
        connection_lost: &CancellationToken,
    ) -> Result<(), Finished> {
        metrics::counter!("sas_agent_circuit_rejections_total", "agent" => lane.name.clone())
            .increment(1);
        tries.tried = true;
        tries.met_service = true;
        let wait = lane.circuit.retry_after().max(Duration::from_millis(10));
        if wait >= left {
            return Err(tries.expired());
        }
        tokio::select! {
            () = tokio::time::sleep(wait) => Ok(()),
            () = self.interrupted(connection_lost) => Err(Finished::Interrupted),
        }
    }

    /// Makes one call once a call slot is free: `Ok` with its result (`None`
    /// when the lane paused while it waited for the slot: look again), `Err`
    /// with how the request ends when the start deadline passes first or
    /// the request is interrupted. `left` is the time to the start deadline.
    async fn call_once(
        &self,
        lane: &Lane,
        received: &Received,
        deadlines: &Deadlines,
        left: Duration,
        tries: &mut Tries,
        connection_lost: &CancellationToken,
    ) -> Result<Option<CallResult>, Finished> {
        // Waiting for a call slot counts against the deadline too: a call
        // must never start after start-by, when the supervisor may soon
        // send the undo.
        let asked = Instant::now();
        let permit = tokio::select! {
            permit = tokio::time::timeout(left, lane.calls.acquire(received.slot_priority)) => match permit {
                Ok(permit) => permit.expect("the call slots are never closed"),
                Err(_) => {
                    tries.slot_wait += asked.elapsed();
                    return Err(tries.expired());
                }
            },
            () = self.interrupted(connection_lost) => return Err(Finished::Interrupted),
        };
        tries.slot_wait += asked.elapsed();
        received.turn.granted();
        // Another request may have heard "slow down" while this one waited
        // for its slot: the pause holds for it too; the slot (and the
        // circuit's permit) go back while it waits, at the loop's top.
        if lane.pause.remaining().is_some() {
            return Ok(None);
        }
        let (Some(_), Some(until_complete)) = (
            self.time_left(deadlines.start_by),
            self.time_left(deadlines.complete_by),
        ) else {
            return Err(tries.expired());
        };
        let timeout =
            until_complete.min(Duration::from_millis(self.settings.agent.call_timeout_ms));
        tries.tried = true;
        tries
            .first_call
            .get_or_insert_with(|| self.clock.database_now());
        // A call under way is not cut short by shutdown: the drain limit
        // bounds it, and cutting it would only make the call repeat. A
        // lost broker connection does cut it: the request is back in the
        // queue for another agent, and this one must stop calling for it.
        let calling = Instant::now();
        let result = tokio::select! {
            result = lane.remote.call(&received.request, timeout, received.trace_id.as_deref()) => {
                // A line of the latency budget: the remote's share of the
                // agent's time; and what an adaptive key learns from.
                let took = calling.elapsed();
                metrics::histogram!("sas_agent_remote_seconds").record(took.as_secs_f64());
                tries.calling = took;
                result
            }
            () = connection_lost.cancelled() => {
                metrics::counter!("sas_agent_calls_abandoned_total").increment(1);
                tracing::warn!("broker connection lost: call abandoned; the request goes back to its queue");
                return Err(Finished::Interrupted);
            }
        };
        drop(permit);
        Ok(Some(result))
    }

    /// What the reply says of the time the request queued (see
    /// [`StepReply::queued_ms`] and [`StepReply::slot_wait_ms`]): from its
    /// dispatch to the first call (or to now when no call was made), and
    /// how long it waited for call slots. Only for a request that says when
    /// it was dispatched.
    fn queue_times(&self, request: &StepRequest, tries: &Tries) -> (Option<u64>, Option<u64>) {
        let Some(dispatched_at) = request.dispatched_at else {
            return (None, None);
        };
        let until = tries
            .first_call
            .unwrap_or_else(|| self.clock.database_now());
        let queued = u64::try_from((until - dispatched_at).num_milliseconds()).unwrap_or(0);
        let slot_wait = u64::try_from(tries.slot_wait.as_millis()).unwrap_or(u64::MAX);
        (Some(queued), Some(slot_wait))
    }

    /// Completes when the agent shuts down or the delivery's broker
    /// connection is lost: either way a waiting request is handed back.
    async fn interrupted(&self, connection_lost: &CancellationToken) {
        tokio::select! {
            () = self.shutdown.cancelled() => {}
            () = connection_lost.cancelled() => {}
        }
    }

    /// The request's deadlines on the database clock.
    ///
    /// `start_by` is the request's own; a request without one (from a
    /// scheduler that does not set it) stops starting calls at
    /// `complete_by - agent.start_margin_ms`, the margin capped at half the
    /// attempt's window (from `dispatched_at`, or from now), so that a step
    /// with a deadline shorter than the margin still gets its calls.
    fn deadlines(&self, request: &StepRequest) -> Deadlines {
        let start_by = request.start_by.unwrap_or_else(|| {
            let margin = chrono::Duration::milliseconds(
                i64::try_from(self.settings.agent.start_margin_ms).unwrap_or(i64::MAX),
            );
            let opened = request
                .dispatched_at
                .unwrap_or_else(|| self.clock.database_now());
            let half_window = (request.complete_by - opened) / 2;
            request.complete_by - margin.min(half_window.max(chrono::Duration::zero()))
        });
        let start_by = start_by.min(request.complete_by);
        Deadlines {
            start_by,
            complete_by: request.complete_by,
        }
    }

    /// Time until `deadline` (database clock) by this agent's estimate of
    /// the database clock, or `None` when it has passed.
    fn time_left(&self, deadline: DateTime<Utc>) -> Option<Duration> {
        (deadline - self.clock.database_now())
            .to_std()
            .ok()
            .filter(|left| !left.is_zero())
    }
}

/// When calls must stop, on the database clock.
struct Deadlines {
    /// No call starts after it.
    start_by: DateTime<Utc>,
    /// No call runs past it.
    complete_by: DateTime<Utc>,
}

/// What one request's calls have learnt so far.
struct Tries {
    /// Retries made.
    attempt: u32,
    /// Whether some call may have reached the service (an unknown
    /// outcome, or a 409 "in progress"): once true, no later answer makes
    /// the step "not applied".
    maybe_applied: bool,
    /// The last call's error.
    last_error: String,
    /// Whether this request may have met the service: a call was made, the
    /// circuit (opened by the service's failures) held it back, or it is a
    /// redelivery.
    tried: bool,
    /// When the first call started (database clock, as this agent
    /// estimates it): the end of the request's time in queues.
    first_call: Option<DateTime<Utc>>,
    /// How long its calls waited for a call slot, in all.
    slot_wait: Duration,
    /// How long its last call took at the remote (a retry's, not the
    /// sum: three quick failures are not one slow answer).
    calling: Duration,
    /// The service's last "slow down" (429: nothing applied), if it
    /// answered one.
    throttled: Option<String>,
    /// Something other than a 429 happened that may count as meeting the
    /// service: another answer or error, the circuit holding it back, a
    /// redelivery. Until then, calls that were all answered 429 applied
    /// nothing, and the request may still answer "not started".
    met_service: bool,
}

impl Tries {
    /// Nothing learnt yet. A redelivery's earlier delivery may have called
    /// (an agent killed mid-call): `redelivered` makes it never "not
    /// started".
    fn new(redelivered: bool) -> Self {
        Self {
            attempt: 0,
            maybe_applied: false,
            last_error: String::new(),
            tried: redelivered,
            first_call: None,
            slot_wait: Duration::ZERO,
            calling: Duration::ZERO,
            throttled: None,
            met_service: redelivered,
        }
    }

    /// What one call's result settles: `Ok` with how the request ends (a
    /// success, a refusal, an answer it cannot use), or `Err` with the
    /// error to retry after and whether it was logged already. Records the
    /// result on the circuit through the call's `permit`: a service that
    /// answered is up, whatever it answered.
    fn settle(
        &mut self,
        permit: Permit<'_>,
        result: CallResult,
    ) -> Result<Finished, (String, bool)> {
        if !matches!(
            result,
            CallResult::Throttled {
                maybe_applied: false,
                ..
            }
        ) {
            self.met_service = true;
        }
        match result {
            CallResult::Throttled {
                error,
                maybe_applied,
                ..
            } => {
                if maybe_applied {
                    // A 503: a proxy says so for a service that is down,
                    // Retry-After or not; it counts against the circuit.
                    permit.failed();
                    self.maybe_applied = true;
                } else {
                    // A 429: the service answered; it is up, and asks for quiet.
                    permit.succeeded();
                    self.throttled = Some(error.clone());
                }
                Err((error, false))
            }
            CallResult::Succeeded(result) => {
                permit.succeeded();
                Ok(Finished::Reply(StepOutcome::Succeeded { result }))
            }
            CallResult::AppliedButUnusable(error) => {
                // The service answered: not a failure of the service.
                permit.succeeded();
                self.maybe_applied = true;
                Ok(Finished::Reply(StepOutcome::Failed {
                    error,
                    permanent: true,
                    maybe_applied: true,
                }))
            }
            CallResult::Refused(error) => {
                permit.succeeded();
                let error = if self.maybe_applied {
                    bounded_text(&format!(
                        "{error} (after an earlier call whose outcome is unknown: {})",
                        self.last_error
                    ))
                } else {
                    error
                };
                Ok(Finished::Reply(StepOutcome::Failed {
                    error,
                    permanent: true,
                    maybe_applied: self.maybe_applied,
                }))
            }
            CallResult::Transient { error, certificate } => {
                permit.failed();
                if certificate {
                    // One clear line per failure, naming the URL.
                    tracing::warn!(error = %error, attempt = self.attempt, "TLS certificate of the remote service not accepted; nothing was sent");
                }
                Err((error, certificate))
            }
            CallResult::InProgress(error) => {
                // The service answered: it is up, and busy with this key.
                permit.succeeded();
                self.maybe_applied = true;
                Err((error, false))
            }
            CallResult::Unknown {
                error,
                service_failed,
            } => {
                if service_failed {
                    permit.failed();
                } else {
                    permit.succeeded();
                }
                self.maybe_applied = true;
                Err((error, false))
            }
        }
    }

    /// Counts a retry after a call that did not settle and logs it (unless
    /// `settle` did, `logged`): returns the pause before the next call.
    fn count_retry(
        &mut self,
        retries: &sas_runtime::Backoff,
        class: &'static str,
        error: String,
        logged: bool,
    ) -> Duration {
        metrics::counter!("sas_agent_retries_total").increment(1);
        self.attempt = self.attempt.saturating_add(1);
        // Retry n waits up to retry_base × 2^n: the first retry already
        // twice the base.
        let wait = retries.wait(self.attempt.saturating_add(1));
        if !logged {
            tracing::info!(class, error = %error, attempt = self.attempt, wait_ms = wait.as_millis() as u64, maybe_applied = self.maybe_applied, "call not settled; retrying the same key");
        }
        self.last_error = error;
        wait
    }

    /// A request limited by key whose service asked the key to rest for
    /// `rest` (429 with `Retry-After`): it ends at once, not started, with
    /// the pause for the scheduler, when no call of it may have applied
    /// anything (every answer was a 429); otherwise it goes on as any
    /// throttled call (`None`).
    fn key_rests(&self, rest: Duration) -> Option<Finished> {
        (!self.met_service && !self.maybe_applied).then(|| Finished::NotStarted {
            throttled: self.throttled.clone(),
            retry_after: Some(rest),
        })
    }

    /// How the request ends at its start deadline: silently when no call
    /// can have reached the service (the supervisor owns the step),
    /// otherwise with a failure that says the step may have been applied.
    fn expired(&self) -> Finished {
        if !self.tried {
            Finished::NotStarted {
                throttled: None,
                retry_after: None,
            }
        } else if !self.met_service && !self.maybe_applied && self.throttled.is_some() {
            // Every call was answered 429: nothing was applied.
            Finished::NotStarted {
                throttled: self.throttled.clone(),
                retry_after: None,
            }
        } else if self.maybe_applied {
            Finished::Reply(StepOutcome::Failed {
                error: bounded_text(&format!(
                    "start deadline reached; an earlier call may have been applied: {}",
                    self.last_error
                )),
                permanent: false,
                maybe_applied: true,
            })
        } else {
            Finished::Expired
        }
    }
}

/// The reply as its message body, within `limit` bytes
/// (`amqp.max_message_bytes`): the scheduler dead-letters a larger one
/// unread, and the outcome would be lost.
///
/// It fits as it is but for a setting out of proportion: a success carries
/// at most `agent.max_answer_bytes` of JSON as written ([`crate::remote`]
/// checks it), which settings keep to a quarter of the limit; a failure's
/// text is at most [`crate::remote::MAX_ERROR_CHARS`] characters (about
/// 3 KB once escaped, at worst: six bytes for a control character); the
/// ids and names are the request's own. Should it not fit all the same (an
/// `amqp.max_message_bytes` of a few KB), it is not sent as it is: a
/// success becomes a permanent failure that may have been applied (an
/// action's order is undone), and a text is cut until the reply fits.
pub fn reply_body(mut reply: StepReply, limit: usize) -> Vec<u8> {
    let body = serde_json::to_vec(&reply).expect("wire types always serialize");
    if body.len() <= limit {
        return body;
    }
    tracing::warn!(
        bytes = body.len(),
        limit,
        "the reply is over amqp.max_message_bytes; sending a shorter one"
    );
    if matches!(reply.outcome, StepOutcome::Succeeded { .. }) {
        reply.outcome = StepOutcome::Failed {
            error: format!(
                "the answer makes a reply of {} bytes, over amqp.max_message_bytes ({limit}): the call may have been applied, and its answer cannot be carried; lower agent.max_answer_bytes",
                body.len()
            ),
            permanent: true,
            maybe_applied: true,
        };
    }
    loop {
        let body = serde_json::to_vec(&reply).expect("wire types always serialize");
        let text = match &mut reply.outcome {
            StepOutcome::Failed { error, .. } => error,
            StepOutcome::NotStarted { reason } => reason,
            // Replaced above: nothing left to shorten.
            StepOutcome::Succeeded { .. } => return body,
        };
        let chars = text.chars().count();
        if body.len() <= limit || chars == 0 {
            return body;
        }
        *text = text.chars().take(chars / 2).collect();
    }
}

/// The label of an outcome in `sas_agent_step_duration_seconds`.
fn outcome_label(outcome: &StepOutcome) -> &'static str {
    match outcome {
        StepOutcome::Succeeded { .. } => "succeeded",
        StepOutcome::NotStarted { .. } => "not_started",
        StepOutcome::Failed {
            permanent: true,
            maybe_applied: false,
            ..
        } => "failed_permanent",
        StepOutcome::Failed {
            permanent: true, ..
        } => "failed_permanent_maybe_applied",
        StepOutcome::Failed {
            maybe_applied: true,
            ..
        } => "failed_maybe_applied",
        StepOutcome::Failed { .. } => "failed_transient",
    }
}

/// What one delivery carries to the calls and the reply.
struct Received {
    request: StepRequest,
    redelivered: bool,
    /// Where the reply goes.
    reply_to: String,
    /// The order's trace, when the request carried one.
    trace_id: Option<String>,
    /// Its place among the requests waiting for a call slot ([`slot_priority`]).
    slot_priority: priority_semaphore::Priority,
    /// Its tenant's turn, held until it ends.
    turn: crate::turns::Turn,
}

/// A request's place among those waiting for a call slot of its lane:
/// higher goes first. It is the lines' rule (admission's `admit_key`, with
/// tenants' turns) turned round: [`PRIORITY_STEP`] per level of the
/// order's priority, plus [`UNDO_HEAD_START`] for a compensation (an order
/// being undone holds what it reserved until its undo runs), each second of
/// them worth 1,000 turns, less the request's turn (`turn`,
/// [`crate::turns`]). The priority is the message's `priority` property; a
/// scheduler older than the property sends none, which counts as the
/// default. Equal places are served in the order they reach the slots. A
/// request that retries after a transient failure keeps its place.
///
/// An urgent request so passes the backlog delivered before it, a quiet
/// tenant's request passes a busy tenant's, and a request waits behind
/// later ones for at most 10,000 turns per level. Waiting is bounded
/// anyway: past its start-by a request answers `not_started`, and its
/// order goes back to its line, keeping its place. A place beyond the
/// semaphore's range (2^31 turns without the lane ever idle) is its
/// lowest: those requests are served in arrival order.
pub fn slot_priority(
    kind: StepKind,
    property: Option<u8>,
    turn: i64,
) -> priority_semaphore::Priority {
    let place = (head_start(kind, property) * 1_000).saturating_sub(turn);
    priority_semaphore::Priority::try_from(place).unwrap_or(priority_semaphore::Priority::MIN)
}

/// A request's head start in seconds: [`PRIORITY_STEP`] per level of its
/// order's priority (none: the default), plus [`UNDO_HEAD_START`] for a
/// compensation. Also the level its tenant's turns are counted in
/// ([`crate::turns`]).
pub fn head_start(kind: StepKind, property: Option<u8>) -> i64 {
    let level = i64::from(property.unwrap_or(DEFAULT_PRIORITY).min(MAX_PRIORITY));
    PRIORITY_STEP.num_seconds() * level
        + match kind {
            StepKind::Action => 0,
            StepKind::Compensation => UNDO_HEAD_START.num_seconds(),
        }
}

#[cfg(test)]
mod tests {

    use sas_messages::StepKind;

    use super::{reply_body, slot_priority};
    use sas_messages::{StepOutcome, StepReply};

    fn reply(outcome: StepOutcome) -> StepReply {
        StepReply {
            schema_version: sas_messages::SCHEMA_VERSION,
            order_id: "o-1".into(),
            step: "charge_payment".into(),
            attempt_id: sas_messages::AttemptId::new(),
            agent_id: "payment-0".into(),
            outcome,
            queued_ms: None,
            slot_wait_ms: None,
            retry_after_ms: None,
            call_ms: None,
        }
    }

    fn sent(body: &[u8]) -> StepOutcome {
        serde_json::from_slice::<StepReply>(body).unwrap().outcome
    }

    #[test]
    fn a_reply_that_fits_is_sent_as_it_is() {
        let outcome = StepOutcome::Succeeded {
            result: serde_json::json!({"id": "x".repeat(16_000)}),
        };
        let body = reply_body(reply(outcome.clone()), 65_536);
        assert_eq!(sent(&body), outcome);
        // The longest failure text, of the widest characters to escape,
        // fits a 64 KiB limit many times over.
        let error = "\u{1}".repeat(crate::remote::MAX_ERROR_CHARS) + "…";
        let outcome = StepOutcome::Failed {
            error,
            permanent: true,
            maybe_applied: true,
        };
        let body = reply_body(reply(outcome.clone()), 65_536);
        assert!(body.len() < 4_000, "{}", body.len());
        assert_eq!(sent(&body), outcome);
    }

    #[test]
    fn a_reply_over_the_message_limit_is_never_sent_as_it_is() {
        let success = StepOutcome::Succeeded {
            result: serde_json::json!({"id": "x".repeat(2_000)}),
        };
        let body = reply_body(reply(success), 1_024);
        assert!(body.len() <= 1_024, "{}", body.len());
        match sent(&body) {
            StepOutcome::Failed {
                error,
                permanent: true,
                maybe_applied: true,
            } => assert!(error.starts_with("the answer makes a reply of"), "{error}"),
            other => panic!("{other:?}"),
        }
        let failure = StepOutcome::Failed {
            error: "é".repeat(500),
            permanent: false,
            maybe_applied: true,
        };
        let body = reply_body(reply(failure), 1_024);
        assert!(body.len() <= 1_024, "{}", body.len());
        match sent(&body) {
            StepOutcome::Failed {
                error,
                permanent: false,
                maybe_applied: true,
            } => assert!(error.starts_with("éé") && error.chars().count() < 500),
            other => panic!("{other:?}"),
        }
    }

    fn at(kind: StepKind, priority: Option<u8>, turn: i64) -> i32 {
        slot_priority(kind, priority, turn)
    }

    #[test]
    fn a_level_of_priority_is_worth_ten_thousand_turns() {
        let waiting = at(StepKind::Action, Some(5), 100_000);
        assert!(at(StepKind::Action, Some(6), 109_999) > waiting);
        assert!(at(StepKind::Action, Some(6), 110_001) < waiting);
        assert!(at(StepKind::Action, Some(9), 139_999) > waiting);
        // Equal places keep their arrival order (the semaphore's FIFO).
        assert_eq!(at(StepKind::Action, Some(6), 110_000), waiting);
    }

    #[test]
    fn a_compensation_goes_before_any_forward_work() {
        let undo = at(StepKind::Compensation, Some(0), 1_000);
        assert!(undo > at(StepKind::Action, Some(9), 1_000));
        assert!(undo > at(StepKind::Action, Some(9), 0));
        assert!(undo < at(StepKind::Compensation, Some(0), 999));
    }

    #[test]
    fn no_property_counts_as_the_default_and_out_of_range_as_the_highest() {
        assert_eq!(
            at(StepKind::Action, None, 7),
            at(StepKind::Action, Some(5), 7)
        );
        assert_eq!(
            at(StepKind::Action, Some(200), 7),
            at(StepKind::Action, Some(9), 7)
        );
    }

    #[test]
    fn turns_beyond_the_range_are_served_in_arrival_order() {
        assert_eq!(at(StepKind::Action, Some(9), i64::MAX), i32::MIN);
        assert_eq!(at(StepKind::Action, Some(0), 1 << 40), i32::MIN);
        let far = 2_000_000_000;
        assert!(at(StepKind::Action, Some(9), far) > at(StepKind::Action, Some(0), far));
    }
}
