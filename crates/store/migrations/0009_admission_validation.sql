-- Admission control trusts only a limit the agent has used (as TCP's
-- congestion window validation, RFC 7661): a limit learnt while the remote
-- service was fast must not admit a burst after it slowed down.
--
-- peak_in_flight: the most attempts in flight since the window started; the
--   supervisors let the limit reach at most twice that (or initial_limit),
--   so an unused limit decays and a used one may double per window.
-- initial_limit: scheduler.admission_initial, the limit a quiet agent falls
--   back to.
ALTER TABLE admission
    ADD COLUMN peak_in_flight integer NOT NULL DEFAULT 0,
    ADD COLUMN initial_limit integer NOT NULL DEFAULT 1 CHECK (initial_limit >= 1);
UPDATE admission SET initial_limit = admit_limit, peak_in_flight = in_flight;
