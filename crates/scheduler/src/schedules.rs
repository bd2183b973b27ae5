//! Firing durable schedules: every `schedule_interval_ms`, this scheduler
//! decides the schedules that are due (whichever scheduler locks one
//! first decides it; see [`sas_store::schedules`]) and stores each started
//! run's order through intake, as if its tenant had submitted it. Runs
//! another scheduler decided and did not fire (it died or froze) are fired
//! here once they are [`UNFIRED_AFTER`] old.

use std::sync::Arc;
use std::time::Duration;

use sas_messages::SubmitOrder;
use sas_runtime::Next;
use sas_store::schedules::Intent;
use sas_store::writes::intake::{Intake, Submission};

use crate::Scheduler;

/// How long a started run may stay unfired before any scheduler fires
/// it: far longer than storing an order takes, short enough that a run
/// whose scheduler froze starts within a few seconds of its time.
pub const UNFIRED_AFTER: Duration = Duration::from_secs(3);

/// The most schedules one tick decides; a full batch ticks again at once.
const BATCH: i64 = 50;

/// Who submits a schedule's orders, as their history records it.
fn submitter(intent: &Intent) -> String {
    format!("schedule:{}", intent.name)
}

impl Scheduler {
    /// Decides and fires due schedules every `schedule_interval_ms`, until
    /// shutdown. It needs only the database: while the broker is away,
    /// occurrences are still decided and their orders stored (their first
    /// requests go out once it is back, or the supervisor retries them), so
    /// an outage of the broker longer than the catch-up window misses none.
    pub async fn schedule_loop(self: Arc<Self>) {
        let interval = Duration::from_millis(self.settings.scheduler.schedule_interval_ms);
        let _ = sas_runtime::every(interval, &self.shutdown, || async {
            Ok::<_, std::convert::Infallible>(self.schedule_once().await)
        })
        .await;
    }

    /// One tick: the due schedules decided, their started runs' orders
    /// stored, and runs left unfired by others fired. A failure is logged,
    /// and the next tick tries again.
    pub async fn schedule_once(&self) -> Next {
        let schedules = self.store.schedules();
        // Two ticks and a second: an occurrence is never missed only because
        // the tick deciding it came after it.
        let least_catch_up = Duration::from_millis(self.settings.scheduler.schedule_interval_ms)
            * 2
            + Duration::from_secs(1);
        // In a task of its own, as a claim's: run to its end, the
        // transaction commits or rolls back even when this loop is dropped
        // with its broker connection.
        let decided = {
            let (store, id) = (self.store.clone(), self.id.clone());
            tokio::spawn(async move {
                store
                    .schedules()
                    .decide_due(&id, BATCH, least_catch_up)
                    .await
            })
        };
        let mut intents = match decided.await {
            Ok(Ok(intents)) => intents,
            Ok(Err(error)) => {
                tracing::warn!(error = %error, "cannot decide due schedules");
                return Next::Wait;
            }
            Err(error) => {
                tracing::error!(error = %error, "the schedule task failed");
                return Next::Wait;
            }
        };
        let full = intents.len() as i64 >= BATCH;
        match schedules.unfired(UNFIRED_AFTER, BATCH).await {
            Ok(unfired) => intents.extend(unfired),
            Err(error) => tracing::warn!(error = %error, "cannot read unfired schedule runs"),
        }
        for intent in &intents {
            let refusal = match self.fire(intent).await {
                Fired::Later | Fired::Gone => continue,
                Fired::Stored => None,
                Fired::Refused(reason) => {
                    metrics::counter!("sas_schedule_runs_refused_total").increment(1);
                    tracing::warn!(schedule = %intent.name, tenant = %intent.tenant, occurrence = %intent.occurrence, reason = %reason, "a schedule's run was refused by intake");
                    Some(reason)
                }
            };
            if let Err(error) = schedules.mark_fired(intent, refusal.as_deref()).await {
                tracing::warn!(schedule = %intent.name, error = %error, "cannot mark a schedule run fired; it is fired again later");
            }
        }
        if full {
            Next::Again
        } else {
            Next::Wait
        }
    }

    /// Stores `intent`'s order as intake stores a submitted one (the same
    /// checks of workflow, attributes and tenancy; not the tenant's quota:
    /// a schedule is the tenant's own standing order) and publishes its
    /// first request.
    async fn fire(&self, intent: &Intent) -> Fired {
        let order: SubmitOrder = match serde_json::from_value(intent.order_body.0.clone()) {
            Ok(order) => order,
            Err(error) => {
                return Fired::Refused(format!(
                    "the schedule's order does not read as an order: {error}"
                ))
            }
        };
        let workflow = match self.workflow_of(&order) {
            Ok(workflow) => workflow,
            Err(reason) => return Fired::Refused(reason),
        };
        if let Err(reason) = self.may_start(&order, &intent.tenant, &workflow) {
            return Fired::Refused(reason);
        }
        // Fired by another scheduler meanwhile (this one froze after its
        // decision), and perhaps retired since with its order: storing it
        // now would run the occurrence twice.
        match self.store.schedules().is_unfired(intent).await {
            Ok(true) => {}
            Ok(false) => return Fired::Gone,
            Err(error) => {
                tracing::warn!(schedule = %intent.name, error = %error, "cannot check a schedule run; the next tick tries again");
                return Fired::Later;
            }
        }
        let mut order = order;
        order.order_id = order.order_id.qualified(&intent.tenant);
        let trace = sas_messages::TraceParent::new_root();
        let submission = Submission {
            submitted_by: Some(submitter(intent)),
            ..Submission::new(order.clone(), trace.trace_id.clone())
        };
        let stored = match self.intake.submit(submission).await {
            Some(Ok(intake)) => intake,
            Some(Err(error)) if error.is_transient() => {
                tracing::warn!(schedule = %intent.name, order_id = %order.order_id, error = %error, "cannot store a schedule's order; the next tick tries again");
                return Fired::Later;
            }
            // Fails the same way every time: recorded, not retried for ever.
            Some(Err(error)) => return Fired::Refused(format!("intake failed: {error}")),
            None => return Fired::Later,
        };
        match stored {
            Intake::Accepted(progress) => {
                metrics::counter!("sas_schedule_runs_started_total").increment(1);
                tracing::info!(schedule = %intent.name, tenant = %intent.tenant, order_id = %order.order_id, occurrence = %intent.occurrence, "schedule run started");
                if let Err(error) = self.announce(None, &progress).await {
                    // Stored: the supervisor retries its first step once
                    // its deadline passes, as for any order.
                    tracing::warn!(order_id = %order.order_id, error = %error, "a schedule's order is stored but its first request was not confirmed; the supervisor will retry it");
                }
                Fired::Stored
            }
            // Fired before by a scheduler that did not get to mark it.
            Intake::Duplicate => Fired::Stored,
            Intake::Conflict => Fired::Refused(format!(
                "order_id {:?} is already used by an order with different content",
                order.order_id.client_id()
            )),
        }
    }
}

/// What became of firing one run.
enum Fired {
    /// Its order is stored (now or before).
    Stored,
    /// Intake refuses it, for good: recorded with the run.
    Refused(String),
    /// Not now (the store failed, or shutdown): the next tick fires it.
    Later,
    /// Fired already by another scheduler, or retired: nothing to do.
    Gone,
}
