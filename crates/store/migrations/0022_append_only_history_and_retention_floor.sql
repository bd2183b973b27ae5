-- Least privilege inside the database (issue 47).
--
-- The services' role (sas_app, deploy/postgres/roles.sql) may UPDATE the
-- rows of every table the owner creates, history included, and may call
-- retention with any age: a compromised service could rewrite what
-- happened, or wipe every finished order with an age of a microsecond.
-- Neither needs a role name, so neither is a grant: a trigger makes
-- history append-only for every role but the schema owner (and
-- superusers), and retention refuses an age below a floor that only the
-- owner sets. Retention itself runs as the owner (SECURITY DEFINER), so it
-- still deletes what it retires.

-- A statement trigger for tables only the schema owner may change: raises
-- insufficient_privilege for anyone else, with the hint it is given.
CREATE FUNCTION sas_owner_only() RETURNS trigger
LANGUAGE plpgsql SET search_path = public, pg_temp AS $$
BEGIN
    IF NOT pg_has_role(current_user, (SELECT relowner FROM pg_class WHERE oid = TG_RELID), 'MEMBER') THEN
        RAISE EXCEPTION '% on % is refused to role %: only the schema owner may', TG_OP, TG_TABLE_NAME, current_user
            USING ERRCODE = 'insufficient_privilege', HINT = TG_ARGV[0];
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER history_append_only
    BEFORE UPDATE OR DELETE OR TRUNCATE ON history
    FOR EACH STATEMENT
    EXECUTE FUNCTION sas_owner_only('history is append-only: retention deletes finished orders'' history through sas_retire_finished');

-- The youngest age retention may delete for a role that is not the schema
-- owner: one row, changed by the owner only
-- (UPDATE retention_floor SET min_age = interval '10 minutes').
CREATE TABLE retention_floor (
    only_row boolean PRIMARY KEY DEFAULT true CHECK (only_row),
    min_age interval NOT NULL CHECK (min_age >= interval '0')
);
INSERT INTO retention_floor (min_age) VALUES (interval '1 hour');

CREATE TRIGGER retention_floor_owner_only
    BEFORE INSERT OR UPDATE OR DELETE OR TRUNCATE ON retention_floor
    FOR EACH STATEMENT
    EXECUTE FUNCTION sas_owner_only('the retention floor is the schema owner''s to set');

-- The floor for the role that logged in (session_user: a SECURITY DEFINER
-- function runs as the owner, but the caller stays the session's): none for
-- the owner and its members, retention_floor's for everyone else.
CREATE FUNCTION sas_retention_floor() RETURNS interval
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = public, pg_temp AS $$
    SELECT CASE
        WHEN pg_has_role(session_user, (SELECT relowner FROM pg_class WHERE oid = 'retention_floor'::regclass), 'MEMBER')
            THEN interval '0'
        ELSE (SELECT min_age FROM retention_floor)
    END
$$;

-- Raises when older_than is below the caller's floor.
CREATE FUNCTION sas_check_retention_age(what text, older_than interval) RETURNS void
LANGUAGE plpgsql STABLE SET search_path = public, pg_temp AS $$
DECLARE
    floor interval := sas_retention_floor();
BEGIN
    IF older_than < floor THEN
        RAISE EXCEPTION '%: an age of % is below the retention floor of % for role %', what, older_than, floor, session_user
            USING ERRCODE = 'insufficient_privilege',
                  HINT = 'raise the retention age, or have the schema owner lower the floor: UPDATE retention_floor SET min_age = ...';
    END IF;
END $$;

-- The two retention functions of migration 0014, with the floor checked first.
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
    PERFORM sas_check_retention_age('sas_retire_dead_letters', older_than);
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
