-- Concurrency limits by key (issue 49): a call step may let at most a
-- limit of its attempts be in flight at once per key (a merchant's API),
-- across every scheduler (see crate::machine::concurrency).
--
-- steps.limit_key: the key line of the step's current attempt (or of the
-- attempt waiting for room). A key's attempts in flight are counted from
-- the steps themselves, through the partial index below, so whatever ends
-- an attempt gives its slot back and none can leak; a key with nothing in
-- flight and nobody waiting has no row anywhere.
ALTER TABLE steps ADD COLUMN limit_key text;
CREATE INDEX steps_limit_key_in_flight ON steps (limit_key)
    WHERE limit_key IS NOT NULL AND state IN ('running', 'compensating');

-- order_process.waiting_key: the key line an order waits in, its step's
-- key full; served by the schedulers' claims in admit_key order.
ALTER TABLE order_process ADD COLUMN waiting_key text;
CREATE INDEX order_process_waiting_key ON order_process (waiting_key, admit_key)
    WHERE waiting_key IS NOT NULL;
-- The claim of due orders leaves the key lines' orders to their lines: out
-- of its index, so that it does not read past them.
DROP INDEX order_process_claimable;
CREATE INDEX order_process_claimable ON order_process (not_before)
    WHERE (state = 'pending' OR (state = 'compensating' AND locked_by IS NULL))
      AND waiting_for IS NULL AND waiting_key IS NULL;

-- key_pauses: keys a remote asked to rest (a 429 with Retry-After for an
-- attempt in the key): no attempt in the key starts before `until`, and its
-- orders wait in its line meanwhile. The claims never scan this table (one
-- lookup by key); ended pauses are forgotten by sas_forget_quiet_keys.
CREATE TABLE key_pauses (
    key       text PRIMARY KEY,
    until     timestamptz NOT NULL,
    paused_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX key_pauses_until ON key_pauses (until);

-- Pauses each of `keys` until the matching `untils` (a longer pause already
-- there stands).
CREATE FUNCTION sas_pause_keys(keys text[], untils timestamptz[])
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    INSERT INTO key_pauses AS k (key, until)
    SELECT u.key, max(u.until) FROM UNNEST(keys, untils) AS u(key, until) GROUP BY u.key
    ON CONFLICT (key) DO UPDATE
       SET until = GREATEST(k.until, EXCLUDED.until), paused_at = now();
$$;

-- key_rates: each rate-limited key's theoretical arrival time (the generic
-- cell rate algorithm: each start moves it on by 1 / per_second; a start
-- may not put it more than `burst` starts ahead of now). A time in the
-- past counts as none. Written under the key's lock; nothing scans this
-- table (one lookup by key); keys quiet for a minute are forgotten by
-- sas_forget_quiet_keys.
CREATE TABLE key_rates (
    key text PRIMARY KEY,
    tat timestamptz NOT NULL
);
CREATE INDEX key_rates_tat ON key_rates (tat);

-- Sets each of `keys`' arrival time to the matching `tats` (never back).
CREATE FUNCTION sas_set_key_rates(keys text[], tats timestamptz[])
RETURNS void
LANGUAGE sql SECURITY DEFINER SET search_path = public, pg_temp AS $$
    INSERT INTO key_rates AS k (key, tat)
    SELECT u.key, max(u.tat) FROM UNNEST(keys, tats) AS u(key, tat) GROUP BY u.key
    ON CONFLICT (key) DO UPDATE SET tat = GREATEST(k.tat, EXCLUDED.tat);
$$;

-- Forgets up to `batch` ended pauses and rates of keys quiet for a minute
-- (the services' role may not DELETE), in a transaction of its own that
-- holds no other lock and skips rows a writer holds: it never waits for
-- the schedulers, nor they for it beyond its commit. The supervisors call
-- it. Returns how many rows it forgot.
CREATE FUNCTION sas_forget_quiet_keys(batch integer)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    pauses integer;
    rates integer;
BEGIN
    IF batch < 1 THEN
        RAISE EXCEPTION 'sas_forget_quiet_keys: batch must be at least 1 (got %)', batch;
    END IF;
    DELETE FROM key_pauses WHERE key IN (
        SELECT key FROM key_pauses WHERE until < now()
         ORDER BY until LIMIT batch
           FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS pauses = ROW_COUNT;
    DELETE FROM key_rates WHERE key IN (
        SELECT key FROM key_rates WHERE tat < now() - interval '1 minute'
         ORDER BY tat LIMIT batch
           FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS rates = ROW_COUNT;
    RETURN pauses + rates;
END $$;
