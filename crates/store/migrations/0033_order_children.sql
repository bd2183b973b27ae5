-- Child orders (issue 48): a workflow's child step starts an order of
-- another workflow and waits for it to end. The child is an ordinary order
-- (its id derived from its parent's and the step's); this table links it
-- to its parent, so that the transaction ending the child tells the parent
-- (crates/store/src/machine/child.rs). Retention that retires either order
-- retires the link with it.
CREATE TABLE order_children (
    child_order_id  text PRIMARY KEY REFERENCES orders (order_id) ON DELETE CASCADE,
    parent_order_id text NOT NULL REFERENCES orders (order_id) ON DELETE CASCADE,
    step            text NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    -- One child per step of a parent.
    UNIQUE (parent_order_id, step)
);
