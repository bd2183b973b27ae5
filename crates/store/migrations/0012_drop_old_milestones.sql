-- no-transaction
-- history_milestones_v2 (0011) replaces it.
DROP INDEX CONCURRENTLY IF EXISTS history_milestones;
