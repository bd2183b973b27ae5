#!/bin/sh
# Turns etcd's authentication on, once, before Patroni starts (the one-shot
# service etcd-auth of docker-compose.ha.yml): a root user, and a user
# `patroni` whose role may read and write Patroni's keys (/service/) and
# nothing else. Safe to run again: with authentication on already, it only
# checks that patroni's password works.
#   ETCD_ROOT_PASSWORD, ETCD_PATRONI_PASSWORD: the two users' passwords.
set -eu
: "${ETCD_ROOT_PASSWORD:?ETCD_ROOT_PASSWORD must be set}"
: "${ETCD_PATRONI_PASSWORD:?ETCD_PATRONI_PASSWORD must be set}"
export ETCDCTL_API=3 ETCDCTL_ENDPOINTS=etcd-1:2379,etcd-2:2379,etcd-3:2379
# Without credentials, listing users works only while authentication is off.
if etcdctl user list >/dev/null 2>&1; then
  etcdctl user get root >/dev/null 2>&1 \
    || printf '%s\n' "$ETCD_ROOT_PASSWORD" | etcdctl user add root --interactive=false >/dev/null
  etcdctl role get patroni >/dev/null 2>&1 || etcdctl role add patroni >/dev/null
  etcdctl role grant-permission patroni --prefix=true readwrite /service/ >/dev/null
  etcdctl user get patroni >/dev/null 2>&1 \
    || printf '%s\n' "$ETCD_PATRONI_PASSWORD" | etcdctl user add patroni --interactive=false >/dev/null
  etcdctl user grant-role patroni patroni >/dev/null
  etcdctl auth enable >/dev/null
  echo "etcd: authentication on (users root and patroni)"
fi
# Patroni's credentials work, and an anonymous client is refused.
etcdctl --user "patroni:$ETCD_PATRONI_PASSWORD" put /service/.auth-check ok >/dev/null
if etcdctl get /service/.auth-check >/dev/null 2>&1; then
  echo "etcd: an anonymous client can still read Patroni's keys" >&2
  exit 1
fi
echo "etcd: patroni authenticates, anonymous clients are refused"
