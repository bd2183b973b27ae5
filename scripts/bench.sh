#!/usr/bin/env bash
# The end-to-end benchmark: builds in release mode, starts the whole system as
# local processes against the local RabbitMQ and PostgreSQL (its own database
# and queue prefix, removed afterwards), drives it, and writes
# target/bench/latest.json plus a table. Takes a few minutes.
#
#   scripts/bench.sh            full run
#   scripts/bench.sh --quick    the small run the tests use
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
export SAS_TEST_DATABASE_ADMIN_URL="${SAS_TEST_DATABASE_ADMIN_URL:-postgres://postgres:postgres@127.0.0.1:5432/postgres}"
cargo build --release --workspace --bins
exec target/release/sas-bench --out target/bench/latest.json "$@"
