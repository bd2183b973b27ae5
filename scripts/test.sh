#!/usr/bin/env bash
# Runs every test (unit, state store, end-to-end and fault injection) against
# real RabbitMQ and PostgreSQL, starting or installing them first if needed.
# Each test creates and drops its own database and queue prefix. The
# console's browser test needs chromium and chromium-driver (installed here
# when missing); its screenshots go to target/screenshots/. The client
# examples' tests need pika, Node and amqplib (scripts/client-deps.sh).
#
#   SAS_TEST_DATABASE_ADMIN_URL  admin URL (default postgres://postgres:postgres@127.0.0.1:5432/postgres)
#   SAS_TEST_AMQP_URL            broker URL (default amqp://guest:guest@127.0.0.1:5672/%2f)
#   SAS_CHAOS_ORDERS             orders in the chaos test (default 1000)
#   SAS_PROMTOOL                 promtool to use (default: on the PATH, else unpacked by scripts/promtool.sh)
#
# Then, on a full run (no test filter given), scripts/compose-test.sh runs
# docker-compose.yml for real, and scripts/ha-test.sh the highly available
# topology (docker-compose.ha.yml) through its faults, or each prints one line
# saying why it cannot here.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/services.sh
# The console's browser test drives Debian's chromium through chromedriver.
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ]; then
  echo "test.sh: installing chromium and chromium-driver from Debian's packages"
  as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi
# The client examples' tests (tests/tests/e2e/contract.rs): pika, Node and amqplib.
scripts/client-deps.sh
export SAS_TEST_DATABASE_ADMIN_URL="${SAS_TEST_DATABASE_ADMIN_URL:-postgres://postgres:postgres@127.0.0.1:5432/postgres}"
# Dependency policy (deny.toml): licenses, duplicate versions, sources, advisories.
scripts/deny.sh
# promtool checks and tests deploy/prometheus (tests/tests/e2e/deployment.rs).
SAS_PROMTOOL="${SAS_PROMTOOL:-$(scripts/promtool.sh || true)}"
export SAS_PROMTOOL
# The end-to-end tests run the real binaries: build them first.
cargo build --workspace --bins
# Every intra-doc link of the Rust sources names an item that exists (the
# Markdown's links and paths: tests/tests/docs.rs). About a minute, most of
# it the first time.
RUSTDOCFLAGS="-D warnings -A rustdoc::private_intra_doc_links" \
  cargo doc --workspace --no-deps --document-private-items --quiet
# The end-to-end tests are one binary (tests/tests/e2e); a test that disturbs
# the shared servers or loads the machine holds them alone while it runs
# (crates/lab/src/servers.rs). A filter selects tests by name: `disruptive::`
# one file's, `chaos` the chaos test.
# A failure's message comes before its backtrace, which a log cut short
# can lose: it is said again, briefly, at the very end.
log="$(mktemp)"
if ! cargo test --workspace -- --test-threads 2 "$@" 2>&1 | tee "$log"; then
  echo "== Why each failing test failed (its panic, repeated from above) =="
  grep -A 6 "panicked at" "$log" | grep -Ev "^stack backtrace:|^ +[0-9]+: |^ +at " || true
  rm -f "$log"
  exit 101
fi
rm -f "$log"
# After the cargo tests, never beside them: both load the machine. The
# highly available topology after the single-node one, whose Docker engine
# and image stand-ins it reuses.
if [ $# -eq 0 ]; then
  scripts/compose-test.sh
  scripts/ha-test.sh
fi
