-- Admission counters in shards: the hot paths no longer wait for each other.
--
-- Every intake batch and every batch of replies moved an agent's admission
-- row, so each waited for the one before it to commit, fsync included: a
-- third of those statements' time was waiting for that row lock (issue 26,
-- docs/performance.md). The intake and fast reply statements now add their
-- deltas to one of the agent's shards, picked at random per statement, so
-- two statements rarely meet on a row. The shards of the agents already
-- here are made below, schedulers make a new agent's when they register it,
-- the supervisors' folds make any missing (a row made by hand), and a
-- statement that picks one still missing makes it.
--
-- admission_shard: per agent and shard, what the hot paths added since the
--   last fold: in_flight (may be negative: a reply releases a slot another
--   shard took), the most attempts in flight a statement saw
--   (peak_in_flight), and settled, in_flight_ms, queued_ms, slot_wait_ms
--   as on the admission row.
-- admission_now: the counters as they are, the row plus its shards; what
--   every reader uses. The rare paths (claims, the write kernel's general
--   path, operators' moves) still write the row itself.
-- The supervisors fold the shards into the row when they adapt the limit
-- (once a window) and when they reconcile it, locking the row and then the
-- shards. A hot statement locks shards and never a row, except that making
-- a missing shard checks its row (the foreign key): only then can it and a
-- fold wait for each other, and Postgres fails one of them (its batch is
-- retried).
CREATE TABLE admission_shard (
    agent          text NOT NULL REFERENCES admission (agent) ON DELETE CASCADE,
    shard          smallint NOT NULL CHECK (shard >= 0),
    in_flight      integer NOT NULL DEFAULT 0,
    peak_in_flight integer NOT NULL DEFAULT 0,
    settled        bigint NOT NULL DEFAULT 0,
    in_flight_ms   bigint NOT NULL DEFAULT 0,
    queued_ms      bigint NOT NULL DEFAULT 0,
    slot_wait_ms   bigint NOT NULL DEFAULT 0,
    PRIMARY KEY (agent, shard)
);
INSERT INTO admission_shard (agent, shard)
SELECT a.agent, s.shard FROM admission a CROSS JOIN generate_series(0, 7) AS s(shard)
 ORDER BY a.agent, s.shard;

CREATE VIEW admission_now AS
SELECT a.agent,
       a.in_flight + COALESCE(s.in_flight, 0) AS in_flight,
       a.waiting, a.admit_limit, a.ceiling, a.deadline_ms, a.initial_limit,
       GREATEST(a.peak_in_flight, COALESCE(s.peak_in_flight, 0)) AS peak_in_flight,
       a.settled + COALESCE(s.settled, 0) AS settled,
       a.in_flight_ms + COALESCE(s.in_flight_ms, 0) AS in_flight_ms,
       a.queued_ms + COALESCE(s.queued_ms, 0) AS queued_ms,
       a.slot_wait_ms + COALESCE(s.slot_wait_ms, 0) AS slot_wait_ms,
       a.window_settled, a.window_in_flight_ms, a.window_queued_ms, a.window_slot_wait_ms,
       a.window_started
  FROM admission a
  LEFT JOIN LATERAL (
      SELECT sum(x.in_flight)::int4 AS in_flight, max(x.peak_in_flight) AS peak_in_flight,
             sum(x.settled)::int8 AS settled, sum(x.in_flight_ms)::int8 AS in_flight_ms,
             sum(x.queued_ms)::int8 AS queued_ms, sum(x.slot_wait_ms)::int8 AS slot_wait_ms
        FROM admission_shard x
       WHERE x.agent = a.agent) s ON true;
