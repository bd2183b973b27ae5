-- Retention: finished orders, with their steps, history and alerts, and old
-- dead letters are deleted after a configurable age, in small batches, by
-- the supervisors (retention.* settings; 0 keeps everything).
--
-- The services' role may not DELETE (history is append-only to it): these
-- two functions run as the schema owner (SECURITY DEFINER) and delete only
-- what the policy allows: orders finished (processed, compensated, or in
-- error with no open alert) and dead letters, older than the age given.
-- SKIP LOCKED lets several supervisors share the work, and never waits for
-- an order a scheduler or an operator holds.

-- Finished orders by when they finished (the last update of the record).
CREATE INDEX order_process_finished ON order_process (updated_at)
    WHERE state IN ('processed', 'compensated', 'error');
CREATE INDEX alerts_order ON alerts (order_id);

CREATE FUNCTION sas_retire_finished(older_than interval, batch integer)
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
    -- order_process and steps go with the order (ON DELETE CASCADE).
    DELETE FROM orders WHERE order_id = ANY (gone);
    RETURN cardinality(gone);
END $$;

CREATE FUNCTION sas_retire_dead_letters(older_than interval, batch integer)
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
    RETURN n;
END $$;
