-- Admission control: work beyond what the agents can finish inside a step's
-- deadline waits here, not in an agent queue where it would expire.
--
-- order_process.waiting_for: the agent an order waits for (a slot of its
--   next attempt); such an order is pending (forward) or compensating, held
--   by nobody, with no deadline: waiting never fails.
-- order_process.admit_key: the order's place in that agent's line: when it
--   started waiting, less 10 s per priority level (aging: a low-priority
--   order waits at most that long per level behind later urgent ones), less
--   a day for compensations (undo goes before new work).
-- admission: one row per agent, shared by every scheduler. in_flight counts
--   attempts dispatched and not yet settled, waiting counts orders in line;
--   both move in the same transaction as the orders they count.
--   admit_limit adapts (supervisor) to the completions measured
--   (settled) times the agent's deadline, under ceiling.
ALTER TABLE order_process
    ADD COLUMN priority smallint NOT NULL DEFAULT 5,
    ADD COLUMN waiting_for text,
    ADD COLUMN admit_key timestamptz;
CREATE INDEX order_process_waiting ON order_process (waiting_for, admit_key)
    WHERE waiting_for IS NOT NULL;
DROP INDEX order_process_claimable;
CREATE INDEX order_process_claimable ON order_process (not_before)
    WHERE (state = 'pending' OR (state = 'compensating' AND locked_by IS NULL))
      AND waiting_for IS NULL;

CREATE TABLE admission (
    agent          text PRIMARY KEY,
    in_flight      integer NOT NULL DEFAULT 0,
    waiting        integer NOT NULL DEFAULT 0,
    admit_limit    integer NOT NULL CHECK (admit_limit >= 1),
    ceiling        integer NOT NULL CHECK (ceiling >= 1),
    deadline_ms    integer NOT NULL CHECK (deadline_ms > 0),
    settled        bigint NOT NULL DEFAULT 0,
    window_settled bigint NOT NULL DEFAULT 0,
    window_started timestamptz NOT NULL DEFAULT now()
);
