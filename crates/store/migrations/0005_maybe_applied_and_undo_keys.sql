-- What compensation needs to know about a step beyond its state.
--
-- maybe_applied: some attempt of the action may have reached the remote
--   service without a known outcome (a timeout, a reset after sending, a 5xx,
--   a 409 "in progress", a missed deadline). It never goes back to false: a
--   later refusal of the same key does not prove the first call did nothing,
--   so compensation undoes a failed step that may have been applied.
-- undo_generation: the compensation's idempotency key is <key>:undo for
--   generation 0 and <key>:undo:r<n> after an operator resumed a
--   compensation the remote refused for good (the old undo key is decided).
-- undo_refused: the current undo key was refused for good.
-- undo_result: the undo's answer, kept beside the action's in result.
ALTER TABLE steps
    ADD COLUMN maybe_applied boolean NOT NULL DEFAULT false,
    ADD COLUMN undo_generation integer NOT NULL DEFAULT 0,
    ADD COLUMN undo_refused boolean NOT NULL DEFAULT false,
    ADD COLUMN undo_result jsonb;
