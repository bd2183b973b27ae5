#!/bin/sh
# Runs once, when the postgres container initialises an empty data directory
# (mounted into /docker-entrypoint-initdb.d/, with roles.sql beside it in
# /sas/postgres/). POSTGRES_USER (sas_owner) owns the schema and runs the
# migrations; sas_app is what the services log in as: see roles.sql for its
# rights (rows of the owner's tables, no DELETE, _sqlx_migrations read-only),
# and sas_reader the gateway's (SELECT only).
set -e
: "${SAS_APP_PASSWORD:?SAS_APP_PASSWORD must be set for the postgres container}"
: "${SAS_READER_PASSWORD:?SAS_READER_PASSWORD must be set for the postgres container}"

psql -v ON_ERROR_STOP=1 --username "$POSTGRES_USER" --dbname "$POSTGRES_DB" \
  -v owner="$POSTGRES_USER" -v db="$POSTGRES_DB" -v app_role="${SAS_APP_ROLE:-sas_app}" \
  -v app_password="$SAS_APP_PASSWORD" -v reader_role="${SAS_READER_ROLE:-sas_reader}" \
  -v reader_password="$SAS_READER_PASSWORD" -f "${SAS_ROLES_SQL:-/sas/postgres/roles.sql}"
