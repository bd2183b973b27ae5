//! Storing a submitted order.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use chrono::{DateTime, Utc};
use sas_messages::SubmitOrder;
use sqlx::Row;
use uuid::Uuid;

use super::Writes;
use crate::machine::kind::{Kind, ParkRef, StoredKind};
use crate::machine::{decide, Context, Event, Snapshot};
use crate::model::{Dispatch, NewStep, Plan, Progress};
use crate::StoreError;

/// What became of a submitted order.
#[derive(Debug, Clone, PartialEq)]
pub enum Intake {
    /// Stored, and its first step started: publish what the progress asks.
    Accepted(Progress),
    /// The same order was already stored (a redelivery or a resubmission): nothing changed.
    Duplicate,
    /// An order with this id but other content was already stored: nothing
    /// changed, and the submission should be rejected.
    Conflict,
}

/// A submitted order to store, with the trace it belongs to.
#[derive(Debug, Clone)]
pub struct Submission {
    /// The order as submitted.
    pub order: SubmitOrder,
    /// Its trace id (the client's, or a new root).
    pub trace_id: String,
    /// The AMQP `reply_to` property of the message, for a client that
    /// follows RabbitMQ's request/reply convention instead of naming
    /// `reply_to` in the body (the body's wins when both are set).
    pub reply_to_property: Option<String>,
    /// The AMQP `correlation_id` property of the message: every status
    /// message to the order's reply queue carries it back.
    pub correlation_id: Option<String>,
    /// Who submitted it (`amqp:<user>`, `gateway:<client>`), as the
    /// scheduler resolved it from the broker's validated `user_id`: kept
    /// with the order and in its `received` history line.
    pub submitted_by: Option<String>,
    /// When its tenant's quota lets it start ([`crate::quota::QuotaTurn::At`]),
    /// if later than now: the order is stored, answered `received`, and
    /// left for a claim at that time.
    pub start_at: Option<DateTime<Utc>>,
}

impl Submission {
    /// A submission without AMQP reply properties.
    pub fn new(order: SubmitOrder, trace_id: String) -> Self {
        Self {
            order,
            trace_id,
            reply_to_property: None,
            correlation_id: None,
            submitted_by: None,
            start_at: None,
        }
    }

    /// The queue the order's status messages go to: the body's `reply_to`,
    /// else the message's `reply_to` property.
    pub fn reply_queue(&self) -> Option<&str> {
        self.order
            .reply_to
            .as_deref()
            .or(self.reply_to_property.as_deref())
    }
}

/// How intake stored a new order.
enum Stored {
    /// By the single statement, which started its first step (or, not
    /// `admitted`, put it in its agent's line), at the time it says.
    Started(DateTime<Utc>, bool),
    /// Through the write kernel (a workflow that starts with a wait): what
    /// the state machine decided it publishes.
    Decided(Progress),
}

/// One intake batch: the submissions, their bodies as stored, and the
/// workflow they start.
struct Batch<'a> {
    submissions: &'a [Submission],
    bodies: Vec<serde_json::Value>,
    plan: Plan<'a>,
    steps: &'a [NewStep],
    actor: &'a str,
    start_margin: std::time::Duration,
    grace: std::time::Duration,
    max_request_bytes: usize,
}

impl Batch<'_> {
    /// Whether submission `index`'s first request can be built as its first
    /// attempt would send it (its template finds every value, it is not too
    /// large): only then may the single statement start it.
    fn first_request_builds(&self, index: usize) -> bool {
        let order_id = &self.submissions[index].order.order_id;
        let mut first = crate::machine::StepRow::new(order_id, 0, &self.steps[0]);
        first.state = crate::model::StepState::Running;
        first.attempt = 1;
        first.attempt_id = Some(sas_messages::AttemptId::new());
        first.complete_by = Some(Utc::now());
        let payload = crate::machine::dispatch::payload(&self.bodies[index], std::iter::empty());
        Dispatch::for_step(
            order_id,
            &first,
            sas_messages::StepKind::Action,
            payload,
            self.start_margin,
            i16::from(self.submissions[index].order.priority()),
            self.max_request_bytes,
        )
        .is_ok()
    }

    /// What to publish for submission `index`, stored by the statement at
    /// `received_at` with its first attempt `attempt_id`. The statement wrote
    /// what the state machine decides for a submission (the property test
    /// holds it to that); what to publish comes from the state machine itself.
    fn accepted(
        &self,
        index: usize,
        attempt_id: Uuid,
        received_at: DateTime<Utc>,
        admitted: bool,
    ) -> Intake {
        let submission = &self.submissions[index];
        let order = &submission.order;
        let mut snapshot = Snapshot::new_order(
            &order.order_id,
            self.bodies[index].clone(),
            submission.reply_queue().map(str::to_owned),
            Some(submission.trace_id.clone()),
            i16::from(order.priority()),
            self.steps,
            received_at,
        );
        snapshot.reply_correlation_id = submission.correlation_id.clone();
        let ctx = Context {
            now: received_at,
            actor: self.actor,
            next_attempt_id: attempt_id.into(),
            start_margin: self.start_margin,
            grace: self.grace,
            max_request_bytes: self.max_request_bytes,
            // Not admitted: the first agent had no room, and the statement
            // put the order in its line.
            closed: (!admitted).then(|| self.steps[0].kind.agent()).flatten(),
            closed_key: None,
        };
        Intake::Accepted(decide(&snapshot, &Event::Submitted, &ctx).progress)
    }
}

impl Writes<'_> {
    /// Stores `order` (of trace `trace_id`); see [`Writes::insert_orders`].
    ///
    /// # Errors
    /// When the database fails; the submission should then be redelivered.
    pub async fn insert_order(
        self,
        order: &SubmitOrder,
        plan: Plan<'_>,
        trace_id: &str,
        actor: &str,
    ) -> Result<Intake, StoreError> {
        let submission = Submission::new(order.clone(), trace_id.to_owned());
        self.insert_orders(std::slice::from_ref(&submission), plan, actor)
            .await
            .pop()
            .expect("one outcome per submission")
    }

    /// Stores each submitted order with its process record and its steps
    /// (those of `plan`, with its name and version), and starts its first
    /// step held by `actor`; idempotent on the order id.
    /// Returns one outcome per submission, in order.
    ///
    /// The orders go in one statement, so the batch is atomic without a
    /// transaction and costs one round trip: per order, the order, its
    /// process record (`processing`, held by `actor`, complete-by of the
    /// first step), its steps (the first one `running` with its first
    /// attempt) and two history rows. The intake scheduler holds the new
    /// orders straight away rather than leaving them pending for a claim,
    /// so a new order costs no polling delay.
    ///
    /// An order id already stored (or seen earlier in the same batch) is a
    /// duplicate when the content is the same, and a conflict otherwise.
    pub async fn insert_orders(
        self,
        submissions: &[Submission],
        plan: Plan<'_>,
        actor: &str,
    ) -> Vec<Result<Intake, StoreError>> {
        let steps = plan.steps;
        let every = |error: StoreError| {
            let shared = Arc::new(error);
            submissions
                .iter()
                .map(|_| Err(StoreError::Shared(shared.clone())))
                .collect()
        };
        if steps.is_empty() {
            return every(StoreError::Invariant(
                "a workflow needs at least one step".into(),
            ));
        }
        let bodies = match submissions
            .iter()
            .map(|s| serde_json::to_value(&s.order))
            .collect::<Result<_, _>>()
        {
            Ok(bodies) => bodies,
            Err(error) => return every(StoreError::Invariant(error.to_string())),
        };
        let batch = Batch {
            submissions,
            bodies,
            plan,
            steps,
            actor,
            start_margin: self.start_margin(),
            grace: self.store.grace(),
            max_request_bytes: self.store.max_request_bytes(),
        };
        // One submission per order id goes into the statement; a repeat in
        // the same batch is checked afterwards, like any duplicate.
        let mut seen = HashSet::new();
        let distinct: Vec<usize> = (0..submissions.len())
            .filter(|&i| seen.insert(submissions[i].order.order_id.as_str()))
            .collect();
        let attempt_ids: Vec<Uuid> = distinct.iter().map(|_| Uuid::now_v7()).collect();
        // The single statement starts the first step as the machine would
        // when its request can be built; a workflow that starts with a
        // wait or with a step limited by key (whose key must have room),
        // an order its tenant's quota holds back, or a first request that
        // cannot be built (a template with a hole, a request too large),
        // takes the write kernel, where the machine decides.
        let (fast, slow): (Vec<usize>, Vec<usize>) = match &steps[0].kind {
            Kind::Wait(_) | Kind::Delay(_) | Kind::Child(_) => (Vec::new(), distinct.clone()),
            Kind::Call(_) if starts_limited(steps) => (Vec::new(), distinct.clone()),
            Kind::Call(_) => distinct.iter().partition(|&&index| {
                submissions[index].start_at.is_none() && batch.first_request_builds(index)
            }),
        };
        let fast_ids: Vec<Uuid> = fast
            .iter()
            .map(|index| attempt_ids[distinct.iter().position(|i| i == index).unwrap_or(0)])
            .collect();
        let (mut stored, mut failed) = if fast.is_empty() {
            (HashMap::new(), HashMap::new())
        } else {
            match self.store_distinct(&batch, &fast, &fast_ids).await {
                Ok((started, failed)) => (
                    started
                        .into_iter()
                        .map(|(id, (at, admitted))| (id, Stored::Started(at, admitted)))
                        .collect(),
                    failed,
                ),
                // The database is away (or this was the only order): every
                // caller gets the error, and retries or gives up on its own.
                Err(error) => return every(StoreError::Database(error)),
            }
        };
        if !slow.is_empty() {
            match self.insert_through_machine(&batch, &slow).await {
                Ok(decided) => stored.extend(decided),
                Err(error) => return every(error),
            }
        }
        let mut outcomes = Vec::with_capacity(submissions.len());
        for (index, submission) in submissions.iter().enumerate() {
            let order_id = &submission.order.order_id;
            if let Some(error) = failed.remove(&index) {
                outcomes.push(Err(error));
                continue;
            }
            let attempt = distinct
                .iter()
                .position(|&i| i == index)
                .map(|slot| attempt_ids[slot]);
            let received = attempt.and_then(|_| stored.remove(order_id.as_str()));
            outcomes.push(match (attempt, received) {
                (Some(attempt_id), Some(Stored::Started(received_at, admitted))) => {
                    Ok(batch.accepted(index, attempt_id, received_at, admitted))
                }
                (Some(_), Some(Stored::Decided(progress))) => Ok(Intake::Accepted(progress)),
                _ => self.existing(order_id, &batch.bodies[index]).await,
            });
        }
        outcomes
    }

    /// Stores the submissions at `distinct` (distinct order ids) in one
    /// statement, or, when that statement fails for one bad order, one by
    /// one so that the others are stored. Returns when each stored order was
    /// received, and the error of each that failed alone.
    ///
    /// # Errors
    /// When the database is away, or the batch held a single order.
    async fn store_distinct(
        self,
        batch: &Batch<'_>,
        distinct: &[usize],
        attempt_ids: &[Uuid],
    ) -> Result<
        (
            HashMap<String, (DateTime<Utc>, bool)>,
            HashMap<usize, StoreError>,
        ),
        sqlx::Error,
    > {
        let error = match self.insert_batch(batch, distinct, attempt_ids).await {
            Ok(stored) => return Ok((stored, HashMap::new())),
            Err(error) if StoreError::is_transient_sqlx(&error) || distinct.len() == 1 => {
                return Err(error)
            }
            Err(error) => error,
        };
        tracing::warn!(error = %error, orders = distinct.len(), "a batched intake statement failed; storing its orders one by one");
        let (mut stored, mut failed) = (HashMap::new(), HashMap::new());
        for (slot, &index) in distinct.iter().enumerate() {
            match self
                .insert_batch(batch, &[index], &attempt_ids[slot..=slot])
                .await
            {
                Ok(one) => stored.extend(one),
                Err(error) => {
                    failed.insert(index, error.into());
                }
            }
        }
        Ok((stored, failed))
    }

    /// Inserts the submissions at `batch` (distinct order ids) in one
    /// statement; returns, per order inserted, when it was received (the
    /// statement's `now()`). Orders already stored are left out.
    async fn insert_batch(
        self,
        batch: &Batch<'_>,
        indices: &[usize],
        attempt_ids: &[Uuid],
    ) -> Result<HashMap<String, (DateTime<Utc>, bool)>, sqlx::Error> {
        let Batch {
            submissions,
            bodies,
            plan,
            steps,
            actor,
            ..
        } = batch;
        let batch = indices;
        let order_ids: Vec<&str> = batch
            .iter()
            .map(|&i| submissions[i].order.order_id.as_str())
            .collect();
        let batch_bodies: Vec<&serde_json::Value> = batch.iter().map(|&i| &bodies[i]).collect();
        let reply_tos: Vec<Option<&str>> = batch
            .iter()
            .map(|&i| submissions[i].reply_queue())
            .collect();
        let correlation_ids: Vec<Option<&str>> = batch
            .iter()
            .map(|&i| submissions[i].correlation_id.as_deref())
            .collect();
        let priorities: Vec<i16> = batch
            .iter()
            .map(|&i| i16::from(submissions[i].order.priority()))
            .collect();
        let trace_ids: Vec<&str> = batch
            .iter()
            .map(|&i| submissions[i].trace_id.as_str())
            .collect();
        let submitters: Vec<Option<&str>> = batch
            .iter()
            .map(|&i| submissions[i].submitted_by.as_deref())
            .collect();
        let positions: Vec<i32> = (0..).take(steps.len()).collect();
        let names: Vec<&str> = steps.iter().map(|s| s.name.as_str()).collect();
        let kinds: Vec<StoredKind<'_>> = steps.iter().map(|s| s.kind.stored()).collect();
        let agents: Vec<&str> = kinds.iter().map(|k| k.agent).collect();
        let actions: Vec<&str> = kinds.iter().map(|k| k.action).collect();
        let compensations: Vec<Option<&str>> = kinds.iter().map(|k| k.compensation).collect();
        let requests: Vec<Option<sqlx::types::Json<&crate::StepCalls>>> = kinds
            .iter()
            .map(|k| k.calls.as_deref().map(sqlx::types::Json))
            .collect();
        let parks: Vec<Option<sqlx::types::Json<&ParkRef<'_>>>> = kinds
            .iter()
            .map(|k| k.park.as_ref().map(sqlx::types::Json))
            .collect();
        let groups: Vec<Option<&str>> = steps.iter().map(|s| s.group.as_deref()).collect();
        let timeouts: Vec<i32> = steps
            .iter()
            .map(|s| i32::try_from(s.timeout.as_millis()).unwrap_or(i32::MAX))
            .collect();
        let rows = sqlx::query(
            "WITH i AS MATERIALIZED (
                 SELECT * FROM UNNEST($1::text[], $2::jsonb[], $3::text[], $4::text[], $5::uuid[], $14::int2[], $15::text[], $21::text[])
                        AS i(order_id, body, reply_to, trace_id, attempt_id, priority, correlation_id, submitted_by)),
             o AS (
                 INSERT INTO orders (order_id, body, submitted_by)
                 SELECT order_id, body, submitted_by FROM i ORDER BY order_id
                 ON CONFLICT (order_id) DO NOTHING
              RETURNING order_id, received_at),
             t AS (
                 SELECT * FROM UNNEST($8::int4[], $9::text[], $10::text[], $11::text[], $12::text[], $13::int4[], $16::jsonb[], $18::jsonb[], $19::text[])
                        AS t(position, name, agent, action, compensation, timeout_ms, request, park, step_group)),
             first AS (
                 SELECT t.*, now() + make_interval(secs => t.timeout_ms::float8 / 1000) AS complete_by
                   FROM t WHERE t.position = 0),
             -- Admission: the whole batch starts if the first agent has room
             -- for it and nobody waits in its line; otherwise the whole
             -- batch joins the line (and the claims admit it in order).
             room AS MATERIALIZED (
                 SELECT a.agent, a.in_flight,
                        a.waiting = 0 AND a.in_flight + (SELECT count(*) FROM o) <= a.admit_limit AS fits
                   FROM admission_now a JOIN first ON a.agent = first.agent),
             ok AS MATERIALIZED (
                 SELECT COALESCE((SELECT fits FROM room), true) AS admitted),
             p AS (
                 INSERT INTO order_process (order_id, workflow, workflow_version, state, locked_by,
                                            reply_to, trace_id, complete_by, priority, waiting_for,
                                            admit_key, reply_correlation_id)
                 SELECT o.order_id, $6, $17,
                        CASE WHEN ok.admitted THEN 'processing' ELSE 'pending' END::process_state,
                        CASE WHEN ok.admitted THEN $7 END, i.reply_to, i.trace_id,
                        CASE WHEN ok.admitted THEN first.complete_by END, i.priority,
                        CASE WHEN NOT ok.admitted THEN first.agent END,
                        CASE WHEN NOT ok.admitted THEN date_trunc('microseconds', now() - i.priority * interval '10 seconds') END,
                        i.correlation_id
                   FROM o JOIN i ON i.order_id = o.order_id CROSS JOIN first CROSS JOIN ok),
             -- Attempts started move one of the agent's shards, picked at
             -- random once per statement (crate::admission::SHARDS) and made
             -- if not there yet, so intake batches rarely wait for each
             -- other's commit; orders put in line move the row's waiting
             -- count.
             q AS (
                 INSERT INTO admission_shard AS a (agent, shard, in_flight, peak_in_flight)
                 SELECT room.agent, (SELECT floor(random() * $20::int2)::int2), (SELECT count(*) FROM o),
                        room.in_flight + (SELECT count(*) FROM o)
                   FROM room
                  WHERE room.fits
                 ON CONFLICT (agent, shard) DO UPDATE
                    SET in_flight = a.in_flight + EXCLUDED.in_flight,
                        peak_in_flight = GREATEST(a.peak_in_flight, EXCLUDED.peak_in_flight)),
             w AS (
                 UPDATE admission a
                    SET waiting = a.waiting + (SELECT count(*) FROM o)
                   FROM room
                  WHERE NOT room.fits AND a.agent = room.agent),
             s AS (
                 INSERT INTO steps (order_id, position, name, agent, action, compensation, timeout_ms,
                                    idempotency_key, state, attempt, attempt_id, complete_by, request, park,
                                    step_group)
                 SELECT o.order_id, t.position, t.name, t.agent, t.action, t.compensation, t.timeout_ms,
                        o.order_id || ':' || t.name,
                        CASE WHEN t.position = 0 AND ok.admitted THEN 'running' ELSE 'not_started' END::step_state,
                        CASE WHEN t.position = 0 AND ok.admitted THEN 1 ELSE 0 END,
                        CASE WHEN t.position = 0 AND ok.admitted THEN i.attempt_id END,
                        CASE WHEN t.position = 0 AND ok.admitted THEN first.complete_by END,
                        t.request, t.park, t.step_group
                   FROM o JOIN i ON i.order_id = o.order_id CROSS JOIN t CROSS JOIN first CROSS JOIN ok),
             h AS (
                 INSERT INTO history (order_id, actor, event, step, attempt_id, detail)
                 SELECT o.order_id, $7, 'received', NULL, NULL, 'submitted by ' || i.submitted_by
                   FROM o JOIN i ON i.order_id = o.order_id
                 UNION ALL
                 SELECT o.order_id, $7, 'dispatched', first.name, i.attempt_id,
                        'attempt 1: ' || first.agent || '.' || first.action
                   FROM o JOIN i ON i.order_id = o.order_id CROSS JOIN first CROSS JOIN ok WHERE ok.admitted
                 UNION ALL
                 SELECT o.order_id, $7, 'waiting_for_admission', first.name, NULL,
                        first.agent || ' has no free slot; waiting in its line'
                   FROM o CROSS JOIN first CROSS JOIN ok WHERE NOT ok.admitted)
             SELECT o.order_id, o.received_at, ok.admitted FROM o CROSS JOIN ok",
        )
        .bind(&order_ids)
        .bind(&batch_bodies)
        .bind(&reply_tos)
        .bind(&trace_ids)
        .bind(attempt_ids)
        .bind(plan.name)
        .bind(actor)
        .bind(&positions)
        .bind(&names)
        .bind(&agents)
        .bind(&actions)
        .bind(&compensations)
        .bind(&timeouts)
        .bind(&priorities)
        .bind(&correlation_ids)
        .bind(&requests)
        .bind(plan.version)
        .bind(&parks)
        .bind(&groups)
        .bind(crate::admission::SHARDS)
        .bind(&submitters)
        .fetch_all(self.pool())
        .await?;
        rows.iter()
            .map(|row| {
                Ok((
                    row.try_get("order_id")?,
                    (row.try_get("received_at")?, row.try_get("admitted")?),
                ))
            })
            .collect()
    }

    /// Stores the submissions at `distinct` in one transaction: each order,
    /// its process record and its steps as they are before intake (pending,
    /// nothing started, not before its `start_at`), then the state
    /// machine's intake through the write kernel. For a workflow whose first
    /// step waits (for an event or a time), which the machine parks (or ends
    /// at once with an event already in its mailbox), for an order its
    /// tenant's quota holds back (the machine leaves it for a claim then),
    /// and for an order whose first request cannot be built (the machine
    /// refuses it, and the order is undone with an alert).
    /// Slower than the single statement, and only for those. Returns what
    /// each stored order publishes; orders already stored are left out.
    ///
    /// # Errors
    /// When the database fails: nothing is stored.
    async fn insert_through_machine(
        self,
        batch: &Batch<'_>,
        distinct: &[usize],
    ) -> Result<HashMap<String, Stored>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let mut new: Vec<String> = Vec::new();
        for &index in distinct {
            let submission = &batch.submissions[index];
            let order_id = submission.order.order_id.as_str();
            let inserted = insert_pending(
                &mut tx,
                &Pending {
                    order_id,
                    body: &batch.bodies[index],
                    submitted_by: submission.submitted_by.as_deref(),
                    workflow: batch.plan.name,
                    version: batch.plan.version,
                    reply_to: submission.reply_queue(),
                    trace_id: Some(&submission.trace_id),
                    priority: i16::from(submission.order.priority()),
                    correlation_id: submission.correlation_id.as_deref(),
                    start_at: submission.start_at,
                },
                batch.steps,
            )
            .await?;
            if !inserted {
                continue;
            }
            new.push(order_id.to_owned());
        }
        new.sort();
        let ids: Vec<&str> = new.iter().map(String::as_str).collect();
        let decided = super::apply::transition(
            &mut tx,
            self.store,
            &ids,
            batch.actor,
            super::apply::Slots::Check,
            |_| Event::Submitted,
        )
        .await?;
        tx.commit().await?;
        Ok(decided
            .into_iter()
            .map(|d| {
                (
                    d.snapshot.order_id.as_str().to_owned(),
                    Stored::Decided(d.decision.progress),
                )
            })
            .collect())
    }

    /// An order id that was already stored: a duplicate if `body` is what
    /// was stored, a conflict otherwise.
    async fn existing(
        self,
        order_id: &str,
        body: &serde_json::Value,
    ) -> Result<Intake, StoreError> {
        let same: bool = sqlx::query_scalar("SELECT body = $2 FROM orders WHERE order_id = $1")
            .bind(order_id)
            .bind(body)
            .fetch_one(self.pool())
            .await?;
        Ok(if same {
            Intake::Duplicate
        } else {
            Intake::Conflict
        })
    }
}

/// Whether the first step of `steps` (or a member of its parallel group)
/// is limited by key: the write kernel must find its key's room before it
/// starts (see [`crate::machine::concurrency`]).
fn starts_limited(steps: &[NewStep]) -> bool {
    let limited = |step: &NewStep| {
        step.kind
            .calls()
            .is_some_and(|calls| calls.key_limits().is_some())
    };
    match steps.first() {
        Some(first) => {
            limited(first)
                || first.group.as_ref().is_some_and(|group| {
                    steps
                        .iter()
                        .take_while(|s| s.group.as_ref() == Some(group))
                        .any(limited)
                })
        }
        None => false,
    }
}

/// An order as it is stored before intake decides it (see [`insert_pending`]).
pub(crate) struct Pending<'a> {
    pub(crate) order_id: &'a str,
    pub(crate) body: &'a serde_json::Value,
    pub(crate) submitted_by: Option<&'a str>,
    pub(crate) workflow: &'a str,
    pub(crate) version: i32,
    pub(crate) reply_to: Option<&'a str>,
    pub(crate) trace_id: Option<&'a str>,
    pub(crate) priority: i16,
    pub(crate) correlation_id: Option<&'a str>,
    pub(crate) start_at: Option<DateTime<Utc>>,
}

/// Inserts `order`, its process record and its `steps` as they are before
/// intake (pending, nothing started, not before its `start_at`), in the
/// caller's transaction; false when the order id was stored already
/// (nothing is written then). The write kernel's `Submitted` then takes it
/// in: intake's general path, and a child step's start.
///
/// # Errors
/// When the database fails.
pub(crate) async fn insert_pending(
    conn: &mut sqlx::PgConnection,
    order: &Pending<'_>,
    steps: &[crate::model::NewStep],
) -> Result<bool, StoreError> {
    let order_id = order.order_id;
    let inserted = sqlx::query(
        "INSERT INTO orders (order_id, body, submitted_by) VALUES ($1, $2, $3)
         ON CONFLICT (order_id) DO NOTHING",
    )
    .bind(order_id)
    .bind(order.body)
    .bind(order.submitted_by)
    .execute(&mut *conn)
    .await?
    .rows_affected()
        == 1;
    if !inserted {
        return Ok(false);
    }
    sqlx::query(
        "INSERT INTO order_process (order_id, workflow, workflow_version, state, reply_to,
                                    trace_id, priority, reply_correlation_id, not_before)
         VALUES ($1, $2, $3, 'pending', $4, $5, $6, $7, COALESCE($8, now()))",
    )
    .bind(order_id)
    .bind(order.workflow)
    .bind(order.version)
    .bind(order.reply_to)
    .bind(order.trace_id)
    .bind(order.priority)
    .bind(order.correlation_id)
    .bind(order.start_at)
    .execute(&mut *conn)
    .await?;
    for (position, step) in (0..).zip(steps) {
        let row = crate::machine::StepRow::new(order_id, position, step);
        let kind = row.kind.stored();
        sqlx::query(
            "INSERT INTO steps (order_id, position, name, agent, action, compensation,
                                timeout_ms, idempotency_key, state, attempt, request, park,
                                step_group)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 'not_started', 0, $9, $10, $11)",
        )
        .bind(order_id)
        .bind(row.position)
        .bind(&row.name)
        .bind(kind.agent)
        .bind(kind.action)
        .bind(kind.compensation)
        .bind(row.timeout_ms)
        .bind(&row.idempotency_key)
        .bind(kind.calls.as_deref().map(sqlx::types::Json))
        .bind(kind.park.as_ref().map(sqlx::types::Json))
        .bind(&row.group)
        .execute(&mut *conn)
        .await?;
    }
    Ok(true)
}
