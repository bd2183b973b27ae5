-- The HTTP gateway answers an order id it does not find stored with the
-- reason intake refused it, if it did (issue 47): the refusals of an
-- order, looked up by its id on every such read (and every quarter second
-- of a waiting one).
CREATE INDEX dead_letters_order ON dead_letters (order_id, id) WHERE order_id IS NOT NULL;
