-- Tenants take turns in every agent's line (issue 47): one tenant's burst
-- no longer queues every other tenant's orders behind it.
--
-- An agent's line was ordered by admit_key alone: when the order started
-- waiting, less 10 s per priority level, less a day for an undo. A tenant
-- that sent ten thousand orders in a second stood, for the minutes they
-- took, before every order any other tenant sent after them.
--
-- Now, once the schedulers have registered the tenants of a tenancy file
-- (tenant_share below; no file, no rows, and lines stay as they were), an
-- order joining a line takes a turn by start-time fair queueing. A flow is
-- one tenant's orders of one priority in one agent's line, its undos apart
-- (an undo's turn, a day ahead, never counts for new work):
--
--   turn      = GREATEST(the line's head + head start (less a ten
--                        millionth of it: fresh flows keep their order),
--                        the flow's last turn + step)
--   step      = 1 ms / the tenant's weight
--   admit_key = turn - head start
--   head start: 10 s per priority level, and a day for an undo, as before
--
-- The line's head (admission.line_head) is the admit_key of the last order
-- the claims took from the line. A flow with no order in line starts there
-- (the next place, with no credit for its idle time and no debt for the
-- past); a flow with orders still in line goes on from its last one, step
-- by step. A tenant sending ten times what the agent serves thus spreads
-- its orders over the turns to come, and an order of a tenant sending a
-- tenth of it takes the next place: two busy tenants alternate (by
-- weight), a quiet one waits as if alone. Within a flow, orders keep the
-- order they came in; an urgent order of a quiet flow goes next, and one
-- of a busy urgent flow stands before its tenant's (and everyone's) less
-- urgent turns of the next 10,000 per level (below). The claims still read
-- one index in admit_key order; a tenant costs nothing until one of its
-- orders joins a line.
--
-- Turns are virtual time: a flow's orders are 1 ms apart (at weight 1)
-- whatever the agent's speed, so turns taken at different times compare
-- (a step measured from the agent, changing while a backlog waits, would
-- give the orders tagged before a change more turns than those after). A
-- priority level's head start, 10 s, is so worth 10,000 turns of a flow.

-- The weights of the tenants a scheduler's tenancy file names
-- (tenants.<t>.weight, 1 when left out). Written by every scheduler at
-- start; a tenant no file names any more keeps its row (the services may
-- not delete), which no order of its reads.
CREATE TABLE tenant_share (
    tenant text PRIMARY KEY,
    weight real NOT NULL DEFAULT 1 CHECK (weight > 0)
);

-- The head starts when the agent is registered (or now, for the agents
-- already here): turns are virtual time, and every flow of a line counts
-- from the same head, never from its own arrival (a burst's turns, 1 ms
-- apart, fall behind the clock: an order placed by the clock would stand
-- behind all of them).
ALTER TABLE admission ADD COLUMN line_head timestamptz NOT NULL DEFAULT now();

-- The tenant of a stored order id: what follows its last '@', else
-- 'default' (sas_messages::ids::tenant_of; a client's own id holds no '@').
CREATE FUNCTION sas_tenant_of(order_id text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$ SELECT coalesce(substring(order_id from '@([^@]*)$'), 'default') $$;

-- order_process.turn: the order's turn in the line it waits in (NULL when
-- it took none: lines without tenants). Each flow's last turn is found by
-- the index below, so joining a line reads one index entry.
ALTER TABLE order_process ADD COLUMN turn timestamptz;
CREATE INDEX order_process_turns
    ON order_process (waiting_for, sas_tenant_of(order_id), priority,
                      (state = 'compensating'), turn)
    WHERE waiting_for IS NOT NULL AND turn IS NOT NULL;

-- Gives an order joining a line its turn (see above). Every path that puts
-- an order in a line (intake, the write kernel, an operator's move) goes
-- through here, so none can forget. An order put back in line (an attempt
-- that never started: its admit_key says it started waiting before this
-- transaction) goes to the head, having waited its turn already.
CREATE FUNCTION sas_fair_turn() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    head_start interval;
    line record;
    flow_tenant text;
    last_turn timestamptz;
BEGIN
    NEW.turn := NULL;
    IF NOT EXISTS (SELECT FROM tenant_share) THEN
        RETURN NEW;
    END IF;
    head_start := NEW.priority * interval '10 seconds'
        + CASE WHEN NEW.state = 'compensating' THEN interval '1 day' ELSE interval '0' END;
    flow_tenant := sas_tenant_of(NEW.order_id);
    SELECT a.line_head AS head,
           interval '1 millisecond' / coalesce((SELECT s.weight FROM tenant_share s
                                                WHERE s.tenant = flow_tenant), 1) AS step
      INTO line
      FROM admission a
     WHERE a.agent = NEW.waiting_for;
    IF NOT FOUND THEN
        RETURN NEW;
    END IF;
    IF NEW.admit_key + head_start < now() THEN
        NEW.turn := line.head + head_start - head_start / 10000000;
    ELSE
        -- One index entry: the flow's last turn (ORDER BY ... LIMIT 1, not
        -- max(), which the planner may take as a scan of the whole flow).
        SELECT p.turn INTO last_turn
          FROM order_process p
         WHERE p.waiting_for = NEW.waiting_for
           AND sas_tenant_of(p.order_id) = flow_tenant
           AND p.priority = NEW.priority
           AND (p.state = 'compensating') = (NEW.state = 'compensating')
           AND p.turn IS NOT NULL
           AND p.order_id <> NEW.order_id
         ORDER BY p.turn DESC
         LIMIT 1;
        -- A flow with nothing in line goes next: at the head, less a ten
        -- millionth of its head start, so that fresh flows keep their
        -- order among themselves (an undo, 8.6 ms, before an urgent order,
        -- 9 µs, before one of priority 5, 5 µs).
        NEW.turn := GREATEST(line.head + head_start - head_start / 10000000,
                             last_turn + line.step);
    END IF;
    NEW.admit_key := NEW.turn - head_start;
    RETURN NEW;
END
$$;

CREATE TRIGGER order_process_fair_turn_insert
    BEFORE INSERT ON order_process
    FOR EACH ROW WHEN (NEW.waiting_for IS NOT NULL)
    EXECUTE FUNCTION sas_fair_turn();
CREATE TRIGGER order_process_fair_turn_update
    BEFORE UPDATE OF waiting_for, admit_key ON order_process
    FOR EACH ROW WHEN (NEW.waiting_for IS NOT NULL
                       AND (OLD.waiting_for IS DISTINCT FROM NEW.waiting_for
                            OR OLD.admit_key IS DISTINCT FROM NEW.admit_key))
    EXECUTE FUNCTION sas_fair_turn();
