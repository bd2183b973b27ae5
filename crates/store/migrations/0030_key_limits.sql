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
