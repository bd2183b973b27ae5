-- No session holds the agents' admission rows across round trips a stopped
-- process can stretch (issue 45).
--
-- The supervisors' maintenance locked every due agent's admission row and
-- then its shards, folded them, read the window, wrote the new limit and
-- committed: five to seven round trips with the locks held. A supervisor
-- SIGSTOPped, paused or cut off between two of them held them for as long as
-- it stayed stopped, and every claim, intake statement and reply of those
-- agents waited behind it. The fold and the reconciliation now run as one
-- call each (the functions below), a statement the server runs to its end
-- whatever happens to the client; the new limit is written by a statement of
-- its own, guarded by the window it was computed for. Inside a function each
-- statement still takes a snapshot of its own, so "read after the lock" holds
-- as it did across statements.
--
-- The schedulers' claims and rare transitions still hold a row for a few
-- statements of a transaction: should one stop inside, the database ends
-- its session after idle_in_transaction_session_timeout, which the services
-- set on their sessions (database.idle_in_transaction_timeout_ms) and which
-- is set below for every other session of this database (an operator's psql
-- left in a transaction, a stopped tool).

-- Adds the shards of `agents` into their rows and zeroes them: the caller's
-- transaction holds the rows (locked before the shards, the order the hot
-- statements keep once every shard exists; missing shards, `shards` of
-- each, are made first, so that the lock below waits only for hot
-- statements' commits).
CREATE FUNCTION sas_admission_fold(agents text[], shards smallint) RETURNS void
LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO admission_shard (agent, shard)
    SELECT a.agent, s.shard
      FROM unnest(agents) AS a(agent)
     CROSS JOIN generate_series(0, shards - 1) AS s(shard)
     ORDER BY 1, 2
    ON CONFLICT (agent, shard) DO NOTHING;
    PERFORM 1 FROM admission_shard x WHERE x.agent = ANY(agents)
      ORDER BY x.agent, x.shard FOR UPDATE;
    -- Each statement reads what is committed when it starts: with the
    -- shards locked above, the sums added here are exactly what is zeroed
    -- below.
    UPDATE admission a
       SET in_flight = a.in_flight + s.in_flight,
           peak_in_flight = GREATEST(a.peak_in_flight, s.peak_in_flight),
           settled = a.settled + s.settled, in_flight_ms = a.in_flight_ms + s.in_flight_ms,
           queued_ms = a.queued_ms + s.queued_ms, slot_wait_ms = a.slot_wait_ms + s.slot_wait_ms
      FROM (SELECT x.agent, sum(x.in_flight)::int4 AS in_flight,
                   max(x.peak_in_flight) AS peak_in_flight, sum(x.settled)::int8 AS settled,
                   sum(x.in_flight_ms)::int8 AS in_flight_ms, sum(x.queued_ms)::int8 AS queued_ms,
                   sum(x.slot_wait_ms)::int8 AS slot_wait_ms
              FROM admission_shard x WHERE x.agent = ANY(agents) GROUP BY x.agent) s
     WHERE a.agent = s.agent;
    UPDATE admission_shard x
       SET in_flight = 0, peak_in_flight = 0, settled = 0, in_flight_ms = 0, queued_ms = 0,
           slot_wait_ms = 0
     WHERE x.agent = ANY(agents);
END
$$;

-- The agents whose measuring window has run `window_ms`, each locked (one
-- another supervisor holds is skipped), its shards folded, and its window as
-- the control law reads it, with the start it was measured from: the new
-- limit is written by `UPDATE ... WHERE window_started = <that start>`.
CREATE FUNCTION sas_admission_fold_due(window_ms float8, shards smallint)
RETURNS TABLE (agent text, admit_limit int4, initial_limit int4, ceiling int4, waiting int4,
               peak_in_flight int4, settled int8, seconds float8, deadline_ms int4,
               in_flight_ms int8, queued_ms int8, slot_wait_ms int8,
               window_started timestamptz)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    due text[];
BEGIN
    -- The rows are held while the shards are locked: never wait long for a
    -- shard (a hot statement commits in milliseconds; a session stopped
    -- holding one is ended by its idle timeout), or claims would wait for
    -- the rows meanwhile. The next window tries again.
    PERFORM set_config('lock_timeout', '200ms', true);
    SELECT array_agg(d.agent ORDER BY d.agent) INTO due
      FROM (SELECT a.agent FROM admission a
             WHERE now() - a.window_started >= make_interval(secs => window_ms / 1000)
             ORDER BY a.agent
               FOR UPDATE SKIP LOCKED) d;
    IF due IS NULL THEN
        RETURN;
    END IF;
    PERFORM sas_admission_fold(due, shards);
    RETURN QUERY
    SELECT a.agent, a.admit_limit, a.initial_limit, a.ceiling, a.waiting, a.peak_in_flight,
           a.settled - a.window_settled,
           GREATEST(EXTRACT(EPOCH FROM now() - a.window_started), 0)::float8,
           a.deadline_ms, a.in_flight_ms - a.window_in_flight_ms,
           a.queued_ms - a.window_queued_ms, a.slot_wait_ms - a.window_slot_wait_ms,
           a.window_started
      FROM admission a
     WHERE a.agent = ANY(due)
     ORDER BY a.agent;
END
$$;

-- Every agent's counters as its orders say they are: an attempt in flight
-- for each order held with a deadline whose current step (running forward,
-- or compensating) is the agent's, a place in line for each order waiting
-- for it. The same count as the state machine's `slots_held`, which the
-- property test holds it to.
CREATE VIEW admission_recount AS
SELECT agent, sum(in_flight)::int4 AS in_flight, sum(waiting)::int4 AS waiting
  FROM (SELECT s.agent, 1 AS in_flight, 0 AS waiting
          FROM order_process op
          JOIN steps s ON s.order_id = op.order_id
           AND s.state = CASE op.state WHEN 'processing' THEN 'running'::step_state
                                       ELSE 'compensating'::step_state END
         WHERE op.state IN ('processing', 'compensating')
           AND op.locked_by IS NOT NULL AND op.complete_by IS NOT NULL
        UNION ALL
        SELECT waiting_for, 0, 1 FROM order_process WHERE waiting_for IS NOT NULL) c
 GROUP BY agent;

-- Corrects counters that drifted from the orders (a row edited by hand, a
-- bug), and returns the corrections. Safe beside live traffic: the rows and
-- then their shards are locked first (waiting at most 200 ms, never a
-- deadlock: the caller tries again later), the shards folded into the rows,
-- and every transition moves one or the other in the same statement as its
-- orders, so the count (a statement of its own, after the locks) sees
-- exactly the transitions whose deltas are applied.
CREATE FUNCTION sas_admission_reconcile(shards smallint)
RETURNS TABLE (agent text, was_in_flight int4, was_waiting int4, in_flight int4, waiting int4)
LANGUAGE plpgsql AS $$
#variable_conflict use_column
DECLARE
    everyone text[];
BEGIN
    PERFORM set_config('lock_timeout', '200ms', true);
    SELECT array_agg(l.agent ORDER BY l.agent) INTO everyone
      FROM (SELECT a.agent FROM admission a ORDER BY a.agent FOR UPDATE) l;
    IF everyone IS NULL THEN
        RETURN;
    END IF;
    PERFORM sas_admission_fold(everyone, shards);
    RETURN QUERY
    WITH counted AS (
        SELECT a.agent, a.in_flight AS was_in_flight, a.waiting AS was_waiting,
               coalesce(r.in_flight, 0) AS in_flight, coalesce(r.waiting, 0) AS waiting
          FROM admission a
          LEFT JOIN admission_recount r ON r.agent = a.agent)
    UPDATE admission a
       SET in_flight = c.in_flight, waiting = c.waiting
      FROM counted c
     WHERE a.agent = c.agent
       AND (c.was_in_flight, c.was_waiting) IS DISTINCT FROM (c.in_flight, c.waiting)
    RETURNING a.agent, c.was_in_flight, c.was_waiting, c.in_flight, c.waiting;
END
$$;

-- Every other session of this database (an operator's psql, a tool) that
-- stops inside a transaction is ended after 15 s, its locks with it. The
-- services set their own value on their sessions. Changing a database's
-- settings takes its owner: a deployment whose migrations run as another
-- role is told so, and should set it itself.
DO $$
BEGIN
    EXECUTE format('ALTER DATABASE %I SET idle_in_transaction_session_timeout = %L',
                   current_database(), '15s');
EXCEPTION WHEN insufficient_privilege THEN
    RAISE WARNING 'cannot set idle_in_transaction_session_timeout on database %: only its owner can; set it (15s) as the owner, or a session stopped inside a transaction holds its locks for as long as it stays stopped', current_database();
END
$$;
