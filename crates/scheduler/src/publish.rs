//! Publishing what a committed transition asks for.

use sas_broker::publish::{confirm_all, json_properties, order_headers, Pending};
use sas_broker::{BrokerError, Publisher};
use sas_messages::{QueueNames, StepRequest, SCHEMA_VERSION};
use sas_store::{Dispatch, Progress};

/// Publishes a transition's status messages and its step request.
///
/// The request is mandatory: if the agent's queue is missing it is an error,
/// not a silently dropped step. Status messages go out first, so a client
/// sees `received` before the first `step_completed`.
///
/// # Errors
/// When the broker does not confirm a message. The transition is committed
/// anyway: a request that was never sent is retried by the supervisor once
/// its deadline passes.
pub async fn publish_progress(
    publisher: &Publisher,
    names: &QueueNames,
    progress: &Progress,
) -> Result<(), BrokerError> {
    // Everything is sent together and the confirms awaited together: one
    // round trip to the broker per transition, not one per message. The
    // statuses are handed to the channel before the request (`join` polls
    // its first future first, and each send hands over its frames in its
    // first poll).
    sas_broker::publish::count_finished(&progress.statuses);
    let trace_id = progress.trace_id.as_deref();
    let statuses = publisher.send_statuses(
        names,
        progress.reply_to.as_deref(),
        trace_id,
        &progress.statuses,
    );
    let request = async {
        match &progress.dispatch {
            Some(dispatch) => send_request(publisher, names, dispatch, trace_id)
                .await
                .map(Some),
            None => Ok(None),
        }
    };
    let (statuses, request) = futures_util::future::join(statuses, request).await;
    let mut pending = statuses?;
    // Each status goes to the same destinations (status exchange, reply_to).
    let per_status = (pending.len() / progress.statuses.len().max(1)) as u64;
    for status in &progress.statuses {
        metrics::counter!("sas_status_messages_total", "event" => status.event.as_str())
            .increment(per_status);
    }
    pending.extend(request?);
    confirm_all(pending).await
}

/// Sends one step request to its agent's queue, with `correlation_id` =
/// attempt id and `reply_to` = the shared scheduler reply queue; the caller
/// awaits the confirm.
///
/// # Errors
/// When the broker cannot take it.
pub async fn send_request(
    publisher: &Publisher,
    names: &QueueNames,
    dispatch: &Dispatch,
    trace_id: Option<&str>,
) -> Result<Pending, BrokerError> {
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
        payload: dispatch.payload.clone(),
    };
    let attempt_id = dispatch.attempt_id.to_string();
    let properties = json_properties(&attempt_id)
        .with_correlation_id(attempt_id.as_str().into())
        .with_reply_to(names.scheduler_replies().into())
        .with_headers(order_headers(&dispatch.order_id, trace_id));
    let pending = publisher
        .send_json(
            "",
            &names.agent_requests(&dispatch.agent),
            &request,
            properties,
            true,
        )
        .await?;
    metrics::counter!("sas_step_requests_total", "agent" => dispatch.agent.clone(), "kind" => format!("{:?}", dispatch.kind)).increment(1);
    tracing::debug!(order_id = %dispatch.order_id, correlation_id = %attempt_id, step = %dispatch.step, agent = %dispatch.agent, "step request sent");
    Ok(pending)
}
