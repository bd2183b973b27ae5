-- Durable schedules (issue 49): a workflow run on a cron expression in a
-- time zone, fired by whichever scheduler gets to it first.
--
-- A scheduler's tick locks the schedules that are due (FOR UPDATE SKIP
-- LOCKED), decides each due occurrence (start, skip, missed; see
-- sas_store::schedules::plan), records every decision in schedule_runs,
-- moves next_run on, and commits; then it stores each started run's order
-- (its body is in its run row) through intake and marks the run fired. An
-- order's id is derived from the schedule and the occurrence, so a run
-- fired twice (a scheduler that died or froze before marking it, whose
-- run another fired) is stored once. Runs recorded as started and not
-- fired within seconds are fired by the next tick of any scheduler.
--
-- Only due schedules are read: next_run is indexed, and the partial index
-- holds the few with a run asked by hand or an occurrence buffered behind
-- a running one, so idle schedules cost nothing per tick.
CREATE TABLE schedules (
    tenant         text NOT NULL,
    name           text NOT NULL,
    workflow       text NOT NULL,
    cron           text NOT NULL,
    time_zone      text NOT NULL,
    -- The order each run submits, without its order_id.
    order_template jsonb NOT NULL,
    overlap        text NOT NULL CHECK (overlap IN ('skip', 'buffer_one', 'allow')),
    -- Occurrences older than this when decided are recorded as missed.
    catch_up_ms    bigint NOT NULL CHECK (catch_up_ms >= 0),
    paused         boolean NOT NULL DEFAULT false,
    -- The first occurrence not decided yet; NULL when none is to come.
    next_run       timestamptz,
    -- buffer_one: the occurrence waiting for the last run to end.
    buffered       timestamptz,
    -- A run asked by hand (trigger), not decided yet.
    trigger_at     timestamptz,
    -- The stored id of the order of the last run started.
    last_order_id  text,
    created_by     text NOT NULL,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_by     text NOT NULL,
    updated_at     timestamptz NOT NULL DEFAULT now(),
    -- The services may not DELETE: a deleted schedule is marked, and a
    -- new one of the same name replaces it.
    deleted_at     timestamptz,
    PRIMARY KEY (tenant, name)
);

CREATE INDEX schedules_due ON schedules (next_run)
    WHERE deleted_at IS NULL AND NOT paused;
CREATE INDEX schedules_asked ON schedules (tenant, name)
    WHERE deleted_at IS NULL AND (trigger_at IS NOT NULL OR buffered IS NOT NULL);

-- Every occurrence decided, once (the key): started (with the order it
-- becomes), skipped (with why), or a stretch of missed ones (from
-- occurrence through missed_through, missed_count of them).
CREATE TABLE schedule_runs (
    tenant         text NOT NULL,
    name           text NOT NULL,
    occurrence     timestamptz NOT NULL,
    by_hand        boolean NOT NULL DEFAULT false,
    outcome        text NOT NULL CHECK (outcome IN ('started', 'skipped', 'missed')),
    reason         text,
    -- started: the order's stored id and the body intake stores.
    order_id       text,
    order_body     jsonb,
    missed_through timestamptz,
    missed_count   integer,
    recorded_by    text NOT NULL,
    recorded_at    timestamptz NOT NULL DEFAULT now(),
    -- started: when intake stored (or refused) its order.
    fired_at       timestamptz,
    -- started: why intake refused its order, if it did.
    refusal        text,
    PRIMARY KEY (tenant, name, occurrence, by_hand),
    CHECK ((outcome = 'started') = (order_id IS NOT NULL AND order_body IS NOT NULL))
);

CREATE INDEX schedule_runs_unfired ON schedule_runs (recorded_at)
    WHERE outcome = 'started' AND fired_at IS NULL;
-- Retention takes the oldest first.
CREATE INDEX schedule_runs_recorded ON schedule_runs (recorded_at);
-- Whether the last run's order is still to be stored (a tick's overlap
-- check): found among the unfired runs only, however many runs are kept.
CREATE INDEX schedule_runs_unfired_order ON schedule_runs (order_id)
    WHERE outcome = 'started' AND fired_at IS NULL;

-- Retention (called with retention.finished_secs, the age at which the
-- runs' orders go too): decided runs recorded longer ago than that, but
-- never a started run not fired yet, and schedules deleted that long ago.
-- The services may not DELETE, so it is a function of the owner's, with
-- the retention floor checked first as for the others.
CREATE FUNCTION sas_retire_schedule_runs(older_than interval, batch integer)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    runs integer;
    schedules integer;
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
    RETURN runs + schedules;
END $$;
