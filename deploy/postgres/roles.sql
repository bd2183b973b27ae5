-- The roles of a sas database. Run with psql as the schema owner (the role
-- that applies the migrations), before the first migration; safe to run
-- again on an existing database (an upgrade), which it brings to the same
-- rights:
--   psql -v ON_ERROR_STOP=1 -v owner=sas_owner -v db=sas -v app_role=sas_app \
--        -v app_password="$SAS_APP_PASSWORD" -f deploy/postgres/roles.sql <owner's connection>
-- Compose runs it from init-roles.sh on the first start of Postgres.
--
-- app_role (sas_app) is what the scheduler and supervisor log in as. It owns
-- nothing, and may SELECT, INSERT and UPDATE the rows of the tables the owner
-- creates. It may not DELETE or TRUNCATE anything (history is append-only),
-- and may only read _sqlx_migrations, so a compromised service can neither
-- erase what happened nor mark a migration as applied. Retention deletes
-- through functions the owner's migrations create (SECURITY DEFINER:
-- sas_retire_finished, sas_retire_dead_letters, sas_retire_schedule_runs),
-- which delete only finished orders (none with an open alert), dead letters
-- and decided schedule runs older than the age they are given; only
-- app_role may execute the owner's functions.
--
-- reader_role (sas_reader; optional: given with -v reader_role=sas_reader
-- -v reader_password=...) is what the HTTP gateway logs in as: it only
-- reads, so it may only SELECT the owner's tables, and execute none of the
-- owner's functions.

SELECT format('CREATE ROLE %I LOGIN PASSWORD %L', :'app_role', :'app_password')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'app_role')\gexec

GRANT CONNECT ON DATABASE :"db" TO :"app_role";
GRANT USAGE ON SCHEMA public TO :"app_role";

-- sqlx's bookkeeping table, created now, before the default privileges
-- below exist, so that they never apply to it. Same definition as sqlx's
-- own `CREATE TABLE IF NOT EXISTS` (sqlx-postgres migrate.rs), which then
-- finds it and uses it. Owned by the owner, like every table.
CREATE TABLE IF NOT EXISTS public._sqlx_migrations (
    version BIGINT PRIMARY KEY,
    description TEXT NOT NULL,
    installed_on TIMESTAMPTZ NOT NULL DEFAULT now(),
    success BOOLEAN NOT NULL,
    checksum BYTEA NOT NULL,
    execution_time BIGINT NOT NULL
);

-- Tables and sequences the owner creates later (the migrations) ...
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public
  REVOKE DELETE, TRUNCATE ON TABLES FROM :"app_role";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public
  GRANT SELECT, INSERT, UPDATE ON TABLES TO :"app_role";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public
  GRANT USAGE, SELECT ON SEQUENCES TO :"app_role";
-- Not per schema: PUBLIC's EXECUTE is a global default, which a per-schema
-- REVOKE leaves in place (a per-schema default only adds to the global one).
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner"
  REVOKE EXECUTE ON FUNCTIONS FROM PUBLIC;
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public
  GRANT EXECUTE ON FUNCTIONS TO :"app_role";
-- ... and those that already exist (a database set up by an older version).
GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO :"app_role";
REVOKE DELETE, TRUNCATE ON ALL TABLES IN SCHEMA public FROM :"app_role";
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO :"app_role";
REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA public FROM PUBLIC;
GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA public TO :"app_role";
-- Read-only for the services, whatever the lines above granted.
REVOKE INSERT, UPDATE, DELETE, TRUNCATE ON public._sqlx_migrations FROM :"app_role";
GRANT SELECT ON public._sqlx_migrations TO :"app_role";

-- The reader, if asked for: SELECT on the owner's tables, now and later.
\if :{?reader_role}
SELECT format('CREATE ROLE %I LOGIN PASSWORD %L', :'reader_role', :'reader_password')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'reader_role')\gexec
GRANT CONNECT ON DATABASE :"db" TO :"reader_role";
GRANT USAGE ON SCHEMA public TO :"reader_role";
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public
  GRANT SELECT ON TABLES TO :"reader_role";
GRANT SELECT ON ALL TABLES IN SCHEMA public TO :"reader_role";
\endif
