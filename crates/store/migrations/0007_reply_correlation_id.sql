-- The AMQP request/reply convention: a client that sets reply_to and
-- correlation_id as message properties gets its status messages on that
-- queue with its correlation_id.
ALTER TABLE order_process ADD COLUMN reply_correlation_id text;
