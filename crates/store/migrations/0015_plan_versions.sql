-- Moving parked orders to another version of their workflow.
--
-- Every scheduler registers the plans of the workflows it runs (name,
-- version, steps), so that an operator's move can read the target plan
-- from the store, whichever process makes it.
CREATE TABLE workflow_plans (
    name          text NOT NULL,
    version       integer NOT NULL,
    steps         jsonb NOT NULL,
    registered_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (name, version)
);

-- A move replaces a pending order's steps with those of the new plan (the
-- state machine's plan_move decides them). The services' role may not
-- DELETE: this function, run as the schema owner, does it only for an
-- order that is pending (nothing in flight), with its history written by
-- the caller in the same transaction.
CREATE FUNCTION sas_replace_steps(p_order text, p_version integer, p_steps jsonb)
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
                       request, park)
    SELECT p_order, x.position, x.name, x.agent, x.action, x.compensation, x.timeout_ms,
           x.state::step_state, x.attempt, x.attempt_id, x.complete_by, x.idempotency_key,
           x.result, x.last_error, x.maybe_applied, x.undo_generation, x.undo_refused,
           x.undo_result, x.calls, x.park
      FROM jsonb_to_recordset(p_steps) AS x(
           position integer, name text, agent text, action text, compensation text,
           timeout_ms integer, state text, attempt integer, attempt_id uuid,
           complete_by timestamptz, idempotency_key text, result jsonb, last_error text,
           maybe_applied boolean, undo_generation integer, undo_refused boolean,
           undo_result jsonb, calls jsonb, park jsonb);
    UPDATE order_process SET workflow_version = p_version, updated_at = now()
     WHERE order_id = p_order;
END $$;
