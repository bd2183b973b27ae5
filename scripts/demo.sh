#!/usr/bin/env bash
# Starts the whole system as local processes (RabbitMQ and PostgreSQL are
# started, or installed, first) and runs a demo you can watch:
#   1. one order followed live, step by step;
#   2. an order whose payment is declined, undone by compensation;
#   3. a large order (workflows/large_order.toml) waiting for a person's
#      approval, approved through the console's API as its button does;
#   4. 200 orders through flaky remote services (transient faults and hangs);
# then leaves the system running, with the console on 127.0.0.1:9104, until Ctrl-C.
#
#   DEMO_EXIT=1   stop after the demo instead of waiting for Ctrl-C
set -euo pipefail
cd "$(dirname "$0")/.."
# The build needs only the build tools: it runs while the servers are
# installed and started (half a minute on a bare machine).
scripts/services.sh build-tools
scripts/build-release.sh &
build=$!
scripts/services.sh || { kill "$build" 2>/dev/null; exit 1; }
wait "$build"
bin=target/release
logs=target/demo
mkdir -p "$logs"

admin_url="${SAS_TEST_DATABASE_ADMIN_URL:-postgres://postgres:postgres@127.0.0.1:5432/postgres}"
if [ -z "${SAS_DATABASE__URL:-}" ]; then
  # The demo's own database starts empty each time.
  export SAS_DATABASE__URL="${admin_url%/*}/sas_demo"
  psql "$admin_url" -qc "DROP DATABASE IF EXISTS sas_demo WITH (FORCE)"
fi
export SAS_AMQP__PREFIX="${SAS_AMQP__PREFIX:-demo.}"
export SAS_AMQP__URL="${SAS_AMQP__URL:-amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=10}"
database="${SAS_DATABASE__URL##*/}"
psql "$admin_url" -qtc "SELECT 1 FROM pg_database WHERE datname = '$database'" | grep -q 1 \
  || psql "$admin_url" -qc "CREATE DATABASE $database"

pids=()
cleanup() {
  echo; echo "stopping (SIGTERM) ..."
  kill -TERM "${pids[@]}" 2>/dev/null || true
  wait "${pids[@]}" 2>/dev/null || true
}
trap cleanup EXIT
trap 'exit 130' INT TERM

start() { # name, binary, then VAR=value pairs
  local name=$1 binary=$2; shift 2
  env "$@" "$bin/$binary" >"$logs/$name.log" 2>&1 &
  pids+=($!)
}
start remote-sim remote-sim SAS_HTTP__LISTEN=127.0.0.1:8080 \
  SAS_SIM__FAULTS__LATENCY_MS=20 SAS_SIM__FAULTS__TRANSIENT_FAULT_RATE=0.05 SAS_SIM__FAULTS__HANG_RATE=0.005
port=9120
for agent in inventory payment shipping; do
  for replica in 1 2; do
    start "agent-$agent-$replica" agent SAS_HTTP__LISTEN=127.0.0.1:$port SAS_AGENT__NAME=$agent \
      SAS_AGENT__ID=$agent-$replica SAS_AGENT__REMOTE_URL=http://127.0.0.1:8080/$agent
    port=$((port + 1))
  done
done
for replica in 1 2; do
  # The shipped workflows (order, the built-in one; return; large_order).
  start "scheduler-$replica" scheduler SAS_HTTP__LISTEN=127.0.0.1:910$replica SAS_SCHEDULER__ID=scheduler-$replica \
    SAS_SCHEDULER__WORKFLOW_DIR="$PWD/workflows"
  start "supervisor-$replica" supervisor SAS_HTTP__LISTEN=127.0.0.1:911$replica SAS_SUPERVISOR__ID=supervisor-$replica \
    SAS_SUPERVISOR__BACKOFF_BASE_MS=200
done

# The console, with a demo operator whose secret is made now; the users
# file keeps only its argon2 hash.
console_secret=$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')
printf 'demo:operator:%s\n' "$(printf '%s\n' "$console_secret" | "$bin/console" hash-secret)" > "$logs/console-users"
chmod 600 "$logs/console-users"
start console console SAS_HTTP__LISTEN=127.0.0.1:9104 SAS_CONSOLE__USERS_FILE="$logs/console-users"

echo "waiting for every service to be ready ..."
for p in 9101 9102 9104 9111 9112 $(seq 9120 $((port - 1))); do
  for _ in $(seq 1 100); do
    curl -fs "http://127.0.0.1:$p/readyz" >/dev/null 2>&1 && break
    sleep 0.2
  done
done
echo "system up: 2 schedulers, 2 supervisors, 2 agents per queue, remote-sim, the console; logs in $logs/"

sasctl() { "$bin/sasctl" "$@"; }
echo; echo "== 1. one order, followed live"
sasctl submit --watch || true
echo; echo "== 2. an order whose payment is declined: the stock reservation is released"
sasctl submit --amount-cents 5000000 --watch || true
echo; echo "== 3. a large order waits for a person's approval; the demo operator gives it in the console"
# What the console's "Send approved" button does, through its JSON API:
# basic auth as the demo operator, the CSRF token from /api/session.
console_api() { # method path [curl options...]
  curl -sS --fail-with-body -K <(printf 'user = "demo:%s"\n' "$console_secret") \
    -X "$1" "http://127.0.0.1:9104$2" "${@:3}"
}
sql() { psql "$SAS_DATABASE__URL" -qtAc "$1"; }
large=$(sasctl submit --workflow large_order)
for _ in $(seq 1 150); do
  [ "$(sql "SELECT p.state || '/' || s.state FROM order_process p JOIN steps s USING (order_id)
            WHERE order_id = '$large' AND s.name = 'approval'")" = pending/running ] && break
  sleep 0.2
done
sasctl orders show "$large" | sed '/^HISTORY/,$d'
csrf=$(console_api GET /api/session | sed -n 's/.*"csrf_token":"\([^"]*\)".*/\1/p')
if answer=$(console_api POST "/api/orders/$large/signal" -H "X-CSRF-Token: $csrf" \
     -H 'Content-Type: application/json' -d '{"event": "approved"}'); then
  echo "console: $(printf '%s' "$answer" | sed -n 's/.*"message":"\([^"]*\)".*/\1/p')"
  for _ in $(seq 1 150); do
    [ "$(sql "SELECT state FROM order_process WHERE order_id = '$large'")" = processed ] && break
    sleep 0.2
  done
  sasctl orders show "$large" | grep -E '^state|wait|processed' || true
else
  echo "the console refused the approval: $answer"
fi
echo; echo "== 4. 200 orders through remote services with 5% transient faults and 0.5% hangs"
sasctl submit --count 200 >/dev/null
for _ in $(seq 1 300); do
  busy=$(psql "$SAS_DATABASE__URL" -qtAc "SELECT count(*) FROM order_process WHERE state NOT IN ('processed','compensated','error')")
  printf "\r   orders still running: %-6s" "$busy"
  [ "$busy" = 0 ] && break
  sleep 1
done
echo
psql "$SAS_DATABASE__URL" -qc "SELECT state, count(*) AS orders FROM order_process GROUP BY state ORDER BY state"
echo "remote side effects: $(curl -s http://127.0.0.1:8080/stats)"
echo
echo "Try:  $bin/sasctl orders list        $bin/sasctl orders show ORDER_ID"
echo "      $bin/sasctl submit --watch     $bin/sasctl alerts"
echo "      (with SAS_AMQP__PREFIX=$SAS_AMQP__PREFIX SAS_DATABASE__URL=$SAS_DATABASE__URL)"
echo "      metrics: curl http://127.0.0.1:9101/metrics"
echo "Console: http://127.0.0.1:9104/  (user demo, secret $console_secret)"
[ "${DEMO_EXIT:-0}" = 1 ] && exit 0
echo "The system keeps running; Ctrl-C stops it."
wait
