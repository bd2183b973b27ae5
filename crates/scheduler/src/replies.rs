//! Replies: an agent's answer advances the workflow, unless it is stale or
//! does not come from an agent.

use sas_broker::consume::{Consumed, Delivery};
use sas_broker::publish::header_u64;
use sas_broker::Publisher;
use sas_messages::{decode, headers, StepOutcome, StepReply};
use sas_store::writes::progress::ReplyOutcome;

use crate::{stopping, Scheduler};

impl Scheduler {
    /// Handles one message of the shared reply queue.
    ///
    /// A reply whose attempt id is not the step's current attempt (the
    /// supervisor gave the step to a new attempt, or the reply is a
    /// duplicate) is acknowledged, counted and ignored. Otherwise the
    /// reply is applied (together with the replies other handlers hold at
    /// the same moment, see [`sas_runtime::Batcher`]) and the next request published.
    ///
    /// Before anything else, the reply must come from an agent: its
    /// `user_id`, which RabbitMQ checked against the publishing connection's
    /// user, must be one of `amqp.agent_users` (when that is set). Anyone
    /// who can publish to the reply queue and has seen an attempt id could
    /// otherwise answer for the agent: "charged" without a charge. A refused
    /// reply is counted in `sas_forged_replies_total`, logged, and
    /// dead-lettered with the reason; it changes nothing.
    pub async fn handle_reply(&self, delivery: Delivery, publisher: &Publisher) -> Consumed {
        if let Some(refused) = self.refuse_forged(&delivery) {
            return refused;
        }
        let mut reply: StepReply =
            match decode(&delivery.body, self.settings.amqp.max_message_bytes) {
                Ok(reply) => reply,
                Err(error) => return Consumed::DeadLetter(error.to_string()),
            };
        // How long the request queued, from the reply's headers (none from
        // agents that do not send them): what admission control measures.
        reply.queued_ms = header_u64(&delivery.properties, headers::QUEUED_MS);
        reply.slot_wait_ms = header_u64(&delivery.properties, headers::SLOT_WAIT_MS);
        reply.retry_after_ms = header_u64(&delivery.properties, headers::RETRY_AFTER_MS);
        reply.call_ms = header_u64(&delivery.properties, headers::CALL_MS);
        let attempt_id = reply.attempt_id.to_string();
        if delivery.correlation_id() != Some(attempt_id.as_str()) {
            return Consumed::DeadLetter(format!(
                "correlation_id {:?} does not match the reply's attempt_id {attempt_id}",
                delivery.correlation_id()
            ));
        }
        let outcome = match self.record_reply(&reply, &attempt_id).await {
            Ok(outcome) => outcome,
            Err(consumed) => return consumed,
        };
        match outcome {
            ReplyOutcome::Stale { reason } => {
                metrics::counter!("sas_stale_replies_total").increment(1);
                tracing::info!(order_id = %reply.order_id, correlation_id = %attempt_id, step = %reply.step, reason = %reason, "stale reply ignored");
                Consumed::Ack
            }
            ReplyOutcome::Applied {
                progress,
                step,
                latency_secs,
            } => {
                // An attempt that never started measures the queue, not the step.
                if !matches!(reply.outcome, StepOutcome::NotStarted { .. }) {
                    metrics::histogram!("sas_step_latency_seconds", "step" => step)
                        .record(latency_secs);
                }
                let label = outcome_label(&reply.outcome);
                metrics::counter!("sas_replies_total", "outcome" => label).increment(1);
                // An applied reply settles its attempt: its slot is free.
                self.slot_freed();
                // Where the attempt's time went, as the agent measured it:
                // queued from dispatch to its call (of which waiting for a
                // call slot), and the call itself.
                tracing::info!(order_id = %reply.order_id, correlation_id = %attempt_id, step = %reply.step, outcome = label, agent_id = %reply.agent_id, trace_id = progress.trace_id.as_deref().unwrap_or(""), queued_ms = reply.queued_ms, slot_wait_ms = reply.slot_wait_ms, call_ms = reply.call_ms, "reply applied");
                match self.announce(Some(publisher), &progress).await {
                    Ok(()) => Consumed::Ack,
                    Err(error) => {
                        tracing::warn!(order_id = %reply.order_id, error = %error, "reply applied but the next request was not confirmed; the supervisor will retry it");
                        Consumed::Requeue
                    }
                }
            }
        }
    }

    /// The dead-lettering of a reply not published by an agent identity
    /// (its `user_id` is not one of `amqp.agent_users`), counted and
    /// logged; `None` for a reply from an agent.
    fn refuse_forged(&self, delivery: &Delivery) -> Option<Consumed> {
        let user_id = delivery
            .properties
            .user_id()
            .as_ref()
            .map(|user| user.as_str().to_owned());
        if self.settings.amqp.accepts_reply_from(user_id.as_deref()) {
            return None;
        }
        metrics::counter!("sas_forged_replies_total").increment(1);
        let publisher_name = user_id.as_deref().unwrap_or("(no user_id)");
        tracing::warn!(
            user_id = publisher_name,
            correlation_id = delivery.correlation_id().unwrap_or(""),
            "reply refused: not published by an agent identity (amqp.agent_users)"
        );
        Some(Consumed::DeadLetter(format!(
            "forged reply refused: published by broker user {publisher_name:?}, \
             which is not one of amqp.agent_users"
        )))
    }

    /// Records the reply (through the reply batch), retrying while the
    /// store's failures are transient: `Err` with [`Consumed::Requeue`] when
    /// the scheduler stops first or the store fails for good (logged).
    async fn record_reply(
        &self,
        reply: &StepReply,
        attempt_id: &str,
    ) -> Result<ReplyOutcome, Consumed> {
        match sas_runtime::retry_transient(
            &self.shutdown,
            "recording a reply",
            |e: &sas_store::StoreError| e.is_transient(),
            || async {
                self.replies
                    .submit(reply.clone())
                    .await
                    .unwrap_or_else(|| Err(stopping()))
            },
        )
        .await
        {
            None => Err(Consumed::Requeue),
            Some(Ok(outcome)) => Ok(outcome),
            Some(Err(error)) => {
                tracing::error!(order_id = %reply.order_id, correlation_id = %attempt_id, error = %error, "cannot record reply");
                Err(Consumed::Requeue)
            }
        }
    }
}

/// The label of a reply's outcome in `sas_replies_total` and the log.
fn outcome_label(outcome: &StepOutcome) -> &'static str {
    match outcome {
        StepOutcome::Succeeded { .. } => "succeeded",
        StepOutcome::NotStarted { .. } => "not_started",
        StepOutcome::Failed {
            permanent: true, ..
        } => "failed_permanent",
        StepOutcome::Failed { .. } => "failed_transient",
    }
}
