#!/bin/sh
# Runs once, when the postgres container initialises an empty data directory
# (mounted into /docker-entrypoint-initdb.d/, with roles.sql beside it in
# /sas/postgres/), as POSTGRES_USER, the cluster's superuser, which the
# services never use. Creates the schema owner sas_owner (SAS_OWNER_PASSWORD),
# not a superuser: it owns the database and its schema, runs the migrations
# and nothing more. Then the services' role sas_app and the gateway's
# sas_reader, and, as the owner, their rights (roles.sql: rows of the
# owner's tables, no DELETE, _sqlx_migrations read-only; SELECT only).
set -e
: "${SAS_OWNER_PASSWORD:?SAS_OWNER_PASSWORD must be set for the postgres container}"
: "${SAS_APP_PASSWORD:?SAS_APP_PASSWORD must be set for the postgres container}"
: "${SAS_READER_PASSWORD:?SAS_READER_PASSWORD must be set for the postgres container}"
owner=${SAS_OWNER_ROLE:-sas_owner}
app_role=${SAS_APP_ROLE:-sas_app}
reader_role=${SAS_READER_ROLE:-sas_reader}

psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v owner="$owner" -v owner_password="$SAS_OWNER_PASSWORD" -v db="$POSTGRES_DB" \
  -v app_role="$app_role" -v app_password="$SAS_APP_PASSWORD" \
  -v reader_role="$reader_role" -v reader_password="$SAS_READER_PASSWORD" <<'SQL'
SELECT format('CREATE ROLE %I LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD %L', :'owner', :'owner_password')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'owner')\gexec
ALTER DATABASE :"db" OWNER TO :"owner";
ALTER SCHEMA public OWNER TO :"owner";
SELECT format('CREATE ROLE %I LOGIN PASSWORD %L', :'app_role', :'app_password')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'app_role')\gexec
SELECT format('CREATE ROLE %I LOGIN PASSWORD %L', :'reader_role', :'reader_password')
WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = :'reader_role')\gexec
SQL

psql -v ON_ERROR_STOP=1 --username "$owner" --dbname "$POSTGRES_DB" \
  -v owner="$owner" -v db="$POSTGRES_DB" -v app_role="$app_role" \
  -v app_password="$SAS_APP_PASSWORD" -v reader_role="$reader_role" \
  -v reader_password="$SAS_READER_PASSWORD" -f "${SAS_ROLES_SQL:-/sas/postgres/roles.sql}"
