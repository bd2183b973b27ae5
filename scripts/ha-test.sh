#!/usr/bin/env bash
# Runs the highly available topology for real (docker-compose.yml with
# docker-compose.ha.yml: 3 RabbitMQ nodes, Patroni's primary and synchronous
# standby behind HAProxy, 3 etcd members) and checks what it promises
# (docs/high-availability.md):
#   1. the cluster is whole: 3 RabbitMQ nodes, every quorum queue with 3
#      members, a Patroni leader with a synchronous standby;
#   2. what synchronous replication costs against asynchronous, side by
#      side: commits (pgbench on the primary, synchronous_commit on and
#      local) and orders (HA_TEST_COMPARE_RATE a second for 15 s each, p50
#      and p99 from receipt to end);
#   3. under a steady load of orders (HA_TEST_RATE a second, from the host
#      with pika, trying each RabbitMQ node in turn), one after another:
#      kill -9 of the RabbitMQ node that leads the busiest queue (the
#      schedulers' replies: 3 an order); one RabbitMQ node cut off from the other two (docker
#      network disconnect), then healed; kill -9 of the Postgres primary;
#      the old primary started again (it must come back as a standby and
#      refuse a write); every node restarted one at a time, HAProxy last;
#   4. after the faults: every order ended, none in error, no operator
#      alert, each side effect applied once and no undo before its action
#      (remote-sim's ledger, scripts/lib/check-ledger.py);
#   5. prints, and writes to target/ha-test/figures.md, the time from each
#      fault until orders complete again, and orders/s and p99 latency
#      before, during and after it.
# Always (also on failure) runs `docker compose down -v`; a failed run keeps
# the services' logs in target/ha-test/.
#
# Needs a Docker engine with compose v2 and the images the files name (here:
# ../shared/compose-standins, which scripts/compose-test.sh builds). Without
# them it prints one line "ha-test: skipped: <why>" and exits 0.
#
#   HA_TEST_RATE    orders a second during the faults (default 20)
#   HA_TEST_COMPARE_RATE  orders a second of each replication run (default 40)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
rate=${HA_TEST_RATE:-20}
compare_rate=${HA_TEST_COMPARE_RATE:-40}
project=sas-hatest-$$
keep=$root/target/ha-test

name=ha-test
# shellcheck source=lib/compose.sh
. scripts/lib/compose.sh

docker info >/dev/null 2>&1 || skip "no Docker engine answers (docker info); scripts/compose-test.sh starts one from ../shared/compose-standins"
docker compose version >/dev/null 2>&1 || skip "the docker compose v2 plugin is missing"
for image in debian:bookworm-slim rust:1-slim-bookworm rabbitmq:3.13-management; do
  docker image inspect "$image" >/dev/null 2>&1 || skip "image $image is missing (../shared/compose-standins/build.sh builds it)"
done
python3 -c 'import pika' 2>/dev/null || export PYTHONPATH="$root/target/compose-test/python${PYTHONPATH:+:$PYTHONPATH}"
python3 -c 'import pika' 2>/dev/null \
  || PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check \
    --target "$root/target/compose-test/python" pika \
  || fail "cannot install pika"
mkdir -p "$keep"

# --- A project of its own: passwords, ports, temporary files ------------------------
start_project "sas-hatest:$$"
compose() {
  docker compose -p "$project" --env-file "$tmp/env" -f docker-compose.yml \
    -f docker-compose.ha.yml -f "$tmp/image.yml" "$@"
}
read -r amqp_port amqp2_port amqp3_port management_port sim_port console_port gateway_port < <(free_ports 7)
cat >>"$tmp/env" <<EOF
PATRONI_SUPERUSER_PASSWORD=$(secret)
PATRONI_REPLICATION_PASSWORD=$(secret)
RABBITMQ_ERLANG_COOKIE=$(secret)$(secret)
RABBITMQ_AMQP_PORT=$amqp_port
RABBITMQ_2_AMQP_PORT=$amqp2_port
RABBITMQ_3_AMQP_PORT=$amqp3_port
RABBITMQ_MANAGEMENT_PORT=$management_port
REMOTE_SIM_PORT=$sim_port
CONSOLE_PORT=$console_port
GATEWAY_PORT=$gateway_port
EOF

# --- Helpers ------------------------------------------------------------------------
container() { compose ps -a -q "$1"; }
healthy() { [ "$(docker inspect -f '{{.State.Health.Status}}' "$(container "$1")" 2>/dev/null)" = healthy ]; }
# sql QUERY: through HAProxy (the `postgres` service), to whichever node is primary.
sql() {
  compose exec -T -e PGPASSWORD="$owner_password" postgres \
    psql -X -q -A -t -h 127.0.0.1 -U sas_owner -d sas -c "$1" 2>/dev/null
}
rabbit_nodes=(rabbitmq rabbitmq-2 rabbitmq-3)
broker_ctl() { # rabbitmqctl on the first node that answers
  local node
  for node in "${rabbit_nodes[@]}"; do
    compose exec -T "$node" rabbitmqctl -q "$@" 2>/dev/null && return 0
  done
  return 1
}
patroni() { # NODE PATH: the HTTP status of Patroni's REST endpoint PATH on NODE
  compose exec -T "$1" curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:8008$2" 2>/dev/null || echo 000
}
primary() { # the Patroni node that is primary, if one is
  local node
  for node in pg-1 pg-2; do
    [ "$(patroni "$node" /primary)" = 200 ] && { echo "$node"; return 0; }
  done
  return 1
}
has_primary() { primary >/dev/null; }
has_sync_standby() {
  local node
  for node in pg-1 pg-2; do [ "$(patroni "$node" /sync)" = 200 ] && return 0; done
  return 1
}
no_sync_standby() { ! has_sync_standby; }
is_replica() { [ "$(patroni "$1" /replica)" = 200 ]; }
ended() { sql "SELECT count(*) FROM order_process WHERE state IN ('processed', 'compensated')"; }
# completing_since EPOCH: an order received after EPOCH has ended, so the
# whole path works again: publish, intake, every step, the end (host and
# database share a clock).
completing_since() {
  [ "$(sql "SELECT count(*) FROM order_process p JOIN orders o USING (order_id)
             WHERE p.state IN ('processed', 'compensated') AND o.received_at > to_timestamp($1)" \
       || echo 0)" -gt 0 ]
}
all_ended() { # N: N orders ended (fails at once on one in error)
  local failed
  failed=$(sql "SELECT count(*) FROM order_process WHERE state = 'error'" || echo 0)
  [ "${failed:-0}" = 0 ] || fail "$failed orders ended in error: sasctl alerts"
  [ "$(ended)" = "$1" ]
}
# publisher NAME COUNT RATE: publishes COUNT orders NAME-<n> (0: until SIGTERM),
# RATE a second (0: as fast as confirmed), to whichever RabbitMQ node takes
# them, and writes how many are confirmed to $tmp/published. An unconfirmed
# order is sent again after a reconnection: intake is idempotent on its id.
publish_in_background() {
  echo 0 >"$tmp/published"
  AMQP_URLS="$(for port in "$amqp_port" "$amqp2_port" "$amqp3_port"; do printf 'amqp://sas-client:%s@127.0.0.1:%s/%%2f?heartbeat=10 ' "$client_password" "$port"; done)" \
    python3 scripts/lib/publish-orders.py "$1" "$2" "$3" 0 "$tmp/published" \
    >"$tmp/publisher.log" 2>&1 &
  publisher=$!
}
published() { cat "$tmp/published" 2>/dev/null || echo 0; }
# steady: waits until the backlog of the last fault has drained, so that
# each fault is measured on its own: no more orders open than 2 s of load,
# or, on a machine so slow that the steady state itself holds more (Little's
# law: rate × latency; a CI run saw 1.8 s at p50), no open order received
# more than 60 s ago (a step deadline, a retry's backoff and the next
# attempt). On a timeout it prints what is open, and where it waits.
few_open() {
  [ "$(sql "SELECT count(*) FROM order_process WHERE state NOT IN ('processed', 'compensated')" || echo 999999)" \
    -le $((rate * 2)) ] \
    || [ "$(sql "SELECT count(*) FROM order_process p JOIN orders o USING (order_id)
                  WHERE p.state NOT IN ('processed', 'compensated')
                    AND o.received_at < now() - interval '60 seconds'" || echo 1)" = 0 ]
}
backlog() { # what is open, for a failed wait
  say "open orders by state, line and age:"
  sql "SELECT p.state || ' ' || coalesce('waiting for ' || p.waiting_for, 'held by ' || coalesce(p.locked_by, 'nobody'))
              || ': ' || count(*) || ', oldest received ' || round(EXTRACT(EPOCH FROM now() - min(o.received_at))) || ' s ago'
         FROM order_process p JOIN orders o USING (order_id)
        WHERE p.state NOT IN ('processed', 'compensated')
        GROUP BY p.state, p.waiting_for, p.locked_by ORDER BY count(*) DESC LIMIT 20" >&2 || true
  say "admission (agent in_flight waiting limit ceiling):"
  sql "SELECT agent || ' ' || in_flight || ' ' || waiting || ' ' || admit_limit || ' ' || ceiling FROM admission_now ORDER BY agent" >&2 || true
  say "the oldest open order's last history lines:"
  sql "SELECT h.at || ' ' || h.actor || ' ' || h.event || ' ' || coalesce(h.step, '') || ' ' || coalesce(h.detail, '')
         FROM history h WHERE h.order_id = (SELECT p.order_id FROM order_process p JOIN orders o USING (order_id)
                                              WHERE p.state NOT IN ('processed', 'compensated')
                                              ORDER BY o.received_at LIMIT 1)
        ORDER BY h.id DESC LIMIT 10" >&2 || true
  broker_ctl list_queues --no-table-headers name messages_ready messages_unacknowledged consumers >&2 || true
}
steady() {
  local deadline=$(($(date +%s) + 300))
  until few_open; do
    if [ "$(date +%s)" -ge "$deadline" ]; then
      backlog
      fail "the backlog drained before the next fault: not within 300 s"
    fi
    sleep 0.5
  done
}
# Each fault's figures: its name, when it happened, when orders completed again.
faults=()
fault() { # NAME EPOCH: waits until an order ends after EPOCH, records the fault
  wait_for "orders completing again after: $1" 180 completing_since "$2"
  local back
  back=$(now)
  faults+=("$1|$2|$back|$(awk -v a="$2" -v b="$back" 'BEGIN { printf "%.1f", b - a }')")
  say "$1: orders completing again after $(awk -v a="$2" -v b="$back" 'BEGIN { printf "%.1f", b - a }') s"
}

# --- Build and start ----------------------------------------------------------------
started=$(now)
say "building the images (project $project)"
compose build migrate etcd-1 pg-1 postgres >"$tmp/build.log" 2>&1 \
  || { cp "$tmp/build.log" "$keep/build.log"; fail "the image build failed: $keep/build.log"; }
say "images built in $(since "$started") s"
up_started=$(now)
compose up -d --wait --no-build >"$tmp/up.log" 2>&1 \
  || { cp "$tmp/up.log" "$keep/up.log"; fail "docker compose up --wait failed: $keep/up.log"; }
say "healthy in $(since "$up_started") s"

# --- 1. The cluster is whole ----------------------------------------------------------
members=$(broker_ctl cluster_status --formatter json \
  | python3 -c 'import json, sys; print(len(json.load(sys.stdin)["running_nodes"]))')
[ "$members" = 3 ] || fail "RabbitMQ runs $members nodes, not 3"
broker_ctl list_queues --no-table-headers name type members >"$tmp/queues.txt" || fail "cannot list the queues"
python3 - "$tmp/queues.txt" <<'EOF' || fail "a quorum queue without 3 members: $(cat "$tmp/queues.txt")"
import sys
quorum = [line.split(None, 2) for line in open(sys.argv[1]) if line.split()[1:2] == ["quorum"]]
assert quorum, "no quorum queue"
short = [name for name, _, members in quorum if members.count("rabbit@") != 3]
sys.exit(f"fewer than 3 members: {short}" if short else 0)
EOF
wait_for "a Patroni primary with a synchronous standby" 60 has_sync_standby
say "cluster: 3 RabbitMQ nodes, $(grep -c quorum "$tmp/queues.txt") quorum queues with 3 members each, primary $(primary) with a synchronous standby"
sim PUT /admin/faults '{"latency_ms": 20, "transient_fault_rate": 0.02, "permanent_fault_rate": 0, "hang_rate": 0}' >/dev/null

# --- 2. What synchronous replication costs --------------------------------------------
# Commits: pgbench's simple updates on the primary, 10 s each, over 4
# connections, synchronous_commit on (waits for the standby) and local.
primary_node=$(primary) || fail "no primary"
compose exec -T "$primary_node" psql -X -q -h /run/postgresql -U postgres -c 'CREATE DATABASE bench' >/dev/null
compose exec -T "$primary_node" pgbench -q -i -s 4 -h /run/postgresql -U postgres bench >/dev/null 2>&1 \
  || fail "pgbench -i failed"
pgbench_run() { # SYNCHRONOUS_COMMIT: prints "tps latency-ms"
  compose exec -T -e PGOPTIONS="-c synchronous_commit=$1" "$primary_node" \
    pgbench -n -N -c 4 -j 2 -T 10 -h /run/postgresql -U postgres bench 2>/dev/null \
    | awk '/^latency average/ { latency = $4 } /^tps/ { tps = $3 } END { printf "%.0f %.2f\n", tps, latency }'
}
read -r sync_tps sync_commit_ms < <(pgbench_run on)
read -r async_tps async_commit_ms < <(pgbench_run local)
say "commits: synchronous $sync_tps/s at $sync_commit_ms ms, asynchronous $async_tps/s at $async_commit_ms ms"
# Orders: the same steady rate with each, their latency from receipt to end.
replication_run() { # NAME: $compare_rate orders a second for 15 s; prints "p50 p99" in ms
  local before count=$((compare_rate * 15))
  before=$(ended)
  publish_in_background "$1" "$count" "$compare_rate"
  wait "$publisher" || { cat "$tmp/publisher.log" >&2; fail "the publisher failed"; }
  publisher=""
  wait_for "the $count orders of $1 ended" 300 all_ended $((before + count))
  sql "SELECT round(1000 * percentile_cont(0.5) WITHIN GROUP (ORDER BY d)) || ' ' ||
              round(1000 * percentile_cont(0.99) WITHIN GROUP (ORDER BY d))
         FROM (SELECT EXTRACT(EPOCH FROM p.updated_at - o.received_at) AS d
                 FROM order_process p JOIN orders o USING (order_id)
                WHERE o.order_id LIKE '$1-%') latencies"
}
read -r sync_p50 sync_p99 < <(replication_run sync)
compose exec -T "$primary_node" patronictl -c /etc/patroni/patroni.yml edit-config --force \
  --set synchronous_mode=false >/dev/null || fail "cannot switch to asynchronous replication"
wait_for "asynchronous replication" 60 no_sync_standby
read -r async_p50 async_p99 < <(replication_run async)
compose exec -T "$primary_node" patronictl -c /etc/patroni/patroni.yml edit-config --force \
  --set synchronous_mode=true >/dev/null || fail "cannot switch back to synchronous replication"
wait_for "a synchronous standby again" 60 has_sync_standby
say "orders at $compare_rate/s, p50 / p99: synchronous $sync_p50 / $sync_p99 ms, asynchronous $async_p50 / $async_p99 ms"

# --- 3. Faults under a steady load ------------------------------------------------------
say "steady load: $rate orders/s"
load_started=$(now)
publish_in_background load 0 "$rate"
published_at_least() { [ "$(published)" -ge "$1" ]; }
wait_for "30 s of load under way" 90 published_at_least $((rate * 30))

steady
# a. kill -9 of the node that leads the busiest queue, the replies.
leader=$(broker_ctl list_queues --no-table-headers name leader \
  | awk '$1 == "sas.scheduler.replies" { sub(/^rabbit@/, "", $2); print $2 }')
[ -n "$leader" ] || fail "no leader for sas.scheduler.replies"
say "a. kill -9 of RabbitMQ node $leader (leads sas.scheduler.replies)"
t=$(now)
docker kill -s KILL "$(container "$leader")" >/dev/null
fault "kill -9 of the RabbitMQ node leading the reply queue (the busiest)" "$t"
docker start "$(container "$leader")" >/dev/null
wait_for "$leader healthy again" 180 healthy "$leader"

steady
# b. a node cut off from the other two, then healed.
network="${project}_default"
cut=rabbitmq-3
[ "$leader" = rabbitmq-3 ] && cut=rabbitmq-2
say "b. network partition: $cut cut off from the other nodes"
t=$(now)
docker network disconnect "$network" "$(container "$cut")"
fault "RabbitMQ node cut off (partition)" "$t"
# Held long enough for the other nodes to notice (net_ticktime) and the minority to pause.
# Load shaping, not waiting for a condition: the partition lasts 75 s.
sleep 75
docker network connect --alias "$cut" "$network" "$(container "$cut")"
wait_for "$cut back in the cluster" 180 healthy "$cut"

steady
# c. kill -9 of the Postgres primary: the synchronous standby takes over.
old_primary=$(primary) || fail "no primary"
say "c. kill -9 of the Postgres primary $old_primary"
t=$(now)
docker kill -s KILL "$(container "$old_primary")" >/dev/null
fault "kill -9 of the Postgres primary" "$t"
new_primary=$(primary) || fail "no primary after the failover"
[ "$new_primary" != "$old_primary" ] || fail "$old_primary is primary again"

steady
# d. the old primary comes back: as a standby, refusing writes.
say "d. the old primary $old_primary starts again"
t=$(now)
docker start "$(container "$old_primary")" >/dev/null
fault "the old Postgres primary back (as a standby)" "$t"
wait_for "$old_primary back as a standby" 180 is_replica "$old_primary"
in_recovery=$(compose exec -T "$old_primary" psql -X -A -t -h /run/postgresql -U postgres -c 'SELECT pg_is_in_recovery()')
[ "$in_recovery" = t ] || fail "$old_primary is not in recovery after coming back: split brain"
if compose exec -T "$old_primary" psql -X -q -h /run/postgresql -U postgres -d sas \
  -c 'CREATE TABLE split_brain_probe ()' >/dev/null 2>&1; then
  fail "$old_primary took a write after coming back: split brain"
fi
[ "$(primary)" = "$new_primary" ] || fail "the primary moved while $old_primary came back"
wait_for "a synchronous standby again" 120 has_sync_standby

steady
# e. a rolling restart: every node, one at a time.
say "e. rolling restart: RabbitMQ, etcd, the Postgres standby, the primary, then HAProxy"
# Each node's restart is a fault of its own: the figure is the worst.
t=$(now)
standby=$old_primary
worst=0 worst_node=""
for node in rabbitmq rabbitmq-2 rabbitmq-3 etcd-1 etcd-2 etcd-3 "$standby" "$new_primary" postgres; do
  node_started=$(now)
  docker restart -t 30 "$(container "$node")" >/dev/null
  wait_for "orders completing again after restarting $node" 180 completing_since "$node_started"
  took=$(since "$node_started")
  if awk -v a="$took" -v b="$worst" 'BEGIN { exit !(a > b) }'; then worst=$took worst_node=$node; fi
  wait_for "$node healthy after its restart" 240 healthy "$node"
  if [[ $node == pg-* ]]; then wait_for "a primary after restarting $node" 120 has_primary; fi
done
rolled=$(now)
faults+=("rolling restart of 9 nodes, one at a time ($(since "$t") s; the worst: $worst_node)|$t|$rolled|$worst")
say "rolling restart: $(since "$t") s; orders completing again at worst $worst s after restarting $worst_node"
# Load shaping: 30 s more of steady load, for the figures after the last fault.
sleep 30

kill -TERM "$publisher"
wait "$publisher" || { cat "$tmp/publisher.log" >&2; fail "the publisher failed"; }
publisher=""
say "publisher: $(tail -n 1 "$tmp/publisher.log")"
total=$((2 * compare_rate * 15 + $(published)))
wait_for "every order ended ($total published)" 600 all_ended "$total"
load_seconds=$(since "$load_started")

# --- 4. Nothing lost, nothing twice, nothing undone before it was done -------------------
stored=$(sql "SELECT count(*) FROM orders")
[ "$stored" = "$total" ] || fail "$total orders published, $stored stored"
alerts=$(sql "SELECT count(*) FROM alerts")
[ "$alerts" = 0 ] || fail "$alerts operator alerts: $(sql "SELECT kind || ': ' || message FROM alerts LIMIT 5")"
sim GET /side-effects >"$tmp/ledger.json"
sql "SELECT order_id, state FROM order_process" >"$tmp/states.txt"
python3 scripts/lib/check-ledger.py "$tmp/ledger.json" "$tmp/states.txt" >"$tmp/ledger-check.txt" \
  || { cat "$tmp/ledger-check.txt" >&2; fail "remote-sim's ledger"; }
states=$(sql "SELECT state || '=' || count(*) FROM order_process GROUP BY state ORDER BY state" | paste -sd ' ')

# --- 5. Figures --------------------------------------------------------------------------
# For each fault: orders/s and p99 latency (received to ended) of the orders
# that ended in the 30 s before it, during it (until an order received after
# it ended; for the rolling restart, until the last node was back), and in
# the 30 s after that.
window() { # FROM TO: "orders/s p99-ms" of the orders that ended in [FROM, TO)
  sql "SELECT round(count(*) / greatest($2 - $1, 0.001), 1) || ' ' ||
              coalesce(round(1000 * percentile_cont(0.99) WITHIN GROUP (ORDER BY
                EXTRACT(EPOCH FROM p.updated_at - o.received_at)))::text, '-')
         FROM order_process p JOIN orders o USING (order_id)
        WHERE p.state IN ('processed', 'compensated') AND o.order_id LIKE 'load-%'
          AND p.updated_at >= to_timestamp($1) AND p.updated_at < to_timestamp($2)"
}
# slow_seconds FROM TO: the seconds s of [FROM, TO) whose next 5 s saw fewer
# than half the offered rate of orders end: how long throughput stayed down.
slow_seconds() {
  sql "SELECT count(*) FROM generate_series(0, greatest(floor($2 - $1)::int - 1, 0)) AS s
        WHERE (SELECT count(*) FROM order_process p
                WHERE p.order_id LIKE 'load-%' AND p.state IN ('processed', 'compensated')
                  AND p.updated_at >= to_timestamp($1 + s)
                  AND p.updated_at < to_timestamp($1 + s + 5)) < $rate * 5 / 2.0"
}
{
  echo "| fault | until an order received after it ended | seconds below half the offered rate (until the next fault) | before: orders/s, p99 | during | 30 s after |"
  echo "|---|---|---|---|---|---|"
  count=${#faults[@]}
  for index in "${!faults[@]}"; do
    IFS='|' read -r fault_name at back recovery <<<"${faults[$index]}"
    if [ $((index + 1)) -lt "$count" ]; then
      IFS='|' read -r _ next _ _ <<<"${faults[$((index + 1))]}"
    else
      next=$(awk -v t="$back" 'BEGIN { printf "%.3f", t + 30 }')
    fi
    before=$(window "$(awk -v t="$at" 'BEGIN { printf "%.3f", t - 30 }')" "$at")
    during=$(window "$at" "$back")
    after=$(window "$back" "$(awk -v t="$back" 'BEGIN { printf "%.3f", t + 30 }')")
    printf '| %s | %s s | %s s of %.0f | %s/s, %s ms | %s/s, %s ms | %s/s, %s ms |\n' "$fault_name" "$recovery" \
      "$(slow_seconds "$at" "$next")" "$(awk -v a="$at" -v b="$next" 'BEGIN { print b - a }')" \
      ${before% *} ${before#* } ${during% *} ${during#* } ${after% *} ${after#* }
  done
  echo
  echo "Replication, side by side on the same cluster: commits (pgbench, 4 connections)" \
    "$sync_tps/s at $sync_commit_ms ms synchronous, $async_tps/s at $async_commit_ms ms asynchronous;" \
    "orders at $compare_rate/s, p50 / p99 from receipt to end, $sync_p50 / $sync_p99 ms synchronous," \
    "$async_p50 / $async_p99 ms asynchronous."
} >"$keep/figures.md"
cat "$keep/figures.md"
say "orders: $total ($states) at $rate/s through the faults, all ended $load_seconds s after the load began"
say "ledger: $(head -n 1 "$tmp/ledger-check.txt"); operator alerts: $alerts"
say "passed in $(since "$started") s"
