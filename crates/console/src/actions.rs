//! What operators do, for the pages and the JSON API alike: resubmit and
//! cancel orders (one, or every order a filter selects), send the event an
//! order's wait step waits for, move waiting orders to another version of
//! their workflow, acknowledge and resolve alerts, replay and discard dead
//! letters. Orders change only through the state store's
//! transitions, the ones `sasctl` uses, and every action is recorded in the
//! order's history as `console:<user>` (an event is recorded by the
//! scheduler that uses it: `wait_ended` with the event's id).

use std::collections::BTreeMap;

pub use sas_announce::bulk::BulkOutcome;
use sas_announce::bulk::{run_bulk, Bulk, BulkError};
use sas_announce::event::{event_message, EventAddress, NewEvent};
use sas_announce::replay::{replay_dead_letter, ReplayError};
use sas_store::machine::kind::{Kind, WaitStep};
use sas_store::machine::park::OnTimeout;
use sas_store::machine::wait::EventAdmission;
use sas_store::machine::StepRow;
use sas_store::reads::dead_letters::NotReplayable;
use sas_store::reads::search::OrderFilter;
use sas_store::writes::dead_letters::Disposition;
use sas_store::writes::moves::{MoveError, MoveReport, MoveRequest};
use sas_store::writes::operator::{Cancel, Resubmit, Resume};
use sas_store::{ProcessState, Progress};
use serde::Serialize;

use crate::auth::Principal;
use crate::error::Failure;
use crate::Console;

pub use sas_store::writes::operator::OrderAction;

impl From<sas_store::writes::operator::UnknownAction> for Failure {
    fn from(error: sas_store::writes::operator::UnknownAction) -> Self {
        Failure::bad_request(error.to_string())
    }
}

/// What a bulk action would do.
#[derive(Debug, Clone, Serialize)]
pub struct Preview {
    /// The action.
    pub action: OrderAction,
    /// Orders the filter selects among those the action applies to.
    pub count: i64,
    /// Most orders one bulk action goes through (the oldest first).
    pub limit: i64,
}

/// The outcome of one action, said for the operator.
#[derive(Debug, Clone, Serialize)]
pub struct Done {
    /// What happened.
    pub message: String,
}

/// A move of waiting orders an operator asks for, as `sasctl orders move`
/// takes it: without `confirm`, a look (nothing changes); with it, the
/// move, refused when more orders would move than confirmed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MoveAsk {
    /// The workflow.
    pub workflow: String,
    /// The version the orders have now.
    pub from: i32,
    /// The version to move them to (registered by a scheduler that runs it).
    pub to: i32,
    /// Old step names to new ones; a step absent keeps its name.
    pub mapping: BTreeMap<String, String>,
    /// `None`: only look. `Some(n)`: move, `n` being how many the look
    /// said would move.
    pub confirm: Option<usize>,
}

/// An order a move takes (or would take), and what changes for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MovedOrder {
    /// The order.
    pub order_id: String,
    /// The versions and what changed (its history line's detail).
    pub detail: String,
}

/// An order a move leaves as it is, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RefusedOrder {
    /// The order.
    pub order_id: String,
    /// Why the move is unsafe for it.
    pub reason: String,
}

/// What a move did (`applied`) or would do: the store's
/// [`MoveReport`], said for the operator.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MoveOutcome {
    /// The workflow.
    pub workflow: String,
    /// The version the orders had.
    pub from: i32,
    /// The version they move to.
    pub to: i32,
    /// True when the orders moved; false for a look.
    pub applied: bool,
    /// Orders moved (or that would move).
    pub moved: Vec<MovedOrder>,
    /// Orders left as they are, with why.
    pub refused: Vec<RefusedOrder>,
    /// Orders of version `from` that do not wait now (running or ended),
    /// which no move touches.
    pub not_waiting: i64,
    /// Most waiting orders one move looks at (`console.bulk_limit`, by
    /// order id); when `moved` and `refused` reach it, there may be more.
    pub limit: i64,
    /// What happened, said for the operator.
    pub message: String,
}

impl MoveOutcome {
    fn new(ask: &MoveAsk, report: MoveReport, applied: bool, limit: i64) -> Self {
        let verb = if applied { "moved" } else { "would move" };
        let message = format!(
            "{} {verb} from version {} to {} of {}, {} refused (they stay); {} of version {} do not wait now (running or ended) and are not touched.",
            report.moved.len(),
            ask.from,
            ask.to,
            ask.workflow,
            report.refused.len(),
            report.not_waiting,
            ask.from,
        );
        Self {
            workflow: ask.workflow.clone(),
            from: ask.from,
            to: ask.to,
            applied,
            moved: report
                .moved
                .into_iter()
                .map(|(order_id, detail)| MovedOrder { order_id, detail })
                .collect(),
            refused: report
                .refused
                .into_iter()
                .map(|(order_id, reason)| RefusedOrder { order_id, reason })
                .collect(),
            not_waiting: report.not_waiting,
            limit,
            message,
        }
    }

    /// Whether the move looked at as many orders as it may: more may wait.
    pub fn at_limit(&self) -> bool {
        i64::try_from(self.moved.len() + self.refused.len()).unwrap_or(i64::MAX) >= self.limit
    }
}

/// An event sent to an order's wait step.
#[derive(Debug, Clone, Serialize)]
pub struct EventSent {
    /// What happened, said for the operator.
    pub message: String,
    /// The event's id (`console-<uuid v7>`): the order's history names it
    /// when its wait ends.
    pub event_id: String,
}

/// The wait step an order is parked at for an event: its step, the event's
/// name and what its timeout means (when it times out: the step's
/// `complete_by`).
#[derive(Debug, Clone, Copy)]
pub struct Waiting<'a> {
    /// The wait step.
    pub step: &'a StepRow,
    /// The event it waits for.
    pub event: &'a str,
    /// What happens when no event comes in time.
    pub on_timeout: OnTimeout,
}

/// The wait step the order waits at for an event, if it does now: the
/// step it is parked at ([`sas_store::machine::park::parked_at`], the
/// state machine's rule) when that step waits for an event.
pub fn waiting_for_event(state: ProcessState, steps: &[StepRow]) -> Option<Waiting<'_>> {
    let step = &steps[sas_store::machine::park::parked_at(state, steps)?];
    match &step.kind {
        Kind::Wait(WaitStep {
            event, on_timeout, ..
        }) => Some(Waiting {
            step,
            event,
            on_timeout: *on_timeout,
        }),
        Kind::Delay(_) | Kind::Child(_) | Kind::Call(_) => None,
    }
}

/// 400 unless `ask` can be a move: a workflow's name, two different
/// versions, a mapping of step names.
fn check_move(ask: &MoveAsk) -> Result<(), Failure> {
    if !sas_messages::order::is_workflow_name(&ask.workflow) {
        return Err(Failure::bad_request(format!(
            "a workflow's name is 1 to 64 letters, digits, '_' or '-' (got {:?})",
            ask.workflow
        )));
    }
    if ask.from == ask.to {
        return Err(Failure::bad_request(format!(
            "the orders are at version {} already: move them to another version",
            ask.from
        )));
    }
    if let Some((old, new)) = ask
        .mapping
        .iter()
        .find(|(old, new)| !is_step_name(old) || !is_step_name(new))
    {
        return Err(Failure::bad_request(format!(
            "the mapping {old:?} = {new:?} does not name two steps (OLD=NEW)"
        )));
    }
    Ok(())
}

/// Whether `name` can be a step's name in a mapping: not empty, no
/// whitespace or `=`.
fn is_step_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= 128 && !name.contains(|c: char| c.is_whitespace() || c == '=')
}

/// A move's step mapping from `OLD=NEW` lines (blank lines are skipped, and
/// spaces around each name), as the page's form and `sasctl orders move
/// --map` take it.
///
/// # Errors
/// 400 naming a line that is not `OLD=NEW`, or an old step mapped twice.
pub fn parse_mapping<'a>(
    lines: impl IntoIterator<Item = &'a str>,
) -> Result<BTreeMap<String, String>, Failure> {
    let mut mapping = BTreeMap::new();
    for line in lines.into_iter().map(str::trim).filter(|l| !l.is_empty()) {
        let pair = line
            .split_once('=')
            .map(|(old, new)| (old.trim(), new.trim()))
            .filter(|(old, new)| is_step_name(old) && is_step_name(new));
        let Some((old, new)) = pair else {
            return Err(Failure::bad_request(format!(
                "the mapping line {line:?} is not OLD=NEW (one renamed step a line)"
            )));
        };
        if mapping.insert(old.to_owned(), new.to_owned()).is_some() {
            return Err(Failure::bad_request(format!(
                "the mapping names step {old:?} twice"
            )));
        }
    }
    Ok(mapping)
}

/// What a wait's timeout does, said for the operator.
pub fn on_timeout_text(on_timeout: OnTimeout) -> &'static str {
    match on_timeout {
        OnTimeout::Compensate => "what was done is undone",
        OnTimeout::Fail => "the order ends in error with an alert",
        OnTimeout::Continue => "the order goes on without it",
    }
}

impl Console {
    /// Sends what a committed transition asks for; a failure is logged, as
    /// the transition stands either way (status messages are notifications,
    /// and a request never sent is retried after its deadline).
    async fn announce(&self, progress: &Progress) {
        let publisher = self.session.publisher().get().ok();
        if let Err(error) = self.announcer.announce(publisher.as_ref(), progress).await {
            tracing::warn!(error = %error, "the status messages of an operator's action were not sent");
        }
    }

    /// Resubmits one order.
    ///
    /// # Errors
    /// 404 for no such order, 409 when it has not failed, 503 when the store fails.
    pub async fn resubmit(&self, order_id: &str, who: &Principal) -> Result<Done, Failure> {
        let outcome = self.store.writes().resubmit(order_id, &who.actor()).await?;
        metrics::counter!("sas_console_actions_total", "action" => "resubmit").increment(1);
        match outcome {
            Resubmit::Resubmitted { what, fresh_keys } => {
                tracing::info!(order_id, user = %who.name, %what, "order resubmitted");
                let keys = if fresh_keys.is_empty() {
                    String::new()
                } else {
                    format!("; fresh keys for {}", fresh_keys.join(", "))
                };
                Ok(Done {
                    message: format!("order {order_id} resubmitted: {what}{keys}"),
                })
            }
            Resubmit::NotFound => Err(Failure::not_found(format!("order {order_id}"))),
            Resubmit::NotFailed(state) => Err(Failure::conflict(format!(
                "order {order_id} is {state}: only orders that ended error or compensated can be resubmitted"
            ))),
            Resubmit::NotResubmittable(why) => Err(Failure::conflict(why)),
        }
    }

    /// Resumes one order stopped in error from its failed step, once its
    /// cause is fixed; `reason` (what was fixed) goes into the history.
    ///
    /// # Errors
    /// 400 without a reason, 404 for no such order, 409 when it is not
    /// stopped in error or its compensation began (with why), 503 when the
    /// store fails.
    pub async fn resume(
        &self,
        order_id: &str,
        reason: &str,
        who: &Principal,
    ) -> Result<Done, Failure> {
        let reason: String = reason.trim().chars().take(500).collect();
        if reason.is_empty() {
            return Err(Failure::bad_request(
                "a resume needs a reason: say what was fixed (it is recorded in the order's history)",
            ));
        }
        let outcome = self
            .store
            .writes()
            .resume(order_id, &reason, &who.actor())
            .await?;
        metrics::counter!("sas_console_actions_total", "action" => "resume").increment(1);
        match outcome {
            Resume::Resumed { from, key_kept } => {
                tracing::info!(order_id, user = %who.name, step = %from, key_kept, "order resumed");
                let key = if key_kept {
                    "its key kept (an earlier attempt's outcome is unknown)"
                } else {
                    "a fresh key"
                };
                Ok(Done {
                    message: format!("order {order_id} resumed from step {from}, with {key}"),
                })
            }
            Resume::NotFound => Err(Failure::not_found(format!("order {order_id}"))),
            Resume::NotStopped(state) => Err(Failure::conflict(format!(
                "order {order_id} is {state}: only orders stopped in error can be resumed"
            ))),
            Resume::NotResumable(why) => Err(Failure::conflict(format!(
                "order {order_id} cannot be resumed: {why}"
            ))),
        }
    }

    /// Cancels one order: what it did is undone, by compensating now.
    ///
    /// # Errors
    /// 404 for no such order, 409 when it is not running, 503 when the store fails.
    pub async fn cancel(
        &self,
        order_id: &str,
        reason: &str,
        who: &Principal,
    ) -> Result<Done, Failure> {
        let reason = if reason.trim().is_empty() {
            format!("cancelled by {} in the console", who.name)
        } else {
            reason.trim().chars().take(500).collect()
        };
        let outcome = self
            .store
            .writes()
            .cancel(order_id, &reason, &who.actor())
            .await?;
        metrics::counter!("sas_console_actions_total", "action" => "cancel").increment(1);
        match outcome {
            Cancel::Cancelled(progress) => {
                tracing::info!(order_id, user = %who.name, "order cancelled");
                self.announce(&progress).await;
                Ok(Done {
                    message: format!("order {order_id} cancelled: what it did is being undone"),
                })
            }
            Cancel::NotFound => Err(Failure::not_found(format!("order {order_id}"))),
            Cancel::NotRunning(state) => Err(Failure::conflict(format!(
                "order {order_id} is {state}: only pending or processing orders, or orders stopped in error before any undo began, can be cancelled"
            ))),
        }
    }

    /// Sends the event `event` to order `order_id`'s wait step, as
    /// `sasctl signal` does: an [`OrderEvent`](sas_messages::OrderEvent) with the id
    /// `console-<uuid v7>` and the data `{"by": "<user>"}`, published to
    /// the events exchange with a confirm. The scheduler that uses it
    /// records the wait's end with the event's id; the console records
    /// nothing more.
    ///
    /// The order is checked first, by the rule the gateway and `sasctl
    /// signal` follow ([`sas_store::machine::wait::admission`]): the event
    /// is sent when the order waits for it now, or has a wait for it still
    /// ahead (its mailbox keeps the event until the order gets there).
    ///
    /// # Errors
    /// 400 for a name that cannot be an event's, 404 for no such order,
    /// 403 when the order's waits for it name senders and this operator is
    /// none of them (`console.tenancy_file`), 409 when nothing in the order
    /// will use it (it ended, or no wait for it is ahead), 503 when the
    /// store fails or the broker does not confirm the event.
    pub async fn send_event(
        &self,
        order_id: &str,
        event: &str,
        who: &Principal,
    ) -> Result<EventSent, Failure> {
        let identity = format!("console:{}", who.name);
        let mut data = serde_json::Map::new();
        data.insert("by".into(), serde_json::Value::String(who.name.clone()));
        let (sent, message) = event_message(
            &self.names,
            NewEvent {
                address: EventAddress::Order(order_id.to_owned()),
                name: event.to_owned(),
                event_id: None,
                data: Some(data),
                origin: "console",
                // Sent on the operator's behalf: the schedulers believe the
                // header from the console's broker user (amqp.delegating_users).
                on_behalf_of: Some(&identity),
                tenant: None,
            },
        )
        .map_err(|invalid| Failure::bad_request(invalid.to_string()))?;
        // What the event would become there, as the gateway and sasctl
        // check it too: an operator's mistake is answered at once, and
        // nothing is sent.
        let principals = self.tenancy.sender(&identity).principals;
        let admission = self
            .store
            .reads()
            .event_admission(order_id, event, &sent.event_id, &principals)
            .await?;
        let said = admission.describe(order_id, event, &identity);
        match admission {
            EventAdmission::Used { .. } | EventAdmission::Kept { .. } => {}
            // The console acts on orders it shows.
            EventAdmission::NoOrderYet => {
                return Err(Failure::not_found(format!("order {order_id}")))
            }
            EventAdmission::Refused { .. } => {
                return Err(Failure::new(axum::http::StatusCode::FORBIDDEN, said))
            }
            EventAdmission::Duplicate | EventAdmission::Unused { .. } => {
                return Err(Failure::conflict(said))
            }
        }
        let publisher = self.session.publisher().get().map_err(|_| {
            Failure::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "not connected to RabbitMQ: nothing was sent; try again once /readyz answers 200",
            )
        })?;
        publisher
            .send_batch(std::slice::from_ref(&message))
            .await
            .map_err(|error| {
                Failure::new(
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "RabbitMQ did not take the event {event} ({error}): nothing was sent; try again"
                    ),
                )
            })?;
        metrics::counter!("sas_console_actions_total", "action" => "event").increment(1);
        tracing::info!(order_id, user = %who.name, event, event_id = %sent.event_id, "event sent to a waiting order");
        Ok(EventSent {
            message: format!(
                "event {event} sent to order {order_id} ({}): {said}",
                sent.event_id
            ),
            event_id: sent.event_id,
        })
    }

    /// Moves the waiting orders of `ask.workflow` at version `ask.from` to
    /// version `ask.to`, as `sasctl orders move` does (the store's
    /// [`sas_store::writes::Writes::move_orders`], at most
    /// `console.bulk_limit` orders by order id): without `ask.confirm`, only
    /// says what would move and what stays and why; with it, moves them in
    /// one transaction, each recorded in its history as `moved` by
    /// `console:<user>`.
    ///
    /// # Errors
    /// 400 for a request that cannot be a move, 404 when no scheduler
    /// registered the target version, 409 when more orders would move now
    /// than confirmed (nothing moved), 503 when the store fails.
    pub async fn move_orders(
        &self,
        ask: &MoveAsk,
        who: &Principal,
    ) -> Result<MoveOutcome, Failure> {
        check_move(ask)?;
        let limit = self.settings.console.bulk_limit;
        let request = MoveRequest {
            workflow: &ask.workflow,
            from: ask.from,
            to: ask.to,
            mapping: &ask.mapping,
            limit,
            apply: ask.confirm.is_some(),
            confirmed: ask.confirm,
        };
        let report = match self
            .store
            .writes()
            .move_orders(&request, &who.actor())
            .await
        {
            Ok(report) => report,
            Err(unknown @ MoveError::UnknownPlan { .. }) => {
                return Err(Failure::new(
                    axum::http::StatusCode::NOT_FOUND,
                    unknown.to_string(),
                ));
            }
            Err(more @ MoveError::MoreThanConfirmed { .. }) => {
                return Err(Failure::conflict(format!("{more}; nothing was moved")));
            }
            Err(MoveError::Store(error)) => return Err(error.into()),
        };
        let outcome = MoveOutcome::new(ask, report, request.apply, limit);
        if outcome.applied {
            metrics::counter!("sas_console_actions_total", "action" => "move")
                .increment(outcome.moved.len() as u64);
            tracing::info!(user = %who.name, workflow = %ask.workflow, from = ask.from, to = ask.to, moved = outcome.moved.len(), refused = outcome.refused.len(), "waiting orders moved to another version");
        }
        Ok(outcome)
    }

    /// How many orders a bulk action would go through.
    ///
    /// # Errors
    /// 503 when the store fails.
    pub async fn preview(
        &self,
        action: OrderAction,
        filter: &OrderFilter,
    ) -> Result<Preview, Failure> {
        Ok(Preview {
            action,
            count: sas_announce::bulk::preview(&self.store, action, filter).await?,
            limit: self.settings.console.bulk_limit,
        })
    }

    /// Applies `action` to every order `filter` selects among those it
    /// applies to (at most `console.bulk_limit`, oldest first), once the
    /// operator confirmed the previewed count (see [`sas_announce::bulk`]).
    /// `reason` goes into each order's history (a resume needs one).
    ///
    /// # Errors
    /// 400 for a resume without a reason, 409 when more orders match than
    /// were confirmed, 503 when the store fails.
    pub async fn bulk(
        &self,
        action: OrderAction,
        filter: &OrderFilter,
        confirmed: i64,
        reason: &str,
        who: &Principal,
    ) -> Result<BulkOutcome, Failure> {
        let query = filter
            .to_pairs()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join("&");
        let given: String = reason.trim().chars().take(500).collect();
        let reason = match action {
            OrderAction::Resume if given.is_empty() => {
                return Err(Failure::bad_request(
                    "a bulk resume needs a reason: say what was fixed (it is recorded in each order's history)",
                ))
            }
            _ if given.is_empty() => {
                format!("bulk {} by {} (filter: {query})", action.as_str(), who.name)
            }
            _ => format!("{given} (bulk {} by {}, filter: {query})", action.as_str(), who.name),
        };
        let publisher = self.session.publisher().get().ok();
        let bulk = Bulk {
            action,
            filter,
            confirmed,
            limit: self.settings.console.bulk_limit,
            reason: &reason,
            actor: &who.actor(),
        };
        let outcome = match run_bulk(&self.store, &self.announcer, publisher.as_ref(), bulk).await {
            Ok(outcome) => outcome,
            Err(refused @ BulkError::Unconfirmed { .. }) => {
                return Err(Failure::conflict(refused.to_string()));
            }
            Err(BulkError::Store(error)) => return Err(error.into()),
        };
        let done = outcome.applied.len() + outcome.skipped.len();
        metrics::counter!("sas_console_actions_total", "action" => action.as_str())
            .increment(done as u64);
        tracing::info!(user = %who.name, action = action.as_str(), applied = outcome.applied.len(), skipped = outcome.skipped.len(), filter = %query, "bulk action");
        Ok(outcome)
    }

    /// Acknowledges an alert.
    ///
    /// # Errors
    /// 404, 409 when it is resolved, 503.
    pub async fn acknowledge_alert(&self, id: i64, who: &Principal) -> Result<Done, Failure> {
        use sas_store::writes::alerts::AlertAction;
        match self
            .store
            .writes()
            .acknowledge_alert(id, &who.actor())
            .await?
        {
            AlertAction::Done => Ok(Done {
                message: format!("alert #{id} acknowledged by {}", who.name),
            }),
            AlertAction::NotFound => Err(Failure::not_found(format!("alert #{id}"))),
            AlertAction::AlreadyResolved => Err(Failure::conflict(format!(
                "alert #{id} is already resolved"
            ))),
        }
    }

    /// Resolves an alert with a note (required: what was found or done).
    ///
    /// # Errors
    /// 400 without a note, 404, 409 when it is resolved, 503.
    pub async fn resolve_alert(
        &self,
        id: i64,
        note: &str,
        who: &Principal,
    ) -> Result<Done, Failure> {
        use sas_store::writes::alerts::AlertAction;
        let note = note.trim();
        if note.is_empty() || note.chars().count() > 2000 {
            return Err(Failure::bad_request(
                "a resolution needs a note of 1 to 2000 characters: what was found or done",
            ));
        }
        match self
            .store
            .writes()
            .resolve_alert(id, note, &who.actor())
            .await?
        {
            AlertAction::Done => Ok(Done {
                message: format!("alert #{id} resolved by {}", who.name),
            }),
            AlertAction::NotFound => Err(Failure::not_found(format!("alert #{id}"))),
            AlertAction::AlreadyResolved => Err(Failure::conflict(format!(
                "alert #{id} is already resolved"
            ))),
        }
    }

    /// Replays a dead letter (see [`sas_announce::replay::replay_dead_letter`]).
    ///
    /// # Errors
    /// 404; 409 when it was already dealt with, its source queue is not
    /// known to be one of this deployment's, or only part of it was
    /// recorded; 503 when the broker or the store fails.
    pub async fn replay_dead_letter(&self, id: i64, who: &Principal) -> Result<Done, Failure> {
        let publisher = self.session.publisher().get().map_err(|_| {
            Failure::new(
                axum::http::StatusCode::SERVICE_UNAVAILABLE,
                "not connected to RabbitMQ: nothing was replayed; try again once /readyz answers 200",
            )
        })?;
        let replayed =
            replay_dead_letter(&self.store, &self.names, &publisher, id, &who.actor()).await;
        let source = match replayed {
            Ok(source) => source,
            Err(ReplayError::Refused(NotReplayable::NotFound(_))) => {
                return Err(Failure::not_found(format!("dead letter #{id}")));
            }
            Err(ReplayError::Refused(refusal)) => {
                return Err(Failure::conflict(refusal.to_string()));
            }
            Err(error @ ReplayError::NotTaken { .. }) => {
                return Err(Failure::new(
                    axum::http::StatusCode::SERVICE_UNAVAILABLE,
                    error.to_string(),
                ));
            }
            Err(ReplayError::Store(error)) => return Err(error.into()),
        };
        metrics::counter!("sas_console_actions_total", "action" => "replay").increment(1);
        tracing::info!(dead_letter = id, queue = %source, user = %who.name, "dead letter replayed");
        Ok(Done {
            message: format!("dead letter #{id} replayed to {source}"),
        })
    }

    /// Marks a dead letter discarded.
    ///
    /// # Errors
    /// 404, 409 when it was already dealt with, 503.
    pub async fn discard_dead_letter(&self, id: i64, who: &Principal) -> Result<Done, Failure> {
        let letter = self
            .store
            .reads()
            .dead_letter(id)
            .await?
            .ok_or_else(|| Failure::not_found(format!("dead letter #{id}")))?;
        if !self
            .store
            .writes()
            .dispose_dead_letter(id, Disposition::Discarded, &who.actor())
            .await?
        {
            return Err(Failure::conflict(format!(
                "dead letter #{id} was already {}",
                letter.disposition.as_deref().unwrap_or("dealt with")
            )));
        }
        metrics::counter!("sas_console_actions_total", "action" => "discard").increment(1);
        Ok(Done {
            message: format!("dead letter #{id} discarded"),
        })
    }
}
