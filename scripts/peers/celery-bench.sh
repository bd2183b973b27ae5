#!/usr/bin/env bash
# The Celery peer of scripts/bench.sh: the same 3-step order (reserve stock,
# charge payment, create shipment, each an HTTP call to remote-sim with an
# idempotency key) as a Celery chain of 3 tasks on the same RabbitMQ and
# Postgres, measured the same way: saturation orders/s, CPU per order of
# every process involved, p50/p99 latency at half the saturation rate. Two
# variants: "durable" (persistent messages with publisher confirms, acks
# late, reject on worker lost, results in Postgres) and "rpc" (results as
# messages back to the client). Prints a table (with sas-bench's figures
# from target/bench/latest.json beside them when that file is there) and
# writes target/bench/peers.json.
#
#   scripts/peers/celery-bench.sh            full run (a few minutes)
#   scripts/peers/celery-bench.sh --quick    a smoke run (~30 s), not a measurement
#
# More options (pool, concurrency, worker processes, variants, remote-sim
# latency, quorum queues): scripts/peers/celery-bench.sh --help.
#
# It makes a venv in target/peers/venv (scripts/peers/requirements.txt from
# PyPI), its own RabbitMQ vhost (or, when rabbitmqctl cannot, unique queue
# names on "/") and its own Postgres database, and removes both at the end.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD

for arg in "$@"; do
  case "$arg" in
    -h|--help)
      sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
      if [ -x target/peers/venv/bin/python ]; then
        target/peers/venv/bin/python scripts/peers/celery_chain.py bench --help
      fi
      exit 0 ;;
  esac
done

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi
}

# remote-sim, as sas-bench runs it: the dist build bench.sh makes and runs,
# else the release build, else (warned) the debug one.
sim_bin=""
for candidate in target/dist/remote-sim target/release/remote-sim target/debug/remote-sim; do
  if [ -x "$candidate" ]; then sim_bin=$candidate; break; fi
done
if [ -z "$sim_bin" ]; then
  echo "celery-bench: remote-sim is not built; build it with scripts/build-release.sh" >&2
  echo "  (scripts/build-release.sh dist builds what scripts/bench.sh runs, target/dist)" >&2
  exit 1
fi
case "$sim_bin" in
  target/debug/*) echo "celery-bench: using the DEBUG build of remote-sim ($sim_bin); sas-bench runs target/dist (scripts/build-release.sh dist)" >&2 ;;
esac

scripts/services.sh

# The venv, reinstalled when requirements.txt changes.
venv=target/peers/venv
stamp=$venv/.requirements.sha256
want=$(sha256sum scripts/peers/requirements.txt | cut -d' ' -f1)
if [ ! -x $venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "celery-bench: installing scripts/peers/requirements.txt into $venv"
  python3 -m venv $venv
  $venv/bin/python -m pip install -q --disable-pip-version-check -r scripts/peers/requirements.txt
  echo "$want" > "$stamp"
fi
python=$root/$venv/bin/python

run_id="$(date +%s)-$$"
run_dir=$root/target/peers/run-$run_id
mkdir -p "$run_dir" target/bench
db_admin_url=${PEER_PG_ADMIN_URL:-postgres://postgres@127.0.0.1:5432/postgres}
database=sas_peer_celery_${run_id//-/_}
vhost=""
queue_prefix="peer-celery-$run_id-"
sim_pid=""

cleanup() {
  set +e
  if [ -n "$sim_pid" ]; then kill "$sim_pid" 2>/dev/null; wait "$sim_pid" 2>/dev/null; fi
  psql -q "$db_admin_url" -c "DROP DATABASE IF EXISTS $database WITH (FORCE)" >/dev/null 2>&1 \
    || echo "celery-bench: could not drop database $database" >&2
  if [ -n "$vhost" ]; then
    as_root timeout 60 rabbitmqctl -q delete_vhost "$vhost" >/dev/null 2>&1 \
      || echo "celery-bench: could not delete vhost $vhost" >&2
  else
    # The variants deleted their queues; the rpc reply queues are auto-delete.
    :
  fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Its own vhost, or unique queue names on "/".
broker_url="amqp://guest:guest@127.0.0.1:5672//"
# (PEER_NO_VHOST=1 takes the second way, to try it.)
if [ -z "${PEER_NO_VHOST:-}" ] && as_root timeout 60 rabbitmqctl -q add_vhost "sas-peer-celery-$run_id" >/dev/null 2>&1; then
  vhost="sas-peer-celery-$run_id"
  as_root timeout 60 rabbitmqctl -q set_permissions -p "$vhost" guest '.*' '.*' '.*' >/dev/null
  broker_url="amqp://guest:guest@127.0.0.1:5672/$vhost"
else
  echo "celery-bench: rabbitmqctl cannot add a vhost; using queues named $queue_prefix* on /" >&2
fi

psql -q "$db_admin_url" -c "CREATE DATABASE $database" >/dev/null
db_url="postgresql://postgres@127.0.0.1:5432/$database"

# remote-sim on a free port, with sas-bench's settings: its journal, no
# bodies in the ledger, warn logs, no latency or faults (the defaults).
port=$($python -c 'import random, socket
for _ in range(200):
    port = random.randrange(20000, 32000)
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", port)); print(port); break
    except OSError: pass
    finally: s.close()')
(
  for var in $(compgen -e | grep '^SAS_' || true); do unset "$var"; done
  export SAS_HTTP__LISTEN="127.0.0.1:$port" \
    SAS_SIM__JOURNAL_FILE="$run_dir/sim-journal.jsonl" \
    SAS_SIM__RECORD_BODIES=false \
    SAS_LOG__FILTER=warn \
    NO_COLOR=1
  exec "$sim_bin" </dev/null >"$run_dir/remote-sim.log" 2>&1
) &
sim_pid=$!
sim_url="http://127.0.0.1:$port"
for _ in $(seq 1 100); do
  if $python -c "import urllib.request; urllib.request.urlopen('$sim_url/stats', timeout=1)" 2>/dev/null; then
    break
  fi
  kill -0 "$sim_pid" 2>/dev/null || { echo "celery-bench: remote-sim exited; see $run_dir/remote-sim.log" >&2; exit 1; }
  sleep 0.1
done

export PEER_BROKER_URL=$broker_url PEER_DB_URL=$db_url PEER_SIM_URL=$sim_url \
  PEER_SIM_PID=$sim_pid PEER_QUEUE_PREFIX=$queue_prefix PEER_LOG_DIR=$run_dir
status=0
$python scripts/peers/celery_chain.py bench --out target/bench/peers.json "$@" || status=$?
echo "celery-bench: logs in $run_dir"
exit $status
