-- Wait steps: a step that calls no agent waits for an event or a time
-- (steps.park: what it waits for, NULL for a step that calls an agent).
ALTER TABLE steps ADD COLUMN park jsonb;

-- Each order's durable mailbox: every event that came for it, once per
-- event_id, used by the wait step that waits for its name (used_at), kept
-- when it arrived before the order reached that step. An event whose
-- order never came is dead-lettered at expires_at (expired_at) by the
-- supervisors. No foreign key: an event may come before its order.
CREATE TABLE order_events (
    order_id    text NOT NULL,
    event_id    text NOT NULL,
    name        text NOT NULL,
    data        jsonb NOT NULL DEFAULT '{}',
    received_at timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    used_at     timestamptz,
    used_by     text,
    expired_at  timestamptz,
    PRIMARY KEY (order_id, event_id)
);
-- The supervisors' look for events whose order never came.
CREATE INDEX order_events_waiting ON order_events (expires_at)
    WHERE used_at IS NULL AND expired_at IS NULL;

-- Retention takes an order's events with it, and expired events with the
-- dead letters they became.
CREATE OR REPLACE FUNCTION sas_retire_finished(older_than interval, batch integer)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    gone text[];
BEGIN
    IF older_than <= interval '0' OR batch < 1 THEN
        RAISE EXCEPTION 'sas_retire_finished: older_than must be positive and batch at least 1 (got %, %)',
            older_than, batch;
    END IF;
    SELECT array_agg(order_id) INTO gone FROM (
        SELECT op.order_id FROM order_process op
         WHERE op.state IN ('processed', 'compensated', 'error')
           AND op.updated_at < now() - older_than
           AND NOT EXISTS (SELECT FROM alerts a
                            WHERE a.order_id = op.order_id AND a.resolved_at IS NULL)
         ORDER BY op.updated_at
         LIMIT batch
           FOR UPDATE SKIP LOCKED) finished;
    IF gone IS NULL THEN
        RETURN 0;
    END IF;
    DELETE FROM history WHERE order_id = ANY (gone);
    DELETE FROM alerts WHERE order_id = ANY (gone);
    DELETE FROM order_events WHERE order_id = ANY (gone);
    -- order_process and steps go with the order (ON DELETE CASCADE).
    DELETE FROM orders WHERE order_id = ANY (gone);
    RETURN cardinality(gone);
END $$;

CREATE OR REPLACE FUNCTION sas_retire_dead_letters(older_than interval, batch integer)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    n integer;
BEGIN
    IF older_than <= interval '0' OR batch < 1 THEN
        RAISE EXCEPTION 'sas_retire_dead_letters: older_than must be positive and batch at least 1 (got %, %)',
            older_than, batch;
    END IF;
    -- Ids grow with time: the oldest come first in the primary key.
    DELETE FROM dead_letters WHERE id IN (
        SELECT id FROM dead_letters
         WHERE at < now() - older_than
         ORDER BY id
         LIMIT batch
           FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS n = ROW_COUNT;
    DELETE FROM order_events WHERE (order_id, event_id) IN (
        SELECT order_id, event_id FROM order_events
         WHERE expired_at < now() - older_than
         LIMIT batch
           FOR UPDATE SKIP LOCKED);
    RETURN n;
END $$;
