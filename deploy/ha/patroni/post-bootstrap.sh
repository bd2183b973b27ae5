#!/bin/sh
# Patroni's post_bootstrap: runs once, on the first primary, after initdb.
# Creates the schema owner (SAS_OWNER_PASSWORD) and the database, then the
# services' role and the gateway's with deploy/postgres/roles.sql, as the
# single-node compose file's init-roles.sh does.
set -eu
: "${SAS_OWNER_PASSWORD:?SAS_OWNER_PASSWORD must be set}"
: "${SAS_APP_PASSWORD:?SAS_APP_PASSWORD must be set}"
psql -v ON_ERROR_STOP=1 -h /run/postgresql -U postgres -d postgres \
  -v password="$SAS_OWNER_PASSWORD" <<'SQL'
SELECT format('CREATE ROLE sas_owner LOGIN SUPERUSER PASSWORD %L', :'password')\gexec
CREATE DATABASE sas OWNER sas_owner;
SQL
psql -v ON_ERROR_STOP=1 -h /run/postgresql -U sas_owner -d sas \
  -v owner=sas_owner -v db=sas -v app_role=sas_app \
  -v app_password="$SAS_APP_PASSWORD" -f /sas/postgres/roles.sql
