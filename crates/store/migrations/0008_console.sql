-- The operator console (issue 13): finding orders among millions, and what
-- operators did to alerts and dead letters.
--
-- Orders list: newest first, with keyset pagination on (created_at,
-- order_id). Neither column changes after intake, so this index does not
-- stop the frequent updates of the process record from being heap-only.
CREATE INDEX order_process_created ON order_process (created_at DESC, order_id DESC);
-- Search by customer, and by order id prefix (text_pattern_ops serves
-- LIKE 'prefix%' whatever the database's collation). The orders table is
-- written once per order and never updated.
CREATE INDEX orders_customer ON orders ((body ->> 'customer_id'));
CREATE INDEX orders_id_prefix ON orders (order_id text_pattern_ops);
-- The overview's per-minute counts over the last hour read only the few
-- history lines that mark an order's life (not every dispatch and reply).
CREATE INDEX history_milestones ON history (at)
    WHERE event IN ('received', 'processed', 'compensation_started', 'compensated',
                    'error', 'retry_scheduled');

-- Alerts: acknowledged (someone is on it), then resolved with a note.
ALTER TABLE alerts
    ADD COLUMN acknowledged_at timestamptz,
    ADD COLUMN acknowledged_by text,
    ADD COLUMN resolved_by text,
    ADD COLUMN resolution_note text;

-- Dead letters: what an operator did with each (replayed to its source
-- queue, or discarded), when, and who.
ALTER TABLE dead_letters
    ADD COLUMN disposition text CHECK (disposition IN ('replayed', 'discarded')),
    ADD COLUMN disposed_at timestamptz,
    ADD COLUMN disposed_by text;
