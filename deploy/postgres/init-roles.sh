#!/bin/sh
# Runs once, when the postgres container initialises an empty data directory
# (mounted into /docker-entrypoint-initdb.d/). POSTGRES_USER (sas_owner) owns the
# schema and runs the migrations; sas_app is what the services log in as: it owns
# nothing and may only read and write rows of the tables sas_owner creates.
set -e
: "${SAS_APP_PASSWORD:?SAS_APP_PASSWORD must be set for the postgres container}"

psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v owner="$POSTGRES_USER" -v db="$POSTGRES_DB" -v app_password="$SAS_APP_PASSWORD" <<'SQL'
SELECT format('CREATE ROLE sas_app LOGIN PASSWORD %L', :'app_password')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'sas_app')\gexec

GRANT CONNECT ON DATABASE :"db" TO sas_app;
GRANT USAGE ON SCHEMA public TO sas_app;
-- Tables and sequences the owner creates later (the migrations) ...
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public
  GRANT SELECT, INSERT, UPDATE, DELETE ON TABLES TO sas_app;
ALTER DEFAULT PRIVILEGES FOR ROLE :"owner" IN SCHEMA public
  GRANT USAGE, SELECT ON SEQUENCES TO sas_app;
-- ... and any that already exist.
GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO sas_app;
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA public TO sas_app;
SQL
