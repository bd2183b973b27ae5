#!/usr/bin/env bash
# Runs the highly available topology for real (docker-compose.yml with
# docker-compose.ha.yml: 3 RabbitMQ nodes, 3 Postgres nodes run by Patroni
# with strict synchronous replication behind two HAProxies, 3 etcd members
# with authentication) and checks what it promises
# (docs/high-availability.md):
#   1. the cluster is whole: 3 RabbitMQ nodes, every quorum queue with 3
#      members, a Patroni leader with a synchronous standby; the control
#      plane closed: no service's container reaches etcd or Patroni's REST
#      API, and a node without the passwords changes nothing;
#   2. what synchronous replication costs against asynchronous, side by
#      side: commits (pgbench on the primary, synchronous_commit on and
#      local) and orders (HA_TEST_COMPARE_RATE a second for 15 s each, p50
#      and p99 from receipt to end);
#   3. under a steady load of orders (HA_TEST_RATE a second, from the host
#      with pika, trying each RabbitMQ node in turn), one after another,
#      each from whole clusters (every Postgres standby streaming, every
#      RabbitMQ node running) and a drained backlog:
#      kill -9 of the RabbitMQ node that leads the busiest queue (the
#      schedulers' replies: 3 an order); one RabbitMQ node cut off from the other two (docker
#      network disconnect), then healed; kill -9 of the Postgres primary;
#      the old primary started again (it must come back as a standby and
#      refuse a write); the Postgres primary frozen (docker pause) past the
#      leader's TTL and resumed, three times (HA_TEST_PG_PAUSES seconds: a
#      race): it must come back as a standby, never take the lock back; a
#      RabbitMQ node frozen past net_ticktime; the primary cut off from etcd
#      only (its clients still reach it); both at once; an HAProxy killed
#      (-9, left down: the other carries on) and one whose process dies
#      (Docker restarts it); every node restarted one at a time, HAProxy
#      last;
#   4. after the faults: every order the broker confirmed is stored
#      (scripts/lib/check-confirmed.py, fault by fault) and ended, none in
#      error, no operator alert, each side effect applied once, no undo
#      before its action, and no effect for an order the database does not
#      know (remote-sim's ledger, scripts/lib/check-ledger.py);
#   5. prints, and writes to target/ha-test/figures.md, for each fault the
#      time until orders complete again, the longest time without a
#      completed order, the orders confirmed and lost in it, and orders/s
#      and p99 latency before, during and after it.
# Always (also on failure) runs `docker compose down -v`; a failed run keeps
# the services' logs in target/ha-test/.
#
# Needs a Docker engine with compose v2 and the images the files name (here:
# ../shared/compose-standins, which scripts/compose-test.sh builds). Without
# them it prints one line "ha-test: skipped: <why>" and exits 0.
#
#   HA_TEST_RATE    orders a second during the faults (default 20)
#   HA_TEST_COMPARE_RATE  orders a second of each replication run (default 40)
#   HA_TEST_PG_PAUSES     seconds of each freeze of the Postgres primary
#                         (default "30 36 45": past the leader TTL, 20 s)
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
    -f docker-compose.ha.yml -f "$tmp/image.yml" -f "$tmp/build-ca.yml" "$@"
}
# The Patroni image installs Patroni from PyPI: behind a proxy with a CA of
# its own (this machine's egress), the build gets the system's CA bundle.
cat >"$tmp/build-ca.yml" <<EOF
services:
  pg-1:
    build:
      context: deploy/ha/patroni
      secrets: [build_ca]
secrets:
  build_ca:
    file: /etc/ssl/certs/ca-certificates.crt
EOF
read -r amqp_port amqp2_port amqp3_port management_port sim_port console_port gateway_port < <(free_ports 7)
cat >>"$tmp/env" <<EOF
PATRONI_SUPERUSER_PASSWORD=$(secret)
PATRONI_REPLICATION_PASSWORD=$(secret)
PATRONI_RESTAPI_PASSWORD=$(secret)
ETCD_ROOT_PASSWORD=$(secret)
ETCD_PATRONI_PASSWORD=$(secret)
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
# freeze SERVICE: docker pause, tried again when the kernel's freezer gives
# up (runc's "unable to freeze", seen in CI: a process in uninterruptible
# I/O, a primary just promoted and flushing, does not stop in runc's time;
# runc thaws the container again). The fault starts when the freeze holds.
freeze() {
  local id attempt
  id=$(container "$1")
  for attempt in 1 2 3 4 5; do
    docker pause "$id" >/dev/null && return 0
    say "$1: docker pause failed (attempt $attempt of 5)"
    [ "$(docker inspect -f '{{.State.Paused}}' "$id")" = true ] && return 0
    sleep 1
  done
  fail "$1 could not be frozen (docker pause failed 5 times)"
}
healthy() { [ "$(docker inspect -f '{{.State.Health.Status}}' "$(container "$1")" 2>/dev/null)" = healthy ]; }
# sql QUERY: through an HAProxy (`postgres`, or `postgres-2` while it is
# down), to whichever node is primary.
sql() {
  local proxy
  for proxy in postgres postgres-2; do
    compose exec -T -e PGPASSWORD="$owner_password" "$proxy" \
      psql -X -q -A -t -h 127.0.0.1 -U sas_owner -d sas -c "$1" 2>/dev/null && return 0
  done
  return 1
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
pg_nodes=(pg-1 pg-2 pg-3)
primary() { # the Patroni node that is primary, if one is
  local node
  for node in "${pg_nodes[@]}"; do
    [ "$(patroni "$node" /primary)" = 200 ] && { echo "$node"; return 0; }
  done
  return 1
}
has_primary() { primary >/dev/null; }
has_sync_standby() {
  local node
  for node in "${pg_nodes[@]}"; do [ "$(patroni "$node" /sync)" = 200 ] && return 0; done
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
  CONFIRMED="$tmp/confirmed.tsv" AMQP_URLS="$(for port in "$amqp_port" "$amqp2_port" "$amqp3_port"; do printf 'amqp://sas-client:%s@127.0.0.1:%s/%%2f?heartbeat=10 ' "$client_password" "$port"; done)" \
    python3 scripts/lib/publish-orders.py "$1" "$2" "$3" 0 "$tmp/published" \
    >"$tmp/publisher.log" 2>&1 &
  publisher=$!
}
published() { cat "$tmp/published" 2>/dev/null || echo 0; }
# few_open: the backlog of the last fault has drained, so that
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
# steady: both clusters whole (every Postgres standby streaming, every
# RabbitMQ node running), then the backlog drained; drained alone is for
# bringing back a node the last fault left down.
steady() {
  wait_for "the Postgres cluster whole (every standby streaming)" 240 postgres_whole
  wait_for "the RabbitMQ cluster whole" 240 healthy_cluster
  drained
}
drained() {
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
  printf '%s\t%s\t%s\n' "$1" "$2" "$back" >>"$tmp/faults.tsv"
  say "$1: orders completing again after $(awk -v a="$2" -v b="$back" 'BEGIN { printf "%.1f", b - a }') s"
}
# until_epoch EPOCH: sleeps until EPOCH (load shaping: a fault lasts as long
# as the test says, whatever happened meanwhile).
until_epoch() { # EPOCH
  local left
  left=$(awk -v t="$1" -v n="$(now)" 'BEGIN { d = t - n; printf "%.3f", (d > 0 ? d : 0) }')
  sleep "$left"
}
# streaming NODE: NODE is a replica that streams from the primary
# (Patroni's /readiness: running, and replication_state streaming), not
# only one that runs (/replica answers 200 while it still rewinds).
streaming() { is_replica "$1" && [ "$(patroni "$1" /readiness)" = 200 ]; }
# rejoined NODE: NODE streams again and a synchronous standby exists.
rejoined() { streaming "$1" && has_sync_standby; }
# postgres_whole: a primary, and every other node streaming from it: a
# fault starts from a whole cluster, never from one still rejoining.
postgres_whole() {
  local node leader
  leader=$(primary) || return 1
  for node in "${pg_nodes[@]}"; do
    [ "$node" = "$leader" ] || streaming "$node" || return 1
  done
  has_sync_standby
}
not_primary() { [ "$(patroni "$1" /primary)" != 200 ]; }
# healthy_cluster: every RabbitMQ node runs, none partitioned.
healthy_cluster() { all_running && ! partitioned; }
cluster_status() { broker_ctl cluster_status --formatter json; }
# all_running: the node asked lists all three as running. A node still
# settling may answer nothing (not JSON): that is "not yet", not an error.
all_running() {
  cluster_status 2>/dev/null \
    | python3 -c 'import json, sys
try:
    sys.exit(0 if len(json.load(sys.stdin)["running_nodes"]) == 3 else 1)
except ValueError:
    sys.exit(1)'
}
# partitioned: any node records a partition (Mnesia's inconsistent_database).
# Each node is asked in turn: a node's own record may be all there is, and
# the first node that answers may not list the one left out.
partitioned() {
  local node
  for node in "${rabbit_nodes[@]}"; do
    compose exec -T "$node" rabbitmqctl -q cluster_status --formatter json 2>/dev/null \
      | python3 -c 'import json, sys
try:
    sys.exit(0 if json.load(sys.stdin).get("partitions") else 1)
except ValueError:
    sys.exit(1)' \
      && return 0
  done
  return 1
}
# each_node_view: what every RabbitMQ node says of the cluster (running
# nodes, partitions, alarms), for the record when a node does not rejoin.
each_node_view() {
  local node
  for node in "${rabbit_nodes[@]}"; do
    printf '%s: ' "$node"
    compose exec -T "$node" rabbitmqctl -q cluster_status --formatter json 2>&1 \
      | python3 -c 'import json, sys
try:
    s = json.load(sys.stdin)
    print("running", s.get("running_nodes"), "partitions", s.get("partitions"), "alarms", s.get("alarms"))
except Exception as e:
    print("no answer:", e)' || true
  done
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
[ "$(sql "SELECT rolsuper FROM pg_roles WHERE rolname = current_user")" = f ] \
  || fail "the schema owner sas_owner is a superuser"
# The control plane is closed. A container on the services' network (as a
# service, the console, the gateway or remote-sim is) resolves neither etcd
# nor a Postgres node, and cannot reach their addresses either.
addresses=$(for node in etcd-1 pg-1; do
  docker inspect -f '{{range .NetworkSettings.Networks}}{{.IPAddress}} {{end}}' "$(container "$node")"
done | tr '\n' ' ')
docker run --rm --network "${project}_default" debian:bookworm-slim bash -c '
  for host in etcd-1 pg-1 pg-2 pg-3; do getent hosts "$host" && exit 1; done
  for address in '"$addresses"'; do
    for port in 2379 8008 5432; do timeout 3 bash -c "</dev/tcp/$address/$port" 2>/dev/null && exit 2; done
  done
  exit 0' \
  || fail "a container on the services' network reaches etcd or a Postgres node"
# A node of the cluster without the passwords reads Patroni's status but
# changes nothing, and reads nothing of etcd.
unsafe=$(compose exec -T pg-2 curl -s -o /dev/null -w '%{http_code}' -X POST http://pg-1:8008/restart)
[ "$unsafe" = 401 ] || fail "Patroni's REST API took an unauthenticated restart: $unsafe"
anonymous=$(compose exec -T pg-2 curl -s -X POST http://etcd-1:2379/v3/kv/range -d '{"key": "L3NlcnZpY2Uv", "range_end": "L3NlcnZpY2Uw"}')
case $anonymous in *'"kvs"'*|*'"count"'*) fail "etcd answered an anonymous read: $anonymous" ;; esac
say "control plane: etcd and Patroni unreachable from the services' network; without passwords, Patroni refuses a restart (401) and etcd a read"
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

# What the database path costs under this load: each Postgres node, etcd
# member and HAProxy (docker stats: CPU over a moment, memory now).
node_costs=$(for node in pg-1 pg-2 pg-3 etcd-1 postgres postgres-2; do
  docker stats --no-stream --format "$node {{.CPUPerc}} {{.MemUsage}}" "$(container "$node")" \
    | awk '{ print $1 " " $2 " " $3 }'
done | paste -sd ',' | sed 's/,/, /g')
say "database path at $rate orders/s (CPU, memory): $node_costs"

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

drained
# d. the old primary comes back: as a standby, refusing writes.
say "d. the old primary $old_primary starts again"
t=$(now)
docker start "$(container "$old_primary")" >/dev/null
fault "the old Postgres primary back (as a standby)" "$t"
wait_for "$old_primary back as a standby" 180 streaming "$old_primary"
in_recovery=$(compose exec -T "$old_primary" psql -X -A -t -h /run/postgresql -U postgres -c 'SELECT pg_is_in_recovery()')
[ "$in_recovery" = t ] || fail "$old_primary is not in recovery after coming back: split brain"
if compose exec -T "$old_primary" psql -X -q -h /run/postgresql -U postgres -d sas \
  -c 'CREATE TABLE split_brain_probe ()' >/dev/null 2>&1; then
  fail "$old_primary took a write after coming back: split brain"
fi
[ "$(primary)" = "$new_primary" ] || fail "the primary moved while $old_primary came back"
wait_for "a synchronous standby again" 120 has_sync_standby

# f. The Postgres primary frozen past the leader's TTL, then resumed: a
# standby takes the lock and is promoted while it is frozen; resumed, it
# must find the lock taken and come back as a standby, never take it back
# (Patroni 3.0.2 did, in 3 runs of 5, and its successor's commits were
# lost). Three times, for different lengths: it is a race.
for pause in ${HA_TEST_PG_PAUSES:-30 36 45}; do
  steady
  frozen=$(primary) || fail "no primary"
  say "f. the Postgres primary $frozen frozen for $pause s (docker pause)"
  freeze "$frozen"
  t=$(now)
  fault "the Postgres primary frozen $pause s (past the leader TTL), then resumed" "$t"
  # Load shaping: the freeze lasts $pause s, whenever the failover ended.
  until_epoch "$(awk -v t="$t" -v p="$pause" 'BEGIN { printf "%.3f", t + p }')"
  docker unpause "$(container "$frozen")" >/dev/null
  wait_for "$frozen back as a standby after its freeze" 180 rejoined "$frozen"
  successor=$(primary) || fail "no primary after $frozen resumed"
  [ "$successor" != "$frozen" ] || fail "$frozen took the primary back after its freeze"
done

steady
# g. A RabbitMQ node frozen past net_ticktime (15 s): the others count it
# gone and the queues it led elect new leaders; resumed, it follows them.
frozen_rabbit=rabbitmq-2
say "g. RabbitMQ node $frozen_rabbit frozen for 30 s (docker pause)"
freeze "$frozen_rabbit"
t=$(now)
fault "a RabbitMQ node frozen 30 s (past net_ticktime), then resumed" "$t"
until_epoch "$(awk -v t="$t" 'BEGIN { printf "%.3f", t + 30 }')"
docker unpause "$(container "$frozen_rabbit")" >/dev/null
# Both sides thought the other down: RabbitMQ 3.10 may record a partition
# (Mnesia's inconsistent_database) that pause_minority does not clear, since
# the resumed node was never in a minority it could see; Mnesia then leaves
# the node out of the running nodes. Traffic flows (the queues are Raft's);
# the record stays until the resumed node restarts, which is what
# docs/high-availability.md tells an operator to do.
# A third outcome was seen in CI (1 run in 4): neither, for 240 s; the
# resumed node had paused itself (pause_minority) and stayed paused. The
# remedy an operator is told is the same: restart the node. The test says
# which outcome it saw, and what each node said, and goes on; what it
# proves here is that orders kept flowing (above) and that the node is
# whole again after the remedy (below).
# Which of the two ended the wait is kept (asking again could get another
# answer from a node still settling).
rejoin="neither running nor a partition recorded after 120 s"
running_or_partitioned() {
  if all_running; then rejoin=rejoined; return 0; fi
  if partitioned; then rejoin="a partition recorded"; return 0; fi
  return 1
}
if ! wait_until 120 running_or_partitioned; then
  say "g. $frozen_rabbit: $rejoin; what each node says:"
  each_node_view | while IFS= read -r line; do say "g.   $line"; done
fi
if [ "$rejoin" != rejoined ]; then
  say "g. $rejoin after the freeze: restarting $frozen_rabbit, as docs/high-availability.md tells an operator"
  docker restart -t 30 "$(container "$frozen_rabbit")" >/dev/null
fi
wait_for "$frozen_rabbit back in the cluster, no partition" 240 healthy_cluster
wait_for "$frozen_rabbit healthy" 120 healthy "$frozen_rabbit"

steady
# h. The primary cut off from etcd only: its clients (HAProxy, the
# standbys) still reach it. It cannot renew the lock, demotes itself, and a
# standby takes over; connected again, it rejoins as a standby.
dcs="${project}_dcs"
cut_off=$(primary) || fail "no primary"
say "h. the Postgres primary $cut_off cut off from etcd only, for 40 s"
t=$(now)
docker network disconnect "$dcs" "$(container "$cut_off")"
fault "the Postgres primary cut off from etcd (not from its clients)" "$t"
wait_for "$cut_off no longer primary while cut off" 60 not_primary "$cut_off"
until_epoch "$(awk -v t="$t" 'BEGIN { printf "%.3f", t + 40 }')"
docker network connect --alias "$cut_off" "$dcs" "$(container "$cut_off")"
wait_for "$cut_off back as a standby" 180 rejoined "$cut_off"

steady
# i. Both at once: the primary cut off from etcd, frozen, resumed while
# still cut off (it must not act as primary), then connected again.
both=$(primary) || fail "no primary"
say "i. the Postgres primary $both cut off from etcd and frozen for 30 s, resumed still cut off"
docker network disconnect "$dcs" "$(container "$both")"
freeze "$both"
t=$(now)
fault "the Postgres primary cut off from etcd and frozen 30 s, resumed still cut off" "$t"
until_epoch "$(awk -v t="$t" 'BEGIN { printf "%.3f", t + 30 }')"
docker unpause "$(container "$both")" >/dev/null
wait_for "$both not primary while still cut off" 30 not_primary "$both"
until_epoch "$(awk -v t="$t" 'BEGIN { printf "%.3f", t + 40 }')"
docker network connect --alias "$both" "$dcs" "$(container "$both")"
wait_for "$both back as a standby" 180 rejoined "$both"

steady
# j. An HAProxy killed and left down (docker kill: Docker does not restart
# a container killed by hand): the services reach the other one, under the
# same name. Then the other's process dies: Docker restarts its container.
say "j. HAProxy postgres killed (-9) and left down"
t=$(now)
docker kill -s KILL "$(container postgres)" >/dev/null
fault "one HAProxy killed (-9) and left down" "$t"
docker start "$(container postgres)" >/dev/null
wait_for "HAProxy postgres healthy again" 120 healthy postgres
steady
restarts=$(docker inspect -f '{{.RestartCount}}' "$(container postgres-2)")
say "j. the HAProxy process of postgres-2 killed (-9): its container exits"
t=$(now)
docker exec "$(container postgres-2)" sh -c 'for d in /proc/[0-9]*; do
  pid=${d#/proc/}
  [ "$pid" != 1 ] && [ "$(readlink "$d/exe")" = /usr/sbin/haproxy ] && kill -9 "$pid"
done; true'
restarted() { [ "$(docker inspect -f '{{.RestartCount}}' "$(container postgres-2)")" -gt "$restarts" ]; }
wait_for "Docker restarting postgres-2" 60 restarted
fault "the other HAProxy's process killed (-9), its container restarted by Docker" "$t"
wait_for "HAProxy postgres-2 healthy again" 120 healthy postgres-2

steady
# e. a rolling restart: every node, one at a time.
say "e. rolling restart: RabbitMQ, etcd, the Postgres standbys, the primary, then the HAProxies"
# Each node's restart is a fault of its own: the figure is the worst.
t=$(now)
last_primary=$(primary) || fail "no primary"
standbys=()
for node in "${pg_nodes[@]}"; do [ "$node" = "$last_primary" ] || standbys+=("$node"); done
worst=0 worst_node=""
for node in rabbitmq rabbitmq-2 rabbitmq-3 etcd-1 etcd-2 etcd-3 "${standbys[@]}" "$last_primary" postgres postgres-2; do
  node_started=$(now)
  docker restart -t 30 "$(container "$node")" >/dev/null
  wait_for "orders completing again after restarting $node" 180 completing_since "$node_started"
  took=$(since "$node_started")
  if awk -v a="$took" -v b="$worst" 'BEGIN { exit !(a > b) }'; then worst=$took worst_node=$node; fi
  wait_for "$node healthy after its restart" 240 healthy "$node"
  # The next node waits until this one streams again: one node out at a time.
  if [[ $node == pg-* ]]; then wait_for "the Postgres cluster whole after restarting $node" 240 postgres_whole; fi
done
rolled=$(now)
faults+=("rolling restart of 11 nodes, one at a time ($(since "$t") s; the worst: $worst_node)|$t|$rolled|$worst")
printf '%s\t%s\t%s\n' "rolling restart" "$t" "$rolled" >>"$tmp/faults.tsv"
say "rolling restart: $(since "$t") s; orders completing again at worst $worst s after restarting $worst_node"
# Load shaping: 30 s more of steady load, for the figures after the last fault.
sleep 30

kill -TERM "$publisher"
wait "$publisher" || { cat "$tmp/publisher.log" >&2; fail "the publisher failed"; }
publisher=""
say "publisher: $(tail -n 1 "$tmp/publisher.log")"
total=$((2 * compare_rate * 15 + $(published)))

# --- 4. Nothing lost, nothing twice, nothing undone before it was done -------------------
# Every order the broker confirmed is in the database: "orders complete
# again" after a fault says nothing of the orders that vanished. Checked
# once the orders queue has drained into the database (or 120 s passed),
# so that lost orders are named, fault by fault, rather than waited for.
stored_all() { [ "$(sql "SELECT count(*) FROM orders" || echo 0)" -ge "$total" ]; }
deadline=$(($(date +%s) + 120))
until stored_all || [ "$(date +%s)" -ge "$deadline" ]; do sleep 0.5; done
sql "SELECT order_id, state FROM order_process" >"$tmp/states.txt"
printf '%s\t%s\t%s\n' "before the faults" "$load_started" "$load_started" >>"$tmp/faults.tsv"
python3 scripts/lib/check-confirmed.py "$tmp/confirmed.tsv" "$tmp/states.txt" "$tmp/faults.tsv" \
  >"$tmp/confirmed-check.txt" || { cat "$tmp/confirmed-check.txt" >&2; fail "confirmed orders lost"; }
stored=$(sql "SELECT count(*) FROM orders")
[ "$stored" = "$total" ] || fail "$total orders published, $stored stored"
wait_for "every order ended ($total published)" 600 all_ended "$total"
load_seconds=$(since "$load_started")
sql "SELECT order_id, state FROM order_process" >"$tmp/states.txt"
alerts=$(sql "SELECT count(*) FROM alerts")
[ "$alerts" = 0 ] || fail "$alerts operator alerts: $(sql "SELECT kind || ': ' || message FROM alerts LIMIT 5")"
sim GET /side-effects >"$tmp/ledger.json"
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
# longest_gap FROM TO: the longest time in [FROM, TO) without an order
# ending (from FROM to the first, and between two).
longest_gap() {
  sql "SELECT coalesce(round(max(gap)::numeric, 1), 0) FROM (
         SELECT EXTRACT(EPOCH FROM lead(at) OVER (ORDER BY at) - at) AS gap FROM (
           SELECT to_timestamp($1) AS at
           UNION ALL
           SELECT p.updated_at FROM order_process p
            WHERE p.order_id LIKE 'load-%' AND p.state IN ('processed', 'compensated')
              AND p.updated_at >= to_timestamp($1) AND p.updated_at < to_timestamp($2)) ends) gaps"
}
confirmed_in() { # START: "confirmed lost" of the fault that started at START
  awk -F '\t' -v t="$1" '$1 == t { print $2 " " $3 }' "$tmp/confirmed-check.txt"
}
{
  echo "| fault | until an order received after it ended | longest without a completed order | orders confirmed / lost (until the next fault) | seconds below half the offered rate (until the next fault) | before: orders/s, p99 | during | 30 s after |"
  echo "|---|---|---|---|---|---|---|---|"
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
    read -r confirmed lost < <(confirmed_in "$at")
    printf '| %s | %s s | %s s | %s / %s | %s s of %.0f | %s/s, %s ms | %s/s, %s ms | %s/s, %s ms |\n' "$fault_name" "$recovery" \
      "$(longest_gap "$at" "$next")" "${confirmed:-?}" "${lost:-?}" \
      "$(slow_seconds "$at" "$next")" "$(awk -v a="$at" -v b="$next" 'BEGIN { print b - a }')" \
      ${before% *} ${before#* } ${during% *} ${during#* } ${after% *} ${after#* }
  done
  echo
  echo "Replication, side by side on the same cluster: commits (pgbench, 4 connections)" \
    "$sync_tps/s at $sync_commit_ms ms synchronous, $async_tps/s at $async_commit_ms ms asynchronous;" \
    "orders at $compare_rate/s, p50 / p99 from receipt to end, $sync_p50 / $sync_p99 ms synchronous," \
    "$async_p50 / $async_p99 ms asynchronous."
  echo
  echo "The database path at $rate orders/s (node, CPU, memory): $node_costs."
} >"$keep/figures.md"
cat "$keep/figures.md"
say "orders: $total ($states) at $rate/s through the faults, all ended $load_seconds s after the load began"
say "ledger: $(head -n 1 "$tmp/ledger-check.txt"); confirmed: $(grep '^confirmed=' "$tmp/confirmed-check.txt"); operator alerts: $alerts"
say "passed in $(since "$started") s"
