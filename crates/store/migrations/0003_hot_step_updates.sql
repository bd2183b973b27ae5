-- Every lookup of an attempt goes through its order (the primary key), so
-- the attempt id index only cost time: it made every step update rewrite two
-- indexes instead of being a heap-only (HOT) update. Leaving room in each
-- page lets the frequent updates of steps and process records stay HOT.
DROP INDEX steps_attempt_id;
ALTER TABLE steps SET (fillfactor = 80);
ALTER TABLE order_process SET (fillfactor = 80);
