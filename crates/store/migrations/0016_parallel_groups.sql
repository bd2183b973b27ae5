-- Parallel groups: consecutive steps of a workflow that share a group name
-- start together, and the order moves on when all of them completed
-- (steps.step_group, NULL for a step that runs alone).
ALTER TABLE steps ADD COLUMN step_group text;

-- A move copies the group with the rest of each step's definition.
CREATE OR REPLACE FUNCTION sas_replace_steps(p_order text, p_version integer, p_steps jsonb)
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    IF NOT EXISTS (SELECT FROM order_process WHERE order_id = p_order AND state = 'pending') THEN
        RAISE EXCEPTION 'sas_replace_steps: order % is not pending; only a waiting order moves', p_order;
    END IF;
    DELETE FROM steps WHERE order_id = p_order;
    INSERT INTO steps (order_id, position, name, agent, action, compensation, timeout_ms,
                       state, attempt, attempt_id, complete_by, idempotency_key, result,
                       last_error, maybe_applied, undo_generation, undo_refused, undo_result,
                       request, park, step_group)
    SELECT p_order, x.position, x.name, x.agent, x.action, x.compensation, x.timeout_ms,
           x.state::step_state, x.attempt, x.attempt_id, x.complete_by, x.idempotency_key,
           x.result, x.last_error, x.maybe_applied, x.undo_generation, x.undo_refused,
           x.undo_result, x.calls, x.park, x."group"
      FROM jsonb_to_recordset(p_steps) AS x(
           position integer, name text, agent text, action text, compensation text,
           timeout_ms integer, state text, attempt integer, attempt_id uuid,
           complete_by timestamptz, idempotency_key text, result jsonb, last_error text,
           maybe_applied boolean, undo_generation integer, undo_refused boolean,
           undo_result jsonb, calls jsonb, park jsonb, "group" text);
    UPDATE order_process SET workflow_version = p_version, updated_at = now()
     WHERE order_id = p_order;
END $$;
