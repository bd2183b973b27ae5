#!/usr/bin/env bash
# Makes sure RabbitMQ (127.0.0.1:5672) and PostgreSQL (127.0.0.1:5432) are
# running, installing them from Debian's packages when they are missing, and
# that `make` and a C compiler are there for the build (jemalloc, the
# scheduler's and the agents' allocator, is built by its configure script
# and make; cargo links with cc).
# Safe to run again: it does nothing when all are there.
#
#   scripts/services.sh             the build tools, then the two servers
#   scripts/services.sh build-tools the build tools only (scripts/demo.sh
#                                   builds while the servers are installed)
set -euo pipefail

as_root() {
  if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_for_port() {
  local port=$1 what=$2
  for _ in $(seq 1 120); do
    port_open "$port" && return 0
    sleep 1
  done
  echo "services.sh: $what did not open port $port within 120 s" >&2
  return 1
}

apt_updated=""
install_packages() {
  [ -n "$apt_updated" ] || { as_root apt-get update -qq; apt_updated=1; }
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# make, for jemalloc's build (crates/runtime/src/allocator.rs); a C compiler,
# which it needs too, as does cargo to link (rustup installs none).
if ! command -v make >/dev/null 2>&1; then
  echo "services.sh: installing make from Debian's packages"
  install_packages make
fi
if ! command -v cc >/dev/null 2>&1; then
  echo "services.sh: installing gcc from Debian's packages"
  install_packages gcc libc6-dev
fi
# openssl, for scripts/dev-ca.sh (TLS in compose, and its test).
if ! command -v openssl >/dev/null 2>&1; then
  echo "services.sh: installing openssl from Debian's packages"
  install_packages openssl
fi
[ "${1:-}" = build-tools ] && exit 0

# PostgreSQL
if ! port_open 5432; then
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    echo "services.sh: installing PostgreSQL from Debian's packages"
    install_packages postgresql
    version=$(ls /etc/postgresql | sort -V | tail -n 1)
    # The tests connect as postgres/postgres over TCP.
    as_root su postgres -c "psql -q -c \"ALTER USER postgres PASSWORD 'postgres'\"" 2>/dev/null || true
  fi
  version=$(ls /etc/postgresql | sort -V | tail -n 1)
  echo "services.sh: starting PostgreSQL $version"
  as_root pg_ctlcluster --skip-systemctl-redirect "$version" main start 2>/dev/null \
    || as_root pg_ctlcluster "$version" main start
  wait_for_port 5432 PostgreSQL
  as_root su postgres -c "psql -q -c \"ALTER USER postgres PASSWORD 'postgres'\"" >/dev/null 2>&1 || true
fi

# RabbitMQ
if ! port_open 5672; then
  if ! command -v rabbitmq-server >/dev/null 2>&1 && [ ! -x /usr/sbin/rabbitmq-server ]; then
    echo "services.sh: installing RabbitMQ from Debian's packages"
    install_packages rabbitmq-server
  fi
  if ! port_open 5672; then
    echo "services.sh: starting RabbitMQ"
    as_root rabbitmq-server -detached
  fi
  wait_for_port 5672 RabbitMQ
  as_root rabbitmqctl await_startup >/dev/null 2>&1 || sleep 5
fi
echo "services.sh: PostgreSQL on 127.0.0.1:5432 and RabbitMQ on 127.0.0.1:5672 are up"
