-- Events addressed by a business key instead of an order id.
--
-- A wait step may read a correlation key from its order (a payment id, an
-- invoice number) when the order reaches it: order_waits records it, so
-- that an event naming the key finds the orders parked with it. A row
-- stays after the wait ends; lookups join the order's parked step, so only
-- orders still waiting at that step count. Rows go with their order.
CREATE TABLE order_waits (
    order_id        text NOT NULL REFERENCES orders (order_id) ON DELETE CASCADE,
    step            text NOT NULL,
    correlation_key text NOT NULL,
    PRIMARY KEY (order_id, step)
);
CREATE INDEX order_waits_key ON order_waits (correlation_key);

-- An event for a key no order waits with yet: kept once per key and event
-- id, given to the first order that parks with the key (adopted_by, at the
-- supervisors' next pass), or dead-lettered by the supervisors at
-- expires_at (expired_at).
CREATE TABLE keyed_events (
    correlation_key text NOT NULL,
    event_id        text NOT NULL,
    name            text NOT NULL,
    data            jsonb NOT NULL DEFAULT '{}',
    received_at     timestamptz NOT NULL DEFAULT now(),
    expires_at      timestamptz NOT NULL,
    adopted_by      text,
    adopted_at      timestamptz,
    expired_at      timestamptz,
    PRIMARY KEY (correlation_key, event_id)
);
CREATE INDEX keyed_events_open ON keyed_events (correlation_key)
    WHERE adopted_at IS NULL AND expired_at IS NULL;
CREATE INDEX keyed_events_expiring ON keyed_events (expires_at)
    WHERE adopted_at IS NULL AND expired_at IS NULL;

-- An event delivered by key keeps its key in the mailbox it went to, so
-- that the same event sent again once its orders are done is known as a
-- repeat, not kept again for an order that will never come.
ALTER TABLE order_events ADD COLUMN correlation_key text;
CREATE INDEX order_events_by_key ON order_events (correlation_key, event_id)
    WHERE correlation_key IS NOT NULL;

-- Retention takes events kept by key once given to an order or
-- dead-lettered, beside the dead letters (0014's function, restated).
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
    DELETE FROM keyed_events WHERE (correlation_key, event_id) IN (
        SELECT correlation_key, event_id FROM keyed_events
         WHERE COALESCE(adopted_at, expired_at) < now() - older_than
         LIMIT batch
           FOR UPDATE SKIP LOCKED);
    RETURN n;
END $$;
