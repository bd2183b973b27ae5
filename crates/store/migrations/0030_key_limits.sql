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
-- orders wait in its line meanwhile. A row outlives its pause until the
-- next pause of any key deletes it (sas_pause_keys): the services' role
-- may not DELETE, and the claims never scan this table (one lookup by key).
CREATE TABLE key_pauses (
    key       text PRIMARY KEY,
    until     timestamptz NOT NULL,
    paused_at timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX key_pauses_until ON key_pauses (until);

-- Pauses each of `keys` until the matching `untils` (a longer pause already
-- there stands), and deletes up to 100 pauses that have ended.
CREATE FUNCTION sas_pause_keys(keys text[], untils timestamptz[])
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    DELETE FROM key_pauses WHERE key IN (
        SELECT key FROM key_pauses WHERE until < now()
         ORDER BY until LIMIT 100
           FOR UPDATE SKIP LOCKED);
    INSERT INTO key_pauses AS k (key, until)
    SELECT u.key, max(u.until) FROM UNNEST(keys, untils) AS u(key, until) GROUP BY u.key
    ON CONFLICT (key) DO UPDATE
       SET until = GREATEST(k.until, EXCLUDED.until), paused_at = now();
END $$;

-- key_rates: each rate-limited key's theoretical arrival time (the generic
-- cell rate algorithm: each start moves it on by 1 / per_second; a start
-- may not put it more than `burst` starts ahead of now). A key quiet for a
-- while has a time in the past, which counts as none; such rows are
-- deleted by the next writes (sas_set_key_rates), the services' role may
-- not DELETE, and nothing scans this table (one lookup by key).
CREATE TABLE key_rates (
    key text PRIMARY KEY,
    tat timestamptz NOT NULL
);
CREATE INDEX key_rates_tat ON key_rates (tat);

-- Sets each of `keys`' arrival time to the matching `tats` (the caller
-- holds each key's lock), and deletes up to 100 keys quiet for a minute.
CREATE FUNCTION sas_set_key_rates(keys text[], tats timestamptz[])
RETURNS void
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
BEGIN
    DELETE FROM key_rates WHERE key IN (
        SELECT key FROM key_rates WHERE tat < now() - interval '1 minute'
         ORDER BY tat LIMIT 100
           FOR UPDATE SKIP LOCKED);
    INSERT INTO key_rates AS k (key, tat)
    SELECT u.key, max(u.tat) FROM UNNEST(keys, tats) AS u(key, tat) GROUP BY u.key
    ON CONFLICT (key) DO UPDATE SET tat = EXCLUDED.tat;
END $$;
