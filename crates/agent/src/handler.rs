//! One request, from delivery to acknowledgement.

use std::time::{Duration, Instant};

use rand::Rng;
use sas_broker::consume::{Consumed, Delivery};
use sas_broker::publish::json_properties;
use sas_broker::Publisher;
use sas_messages::{decode, StepOutcome, StepReply, StepRequest, SCHEMA_VERSION};
use tracing::Instrument;

use crate::remote::CallResult;
use crate::{Agent, Lane};

/// How a request ended, before the reply.
enum Finished {
    /// Send this outcome.
    Reply(StepOutcome),
    /// The deadline passed: the supervisor owns the step now; send nothing.
    Expired,
    /// Shutting down: hand the request back.
    Interrupted,
}

impl Agent {
    /// Handles one request: calls the remote service (with retries inside the
    /// deadline), then publishes the reply and acknowledges.
    pub async fn handle(&self, lane: &Lane, delivery: Delivery, publisher: &Publisher) -> Consumed {
        let request: StepRequest =
            match decode(&delivery.body, self.settings.amqp.max_message_bytes) {
                Ok(request) => request,
                Err(error) => return Consumed::DeadLetter(error.to_string()),
            };
        let Some(reply_to) = delivery.reply_to().map(str::to_owned) else {
            return Consumed::DeadLetter("request has no reply_to".into());
        };
        let correlation_id = request.attempt_id.to_string();
        let trace_id = sas_broker::publish::trace_id_of(&delivery.properties);
        let span = tracing::info_span!("step", order_id = %request.order_id, correlation_id = %correlation_id, trace_id = trace_id.as_deref().unwrap_or(""), step = %request.step, action = %request.action);
        self.handle_request(
            lane,
            request,
            &reply_to,
            trace_id.as_deref(),
            delivery.redelivered,
            publisher,
        )
        .instrument(span)
        .await
    }

    async fn handle_request(
        &self,
        lane: &Lane,
        request: StepRequest,
        reply_to: &str,
        trace_id: Option<&str>,
        redelivered: bool,
        publisher: &Publisher,
    ) -> Consumed {
        let correlation_id = request.attempt_id.to_string();
        if redelivered {
            tracing::info!(
                "redelivered request; the idempotency key makes the call safe to repeat"
            );
        }
        metrics::gauge!("sas_agent_requests_in_flight").increment(1.0);
        let started = Instant::now();
        let finished = self.call_until_deadline(lane, &request).await;
        metrics::gauge!("sas_agent_requests_in_flight").decrement(1.0);
        let outcome = match finished {
            Finished::Reply(outcome) => outcome,
            Finished::Expired => {
                metrics::counter!("sas_agent_deadline_expired_total").increment(1);
                tracing::warn!(complete_by = %request.complete_by, "deadline passed; stopping without a reply");
                return Consumed::Ack;
            }
            Finished::Interrupted => return Consumed::Requeue,
        };
        let label = match &outcome {
            StepOutcome::Succeeded { .. } => "succeeded",
            StepOutcome::Failed {
                permanent: true, ..
            } => "failed_permanent",
            StepOutcome::Failed { .. } => "failed_transient",
        };
        metrics::histogram!("sas_agent_step_duration_seconds", "action" => request.action.clone(), "outcome" => label)
            .record(started.elapsed().as_secs_f64());
        let reply = StepReply {
            schema_version: SCHEMA_VERSION,
            order_id: request.order_id.clone(),
            step: request.step.clone(),
            attempt_id: request.attempt_id,
            agent_id: self.id.clone(),
            outcome,
        };
        let properties = json_properties(&uuid::Uuid::now_v7().to_string())
            .with_correlation_id(correlation_id.as_str().into())
            .with_headers(sas_broker::publish::order_headers(
                &request.order_id,
                trace_id,
            ));
        match publisher
            .publish_json("", reply_to, &reply, properties, true)
            .await
        {
            Ok(()) => {
                tracing::info!(outcome = label, "replied");
                Consumed::Ack
            }
            Err(error) => {
                // Not confirmed: hand the request back; the repeat call is
                // deduplicated by the idempotency key.
                tracing::warn!(error = %error, "reply not confirmed; requeueing the request");
                Consumed::Requeue
            }
        }
    }

    async fn call_until_deadline(&self, lane: &Lane, request: &StepRequest) -> Finished {
        let settings = &self.settings.agent;
        let mut attempt: u32 = 0;
        loop {
            let Some(left) = time_left(request) else {
                return Finished::Expired;
            };
            if !lane.circuit.allow() {
                // Fail fast: no call to a service that keeps failing. The
                // request waits here for the probe (or its deadline), rather
                // than answering at once and using up the order's failures
                // in a few seconds of outage.
                metrics::counter!("sas_agent_circuit_rejections_total", "agent" => lane.name.clone()).increment(1);
                let wait = lane.circuit.retry_after().max(Duration::from_millis(10));
                if wait >= left {
                    return Finished::Expired;
                }
                tokio::select! {
                    () = tokio::time::sleep(wait) => continue,
                    () = self.shutdown.cancelled() => return Finished::Interrupted,
                }
            }
            // Waiting for a call slot counts against the deadline too: a call
            // must never start after complete-by, when the supervisor may
            // already have sent the undo.
            let permit = tokio::select! {
                permit = tokio::time::timeout(left, lane.calls.acquire()) => match permit {
                    Ok(permit) => permit.expect("the semaphore is never closed"),
                    Err(_) => return Finished::Expired,
                },
                () = self.shutdown.cancelled() => return Finished::Interrupted,
            };
            let Some(left) = time_left(request) else {
                return Finished::Expired;
            };
            let timeout = left.min(Duration::from_millis(settings.call_timeout_ms));
            // A call under way is not cut short by shutdown: the drain limit
            // bounds it, and cutting it would only make the call repeat.
            let result = lane.remote.call(request, timeout).await;
            drop(permit);
            match result {
                CallResult::Success(result) => {
                    lane.circuit.record_success();
                    return Finished::Reply(StepOutcome::Succeeded { result });
                }
                CallResult::Permanent(error) => {
                    lane.circuit.record_success();
                    return Finished::Reply(StepOutcome::Failed {
                        error,
                        permanent: true,
                        maybe_applied: false,
                    });
                }
                CallResult::Transient(error) => {
                    lane.circuit.record_failure();
                    metrics::counter!("sas_agent_retries_total").increment(1);
                    attempt = attempt.saturating_add(1);
                    let ceiling = settings
                        .retry_base_ms
                        .saturating_mul(1u64 << attempt.min(16))
                        .min(settings.retry_max_ms);
                    let wait = Duration::from_millis(rand::thread_rng().gen_range(0..=ceiling));
                    tracing::info!(error = %error, attempt, wait_ms = wait.as_millis() as u64, "transient fault; retrying");
                    match time_left(request) {
                        Some(left) if left > wait => {}
                        _ => return Finished::Expired,
                    }
                    tokio::select! {
                        () = tokio::time::sleep(wait) => {}
                        () = self.shutdown.cancelled() => return Finished::Interrupted,
                    }
                }
            }
        }
    }
}

/// Time until the request's complete-by, or `None` when it has passed.
///
/// complete-by comes from the database clock; this compares it with the
/// local clock, so hosts must keep their clocks in sync (NTP).
fn time_left(request: &StepRequest) -> Option<Duration> {
    (request.complete_by - chrono::Utc::now())
        .to_std()
        .ok()
        .filter(|left| !left.is_zero())
}
