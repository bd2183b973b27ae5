#!/usr/bin/env bash
# Makes a development CA and one server certificate it signed, for TLS in
# Docker Compose (docs/tls.md): deploy/tls/ca.pem, ca-key.pem, server.pem,
# server-key.pem. The certificate names every host a client reaches over
# TLS: rabbitmq (and rabbitmq-2, rabbitmq-3 of the HA topology), postgres,
# console, gateway, localhost and 127.0.0.1.
#
# For development only: the keys are readable by every user of the
# containers (RabbitMQ and Postgres run as their own users, and read them
# from a bind mount), and the CA signs whatever its key is given. Keeps
# files already there unless run with --force. DEV_CA_DIR puts them
# elsewhere (the TLS test does).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${DEV_CA_DIR:-deploy/tls}
if [ -f "$dir/server.pem" ] && [ "${1:-}" != --force ]; then
  echo "dev-ca: $dir/ already holds a CA and a certificate (--force makes new ones)"
  exit 0
fi
command -v openssl >/dev/null || { echo "dev-ca: openssl is needed (apt-get install openssl)" >&2; exit 1; }
mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
openssl req -x509 -newkey rsa:3072 -nodes -days 825 -sha256 \
  -subj "/CN=sas development CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
  -keyout "$tmp/ca-key.pem" -out "$tmp/ca.pem" 2>/dev/null
openssl req -newkey rsa:3072 -nodes -sha256 -subj "/CN=sas development server" \
  -keyout "$tmp/server-key.pem" -out "$tmp/server.csr" 2>/dev/null
cat >"$tmp/server.ext" <<'EXT'
basicConstraints=CA:FALSE
keyUsage=critical,digitalSignature,keyEncipherment
extendedKeyUsage=serverAuth
subjectAltName=DNS:rabbitmq,DNS:rabbitmq-2,DNS:rabbitmq-3,DNS:postgres,DNS:console,DNS:gateway,DNS:localhost,IP:127.0.0.1
EXT
openssl x509 -req -in "$tmp/server.csr" -CA "$tmp/ca.pem" -CAkey "$tmp/ca-key.pem" -CAcreateserial \
  -days 825 -sha256 -extfile "$tmp/server.ext" -out "$tmp/server.pem" 2>/dev/null
chmod 644 "$tmp/ca.pem" "$tmp/server.pem" "$tmp/server-key.pem"
chmod 600 "$tmp/ca-key.pem"
mv "$tmp/ca.pem" "$tmp/ca-key.pem" "$tmp/server.pem" "$tmp/server-key.pem" "$dir/"
echo "dev-ca: made $dir/ca.pem (trust it in clients) and $dir/server.pem for rabbitmq, postgres, console, gateway, localhost, 127.0.0.1"
