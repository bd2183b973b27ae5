#!/usr/bin/env bash
# The end-to-end benchmark: builds the dist profile (each program optimised
# whole, as production images are: Cargo.toml), starts the whole system as
# local processes against the local RabbitMQ and PostgreSQL (its own database
# and queue prefix, removed afterwards), drives it, and writes
# target/bench/latest.json plus a table. Takes a few minutes.
#
#   scripts/bench.sh            full run
#   scripts/bench.sh --quick    the small run the tests use
#   scripts/bench.sh console    the console's list and filter pages at 100,000
#                               and 1,000,000 orders (target/bench/console.json)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export SAS_TEST_DATABASE_ADMIN_URL="${SAS_TEST_DATABASE_ADMIN_URL:-postgres://postgres:postgres@127.0.0.1:5432/postgres}"
scripts/build-release.sh dist
if [ "${1:-}" = console ]; then
  shift
  exec target/dist/sas-console-bench --out target/bench/console.json "$@"
fi
exec target/dist/sas-bench --out target/bench/latest.json "$@"
