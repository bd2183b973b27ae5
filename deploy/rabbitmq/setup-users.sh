#!/bin/sh
# Creates (or updates) the broker user of each role with only the permissions
# it needs, idempotently. Run where rabbitmqctl reaches the broker: compose
# runs it inside the rabbitmq container at every start (entrypoint.sh);
# on Kubernetes: kubectl exec -i <rabbitmq-pod> -- sh -s < deploy/rabbitmq/setup-users.sh
# with the variables below in its environment (see deploy/README.md).
#
# Passwords come from the environment, never from a file in the repository:
#   SAS_RABBITMQ_SCHEDULER_PASSWORD, SAS_RABBITMQ_SUPERVISOR_PASSWORD,
#   SAS_RABBITMQ_AGENT_PASSWORD, SAS_RABBITMQ_CLIENT_PASSWORD,
#   SAS_RABBITMQ_CONSOLE_PASSWORD; SAS_RABBITMQ_GATEWAY_PASSWORD (optional:
#   without it no gateway user is made)
# Optional: SAS_AMQP_PREFIX (the deployment's amqp.prefix, default empty),
#   SAS_RABBITMQ_VHOST (default /),
#   SAS_RABBITMQ_{SCHEDULER,SUPERVISOR,AGENT,CLIENT,CONSOLE,GATEWAY}_USER (defaults
#   sas-scheduler, sas-supervisor, sas-agent, sas-client, sas-console,
#   sas-gateway), SAS_RABBITMQ_DELETE=1 deletes the users instead (cleanup).
#
# Permissions (configure / write / read regexes; P is the prefix):
#   scheduler  declares orders, replies and agent queues; consumes orders and
#              replies; publishes requests and client statuses (default
#              exchange), statuses (P sas.status) and dead letters; sasctl in
#              its container may follow orders (server-named amq.gen-* queues).
#   supervisor declares the dead-letter queues and the status exchange;
#              consumes P sas.dead-letters.record; publishes statuses,
#              compensation requests (default exchange) and dead letters.
#   agent      declares and consumes P sas.agent.*; publishes replies (default
#              exchange) and dead letters.
#   client     publishes to the exchanges P sas.orders and P sas.events only (not the default
#              exchange, which reaches every queue); declares and reads only
#              queues named P sas.client.<its user>.<anything>, its reply_to
#              queues. Client user names: letters, digits, - and _.
#   gateway    (when SAS_RABBITMQ_GATEWAY_PASSWORD is set) publishes to the
#              exchanges P sas.orders and P sas.events only, on its clients'
#              behalf (its x-sas-sender header names the client; the
#              schedulers believe it from this user alone); declares and
#              reads nothing.
#   console    declares nothing and consumes nothing: it reads queue depths
#              with passive declares, which RabbitMQ checks against no
#              permission (access-control guide: queue.declare with
#              passive=true needs none); publishes replayed dead letters,
#              step requests and client statuses (default exchange),
#              statuses (P sas.status) and an operator's events for wait
#              steps (P sas.events).
set -eu

prefix=$(printf '%s' "${SAS_AMQP_PREFIX:-}" | sed 's/[].[^$*+?(){}|\\]/\\&/g')
vhost=${SAS_RABBITMQ_VHOST:-/}
scheduler=${SAS_RABBITMQ_SCHEDULER_USER:-sas-scheduler}
supervisor=${SAS_RABBITMQ_SUPERVISOR_USER:-sas-supervisor}
agent=${SAS_RABBITMQ_AGENT_USER:-sas-agent}
client=${SAS_RABBITMQ_CLIENT_USER:-sas-client}
console=${SAS_RABBITMQ_CONSOLE_USER:-sas-console}
# The gateway's user, made only when its password is given.
gateway=${SAS_RABBITMQ_GATEWAY_USER:-sas-gateway}

if [ "${SAS_RABBITMQ_DELETE:-}" = 1 ]; then
  for user in "$scheduler" "$supervisor" "$agent" "$client" "$console" ${SAS_RABBITMQ_GATEWAY_PASSWORD:+"$gateway"}; do
    rabbitmqctl -q delete_user "$user" >/dev/null 2>&1 || true
  done
  exit 0
fi

case $client in
  *[!A-Za-z0-9_-]*) echo "client user name $client: only letters, digits, - and _" >&2; exit 2 ;;
esac

# Names of the topology, as regex alternatives (see crates/messages names.rs).
common="sas\.dead-letter|sas\.dead-letters|sas\.dead-letters\.record|sas\.status"
agents="sas\.agent\..+"
work="sas\.orders|sas\.events|sas\.scheduler\.replies|$agents"

# Every rabbitmqctl call starts an Erlang node (about a second): the users
# are listed once, and a new user needs no tags cleared.
listed=$(rabbitmqctl -q list_users) || { echo "setup-users.sh: rabbitmqctl cannot list the broker's users: is RabbitMQ up, and is this its node?" >&2; exit 1; }
existing=$(printf '%s\n' "$listed" | cut -f1)

ensure_user() { # user password-variable
  eval "password=\${$2:?$2 must be set: the broker password of $1}"
  if printf '%s\n' "$existing" | grep -qxF -- "$1"; then
    rabbitmqctl -q change_password "$1" "$password" >/dev/null
    rabbitmqctl -q set_user_tags "$1" >/dev/null
  else
    rabbitmqctl -q add_user "$1" "$password" >/dev/null
    existing=$(printf '%s\n%s' "$existing" "$1")
  fi
}

grant() { # user configure write read
  rabbitmqctl -q set_permissions -p "$vhost" "$1" "$2" "$3" "$4" >/dev/null
}

ensure_user "$scheduler" SAS_RABBITMQ_SCHEDULER_PASSWORD
grant "$scheduler" \
  "^$prefix($work|$common|amq\.gen-.+)\$" \
  "^(amq\.default|$prefix($work|$common|amq\.gen-.+))\$" \
  "^$prefix($work|sas\.dead-letter|sas\.status|amq\.gen-.+)\$"

ensure_user "$supervisor" SAS_RABBITMQ_SUPERVISOR_PASSWORD
grant "$supervisor" \
  "^$prefix($common)\$" \
  "^(amq\.default|$prefix($common))\$" \
  "^$prefix(sas\.dead-letters\.record|sas\.dead-letter)\$"

ensure_user "$agent" SAS_RABBITMQ_AGENT_PASSWORD
grant "$agent" \
  "^$prefix($agents|$common)\$" \
  "^(amq\.default|$prefix(sas\.dead-letter|sas\.dead-letters|sas\.dead-letters\.record))\$" \
  "^$prefix($agents|sas\.dead-letter)\$"

ensure_user "$client" SAS_RABBITMQ_CLIENT_PASSWORD
grant "$client" \
  "^${prefix}sas\.client\.$client\..+\$" \
  "^${prefix}sas\.(orders|events)\$" \
  "^${prefix}sas\.client\.$client\..+\$"

ensure_user "$console" SAS_RABBITMQ_CONSOLE_PASSWORD
grant "$console" \
  "^\$" \
  "^(amq\.default|${prefix}sas\.(status|events))\$" \
  "^\$"

if [ -n "${SAS_RABBITMQ_GATEWAY_PASSWORD:-}" ]; then
  ensure_user "$gateway" SAS_RABBITMQ_GATEWAY_PASSWORD
  grant "$gateway" \
    "^\$" \
    "^${prefix}sas\.(orders|events)\$" \
    "^\$"
fi

echo "broker users ready: $scheduler $supervisor $agent $client $console${SAS_RABBITMQ_GATEWAY_PASSWORD:+ $gateway} (vhost $vhost, prefix '${SAS_AMQP_PREFIX:-}')"
