//! Events for orders' wait steps: each kept in its order's durable mailbox
//! once per event id, and used by the wait step that waits for its name,
//! now or when the order gets there; an event whose order never came is
//! dead-lettered when its time to live runs out.

use std::time::Duration;

use sas_messages::OrderEvent;

use super::apply::{transition, Slots};
use super::Writes;
use crate::machine::kind::{Park, WaitStep};
use crate::machine::wait;
use crate::machine::{storable, Event, HistoryEvent, Verdict};
use crate::model::Progress;
use crate::StoreError;

/// What became of an event.
#[derive(Debug, Clone, PartialEq)]
pub enum EventOutcome {
    /// Orders were waiting for it and run on (one for an order id; each
    /// order parked with the key for a correlation key): publish each
    /// progress.
    Used(Vec<Progress>),
    /// Kept: in the mailbox of orders that have not reached a wait for it
    /// (`order_exists`), or for an order (or a key) nobody has yet.
    Kept {
        /// Whether an order it is for exists (or waits with its key).
        order_exists: bool,
    },
    /// An event with this id came for the order (or the key) before:
    /// nothing changed.
    Duplicate,
    /// The orders it is for wait for it, and none of those waits accepts
    /// it from its sender: not kept; a line in each order's history says
    /// so (`reason` is the first).
    Refused {
        /// Why, naming the sender and whom the wait accepts.
        reason: String,
    },
}

/// Who sent an event, as the scheduler resolved it from the broker's
/// validated `user_id` (see [`sas_runtime::tenancy`]).
#[derive(Debug, Clone, Copy)]
pub struct EventSender<'a> {
    /// `amqp:<user>`, `gateway:<client>` or `console:<user>`.
    pub identity: &'a str,
    /// What a wait's `senders` may name it by.
    pub principals: &'a [String],
    /// Why an event of this sender may not be kept for an order (or a
    /// key) nobody has yet, if it may not: no wait of any workflow would
    /// take it from this sender.
    pub early_refusal: Option<&'a str>,
}

/// The `order_waits w` rows whose order still waits at that step (the
/// rows stay after a wait ends): the one rule both lookups by key share.
/// A preselection only: each order found is then given the event through
/// the state machine, whose `parked_at` decides whether it takes it.
macro_rules! still_waiting {
    () => {
        "JOIN order_process p ON p.order_id = w.order_id AND p.state = 'pending'
         JOIN steps s ON s.order_id = w.order_id AND s.name = w.step
                     AND s.state = 'running' AND s.park IS NOT NULL"
    };
}

/// The orders parked at a wait with business key `$1`.
const WAITING_WITH_KEY: &str = concat!(
    "SELECT w.order_id FROM order_waits w ",
    still_waiting!(),
    " WHERE w.correlation_key = $1 ORDER BY w.order_id"
);

impl Writes<'_> {
    /// Keeps `event` in its order's mailbox (once per event id; one that
    /// comes for no order is kept `ttl`) and, in the same transaction, lets
    /// the order use it if it waits for it. An event naming a correlation
    /// key goes so to every order parked with the key, or is kept by key
    /// (`ttl`) for the first order that parks with it.
    ///
    /// # Errors
    /// When the database fails; the event should then be redelivered.
    pub async fn deliver_event(
        self,
        event: &OrderEvent,
        sender: EventSender<'_>,
        ttl: Duration,
        actor: &str,
    ) -> Result<EventOutcome, StoreError> {
        let mut tx = self.pool().begin().await?;
        let mut orders: Vec<String> = match (&event.order_id, &event.correlation_key) {
            (Some(order_id), _) => vec![order_id.as_str().to_owned()],
            (None, Some(key)) => {
                sqlx::query_scalar(WAITING_WITH_KEY)
                    .bind(key)
                    .fetch_all(&mut *tx)
                    .await?
            }
            (None, None) => {
                return Err(StoreError::Invariant(
                    "an event names neither an order nor a key".into(),
                ))
            }
        };
        let data = storable(&serde_json::Value::Object(
            event.data.clone().unwrap_or_default(),
        ));
        let refusals = refuse_unaccepted(&mut tx, &mut orders, event, sender, actor).await?;
        if orders.is_empty() {
            if let Some(reason) = refusals
                .into_iter()
                .next()
                .or_else(|| sender.early_refusal.map(str::to_owned))
            {
                tx.commit().await?;
                return Ok(EventOutcome::Refused { reason });
            }
            let key = event.correlation_key.as_deref().unwrap_or_default();
            let delivered_before: bool = sqlx::query_scalar(
                "SELECT EXISTS (SELECT 1 FROM order_events WHERE correlation_key = $1 AND event_id = $2)",
            )
            .bind(key)
            .bind(&event.event_id)
            .fetch_one(&mut *tx)
            .await?;
            if delivered_before {
                tx.commit().await?;
                return Ok(EventOutcome::Duplicate);
            }
            let inserted = sqlx::query(
                "INSERT INTO keyed_events (correlation_key, event_id, name, data, expires_at, sender, principals)
                 VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5), $6, $7)
                 ON CONFLICT (correlation_key, event_id) DO NOTHING",
            )
            .bind(key)
            .bind(&event.event_id)
            .bind(&event.name)
            .bind(&data)
            .bind(ttl.as_secs_f64())
            .bind(sender.identity)
            .bind(sender.principals)
            .execute(&mut *tx)
            .await?
            .rows_affected()
                == 1;
            tx.commit().await?;
            return Ok(if inserted {
                EventOutcome::Kept {
                    order_exists: false,
                }
            } else {
                EventOutcome::Duplicate
            });
        }
        if let (None, Some(key)) = (&event.order_id, &event.correlation_key) {
            // The event may have been kept by key before these orders
            // parked (a redelivery after a lost ack, before the supervisors'
            // adoption): they have it now, so nobody else gets it, and it
            // is not dead-lettered as one no order waited for. Closed
            // before the mailboxes are written, in the order adoption
            // takes its locks (the kept row, then the mailboxes): the other
            // way round, each would wait for the other.
            sqlx::query(
                "UPDATE keyed_events SET adopted_at = now(), adopted_by = $3
                  WHERE correlation_key = $1 AND event_id = $2
                    AND adopted_at IS NULL AND expired_at IS NULL",
            )
            .bind(key)
            .bind(&event.event_id)
            .bind(&orders[0])
            .execute(&mut *tx)
            .await?;
        }
        let mut inserted = false;
        for order_id in &orders {
            inserted |= keep(&mut tx, order_id, event, sender, &data, ttl).await?;
        }
        // A redelivered event that was kept but not used is offered again:
        // the order may have reached its wait since.
        let ids: Vec<&str> = orders.iter().map(String::as_str).collect();
        let decided = transition(&mut tx, self.store, &ids, actor, Slots::Check, |_| {
            Event::EventArrived
        })
        .await?;
        tx.commit().await?;
        let exists = !decided.is_empty();
        let used: Vec<Progress> = decided
            .into_iter()
            .filter(|d| d.decision.verdict == Verdict::Applied)
            .map(|d| d.decision.progress)
            .collect();
        Ok(if !used.is_empty() {
            EventOutcome::Used(used)
        } else if !inserted {
            EventOutcome::Duplicate
        } else {
            EventOutcome::Kept {
                order_exists: exists,
            }
        })
    }

    /// Gives up to `batch` events kept by key, each to every order that
    /// now waits with its key (into the order's mailbox), marks them
    /// adopted, and lets the orders use them: what each order does next, to
    /// publish. Run by the supervisors every `supervisor.interval_ms`, so an
    /// event that came before its order parked is used within an interval
    /// of it parking. One statement picks the events and fans them out, so
    /// the batch counts events, never a part of one event's orders. An
    /// empty `keyed_events` costs one probe of a partial index.
    ///
    /// # Errors
    /// When the database fails; nothing is given then.
    pub async fn adopt_keyed_events(
        self,
        actor: &str,
        batch: i64,
    ) -> Result<Vec<Progress>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let orders: Vec<String> = sqlx::query_scalar(concat!(
            "WITH picked AS MATERIALIZED (
                 SELECT k.correlation_key, k.event_id, k.name, k.data, k.sender, k.principals
                   FROM keyed_events k
                  WHERE k.adopted_at IS NULL AND k.expired_at IS NULL
                    AND EXISTS (SELECT 1 FROM order_waits w ",
            still_waiting!(),
            " WHERE w.correlation_key = k.correlation_key)
                  ORDER BY k.received_at
                  LIMIT $1
                    FOR UPDATE OF k SKIP LOCKED),
             fan AS MATERIALIZED (
                 SELECT k.*, w.order_id
                   FROM picked k
                   JOIN order_waits w ON w.correlation_key = k.correlation_key ",
            still_waiting!(),
            "),
             given AS (
                 INSERT INTO order_events (order_id, event_id, name, data, expires_at, correlation_key,
                                           sender, principals)
                 SELECT order_id, event_id, name, data, now(), correlation_key, sender, principals FROM fan
                  ORDER BY order_id, event_id
                 ON CONFLICT (order_id, event_id) DO NOTHING),
             adopted AS (
                 UPDATE keyed_events k SET adopted_at = now(), adopted_by = f.first
                   FROM (SELECT correlation_key, event_id, min(order_id) AS first
                           FROM fan GROUP BY correlation_key, event_id) f
                  WHERE k.correlation_key = f.correlation_key AND k.event_id = f.event_id)
             SELECT DISTINCT order_id FROM fan ORDER BY order_id"
        ))
        .bind(batch)
        .fetch_all(&mut *tx)
        .await?;
        if orders.is_empty() {
            tx.commit().await?;
            return Ok(Vec::new());
        }
        let ids: Vec<&str> = orders.iter().map(String::as_str).collect();
        let decided = transition(&mut tx, self.store, &ids, actor, Slots::Check, |_| {
            Event::EventArrived
        })
        .await?;
        tx.commit().await?;
        Ok(decided
            .into_iter()
            .filter(|d| d.decision.verdict == Verdict::Applied)
            .map(|d| d.decision.progress)
            .collect())
    }

    /// Dead-letters up to `batch` events whose order never came within
    /// their time to live, and up to `batch` kept by a key no order waited
    /// with in theirs: each is recorded in `dead_letters` (as from
    /// `source_queue`) with its reason, and marked expired. Returns how
    /// many.
    ///
    /// # Errors
    /// When the database fails.
    pub async fn expire_events(self, source_queue: &str, batch: i64) -> Result<u64, StoreError> {
        let expired = sqlx::query(
            "WITH gone AS (
                 UPDATE order_events e SET expired_at = now()
                  WHERE (e.order_id, e.event_id) IN (
                        SELECT x.order_id, x.event_id FROM order_events x
                         WHERE x.used_at IS NULL AND x.expired_at IS NULL AND x.expires_at <= now()
                           AND NOT EXISTS (SELECT 1 FROM orders o WHERE o.order_id = x.order_id)
                         ORDER BY x.expires_at
                         LIMIT $2
                           FOR UPDATE SKIP LOCKED)
              RETURNING e.*)
             INSERT INTO dead_letters (source_queue, reason, order_id, message_id, body)
             SELECT $1,
                    'no order ' || gone.order_id || ' came within the event''s time to live (scheduler.event_ttl_secs), from ' || gone.received_at,
                    gone.order_id, gone.event_id,
                    jsonb_build_object('schema_version', 1, 'order_id', gone.order_id,
                                       'name', gone.name, 'event_id', gone.event_id,
                                       'data', gone.data)::text
               FROM gone",
        )
        .bind(source_queue)
        .bind(batch)
        .execute(self.pool())
        .await?
        .rows_affected();
        let keyed = sqlx::query(
            "WITH gone AS (
                 UPDATE keyed_events k SET expired_at = now()
                  WHERE (k.correlation_key, k.event_id) IN (
                        SELECT x.correlation_key, x.event_id FROM keyed_events x
                         WHERE x.adopted_at IS NULL AND x.expired_at IS NULL AND x.expires_at <= now()
                         ORDER BY x.expires_at
                         LIMIT $2
                           FOR UPDATE SKIP LOCKED)
              RETURNING k.*)
             INSERT INTO dead_letters (source_queue, reason, order_id, message_id, body)
             SELECT $1,
                    'no order waited with correlation key ' || gone.correlation_key || ' within the event''s time to live (scheduler.event_ttl_secs), from ' || gone.received_at,
                    NULL, gone.event_id,
                    jsonb_build_object('schema_version', 1, 'correlation_key', gone.correlation_key,
                                       'name', gone.name, 'event_id', gone.event_id,
                                       'data', gone.data)::text
               FROM gone",
        )
        .bind(source_queue)
        .bind(batch)
        .execute(self.pool())
        .await?
        .rows_affected();
        Ok(expired + keyed)
    }
}

/// Keeps `event` in the mailbox of `order_id`, once per event id (for
/// `ttl`, which counts only while the order does not exist). Says whether
/// it was new.
async fn keep(
    tx: &mut sqlx::PgConnection,
    order_id: &str,
    event: &OrderEvent,
    sender: EventSender<'_>,
    data: &serde_json::Value,
    ttl: Duration,
) -> Result<bool, StoreError> {
    Ok(sqlx::query(
        "INSERT INTO order_events (order_id, event_id, name, data, expires_at, correlation_key,
                                   sender, principals)
         VALUES ($1, $2, $3, $4, now() + make_interval(secs => $5), $6, $7, $8)
         ON CONFLICT (order_id, event_id) DO NOTHING",
    )
    .bind(order_id)
    .bind(&event.event_id)
    .bind(&event.name)
    .bind(data)
    .bind(ttl.as_secs_f64())
    .bind(&event.correlation_key)
    .bind(sender.identity)
    .bind(sender.principals)
    .execute(&mut *tx)
    .await?
    .rows_affected()
        == 1)
}

/// Takes out of `orders` each order whose workflow waits for `event`'s
/// name and accepts it from none of those waits' senders, writing a line
/// in its history (`event_refused`, by `actor`) naming the sender and whom
/// the waits accept, and each order that does not exist yet when the
/// sender's events may not be kept for one (`early_refusal`); returns the
/// reasons. An order with no wait for the name keeps the event (it changes
/// nothing there).
async fn refuse_unaccepted(
    tx: &mut sqlx::PgConnection,
    orders: &mut Vec<String>,
    event: &OrderEvent,
    sender: EventSender<'_>,
    actor: &str,
) -> Result<Vec<String>, StoreError> {
    if orders.is_empty() {
        return Ok(Vec::new());
    }
    let waits: Vec<(String, String, serde_json::Value)> = sqlx::query_as(
        "SELECT order_id, name, park FROM steps
          WHERE order_id = ANY($1) AND park->>'kind' = 'event' AND park->>'event' = $2",
    )
    .bind(&*orders)
    .bind(&event.name)
    .fetch_all(&mut *tx)
    .await?;
    let existing: Vec<String> =
        sqlx::query_scalar("SELECT order_id FROM orders WHERE order_id = ANY($1)")
            .bind(&*orders)
            .fetch_all(&mut *tx)
            .await?;
    let mut refused: Vec<(String, String)> = Vec::new();
    let mut early: Vec<String> = Vec::new();
    for order_id in orders.iter() {
        if !existing.contains(order_id) {
            if let Some(reason) = sender.early_refusal {
                early.push(order_id.clone());
                refused.push((order_id.clone(), reason.to_owned()));
            }
            continue;
        }
        let mine: Vec<(&str, WaitStep)> = waits
            .iter()
            .filter(|(id, _, _)| id == order_id)
            .filter_map(
                |(_, step, park)| match serde_json::from_value(park.clone()).ok()? {
                    Park::Event(wait) => Some((step.as_str(), wait)),
                    Park::Delay(_) | Park::Child(_) => None,
                },
            )
            .collect();
        let tenant = sas_messages::ids::tenant_of(order_id);
        let named = mine.iter().map(|(step, wait)| (*step, wait));
        let Some((step, senders)) = wait::refusal(named, sender.principals, tenant) else {
            continue;
        };
        refused.push((
            order_id.clone(),
            format!(
                "event {} ({}) from {} refused: wait step {step} accepts it only from {}",
                event.name,
                event.event_id,
                sender.identity,
                senders.join(", ")
            ),
        ));
    }
    if refused.is_empty() {
        return Ok(Vec::new());
    }
    let (ids, reasons): (Vec<String>, Vec<String>) = refused.into_iter().unzip();
    // An order that does not exist yet has no history to write to.
    let (logged, logged_reasons): (Vec<&String>, Vec<&String>) = ids
        .iter()
        .zip(&reasons)
        .filter(|(id, _)| !early.contains(id))
        .unzip();
    sqlx::query(
        "INSERT INTO history (order_id, actor, event, detail)
         SELECT * FROM unnest($1::text[], array_fill($2::text, ARRAY[cardinality($1)]),
                              array_fill($3::text, ARRAY[cardinality($1)]), $4::text[])",
    )
    .bind(&logged)
    .bind(actor)
    .bind(HistoryEvent::EventRefused.as_str())
    .bind(&logged_reasons)
    .execute(&mut *tx)
    .await?;
    orders.retain(|order_id| !ids.contains(order_id));
    Ok(reasons)
}
