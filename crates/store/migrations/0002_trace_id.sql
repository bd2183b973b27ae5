-- The W3C trace id of each order, carried in the traceparent header of every
-- message about it, so one order's log lines join up across services.
ALTER TABLE order_process ADD COLUMN trace_id text;
