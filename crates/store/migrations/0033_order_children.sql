-- Child orders (issue 48): a workflow's child step starts an order of
-- another workflow and waits for it to end. The child is an ordinary order
-- (its id derived from its parent's and the step's); this table links it
-- to its parent, so that the transaction ending the child tells the parent
-- (crates/store/src/machine/child.rs). Retention that retires either order
-- retires the link with it, and retires a child only once its parent is
-- retired (below): a parent undone later must still find its child.
CREATE TABLE order_children (
    child_order_id  text PRIMARY KEY REFERENCES orders (order_id) ON DELETE CASCADE,
    parent_order_id text NOT NULL REFERENCES orders (order_id) ON DELETE CASCADE,
    step            text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now()
);
-- A parent's children (one per start of a step: a step an operator
-- restarted starts another).
CREATE INDEX order_children_parent ON order_children (parent_order_id);

-- Retention as in 0022, but an order a parent's child step started stays
-- while its link does, that is until its parent is retired (the link goes
-- with the parent): a processed child whose parent (or any ancestor) is
-- still running may yet have to be undone as a whole.
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
    PERFORM sas_check_retention_age('sas_retire_finished', older_than);
    SELECT array_agg(order_id) INTO gone FROM (
        SELECT op.order_id FROM order_process op
         WHERE op.state IN ('processed', 'compensated', 'error')
           AND op.updated_at < now() - older_than
           AND NOT EXISTS (SELECT FROM alerts a
                            WHERE a.order_id = op.order_id AND a.resolved_at IS NULL)
           AND NOT EXISTS (SELECT FROM order_children c WHERE c.child_order_id = op.order_id)
         ORDER BY op.updated_at
         LIMIT batch
           FOR UPDATE SKIP LOCKED) finished;
    IF gone IS NULL THEN
        RETURN 0;
    END IF;
    DELETE FROM history WHERE order_id = ANY (gone);
    DELETE FROM alerts WHERE order_id = ANY (gone);
    DELETE FROM order_events WHERE order_id = ANY (gone);
    -- order_process, steps and the links to children go with the order
    -- (ON DELETE CASCADE).
    DELETE FROM orders WHERE order_id = ANY (gone);
    RETURN cardinality(gone);
END $$;
