-- Who sent each event (issue 47): a wait step may accept its event only
-- from some senders (a role, the order's tenant, a named identity). The
-- scheduler records the sender's identity (amqp:<user>, gateway:<client>,
-- console:<user>) and what a wait step may name it by (the identity,
-- tenant:<tenant>, role:<role>...) as it resolved them when the event came,
-- so a wait decides on what was true then, without the tenancy file.
-- Events kept before this migration name no sender and satisfy only waits
-- that accept anyone.
ALTER TABLE order_events
    ADD COLUMN sender text,
    ADD COLUMN principals text[] NOT NULL DEFAULT '{}';
ALTER TABLE keyed_events
    ADD COLUMN sender text,
    ADD COLUMN principals text[] NOT NULL DEFAULT '{}';

-- Who submitted each order (amqp:<user>, gateway:<client>), from the
-- broker's validated user_id or the gateway's authenticated client, never
-- from the body; NULL for orders stored before this migration.
ALTER TABLE orders ADD COLUMN submitted_by text;
