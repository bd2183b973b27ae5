-- Urgent work passes a limit full of less urgent work (issue 26).
--
-- admit_cap: the most attempts an agent may have in flight when an order
--   from its line starts past a full limit because fewer than the limit are
--   in flight at its level (its priority; undos above every priority) or
--   above: agents serve what they hold by that rule, so nothing less urgent
--   stands before it. The supervisors set it with the limit, every window:
--   the deadline target (completions/s x step deadline x
--   admission_deadline_share), or what the calls and hops held plus the
--   queue the law aims at if more, under the ceiling
--   (crates/store/src/machine/admission.rs, adapted_cap). 0 until then:
--   nothing passes a limit nobody has measured.
ALTER TABLE admission ADD COLUMN admit_cap integer NOT NULL DEFAULT 0;

CREATE OR REPLACE VIEW admission_now AS
SELECT a.agent,
       a.in_flight + COALESCE(s.in_flight, 0) AS in_flight,
       a.waiting, a.admit_limit, a.ceiling, a.deadline_ms, a.initial_limit,
       GREATEST(a.peak_in_flight, COALESCE(s.peak_in_flight, 0)) AS peak_in_flight,
       a.settled + COALESCE(s.settled, 0) AS settled,
       a.in_flight_ms + COALESCE(s.in_flight_ms, 0) AS in_flight_ms,
       a.queued_ms + COALESCE(s.queued_ms, 0) AS queued_ms,
       a.slot_wait_ms + COALESCE(s.slot_wait_ms, 0) AS slot_wait_ms,
       a.window_settled, a.window_in_flight_ms, a.window_queued_ms, a.window_slot_wait_ms,
       a.window_started, a.admit_cap
  FROM admission a
  LEFT JOIN LATERAL (
      SELECT sum(x.in_flight)::int4 AS in_flight, max(x.peak_in_flight) AS peak_in_flight,
             sum(x.settled)::int8 AS settled, sum(x.in_flight_ms)::int8 AS in_flight_ms,
             sum(x.queued_ms)::int8 AS queued_ms, sum(x.slot_wait_ms)::int8 AS slot_wait_ms
        FROM admission_shard x
       WHERE x.agent = a.agent) s ON true;
