//! The scheduler's transitions: claiming ready orders, and applying an
//! agent's reply.
//!
//! Each runs in a transaction that locks the order's `order_process` row,
//! reads its snapshot, asks the state machine ([`crate::machine`]) what to
//! do, and writes the decision; the caller publishes the returned
//! [`Progress`] only after the commit. Successes of forward steps, nearly
//! every reply, take the batched statement of [`super::fast`] instead.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use sas_messages::{StepOutcome, StepReply};

use sqlx::AssertSqlSafe;

use super::apply::{transition, Decided, Slots};
use super::key_room::{read_key_line, KeyRead};
use super::Writes;
use crate::admission::IN_FLIGHT;
use crate::machine::admission::{Head, Levels, UNDO_LEVEL};
use crate::machine::concurrency::KeyLimits;
use crate::machine::{Event, Verdict};
use crate::model::Progress;
use crate::StepCalls;
use crate::StoreError;

/// The most heads of a full line one claim reads to let pass: the claims
/// that follow, as replies free slots, take the next.
const PASSING_AT_ONCE: i64 = 32;

/// An agent with orders in its line, as a claim serves it.
#[derive(sqlx::FromRow)]
struct Line {
    agent: String,
    in_flight: i32,
    admit_limit: i32,
    admit_cap: i32,
}

/// The heads of `line`, whose limit is full, that may pass it, at most
/// `left` ([`Levels`]): each at a level (its order's priority, or an
/// undo's) with fewer than the limit in flight at that level or above, or,
/// the first of a tenant with nothing in flight at the agent in a line
/// that takes turns, above it ([`Head::fresh`]); under the cap. Reads the
/// heads first, and locks only those that pass (each still in the line: a
/// head that left it meanwhile, or that another transaction holds, is not
/// started).
async fn urgent_heads(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    line: &Line,
    left: i64,
) -> Result<Vec<String>, StoreError> {
    let in_flight: Vec<(i16, String, i64)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT (CASE op.state WHEN 'compensating' THEN {UNDO_LEVEL} ELSE op.priority END)::int2,
                sas_tenant_of(op.order_id), count(*)::int8
         {IN_FLIGHT} AND s.agent = $1
          GROUP BY 1, 2"
    )))
    .bind(&line.agent)
    .fetch_all(&mut **tx)
    .await?;
    let mut levels = Levels::new(in_flight.iter().map(|(level, _, count)| (*level, *count)));
    let mut busy: HashSet<String> = in_flight.into_iter().map(|(_, tenant, _)| tenant).collect();
    let room = i64::from(line.admit_cap - line.in_flight).min(left);
    let most = room.min(PASSING_AT_ONCE);
    if most <= 0 {
        return Ok(Vec::new());
    }
    let heads: Vec<(String, i16, String, bool)> = sqlx::query_as(AssertSqlSafe(format!(
        "SELECT order_id,
                (CASE state WHEN 'compensating' THEN {UNDO_LEVEL} ELSE priority END)::int2,
                sas_tenant_of(order_id), turn IS NOT NULL
           FROM order_process
          WHERE waiting_for = $1 AND not_before <= now()
          ORDER BY admit_key
          LIMIT $2"
    )))
    .bind(&line.agent)
    .bind(most)
    .fetch_all(&mut **tx)
    .await?;
    // Only a tenant's first head may be fresh: the next has that one ahead
    // of it.
    let candidates: Vec<Head> = heads
        .iter()
        .map(|(_, level, tenant, took_turn)| {
            let first = busy.insert(tenant.clone());
            Head {
                level: *level,
                fresh: *took_turn && first,
            }
        })
        .collect();
    let passing: Vec<&str> = levels
        .admit_heads(line.admit_limit, room, &candidates)
        .into_iter()
        .map(|index| heads[index].0.as_str())
        .collect();
    if passing.is_empty() {
        return Ok(Vec::new());
    }
    Ok(sqlx::query_scalar(AssertSqlSafe(format!(
        "WITH heads AS (
             SELECT order_id, admit_key, turn FROM order_process
              WHERE order_id = ANY($1) AND waiting_for = $2
              ORDER BY admit_key
                FOR UPDATE SKIP LOCKED),
         {MOVE_HEAD}
         SELECT order_id FROM heads ORDER BY admit_key"
    )))
    .bind(&passing)
    .bind(&line.agent)
    .fetch_all(&mut **tx)
    .await?)
}

/// A CTE, after `heads` (the orders a claim takes from agent `$2`'s line:
/// `order_id`, `admit_key`, `turn`), that moves the line's head
/// (`admission.line_head`) to the last of them that took a turn: where the
/// next order of a flow with none in line is placed (migration 0027,
/// tenants taking turns). Lines without tenants take no turns, and it
/// writes nothing.
const MOVE_HEAD: &str = "moved AS (
             UPDATE admission a SET line_head = h.head
               FROM (SELECT max(admit_key) AS head FROM heads WHERE turn IS NOT NULL) h
              WHERE a.agent = $2 AND h.head > a.line_head)";

/// How many of a key line's orders may start now: what its limit in
/// flight leaves, and its rate, whichever is less.
fn key_line_room(limits: KeyLimits<'_>, read: &KeyRead, now: chrono::DateTime<chrono::Utc>) -> i64 {
    let in_flight = read
        .in_flight_limit(limits)
        .map_or(i64::MAX, |limit| i64::from(limit) - read.in_flight);
    let rate = limits
        .rate
        .map_or(i64::MAX, |rate| rate.room(read.tat, now));
    in_flight.min(rate)
}

/// The most key lines one claim serves: the claims that follow, as
/// replies free room, take the next.
const KEY_LINES_AT_ONCE: i64 = 64;

/// The key lines orders wait in, at most `$1`, each once: first those
/// after `$2` (where the last claim stopped), then from the start. Read
/// by skipping through the index of waiting orders, one probe a line
/// however long it is.
const WAITING_KEY_LINES: &str = "
    WITH RECURSIVE after AS (
         (SELECT waiting_key AS line FROM order_process
           WHERE waiting_key > $2 ORDER BY waiting_key LIMIT 1)
         UNION ALL
         SELECT (SELECT waiting_key FROM order_process
                  WHERE waiting_key > after.line ORDER BY waiting_key LIMIT 1)
           FROM after WHERE after.line IS NOT NULL),
     upto AS (
         (SELECT waiting_key AS line FROM order_process
           WHERE waiting_key IS NOT NULL AND waiting_key <= $2 ORDER BY waiting_key LIMIT 1)
         UNION ALL
         SELECT (SELECT waiting_key FROM order_process
                  WHERE waiting_key > upto.line AND waiting_key <= $2
                  ORDER BY waiting_key LIMIT 1)
           FROM upto WHERE upto.line IS NOT NULL)
    SELECT line FROM (SELECT line FROM after UNION ALL SELECT line FROM upto) l
     WHERE line IS NOT NULL
     LIMIT $1";

/// What became of an agent's reply.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplyOutcome {
    /// The reply answered an attempt that is no longer current: nothing changed.
    Stale {
        /// Why it was not applied, for logs.
        reason: String,
    },
    /// The reply was applied; publish what it asks.
    Applied {
        /// What to publish.
        progress: Progress,
        /// The step answered.
        step: String,
        /// Seconds from the attempt's dispatch to this reply (database clock).
        latency_secs: f64,
    },
}

/// An order a claim started (or put in its agent's line).
#[derive(Debug, Clone, PartialEq)]
pub struct Claimed {
    /// What to publish.
    pub progress: Progress,
    /// When it was taken from an agent's line: the agent and how long the
    /// order waited in it (database clock).
    pub waited: Option<(String, std::time::Duration)>,
}

impl Writes<'_> {
    /// Claims up to `limit` orders that are ready to run for `actor`, and
    /// starts each one's next attempt, in one transaction: first the heads of
    /// the agents' lines, as many as each agent has free slots (in
    /// `admit_key` order: undo first, then by priority and waiting time), or
    /// of a full line those that pass it by their level ([`Levels`]), then
    /// orders back from the supervisor's backoff and compensations
    /// nobody holds, which take a slot if one is free and otherwise join
    /// their agent's line.
    ///
    /// `FOR UPDATE SKIP LOCKED` makes the claim atomic: two schedulers never
    /// claim the same order. The agent's admission row is locked while its
    /// line is served, so two schedulers do not hand out the same free slots
    /// (the row and its shards are read after the lock, in a statement of
    /// their own).
    ///
    /// # Errors
    /// When the database fails; nothing is claimed then.
    pub async fn claim_ready(self, actor: &str, limit: i64) -> Result<Vec<Claimed>, StoreError> {
        let mut claimed = self.claim_heads(actor, limit).await?;
        let left = limit - claimed.len() as i64;
        if left > 0 {
            claimed.extend(self.claim_key_heads(actor, left).await?);
        }
        let left = limit - claimed.len() as i64;
        if left > 0 {
            claimed.extend(self.claim_due(actor, left).await?);
        }
        Ok(claimed)
    }

    /// The heads of the agents' lines, as many as each has free slots, in
    /// one transaction that holds each served agent's admission row; of a
    /// line whose limit is full, the urgent heads that may pass it
    /// ([`Levels`]).
    async fn claim_heads(self, actor: &str, limit: i64) -> Result<Vec<Claimed>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let lined: Vec<String> = sqlx::query_scalar(
            "SELECT agent FROM admission WHERE waiting > 0 ORDER BY agent FOR UPDATE",
        )
        .fetch_all(&mut *tx)
        .await?;
        // Read in a statement of its own, after the locks: one that waited
        // for a supervisor's fold would otherwise see the folded row beside
        // the shards as they were before it, counting them twice.
        let lines: Vec<Line> = sqlx::query_as(
            "SELECT agent, in_flight, admit_limit, admit_cap FROM admission_now
              WHERE agent = ANY($1) AND waiting > 0
                AND (in_flight < admit_limit OR in_flight < admit_cap)
              ORDER BY agent",
        )
        .bind(&lined)
        .fetch_all(&mut *tx)
        .await?;
        let mut ready: Vec<String> = Vec::new();
        for line in lines {
            let left = limit - ready.len() as i64;
            if left <= 0 {
                break;
            }
            let heads = if line.in_flight < line.admit_limit {
                let room = i64::from(line.admit_limit - line.in_flight);
                sqlx::query_scalar(AssertSqlSafe(format!(
                    "WITH heads AS (
                         SELECT order_id, admit_key, turn FROM order_process
                          WHERE waiting_for = $2 AND not_before <= now()
                          ORDER BY admit_key
                          LIMIT $1
                            FOR UPDATE SKIP LOCKED),
                     {MOVE_HEAD}
                     SELECT order_id FROM heads ORDER BY admit_key"
                )))
                .bind(room.min(left))
                .bind(&line.agent)
                .fetch_all(&mut *tx)
                .await?
            } else {
                urgent_heads(&mut tx, &line, left).await?
            };
            ready.extend(heads);
        }
        // Each head was counted against its agent's room, or passed its
        // full limit by its level, above.
        self.start_claimed(tx, &ready, actor, true).await
    }

    /// The heads of the key lines (see [`crate::machine::concurrency`]), as
    /// many as each key has room for: only keys with orders in line are
    /// looked at (at most [`KEY_LINES_AT_ONCE`] a claim, going on from
    /// where the last claim stopped, so none is left behind), each locked
    /// while it is served, so
    /// that two schedulers do not hand out the same room. Each head is
    /// then decided as any claimed order: its agent may have no slot, and
    /// the order joins the agent's line.
    async fn claim_key_heads(self, actor: &str, limit: i64) -> Result<Vec<Claimed>, StoreError> {
        let cursor = self
            .store
            .key_cursor
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        // Read before any transaction: with no key line (no workflow
        // limits a key, or none is full), a claim costs one index probe.
        let lines: Vec<String> = sqlx::query_scalar(WAITING_KEY_LINES)
            .bind(KEY_LINES_AT_ONCE)
            .bind(&cursor)
            .fetch_all(self.pool())
            .await?;
        // When a rate-limited line left waiting may start next.
        let mut next_start: Option<chrono::Duration> = None;
        let mut soonest = |due: chrono::Duration| {
            next_start = Some(next_start.map_or(due, |known| known.min(due)));
        };
        if lines.is_empty() {
            self.store.set_next_key_start(None);
            return Ok(Vec::new());
        }
        let mut tx = self.pool().begin().await?;
        let mut ready: Vec<String> = Vec::new();
        for line in lines {
            let left = limit - ready.len() as i64;
            if left <= 0 {
                break;
            }
            line.clone_into(
                &mut self
                    .store
                    .key_cursor
                    .lock()
                    .unwrap_or_else(|e| e.into_inner()),
            );
            let Some(read) = read_key_line(&mut tx, &line, self.store.grace()).await? else {
                continue;
            };
            // The limits of the line's head: a key is one remote's, and
            // the steps naming it declare its limits.
            let head: Option<(
                Option<sqlx::types::Json<StepCalls>>,
                chrono::DateTime<chrono::Utc>,
            )> = sqlx::query_as(
                "SELECT s.request, now()
                       FROM order_process p
                       JOIN steps s ON s.order_id = p.order_id AND s.limit_key = p.waiting_key
                      WHERE p.waiting_key = $1
                      ORDER BY p.admit_key
                      LIMIT 1",
            )
            .bind(&line)
            .fetch_optional(&mut *tx)
            .await?;
            let Some((Some(calls), now)) = head else {
                continue;
            };
            let Some((limits, _, _)) = calls.0.key_limits() else {
                continue;
            };
            let room = key_line_room(limits, &read, now);
            let heads: Vec<String> = if room > 0 {
                sqlx::query_scalar(
                    "SELECT order_id FROM order_process
                      WHERE waiting_key = $1 AND not_before <= now()
                      ORDER BY admit_key
                      LIMIT $2
                        FOR UPDATE SKIP LOCKED",
                )
                .bind(&line)
                .bind(room.min(left))
                .fetch_all(&mut *tx)
                .await?
            } else {
                Vec::new()
            };
            if let Some(rate) = limits.rate {
                // The rate's next room, after what this claim starts, when
                // the rate is what holds the line back (not a full
                // concurrency limit, heads not due or held elsewhere).
                let mut tat = read.tat;
                for _ in &heads {
                    tat = Some(rate.after_start(tat, now));
                }
                if let Some(due) = tat.map(|tat| rate.next_room_at(tat) - now) {
                    if due > chrono::Duration::zero() {
                        soonest(due);
                    }
                }
            }
            ready.extend(heads);
        }
        self.store
            .set_next_key_start(next_start.and_then(|due| due.to_std().ok()));
        self.start_claimed(tx, &ready, actor, false).await
    }

    /// Orders back from the supervisor's backoff and compensations nobody
    /// holds, oldest first: each takes a slot if one is free, or joins its
    /// agent's line.
    async fn claim_due(self, actor: &str, limit: i64) -> Result<Vec<Claimed>, StoreError> {
        let mut tx = self.pool().begin().await?;
        let due: Vec<String> = sqlx::query_scalar(
            "SELECT order_id FROM order_process
              WHERE (state = 'pending' OR (state = 'compensating' AND locked_by IS NULL))
                AND waiting_for IS NULL AND waiting_key IS NULL AND not_before <= now()
              ORDER BY not_before
              LIMIT $1
                FOR UPDATE SKIP LOCKED",
        )
        .bind(limit)
        .fetch_all(&mut *tx)
        .await?;
        self.start_claimed(tx, &due, actor, false).await
    }

    /// Claims the orders `ids`, locked by `tx`, for `actor`, and commits.
    /// `admitted`: each already has a slot of its agent; otherwise each is
    /// checked for one, and joins its agent's line without.
    async fn start_claimed(
        self,
        mut tx: sqlx::Transaction<'_, sqlx::Postgres>,
        ids: &[String],
        actor: &str,
        admitted: bool,
    ) -> Result<Vec<Claimed>, StoreError> {
        if ids.is_empty() {
            // Ended explicitly, not by dropping it: no connection goes back
            // to the pool with a rollback still to send.
            tx.commit().await?;
            return Ok(Vec::new());
        }
        let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
        let slots = if admitted { Slots::Held } else { Slots::Check };
        let decided =
            transition(&mut tx, self.store, &ids, actor, slots, |_| Event::Claimed).await?;
        let claimed = decided
            .into_iter()
            .filter(|d| d.decision.verdict == Verdict::Applied)
            .map(
                |Decided {
                     snapshot,
                     decision,
                     now,
                 }| Claimed {
                    progress: decision.progress,
                    waited: snapshot.process.waiting_for.map(|agent| {
                        let since = snapshot.process.not_before;
                        (agent, (now - since).to_std().unwrap_or_default())
                    }),
                },
            )
            .collect();
        tx.commit().await?;
        Ok(claimed)
    }

    /// Applies each agent's reply if it answers the step's current attempt
    /// of an order that is still waiting for it; otherwise changes nothing
    /// and says why (fencing by attempt id). Returns one outcome per reply,
    /// in order; an error means the reply should be redelivered.
    ///
    /// Successes of forward steps, the bulk of the traffic, are applied
    /// together in one statement (at most one reply per order in it); every
    /// other reply, and any the statement left alone, takes the general
    /// path: one per order together in one more transaction, and a repeat
    /// of an order already in it [`Writes::record_reply`], a transaction of
    /// its own.
    pub async fn record_replies(
        self,
        replies: &[StepReply],
        actor: &str,
    ) -> Vec<Result<ReplyOutcome, StoreError>> {
        let mut orders = HashSet::new();
        let in_fast: Vec<bool> = replies
            .iter()
            .map(|reply| {
                matches!(reply.outcome, StepOutcome::Succeeded { .. })
                    && orders.insert(reply.order_id.as_str())
            })
            .collect();
        let fast: Vec<(&StepReply, &serde_json::Value)> = replies
            .iter()
            .zip(&in_fast)
            .filter_map(|(reply, &fast)| match &reply.outcome {
                StepOutcome::Succeeded { result } if fast => Some((reply, result)),
                _ => None,
            })
            .collect();
        let mut applied = if fast.is_empty() {
            HashMap::new()
        } else {
            match self.complete_steps_fast(&fast, actor).await {
                Ok(applied) => applied,
                // The database is away: every caller gets the error and
                // retries on its own, as intake does, rather than each
                // trying the general path against it at once.
                Err(error) if error.is_transient() => {
                    let shared = Arc::new(error);
                    return replies
                        .iter()
                        .map(|_| Err(StoreError::Shared(shared.clone())))
                        .collect();
                }
                // Nothing changed: every reply takes the general path.
                Err(error) => {
                    tracing::warn!(error = %error, "the batched reply statement failed; replies take the general path");
                    HashMap::new()
                }
            }
        };
        let mut outcomes: Vec<Option<Result<ReplyOutcome, StoreError>>> = replies
            .iter()
            .zip(in_fast)
            .map(|(reply, fast)| {
                let done = fast
                    .then(|| applied.remove(reply.order_id.as_str()))
                    .flatten()?;
                Some(Ok(ReplyOutcome::Applied {
                    progress: done.progress,
                    step: done.step,
                    latency_secs: done.latency_secs,
                }))
            })
            .collect();
        // The replies the statement left alone take the general path: the
        // first of each order all in one transaction, so that replies
        // joining an agent's line do not each wait for that agent's row
        // behind the others' commits; a repeat of an order already in it
        // afterwards, in a transaction of its own.
        let mut seen = HashSet::new();
        let (together, repeats): (Vec<usize>, Vec<usize>) = (0..replies.len())
            .filter(|&i| outcomes[i].is_none())
            .partition(|&i| seen.insert(replies[i].order_id.as_str()));
        let batch: Vec<&StepReply> = together.iter().map(|&i| &replies[i]).collect();
        match self.record_replies_together(&batch, actor).await {
            Ok(results) => {
                for (&i, result) in together.iter().zip(results) {
                    outcomes[i] = Some(result);
                }
            }
            // As above: every caller retries on its own.
            Err(error) if error.is_transient() => {
                let shared = Arc::new(error);
                for &i in together.iter().chain(&repeats) {
                    outcomes[i] = Some(Err(StoreError::Shared(shared.clone())));
                }
            }
            // Nothing changed: each reply alone, so that one the database
            // refuses fails alone.
            Err(error) => {
                tracing::warn!(error = %error, replies = together.len(), "the general path's transaction of a reply batch failed; applying its replies one by one");
                let alone = together
                    .iter()
                    .map(|&i| self.record_reply(&replies[i], actor));
                for (&i, result) in together
                    .iter()
                    .zip(futures_util::future::join_all(alone).await)
                {
                    outcomes[i] = Some(result);
                }
            }
        }
        let later = repeats
            .iter()
            .filter(|&&i| outcomes[i].is_none())
            .map(|&i| async move { (i, self.record_reply(&replies[i], actor).await) });
        for (i, result) in futures_util::future::join_all(later).await {
            outcomes[i] = Some(result);
        }
        outcomes
            .into_iter()
            .map(|outcome| {
                outcome.unwrap_or_else(|| {
                    Err(StoreError::Invariant(
                        "a reply of the batch was given no outcome".into(),
                    ))
                })
            })
            .collect()
    }

    /// The general path for replies of distinct orders, in one transaction
    /// of the write kernel: each order decided on its own snapshot, the
    /// agents' slots counted across the batch ([`transition`]), all written
    /// together. Returns one outcome per reply, in order.
    ///
    /// # Errors
    /// When the transaction fails; nothing changed then.
    async fn record_replies_together(
        self,
        replies: &[&StepReply],
        actor: &str,
    ) -> Result<Vec<Result<ReplyOutcome, StoreError>>, StoreError> {
        if replies.is_empty() {
            return Ok(Vec::new());
        }
        let by_order: HashMap<&str, &StepReply> = replies
            .iter()
            .map(|reply| (reply.order_id.as_str(), *reply))
            .collect();
        let ids: Vec<&str> = by_order.keys().copied().collect();
        let mut tx = self.pool().begin().await?;
        let decided = transition(&mut tx, self.store, &ids, actor, Slots::Check, |snapshot| {
            Event::Reply(by_order[snapshot.order_id.as_str()])
        })
        .await?;
        tx.commit().await?;
        let mut decided: HashMap<String, Decided> = decided
            .into_iter()
            .map(|d| (d.snapshot.order_id.to_string(), d))
            .collect();
        Ok(replies
            .iter()
            .map(|reply| reply_outcome(reply, decided.remove(reply.order_id.as_str())))
            .collect())
    }

    /// Applies one reply in a transaction of its own, whatever its case:
    /// the general path of [`Writes::record_replies`].
    ///
    /// # Errors
    /// When the database fails; the reply should then be redelivered.
    pub async fn record_reply(
        self,
        reply: &StepReply,
        actor: &str,
    ) -> Result<ReplyOutcome, StoreError> {
        let event = Event::Reply(reply);
        let decided = self.transition_one(&reply.order_id, &event, actor).await?;
        reply_outcome(reply, decided)
    }
}

/// What the write kernel's decision on `reply` (`None`: its order does not
/// exist) means for the agent that sent it.
fn reply_outcome(reply: &StepReply, decided: Option<Decided>) -> Result<ReplyOutcome, StoreError> {
    let Some(Decided {
        snapshot,
        decision,
        now,
    }) = decided
    else {
        return Ok(ReplyOutcome::Stale {
            reason: "no such order".into(),
        });
    };
    match decision.verdict {
        Verdict::Applied => {
            let step = snapshot.step_of_attempt(reply.attempt_id);
            let started = step.and_then(|step| step.started_at()).unwrap_or(now);
            Ok(ReplyOutcome::Applied {
                progress: decision.progress,
                step: step.map_or_else(|| reply.step.clone(), |step| step.name.clone()),
                latency_secs: (now - started).num_microseconds().unwrap_or(0) as f64 / 1e6,
            })
        }
        Verdict::Stale(reason) | Verdict::Unchanged(reason) => Ok(ReplyOutcome::Stale { reason }),
        other => Err(StoreError::Invariant(format!(
            "a reply was decided as {other:?}"
        ))),
    }
}
