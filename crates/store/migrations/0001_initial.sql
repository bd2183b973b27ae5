-- The state store of the Scheduler Agent Supervisor pattern.
-- Every transition is a guarded UPDATE; every time comes from now().

CREATE TYPE process_state AS ENUM
    ('pending', 'processing', 'processed', 'error', 'compensating', 'compensated');
CREATE TYPE step_state AS ENUM
    ('not_started', 'running', 'completed', 'failed', 'compensating', 'compensated');

-- The order as the client submitted it; order_id is the client's id.
CREATE TABLE orders (
    order_id    text PRIMARY KEY,
    body        jsonb NOT NULL,
    received_at timestamptz NOT NULL DEFAULT now()
);

-- The pattern's process record: who holds the order, until when, how often it failed.
CREATE TABLE order_process (
    order_id      text PRIMARY KEY REFERENCES orders (order_id) ON DELETE CASCADE,
    workflow      text NOT NULL,
    state         process_state NOT NULL DEFAULT 'pending',
    locked_by     text,
    complete_by   timestamptz,
    failure_count integer NOT NULL DEFAULT 0,
    not_before    timestamptz NOT NULL DEFAULT now(),
    reply_to      text,
    last_error    text,
    created_at    timestamptz NOT NULL DEFAULT now(),
    updated_at    timestamptz NOT NULL DEFAULT now()
);
-- The scheduler's claim: pending orders, and compensations nobody holds.
CREATE INDEX order_process_claimable ON order_process (not_before)
    WHERE state = 'pending' OR (state = 'compensating' AND locked_by IS NULL);
-- The supervisor's scan: held orders by deadline.
CREATE INDEX order_process_deadline ON order_process (complete_by)
    WHERE state IN ('processing', 'compensating');
CREATE INDEX order_process_state ON order_process (state);

-- One row per workflow step, a snapshot of the workflow definition at intake
-- (a changed definition never confuses an order already running).
CREATE TABLE steps (
    order_id        text NOT NULL REFERENCES orders (order_id) ON DELETE CASCADE,
    position        integer NOT NULL,
    name            text NOT NULL,
    agent           text NOT NULL,
    action          text NOT NULL,
    compensation    text,
    timeout_ms      integer NOT NULL CHECK (timeout_ms > 0),
    state           step_state NOT NULL DEFAULT 'not_started',
    attempt         integer NOT NULL DEFAULT 0,
    attempt_id      uuid,
    complete_by     timestamptz,
    idempotency_key text NOT NULL,
    result          jsonb,
    last_error      text,
    updated_at      timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (order_id, position)
);
CREATE UNIQUE INDEX steps_attempt_id ON steps (attempt_id);

-- Append-only: every decision about an order, by whom and when.
CREATE TABLE history (
    id         bigserial PRIMARY KEY,
    order_id   text NOT NULL,
    at         timestamptz NOT NULL DEFAULT now(),
    actor      text NOT NULL,
    event      text NOT NULL,
    step       text,
    attempt_id uuid,
    detail     text
);
CREATE INDEX history_order ON history (order_id, id);

-- What an operator must look at.
CREATE TABLE alerts (
    id          bigserial PRIMARY KEY,
    order_id    text,
    raised_at   timestamptz NOT NULL DEFAULT now(),
    kind        text NOT NULL,
    message     text NOT NULL,
    resolved_at timestamptz
);

-- Every message any queue dead-lettered, with the reason.
CREATE TABLE dead_letters (
    id           bigserial PRIMARY KEY,
    at           timestamptz NOT NULL DEFAULT now(),
    source_queue text,
    reason       text NOT NULL,
    order_id     text,
    message_id   text,
    body         text NOT NULL
);
