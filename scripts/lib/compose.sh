# shellcheck shell=bash
# What scripts/compose-test.sh and scripts/ha-test.sh share: logging, a
# project of their own (an env file of made-up passwords, free ports, their
# own image name), polling with a deadline, remote-sim's admin routes, and
# the teardown that always runs. Sourced after setting:
#   name     the prefix of every line ("compose-test")
#   project  the compose project name
#   keep     where a failed run leaves the services' logs
# The caller defines compose() (its files, with "$tmp/env" and "$tmp/image.yml")
# and may set publisher (a background PID to stop at the end).

say() { echo "$name: $*"; }
skip() { say "skipped: $*"; exit 0; }
fail() { say "FAILED: $*" >&2; exit 1; }
now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'; }
secret() { od -An -tx1 -N12 /dev/urandom | tr -d ' \n'; }

# wait_until SECONDS COMMAND...: polls COMMAND until it succeeds (status 0)
# or SECONDS pass (status 1), for a test that has a remedy when it does not.
wait_until() {
  local seconds=$1 deadline
  shift
  deadline=$(($(date +%s) + seconds))
  until "$@"; do
    [ "$(date +%s)" -lt "$deadline" ] || return 1
    sleep 0.5
  done
}

# wait_for DESCRIPTION SECONDS COMMAND...: polls COMMAND until it succeeds,
# and fails the test naming DESCRIPTION when it does not within SECONDS.
wait_for() {
  local what=$1 seconds=$2
  shift 2
  wait_until "$seconds" "$@" || fail "$what: not within $seconds s"
}

# free_ports N: N free ports of 127.0.0.1, held together while chosen so they differ.
free_ports() {
  python3 -c '
import socket, sys
sockets = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in sockets: s.bind(("127.0.0.1", 0))
print(*(s.getsockname()[1] for s in sockets))' "$1"
}

# start_project IMAGE: makes $tmp with the env file of docker-compose.yml's
# variables (made-up passwords; client_password, owner_password, sim_token,
# console_secret and manager_secret kept for the caller; the gateway's
# clients are deploy/tenants.toml's shop, with console_secret, and
# shop-manager, the approver, with manager_secret) and $tmp/image.yml, which runs
# every service of ours from IMAGE, so a user's sas:latest is left alone.
# The caller appends its ports and any further variables to $tmp/env.
start_project() {
  tmp=$(mktemp -d)
  image=$1
  client_password=$(secret)
  owner_password=$(secret)
  sim_token=$(secret)
  console_secret=$(secret)$(secret)
  manager_secret=$(secret)$(secret)
  # The shell's values would win over the env file's.
  unset RABBITMQ_USER RABBITMQ_PASSWORD RABBITMQ_SCHEDULER_PASSWORD RABBITMQ_SUPERVISOR_PASSWORD \
    RABBITMQ_AGENT_PASSWORD RABBITMQ_CLIENT_PASSWORD RABBITMQ_CONSOLE_PASSWORD RABBITMQ_GATEWAY_PASSWORD POSTGRES_PASSWORD POSTGRES_SUPERUSER_PASSWORD \
    SAS_APP_PASSWORD SAS_READER_PASSWORD REMOTE_SIM_ADMIN_TOKEN CONSOLE_USERS RABBITMQ_AMQP_PORT RABBITMQ_MANAGEMENT_PORT \
    RABBITMQ_2_AMQP_PORT RABBITMQ_3_AMQP_PORT REMOTE_SIM_PORT CONSOLE_PORT GATEWAY_PORT GATEWAY_CLIENTS PATRONI_SUPERUSER_PASSWORD \
    PATRONI_REPLICATION_PASSWORD PATRONI_RESTAPI_PASSWORD ETCD_ROOT_PASSWORD ETCD_PATRONI_PASSWORD RABBITMQ_ERLANG_COOKIE COMPOSE_FILE COMPOSE_PROJECT_NAME COMPOSE_PROFILES
  (
    umask 077
    cat >"$tmp/env" <<ENV
RABBITMQ_USER=sas
RABBITMQ_PASSWORD=$(secret)
RABBITMQ_SCHEDULER_PASSWORD=$(secret)
RABBITMQ_SUPERVISOR_PASSWORD=$(secret)
RABBITMQ_AGENT_PASSWORD=$(secret)
RABBITMQ_CLIENT_PASSWORD=$client_password
RABBITMQ_CONSOLE_PASSWORD=$(secret)
RABBITMQ_GATEWAY_PASSWORD=$(secret)
POSTGRES_PASSWORD=$owner_password
POSTGRES_SUPERUSER_PASSWORD=$(secret)
SAS_APP_PASSWORD=$(secret)
SAS_READER_PASSWORD=$(secret)
REMOTE_SIM_ADMIN_TOKEN=$sim_token
CONSOLE_USERS=tester:operator:$console_secret
GATEWAY_CLIENTS=shop:$console_secret,shop-manager:$manager_secret
ENV
    cat >"$tmp/image.yml" <<YAML
services:
  migrate: { image: "$image" }
  scheduler: { image: "$image" }
  supervisor: { image: "$image" }
  agent: { image: "$image" }
  remote-sim: { image: "$image" }
  console: { image: "$image" }
  gateway: { image: "$image" }
YAML
  )
  trap finish EXIT
  trap 'exit 130' INT TERM
}

# Always: stops the publisher, keeps the services' logs of a failed run,
# removes the project (containers, volumes, the image) and $tmp.
finish() {
  local status=$?
  trap - EXIT INT TERM
  [ -z "${publisher:-}" ] || kill "$publisher" 2>/dev/null || true
  if [ "$status" -ne 0 ] && [ -f "$tmp/image.yml" ]; then
    mkdir -p "$keep"
    compose logs --no-color --timestamps >"$keep/services.log" 2>&1 || true
    compose ps -a >"$keep/ps.txt" 2>&1 || true
    cp "$tmp"/*.log "$keep/" 2>/dev/null || true
    say "service logs: $keep/services.log" >&2
  fi
  if [ -f "$tmp/image.yml" ]; then
    compose down -v --remove-orphans --timeout 10 >/dev/null 2>&1 \
      || say "docker compose -p $project down -v failed: remove it by hand" >&2
    docker image rm "$image" >/dev/null 2>&1 || true
  fi
  rm -rf "$tmp"
  exit "$status"
}

# sim METHOD PATH [BODY]: remote-sim's admin and ledger routes, with its token.
sim() {
  SIM_TOKEN=$sim_token python3 - "http://127.0.0.1:$sim_port$2" "$1" "${3:-}" <<'PY'
import os, sys, urllib.request
url, method, body = sys.argv[1], sys.argv[2], sys.argv[3]
request = urllib.request.Request(url, method=method, data=body.encode() if body else None,
    headers={"Authorization": "Bearer " + os.environ["SIM_TOKEN"], "Content-Type": "application/json"})
sys.stdout.write(urllib.request.urlopen(request, timeout=30).read().decode())
PY
}
