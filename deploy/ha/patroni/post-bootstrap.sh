#!/bin/sh
# Patroni's post_bootstrap: runs once, on the first primary, after initdb.
# Creates the schema owner (SAS_OWNER_PASSWORD) and the database, then the
# services' role and the gateway's with deploy/postgres/roles.sql, as the
# single-node compose file's init-roles.sh does.
set -eu
: "${SAS_OWNER_PASSWORD:?SAS_OWNER_PASSWORD must be set}"
: "${SAS_APP_PASSWORD:?SAS_APP_PASSWORD must be set}"
: "${SAS_READER_PASSWORD:?SAS_READER_PASSWORD must be set}"
# No standby exists yet: in strict synchronous mode a commit would wait
# for one for ever. These commits are the bootstrap's own.
export PGOPTIONS='-c synchronous_commit=local'
# The schema owner is no superuser: it owns the database and its schema,
# runs the migrations and nothing more. The services' roles are made here
# too (roles.sql, run as the owner, then only grants).
psql -v ON_ERROR_STOP=1 -h /run/postgresql -U postgres -d postgres \
  -v password="$SAS_OWNER_PASSWORD" -v app_password="$SAS_APP_PASSWORD" \
  -v reader_password="$SAS_READER_PASSWORD" <<'SQL'
SELECT format('CREATE ROLE sas_owner LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE PASSWORD %L', :'password')\gexec
CREATE DATABASE sas OWNER sas_owner;
SELECT format('CREATE ROLE sas_app LOGIN PASSWORD %L', :'app_password')\gexec
SELECT format('CREATE ROLE sas_reader LOGIN PASSWORD %L', :'reader_password')\gexec
SQL
psql -v ON_ERROR_STOP=1 -h /run/postgresql -U postgres -d sas \
  -c 'ALTER SCHEMA public OWNER TO sas_owner'

psql -v ON_ERROR_STOP=1 -h /run/postgresql -U sas_owner -d sas \
  -v owner=sas_owner -v db=sas -v app_role=sas_app \
  -v app_password="$SAS_APP_PASSWORD" -v reader_role=sas_reader \
  -v reader_password="$SAS_READER_PASSWORD" -f /sas/postgres/roles.sql
