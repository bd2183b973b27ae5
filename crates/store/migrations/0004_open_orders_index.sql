-- The supervisor counts orders by state for its gauges every interval. An
-- index on every order's state made that count grow with every order ever
-- processed, and cost an index entry on every transition. Finished orders
-- (processed, compensated) are counted by the services as they finish
-- (sas_orders_finished_total); the gauges count only the open ones, which
-- this partial index holds.
DROP INDEX order_process_state;
CREATE INDEX order_process_open ON order_process (state)
    WHERE state NOT IN ('processed', 'compensated');
