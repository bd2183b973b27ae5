-- Limits that learn (issue 49): a step whose concurrency limit by key is
-- `adaptive` lets each key learn the limit its remote copes with, under
-- the declared one (see crate::machine::key_learning).
--
-- key_learnt: what each adaptive key has learnt. Written by the reply
-- transactions (rows locked in key order), read with the key's room (one
-- lookup by key); nothing scans it but the forgetting of keys quiet for
-- ten minutes, through its index on seen_at. A key without a row starts
-- again from one attempt.
CREATE TABLE key_learnt (
    key          text PRIMARY KEY,
    learnt_limit float8 NOT NULL CHECK (learnt_limit >= 1),
    base_ms      float8 NOT NULL,
    recent_ms    float8 NOT NULL,
    cut_at       timestamptz,
    seen_at      timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX key_learnt_seen_at ON key_learnt (seen_at);

-- As 0030's, and also forgets up to `batch` learnt limits of keys quiet
-- for ten minutes.
CREATE OR REPLACE FUNCTION sas_forget_quiet_keys(batch integer)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path = public, pg_temp AS $$
DECLARE
    pauses integer;
    rates integer;
    learnt integer;
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
    DELETE FROM key_learnt WHERE key IN (
        SELECT key FROM key_learnt WHERE seen_at < now() - interval '10 minutes'
         ORDER BY seen_at LIMIT batch
           FOR UPDATE SKIP LOCKED);
    GET DIAGNOSTICS learnt = ROW_COUNT;
    RETURN pauses + rates + learnt;
END $$;
