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
psql -v ON_ERROR_STOP=1 -h /run/postgresql -U postgres -d postgres \
  -v password="$SAS_OWNER_PASSWORD" <<'SQL'
SELECT format('CREATE ROLE sas_owner LOGIN SUPERUSER PASSWORD %L', :'password')\gexec
CREATE DATABASE sas OWNER sas_owner;
SQL
psql -v ON_ERROR_STOP=1 -h /run/postgresql -U sas_owner -d sas \
  -v owner=sas_owner -v db=sas -v app_role=sas_app \
  -v app_password="$SAS_APP_PASSWORD" -v reader_role=sas_reader \
  -v reader_password="$SAS_READER_PASSWORD" -f /sas/postgres/roles.sql
