//! The hot path of replies: steps of orders running forward succeeded.
//!
//! That is nearly every reply, so a batch of them gets one statement instead
//! of a transaction each: lock the orders, complete their steps (guarded by
//! attempt id and state), start each order's next step or finish it, and
//! record the history. A reply whose case is unusual (its order is not
//! processing, its attempt is not current, the steps are not in the plain
//! forward shape) is left out of the statement's effects, and the caller
//! takes the general path for it, which handles every case.

use std::collections::HashMap;

use chrono::{DateTime, Utc};
use sas_messages::{StatusEvent, StepKind, StepReply};
use sqlx::Row;
use uuid::Uuid;

use super::Writes;
use crate::machine::dispatch::{payload, payload_budget};
use crate::machine::{status, storable};
use crate::model::{Dispatch, Progress};
use crate::step_columns::NEXT;
use crate::StoreError;

/// What the fast path did for one reply.
pub(crate) struct Completed {
    /// Statuses and the next request to publish.
    pub progress: Progress,
    /// The completed step.
    pub step: String,
    /// Seconds from the attempt's dispatch to this reply.
    pub latency_secs: f64,
}

impl Writes<'_> {
    /// Applies successful replies to forward steps, at most one per order,
    /// in one statement. Returns what was done, by order id; a reply whose
    /// order is missing from the map changed nothing.
    pub(crate) async fn complete_steps_fast(
        self,
        replies: &[(&StepReply, &serde_json::Value)],
        actor: &str,
    ) -> Result<HashMap<String, Completed>, StoreError> {
        let order_ids: Vec<&str> = replies.iter().map(|(r, _)| r.order_id.as_str()).collect();
        let attempt_ids: Vec<Uuid> = replies
            .iter()
            .map(|(r, _)| r.attempt_id.as_uuid())
            .collect();
        // Stored as the state machine stores any answer (no U+0000), so one
        // odd answer cannot fail the whole batch.
        let results: Vec<serde_json::Value> =
            replies.iter().map(|(_, result)| storable(result)).collect();
        let next_attempt_ids: Vec<Uuid> = replies.iter().map(|_| Uuid::now_v7()).collect();
        let reported = |ms: Option<u64>| ms.map_or(0, |ms| i64::try_from(ms).unwrap_or(i64::MAX));
        let queued_ms: Vec<i64> = replies.iter().map(|(r, _)| reported(r.queued_ms)).collect();
        let slot_wait_ms: Vec<i64> = replies
            .iter()
            .map(|(r, _)| reported(r.slot_wait_ms))
            .collect();
        let details: Vec<String> = replies
            .iter()
            .map(|(r, _)| format!("by {}", r.agent_id))
            .collect();
        // The guards in `done` keep this to the plain forward shape: every
        // earlier step completed, no later one completed. The orders are
        // locked in order_id order, so two batches cannot deadlock. `p`
        // compares `state::text` so that the planner finds the orders by
        // primary key: compared as an enum, stale statistics made it read
        // the partial index of open orders (`order_process_open`), tens of
        // thousands of dead entries between vacuums, for every batch.
        let rows = sqlx::query(
            "WITH r AS MATERIALIZED (
                 SELECT * FROM UNNEST($1::text[], $2::uuid[], $3::jsonb[], $4::uuid[], $5::text[],
                                      $7::int8[], $8::int8[])
                        AS r(order_id, attempt_id, result, next_attempt_id, detail, queued_ms,
                             slot_wait_ms)),
             p AS MATERIALIZED (
                 SELECT op.order_id, op.reply_to, op.reply_correlation_id, op.trace_id, op.priority FROM order_process op
                  WHERE op.order_id = ANY($1) AND op.state::text = 'processing'
                  ORDER BY op.order_id
                    FOR UPDATE),
             -- Admission: a next step starts here only if its agent has room
                 -- for every reply of the batch that wants it and nobody waits
                 -- in its line; the others take the general path, which puts
                 -- the order in the line.
             wanted AS MATERIALIZED (
                 SELECT n.agent, count(*) AS n
                   FROM r JOIN steps c ON c.order_id = r.order_id AND c.attempt_id = r.attempt_id
                   JOIN steps n ON n.order_id = c.order_id AND n.position = c.position + 1
                  GROUP BY n.agent),
             full_agents AS MATERIALIZED (
                 SELECT a.agent FROM admission_now a JOIN wanted w ON w.agent = a.agent
                  WHERE NOT (a.waiting = 0 AND a.in_flight + w.n <= a.admit_limit)),
             done AS (
                 UPDATE steps d
                    SET state = 'completed', result = r.result, last_error = NULL, updated_at = now()
                   FROM r JOIN p ON p.order_id = r.order_id
                  WHERE d.order_id = r.order_id AND d.attempt_id = r.attempt_id AND d.state = 'running'
                    AND NOT EXISTS (SELECT 1 FROM steps e WHERE e.order_id = d.order_id AND e.position < d.position AND e.state <> 'completed')
                    AND NOT EXISTS (SELECT 1 FROM steps e WHERE e.order_id = d.order_id AND e.position > d.position AND e.state = 'completed')
                    -- A step whose key learns its limit from its answers
                    -- (crate::machine::key_learning): the general path
                    -- learns from this one.
                    AND d.request->'concurrency'->'adaptive' IS DISTINCT FROM 'true'::jsonb
                    -- The last step of a child order: the general path
                    -- ends it and tells its parent (crate::machine::child).
                    AND (EXISTS (SELECT 1 FROM steps e WHERE e.order_id = d.order_id AND e.position = d.position + 1)
                         OR NOT EXISTS (SELECT 1 FROM order_children c WHERE c.child_order_id = d.order_id))
                    AND NOT EXISTS (SELECT 1 FROM steps e JOIN full_agents f ON f.agent = e.agent
                                     WHERE e.order_id = d.order_id AND e.position = d.position + 1)
                    -- A wait step next parks the order, and a parallel group
                    -- starts several steps: the general path decides them.
                    -- (A group's member that answers beside one in flight
                    -- fails the guards above: an earlier step not completed,
                    -- or a later one completed or next in its group.) So
                    -- does a next step whose template may find no value.
                    AND NOT EXISTS (SELECT 1 FROM steps e
                                     WHERE e.order_id = d.order_id AND e.position = d.position + 1
                                       AND (e.park IS NOT NULL OR e.step_group IS NOT NULL
                                            OR e.request IS NOT NULL))
                    -- A next request whose default payload ({order, results})
                    -- may be over the message limit takes the general path,
                    -- which refuses it with the reason. Measured on jsonb's
                    -- text, which is never shorter than compact JSON.
                    AND (NOT EXISTS (SELECT 1 FROM steps e
                                      WHERE e.order_id = d.order_id AND e.position = d.position + 1)
                         OR (SELECT octet_length(o.body::text) FROM orders o WHERE o.order_id = d.order_id)
                            + octet_length(r.result::text)
                            + COALESCE((SELECT sum(octet_length(e.result::text)) FROM steps e
                                         WHERE e.order_id = d.order_id AND e.position <> d.position
                                           AND e.result IS NOT NULL), 0)
                            <= $10)
              RETURNING d.order_id, d.position, d.name, d.agent, d.updated_at, r.attempt_id, r.result,
                        r.next_attempt_id, r.detail, r.queued_ms, r.slot_wait_ms,
                        EXTRACT(EPOCH FROM now() - (d.complete_by - make_interval(secs => d.timeout_ms::float8 / 1000)))::float8 AS latency),
             next AS (
                 UPDATE steps n
                    SET state = 'running', attempt = n.attempt + 1, attempt_id = done.next_attempt_id,
                        complete_by = now() + make_interval(secs => n.timeout_ms::float8 / 1000),
                        updated_at = now()
                   FROM done
                  WHERE n.order_id = done.order_id AND n.position = done.position + 1
              RETURNING n.order_id, n.position, n.name, n.agent, n.action, n.compensation,
                        n.timeout_ms, n.state, n.attempt, n.attempt_id, n.complete_by,
                        n.idempotency_key, n.result, n.last_error, n.maybe_applied,
                        n.undo_generation, n.undo_refused, n.undo_result, n.request, n.park, n.step_group,
                        n.limit_key),
             process AS (
                 UPDATE order_process op
                    SET state = CASE WHEN next.order_id IS NULL THEN 'processed' ELSE 'processing' END::process_state,
                        complete_by = next.complete_by,
                        locked_by = CASE WHEN next.order_id IS NULL THEN NULL ELSE $6 END,
                        updated_at = now()
                   FROM done LEFT JOIN next ON next.order_id = done.order_id
                  WHERE op.order_id = done.order_id
              RETURNING op.order_id, op.updated_at),
             -- An agent's counters move in one of its shards, not in its
             -- row, so batches rarely wait for each other's commit
             -- (crate::admission::SHARDS). The shard is picked at random by
             -- an uncorrelated subquery, so once per statement; one not
             -- there yet is made. Agents without admission control have no
             -- row and are left out. The peak is what this statement saw in
             -- flight, plus its own delta.
             q AS (
                 INSERT INTO admission_shard AS a (agent, shard, in_flight, peak_in_flight, settled,
                                                   in_flight_ms, queued_ms, slot_wait_ms)
                 SELECT x.agent, (SELECT floor(random() * $9::int2)::int2), x.delta,
                        n.in_flight + x.delta, x.released, x.in_flight_ms, x.queued_ms, x.slot_wait_ms
                   FROM (SELECT agent, sum(delta)::int4 AS delta, sum(released)::int4 AS released,
                                sum(in_flight_ms)::int8 AS in_flight_ms,
                                sum(LEAST(queued_ms, in_flight_ms))::int8 AS queued_ms,
                                sum(LEAST(slot_wait_ms, in_flight_ms))::int8 AS slot_wait_ms
                           FROM (SELECT agent, -1 AS delta, 1 AS released,
                                        GREATEST(round(latency * 1000), 0)::int8 AS in_flight_ms,
                                        queued_ms, slot_wait_ms
                                   FROM done
                                 UNION ALL
                                 SELECT agent, 1, 0, 0, 0, 0 FROM next) u
                          GROUP BY agent) x
                   JOIN admission_now n ON n.agent = x.agent
                  ORDER BY x.agent
                 ON CONFLICT (agent, shard) DO UPDATE
                    SET in_flight = a.in_flight + EXCLUDED.in_flight,
                        peak_in_flight = GREATEST(a.peak_in_flight, EXCLUDED.peak_in_flight),
                        settled = a.settled + EXCLUDED.settled,
                        in_flight_ms = a.in_flight_ms + EXCLUDED.in_flight_ms,
                        queued_ms = a.queued_ms + EXCLUDED.queued_ms,
                        slot_wait_ms = a.slot_wait_ms + EXCLUDED.slot_wait_ms),
             h AS (
                 INSERT INTO history (order_id, actor, event, step, attempt_id, detail)
                 SELECT order_id, $6, 'step_completed', name, attempt_id, detail FROM done
                 UNION ALL
                 SELECT order_id, $6, 'dispatched', name, attempt_id,
                        'attempt ' || attempt || ': ' || agent || '.' || action FROM next
                 UNION ALL
                 SELECT order_id, $6, 'processed', NULL, NULL, NULL FROM done
                  WHERE NOT EXISTS (SELECT 1 FROM next WHERE next.order_id = done.order_id))
             SELECT done.order_id, done.name AS step, done.updated_at AS at, done.latency,
                    p.reply_to, p.reply_correlation_id, p.trace_id, p.priority, process.updated_at AS finished_at,
                    next.position AS next_position, next.name AS next_step, next.agent AS next_agent,
                    next.action AS next_action, next.compensation AS next_compensation,
                    next.timeout_ms AS next_timeout_ms, next.state AS next_state,
                    next.attempt AS next_attempt, next.attempt_id AS next_attempt_id,
                    next.complete_by AS next_complete_by, next.idempotency_key AS next_key,
                    next.result AS next_result, next.last_error AS next_last_error,
                    next.maybe_applied AS next_maybe_applied,
                    next.undo_generation AS next_undo_generation,
                    next.undo_refused AS next_undo_refused, next.undo_result AS next_undo_result,
                    next.request AS next_request, next.park AS next_park, next.step_group AS next_group,
                    next.limit_key AS next_limit_key,
                    CASE WHEN next.order_id IS NOT NULL THEN
                        (SELECT body FROM orders o WHERE o.order_id = done.order_id) END AS body,
                    CASE WHEN next.order_id IS NOT NULL THEN
                        COALESCE((SELECT jsonb_object_agg(s.name, s.result) FROM steps s
                                   WHERE s.order_id = done.order_id AND s.result IS NOT NULL), '{}'::jsonb)
                          || jsonb_build_object(done.name, done.result) END AS results
               FROM done
               JOIN p ON p.order_id = done.order_id
               JOIN process ON process.order_id = done.order_id
               LEFT JOIN next ON next.order_id = done.order_id",
        )
        .bind(&order_ids)
        .bind(&attempt_ids)
        .bind(&results)
        .bind(&next_attempt_ids)
        .bind(&details)
        .bind(actor)
        .bind(&queued_ms)
        .bind(&slot_wait_ms)
        .bind(crate::admission::SHARDS)
        .bind(i64::try_from(payload_budget(self.store.max_request_bytes())).unwrap_or(i64::MAX))
        .fetch_all(self.pool())
        .await?;
        let limits = (self.start_margin(), self.store.max_request_bytes());
        rows.iter()
            .map(|row| {
                let order_id: String = row.try_get("order_id")?;
                let completed = completed_from_row(&order_id, row, limits)?;
                Ok((order_id, completed))
            })
            .collect()
    }
}

/// What one row of the fast statement says was done to `order_id`, with
/// the start margin and the largest request of the requests it builds.
fn completed_from_row(
    order_id: &str,
    row: &sqlx::postgres::PgRow,
    (start_margin, max_request_bytes): (std::time::Duration, usize),
) -> Result<Completed, StoreError> {
    let step: String = row.try_get("step")?;
    let at: DateTime<Utc> = row.try_get("at")?;
    let mut progress = Progress {
        reply_to: row.try_get("reply_to")?,
        correlation_id: row.try_get("reply_correlation_id")?,
        trace_id: row.try_get("trace_id")?,
        ..Progress::default()
    };
    progress.statuses.push(status(
        order_id,
        StatusEvent::StepCompleted,
        Some(&step),
        None,
        at,
    ));
    match row.try_get::<Option<String>, _>("next_step")? {
        Some(_) => {
            let next = NEXT.read(row)?;
            let body: serde_json::Value = row.try_get("body")?;
            let results: serde_json::Value = row.try_get("results")?;
            let results = results.as_object().into_iter().flatten();
            let payload = payload(&body, results.map(|(name, result)| (name.as_str(), result)));
            let priority: i16 = row.try_get("priority")?;
            // The statement let through only next steps without a template
            // whose payload fits: a request that cannot be built here is a
            // bug, and its step is left to its deadline.
            let dispatch = Dispatch::for_step(
                order_id,
                &next,
                StepKind::Action,
                payload,
                start_margin,
                priority,
                max_request_bytes,
            )
            .map_err(|unbuilt| {
                StoreError::Invariant(format!(
                    "order {order_id}: the fast path started step {} whose request it cannot build: {unbuilt}",
                    next.name
                ))
            })?;
            progress.dispatches.push(dispatch);
        }
        None => {
            let finished_at: DateTime<Utc> = row.try_get("finished_at")?;
            progress.statuses.push(status(
                order_id,
                StatusEvent::Processed,
                None,
                None,
                finished_at,
            ));
        }
    }
    Ok(Completed {
        progress,
        step,
        latency_secs: row.try_get("latency")?,
    })
}
