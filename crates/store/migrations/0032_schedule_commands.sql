-- Schedule commands (issue 49): a change to a schedule sent over the
-- broker by a client that may not write here (the HTTP gateway, on its
-- clients' behalf). The scheduler that takes one applies it and records
-- its outcome in one transaction, once per (tenant, command_id): a
-- command delivered again (the broker redelivers, the client retries with
-- the same id) changes nothing more and is answered with the first
-- outcome, which the sender reads here.
CREATE TABLE schedule_commands (
    tenant      text NOT NULL,
    command_id  text NOT NULL,
    name        text NOT NULL,
    action      text NOT NULL CHECK (action IN ('create', 'pause', 'resume', 'trigger', 'delete')),
    -- done; not_found (no such schedule); exists (create: the name is
    -- taken); refused (the definition or the sender's rights; see detail).
    outcome     text NOT NULL CHECK (outcome IN ('done', 'not_found', 'exists', 'refused')),
    detail      text,
    -- create: the definition it carried, so that the same key resent with
    -- another definition is told apart.
    definition  jsonb,
    -- Who sent it (the identity the gateway vouched for).
    sent_by     text NOT NULL,
    recorded_by text NOT NULL,
    recorded_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant, command_id)
);
-- Retention takes the oldest first.
CREATE INDEX schedule_commands_recorded ON schedule_commands (recorded_at);

-- Retention of schedule runs also retires the commands recorded as long ago.
CREATE OR REPLACE FUNCTION sas_retire_schedule_runs(older_than interval, batch integer)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    runs integer;
    schedules integer;
    commands integer;
BEGIN
    IF older_than <= interval '0' OR batch < 1 THEN
        RAISE EXCEPTION 'sas_retire_schedule_runs: older_than must be positive and batch at least 1 (got %, %)',
            older_than, batch;
    END IF;
    PERFORM sas_check_retention_age('sas_retire_schedule_runs', older_than);
    DELETE FROM schedule_runs WHERE (tenant, name, occurrence, by_hand) IN (
        SELECT tenant, name, occurrence, by_hand FROM schedule_runs
         WHERE recorded_at < now() - older_than
           AND NOT (outcome = 'started' AND fired_at IS NULL)
         ORDER BY recorded_at
         LIMIT batch
           FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS runs = ROW_COUNT;
    DELETE FROM schedules WHERE (tenant, name) IN (
        SELECT tenant, name FROM schedules
         WHERE deleted_at < now() - older_than
         LIMIT batch
           FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS schedules = ROW_COUNT;
    DELETE FROM schedule_commands WHERE (tenant, command_id) IN (
        SELECT tenant, command_id FROM schedule_commands
         WHERE recorded_at < now() - older_than
         ORDER BY recorded_at
         LIMIT batch
           FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS commands = ROW_COUNT;
    RETURN runs + schedules + commands;
END $$;
