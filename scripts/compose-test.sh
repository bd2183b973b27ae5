#!/usr/bin/env bash
# Runs docker-compose.yml for real, as a user would, and checks what it promises:
#   1. builds the image from the working tree (`docker compose build`; BuildKit's
#      cache mounts keep cargo's registry and target between runs);
#   2. `docker compose up --wait` under its own project name (sas-composetest-<pid>),
#      with passwords it makes up and free host ports, so it never touches a user's stack;
#   3. publishes orders from the host the README's way: pika, broker user sas-client,
#      exchange sas.orders;
#   4. scales the agents up and down (`--scale agent=N`) and checks the consumers of each
#      agent queue; kills an agent and a scheduler with `docker kill -s KILL` and restarts
#      the broker's container while orders are in flight;
#   5. checks that the console refuses a request without credentials (401) and answers
#      the API with the test's operator (200), its queue depths readable as sas-console;
#      at the end, submits an order through the HTTP gateway and reads its outcome;
#   6. checks that every order ended (Postgres: processed or compensated) and that each
#      side effect happened once (remote-sim's ledger, GET /side-effects with its token);
#   7. prints its figures, and always (also on failure) runs `docker compose down -v` and
#      removes its temporary files. Service logs of a failed run are kept in target/compose-test/.
#
# Needs a Docker engine with the compose v2 plugin and the images the files name. Where no
# registry is reachable, the stand-ins of ../shared/compose-standins (build.sh, run as root)
# provide both. Without them it prints one line "compose-test: skipped: <why>" and exits 0.
#
#   COMPOSE_TEST_BURST    orders of the throughput burst, published at once (default 1000)
#   COMPOSE_TEST_ORDERS   orders published at COMPOSE_TEST_RATE a second while processes
#                         are killed, scaled and restarted (default 1000 at 10/s)
#   CARGO_BUILD_JOBS      passed to the image build (cargo's parallel jobs), when set
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
standins=$(cd .. && pwd)/shared/compose-standins
burst=${COMPOSE_TEST_BURST:-1000}
orders=${COMPOSE_TEST_ORDERS:-1000}
rate=${COMPOSE_TEST_RATE:-10}
project=sas-composetest-$$
keep=$root/target/compose-test

name=compose-test
# shellcheck source=lib/compose.sh
. scripts/lib/compose.sh

# --- Is there a Docker engine that can run the compose file? -------------------------
# The images the compose file runs and the Dockerfile builds from (ours excepted).
mapfile -t images < <({
  awk '$1 == "image:" && $2 !~ /^sas:/ { print $2 }' docker-compose.yml
  awk '$1 == "FROM" { print $2 }' deploy/Dockerfile
} | sort -u)
can_build_standins() { [ "$(id -u)" -eq 0 ] && [ -f "$standins/build.sh" ]; }
standins_built=""
build_standins() {
  say "building the engine and image stand-ins ($standins/build.sh)"
  local started
  started=$(now)
  bash "$standins/build.sh" || fail "$standins/build.sh failed"
  standins_built="$(since "$started") s"
}

if ! docker info >/dev/null 2>&1; then
  command -v docker >/dev/null 2>&1 || can_build_standins \
    || skip "no docker command, and no stand-ins to install one ($standins/build.sh, as root)"
  can_build_standins \
    || skip "no Docker engine answers (docker info), and no stand-ins to start one ($standins/build.sh, as root)"
  build_standins
fi
if ! docker compose version >/dev/null 2>&1; then
  can_build_standins || skip "the docker compose v2 plugin is missing, and no stand-ins to install it"
  build_standins
fi
missing=()
for image in "${images[@]}"; do
  docker image inspect "$image" >/dev/null 2>&1 && continue
  # No registry may be reachable: give a pull a bounded time.
  timeout 120 docker pull -q "$image" >/dev/null 2>&1 || missing+=("$image")
done
if [ ${#missing[@]} -gt 0 ]; then
  [ -z "$standins_built" ] && can_build_standins \
    || skip "cannot pull ${missing[*]} and no stand-ins to build them ($standins/build.sh, as root)"
  build_standins
fi

# --- Python's pika, as the README's example uses ------------------------------------
mkdir -p "$keep"
if ! python3 -c 'import pika' 2>/dev/null; then
  export PYTHONPATH="$keep/python${PYTHONPATH:+:$PYTHONPATH}"
  python3 -c 'import pika' 2>/dev/null \
    || PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check \
      --target "$keep/python" pika \
    || fail "cannot install pika (python3 -m pip install --target $keep/python pika)"
fi

# --- A project of its own: passwords, ports, temporary files ------------------------
# The test's own image name, so that a user's sas:latest is left alone.
start_project "sas-composetest:$$"
compose() {
  docker compose -p "$project" --env-file "$tmp/env" -f docker-compose.yml -f "$tmp/image.yml" "$@"
}
read -r amqp_port management_port sim_port console_port gateway_port < <(free_ports 5)
cat >>"$tmp/env" <<EOF
RABBITMQ_AMQP_PORT=$amqp_port
RABBITMQ_MANAGEMENT_PORT=$management_port
REMOTE_SIM_PORT=$sim_port
CONSOLE_PORT=$console_port
GATEWAY_PORT=$gateway_port
EOF

# --- Helpers ------------------------------------------------------------------------
sql() { compose exec -T postgres psql -X -q -A -t -U sas_owner -d sas -c "$1"; }
broker_ctl() { compose exec -T rabbitmq rabbitmqctl -q "$@"; }
# consumers QUEUE: how many consumers the broker counts on it.
consumers() {
  { broker_ctl list_queues --no-table-headers name consumers 2>/dev/null || true; } \
    | awk -v q="$1" '$1 == q { print $2 }'
}
agent_queues=(sas.agent.inventory sas.agent.payment sas.agent.shipping)
consumed_by() { [ "$(consumers "$1")" = "$2" ]; } # QUEUE N
agents_consume() { # N: every agent queue has N consumers
  local queue
  for queue in "${agent_queues[@]}"; do
    [ "$(consumers "$queue")" = "$1" ] || return 1
  done
}
show_consumers() {
  local queue line=""
  for queue in "${agent_queues[@]}" sas.orders sas.scheduler.replies sas.dead-letters.record; do
    line+=" $queue=$(consumers "$queue")"
  done
  say "consumers:$line"
}
open_orders() { sql "SELECT count(*) FROM order_process WHERE state NOT IN ('processed', 'compensated')"; }
ended_orders() { sql "SELECT count(*) FROM order_process WHERE state IN ('processed', 'compensated')"; }
# all_ended N: N orders ended (fails at once if one ended in error).
all_ended() {
  local failed
  failed=$(sql "SELECT count(*) FROM order_process WHERE state = 'error'" || true)
  [ "${failed:-0}" = 0 ] || fail "$failed orders ended in error (an operator alert): sasctl alerts"
  [ "$(ended_orders)" = "$1" ]
}
healthy() { [ "$(docker inspect -f '{{.State.Health.Status}}' "$1" 2>/dev/null)" = healthy ]; }
# publish_in_background NAME COUNT RATE [DECLINED]: publishes COUNT orders NAME-<n> the
# README's way (pika, confirmed, persistent), RATE a second (0: as fast as confirmed),
# every DECLINED-th one (default none) with an amount the payment service declines, and
# writes how many are confirmed to $tmp/published. When the broker goes away it
# reconnects and publishes the unconfirmed order again: intake is idempotent on
# the order id, so a repeat is a no-op.
publish_in_background() {
  echo 0 >"$tmp/published"
  AMQP_URLS="amqp://sas-client:$client_password@127.0.0.1:$amqp_port/%2f" \
    python3 scripts/lib/publish-orders.py "$project-$1" "$2" "$3" "${4:-0}" "$tmp/published" \
    >"$tmp/publisher.log" 2>&1 &
  publisher=$!
}
published() { cat "$tmp/published" 2>/dev/null || echo 0; }
# published_at_least N: N orders confirmed (fails if the publisher died before).
published_at_least() {
  [ "$(published)" -ge "$1" ] && return 0
  kill -0 "$publisher" 2>/dev/null || { cat "$tmp/publisher.log" >&2; fail "the publisher stopped at $(published) orders"; }
  return 1
}

# --- Build and start ----------------------------------------------------------------
started=$(now)
build_args=()
[ -n "${CARGO_BUILD_JOBS:-}" ] && build_args=(--build-arg "CARGO_BUILD_JOBS=$CARGO_BUILD_JOBS")
say "building the image from the working tree (project $project)"
# Only one service builds it: they all share the image.
compose build "${build_args[@]}" migrate >"$tmp/build.log" 2>&1 \
  || { cp "$tmp/build.log" "$keep/build.log"; fail "the image build failed: $keep/build.log"; }
build_seconds=$(since "$started")
say "image built in $build_seconds s"

up_started=$(now)
compose up -d --wait --no-build >"$tmp/up.log" 2>&1 \
  || { cp "$tmp/up.log" "$keep/up.log"; fail "docker compose up --wait failed: $keep/up.log"; }
healthy_seconds=$(since "$up_started")
say "healthy in $healthy_seconds s (AMQP on 127.0.0.1:$amqp_port, management $management_port, remote-sim $sim_port, console $console_port)"
wait_for "two agents consume each agent queue" 60 agents_consume 2
# The schema owner (which the migrate job logs in as) is no superuser.
[ "$(sql "SELECT rolsuper FROM pg_roles WHERE rolname = 'sas_owner'")" = f ] \
  || fail "the schema owner sas_owner is a superuser"
say "postgres: the schema owner sas_owner is no superuser; the migrations ran as it"

# The admin routes refuse a caller without the token; with it, some latency and
# transient faults, so that orders are still in flight when processes die.
code=$(python3 -c 'import sys, urllib.request, urllib.error
try: print(urllib.request.urlopen(sys.argv[1], timeout=10).status)
except urllib.error.HTTPError as e: print(e.code)' "http://127.0.0.1:$sim_port/side-effects")
[ "$code" = 401 ] || fail "remote-sim's ledger answered $code without its token (expected 401)"
# The console: nothing without credentials; the API with the test's operator, and
# the overview's queue depths, read with passive declares as sas-console.
console_get() { # PATH [SECRET]: prints the status, and the body to $tmp/console.json
  python3 - "http://127.0.0.1:$console_port$1" "${2:-}" "$tmp/console.json" <<'EOF'
import sys, urllib.request, urllib.error
url, secret, out = sys.argv[1], sys.argv[2], sys.argv[3]
request = urllib.request.Request(url, headers={"Authorization": "Bearer " + secret} if secret else {})
try:
    response = urllib.request.urlopen(request, timeout=10)
    open(out, "wb").write(response.read())
    print(response.status)
except urllib.error.HTTPError as e:
    print(e.code)
EOF
}
code=$(console_get /api/orders)
[ "$code" = 401 ] || fail "the console answered $code to /api/orders without credentials (expected 401)"
code=$(console_get /api/orders "$console_secret")
[ "$code" = 200 ] || fail "the console answered $code to /api/orders with the operator's secret (expected 200)"
code=$(console_get /api/overview "$console_secret")
[ "$code" = 200 ] || fail "the console answered $code to /api/overview (expected 200)"
if grep -q ACCESS_REFUSED "$tmp/console.json"; then
  fail "the console may not read the queue depths as sas-console: $(cat "$tmp/console.json")"
fi
say "console: 401 without credentials, 200 for the operator on /api/orders and /api/overview"
sim PUT /admin/faults '{"latency_ms": 50, "transient_fault_rate": 0.05, "permanent_fault_rate": 0, "hang_rate": 0}' >/dev/null

# --- Throughput: a burst published at once to the default stack ---------------------
say "publishing $burst orders at once from the host (pika, sas-client, exchange sas.orders)"
burst_started=$(now)
publish_in_background burst "$burst" 0
wait "$publisher" || { cat "$tmp/publisher.log" >&2; fail "the publisher failed"; }
wait_for "the $burst orders of the burst ended" 600 all_ended "$burst"
burst_seconds=$(since "$burst_started")
burst_rate=$(awk -v n="$burst" -v s="$burst_seconds" 'BEGIN { printf "%.1f", n / s }')
say "burst: $burst orders ended in $burst_seconds s, $burst_rate orders/s"

# --- Scaling and failures under a steady load ---------------------------------------
say "scaling agents to 4"
compose up -d --wait --no-build --scale agent=4 >/dev/null 2>&1 || fail "docker compose up --scale agent=4 failed"
wait_for "four agents consume each agent queue" 60 agents_consume 4
show_consumers

# One in ten is declined by the payment service: its reservation must be undone once.
say "publishing $orders orders at $rate/s, one in ten declined"
load_started=$(now)
publish_in_background load "$orders" "$rate" 10

wait_for "$((orders / 5)) orders published" 300 published_at_least $((orders / 5))
agent=$(compose ps -q agent | sed -n 1p)
scheduler=$(compose ps -q scheduler | sed -n 1p)
say "killing an agent and a scheduler with SIGKILL ($(published) published, $(open_orders) open)"
docker kill -s KILL "$agent" "$scheduler" >/dev/null
wait_for "three agents left on each agent queue" 60 agents_consume 3
show_consumers

wait_for "$((orders * 2 / 5)) orders published" 300 published_at_least $((orders * 2 / 5))
say "scaling agents down to 1 ($(published) published, $(open_orders) open)"
# Also starts the killed scheduler again (replicas: 2). Without --wait: the
# consumers say when the agents are down to one, and the broker restart below
# waits for both schedulers.
compose up -d --no-build --scale agent=1 >/dev/null 2>&1 || fail "docker compose up --scale agent=1 failed"
wait_for "one agent consumes each agent queue" 60 agents_consume 1
show_consumers

wait_for "$((orders * 3 / 5)) orders published" 300 published_at_least $((orders * 3 / 5))
rabbit=$(compose ps -q rabbitmq)
say "restarting the broker's container ($(published) published, $(open_orders) open)"
restart_started=$(now)
# SIGTERM, and SIGKILL after 10 s: a broker that does not stop on SIGTERM is still
# restarted while the publisher runs.
docker restart -t 10 "$rabbit" >/dev/null
wait_for "the broker healthy again" 120 healthy "$rabbit"
# Every service reconnects by itself: two schedulers, two supervisors, the agent.
for queue in sas.orders sas.scheduler.replies sas.dead-letters.record; do
  wait_for "two consumers back on $queue after the broker restart" 120 consumed_by "$queue" 2
done
wait_for "the agent back on each agent queue after the broker restart" 120 agents_consume 1
say "broker and every consumer back in $(since "$restart_started") s"
show_consumers

wait "$publisher" || { cat "$tmp/publisher.log" >&2; fail "the publisher failed"; }
say "publisher: $(tail -n 1 "$tmp/publisher.log")"
orders=$((burst + orders))
wait_for "every order ended ($orders published)" 600 all_ended "$orders"
load_seconds=$(since "$load_started")

# --- What Postgres and remote-sim's ledger say --------------------------------------
states=$(sql "SELECT state || '=' || count(*) FROM order_process GROUP BY state ORDER BY state" | paste -sd ' ')
stored=$(sql "SELECT count(*) FROM orders")
[ "$stored" = "$orders" ] || fail "$orders orders published, $stored stored"
declined_processed=$(sql "SELECT count(*) FROM orders JOIN order_process USING (order_id)
  WHERE (body->>'amount_cents')::bigint > 1000000 AND state <> 'compensated'")
[ "$declined_processed" = 0 ] || fail "$declined_processed declined orders did not end compensated"
sim GET /side-effects >"$tmp/ledger.json"
sql "SELECT order_id, state FROM order_process" >"$tmp/states.txt"
python3 scripts/lib/check-ledger.py "$tmp/ledger.json" "$tmp/states.txt" >"$tmp/ledger-check.txt" \
  || { cat "$tmp/ledger-check.txt" >&2; fail "remote-sim's ledger"; }
ledger=$(head -n 1 "$tmp/ledger-check.txt")
duplicates=${ledger##*duplicates=}

# --- The HTTP gateway: an order in over HTTP, its outcome read back ----------------
gateway_call() { # METHOD PATH [BODY]: prints the status, and the body to $tmp/gateway.json
  # As the client shop, or as $gateway_secret's client when set.
  python3 - "$1" "http://127.0.0.1:$gateway_port$2" "${gateway_secret:-$console_secret}" "${3:-}" "$tmp/gateway.json" <<'EOF'
import sys, urllib.request, urllib.error
method, url, secret, body, out = sys.argv[1:6]
request = urllib.request.Request(url, method=method, data=body.encode() or None,
                                 headers={"Authorization": "Bearer " + secret, "Content-Type": "application/json"})
try:
    response = urllib.request.urlopen(request, timeout=90)
    open(out, "wb").write(response.read())
    print(response.status)
except urllib.error.HTTPError as e:
    open(out, "wb").write(e.read())
    print(e.code)
EOF
}
gateway_order='{"schema_version": 1, "order_id": "http-compose-1", "customer_id": "cust-http",
  "items": [{"sku": "SKU-1", "quantity": 1}], "amount_cents": 1200, "currency": "EUR"}'
code=$(gateway_call POST /v1/orders "$gateway_order")
[ "$code" = 202 ] || fail "the gateway answered $code to an order (expected 202): $(cat "$tmp/gateway.json")"
code=$(gateway_call GET "/v1/orders/http-compose-1?wait=60")
{ [ "$code" = 200 ] && grep -q '"outcome":"processed"' "$tmp/gateway.json"; } \
  || fail "the gateway's order did not end processed ($code): $(cat "$tmp/gateway.json")"
say "gateway: an order submitted over HTTP (202) and its outcome read back: processed"

# --- A step that waits: a large order approved by its manager -----------------------
# The schedulers run the mounted workflows/ folder; the approval accepts only the
# role approver (deploy/tenants.toml): the customer shop's own is refused.
large_order='{"schema_version": 1, "order_id": "large-compose-1", "customer_id": "cust-http",
  "items": [{"sku": "SKU-1", "quantity": 1}], "amount_cents": 1300, "currency": "EUR",
  "workflow": "large_order"}'
code=$(gateway_call POST /v1/orders "$large_order")
[ "$code" = 202 ] || fail "the gateway answered $code to a large order (expected 202): $(cat "$tmp/gateway.json")"
waits_for_approval() {
  [ "$(sql "SELECT p.state || '/' || s.state FROM order_process p JOIN steps s USING (order_id)
            WHERE order_id = 'large-compose-1' AND s.name = 'approval'")" = pending/running ]
}
wait_for "the large order to wait for its approval" 60 waits_for_approval
# The gateway checks the order first, by the rule the schedulers follow:
# refused at once, nothing sent.
code=$(gateway_call POST /v1/orders/large-compose-1/events \
  '{"schema_version": 1, "name": "approved", "event_id": "compose-self-approval"}')
{ [ "$code" = 403 ] && grep -q 'accepts approved only from role:approver, and gateway:shop is none of these' "$tmp/gateway.json"; } \
  || fail "the gateway answered $code to the customer's approval (expected 403): $(cat "$tmp/gateway.json")"
[ "$(sql "SELECT count(*) FROM order_events WHERE event_id = 'compose-self-approval'")" = 0 ] \
  || fail "the customer's own approval reached the order's mailbox"
waits_for_approval || fail "the customer's own approval ended the wait"
code=$(gateway_secret="shop-manager:$manager_secret" gateway_call POST /v1/orders/large-compose-1/events \
  '{"schema_version": 1, "name": "approved", "event_id": "compose-approval-1", "data": {"by": "compose-test"}}')
[ "$code" = 202 ] || fail "the gateway answered $code to the manager's approval (expected 202): $(cat "$tmp/gateway.json")"
code=$(gateway_call GET "/v1/orders/large-compose-1?wait=60")
{ [ "$code" = 200 ] && grep -q '"outcome":"processed"' "$tmp/gateway.json"; } \
  || fail "the approved large order did not end processed ($code): $(cat "$tmp/gateway.json")"
say "a large order waited for its approval: the customer's own refused by the gateway (403), the manager's taken: processed"

say "orders: $orders ($states); throughput $burst_rate orders/s ($burst at once, $burst_seconds s);" \
  "$((orders - burst)) at $rate/s through kills, scaling and a broker restart ended $load_seconds s after the first"
say "ledger: ${ledger% duplicates=*}, duplicates found: $duplicates"
say "time to healthy: $healthy_seconds s; image build: $build_seconds s${standins_built:+; stand-ins built in $standins_built}"
say "passed in $(since "$started") s"
