-- Tenant quotas (issue 47): how many orders a tenant may start, shared by
-- every scheduler (tenants.<t>.quota in the tenancy file).
--
-- A generic cell rate algorithm: one row per capped tenant holds its
-- theoretical arrival time (tat). An order of a tenant sending at its rate
-- or slower finds tat in the past; a burst moves tat ahead by one emission
-- (1 / per_second) per order, and an order may start once
--
--   GREATEST(tat, now()) - tolerance <= now()     (tolerance: burst - 1 emissions)
--
-- Over it, the order is refused (over = "refuse") or, with over = "queue",
-- stored and started at that time if it falls within max_wait_secs
-- (intake sets its not_before; a claim starts it then). One row per capped
-- tenant, taken under its row lock for one statement per order: a tenant
-- with no quota costs nothing (intake does not ask), and an idle one
-- costs one row. The settings come with each call (from the scheduler's
-- tenancy file), so the table holds only the state.
CREATE TABLE tenant_quota (
    tenant text PRIMARY KEY,
    tat    timestamptz NOT NULL
);
