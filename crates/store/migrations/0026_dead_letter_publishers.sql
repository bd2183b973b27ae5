-- Who published the message that died (its validated user_id, as one of our
-- services vouched for it), so that the gateway answers an order's refusal
-- only from a message the gateway itself published: a refusal of another
-- client's message under the same id is not this client's.
ALTER TABLE dead_letters ADD COLUMN publisher text;
