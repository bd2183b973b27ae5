-- no-transaction
-- The overview's backlog chart works back from the orders in progress now,
-- so it counts every way an order enters or leaves progress; an operator's
-- resubmission brings an ended order back. The milestones index gains
-- 'resubmitted'; built beside the old one without blocking writes (this
-- file and the next run outside a transaction, one statement each, as
-- CONCURRENTLY needs).
CREATE INDEX CONCURRENTLY IF NOT EXISTS history_milestones_v2 ON history (at)
    WHERE event IN ('received', 'processed', 'compensation_started', 'compensated',
                    'error', 'retry_scheduled', 'resubmitted');
