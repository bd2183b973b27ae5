#!/usr/bin/env bash
# The README's two commands as a newcomer meets them: in a container of
# Debian 12 as debootstrap leaves it (no Rust, no PostgreSQL, no RabbitMQ, no
# compiler), rustup's stable installed as its site says, then a clone of HEAD,
# `scripts/demo.sh` (DEMO_EXIT=1) and `scripts/test.sh`, each timed. Needs a
# Docker engine and the debian:bookworm-slim image (the stand-ins of
# /work/shared/compose-standins/build.sh do). There is no Docker inside, so
# the compose and HA tests print that they cannot run there.
#
#   scripts/lib/bare-debian.sh [demo|test|both]   (default both)
#
# Logs and timings: target/bare-debian/. The host's CA bundle is mounted for
# this machine's TLS egress; a user's machine has Debian's own.
set -euo pipefail
cd "$(dirname "$0")/../.."
what="${1:-both}"
out="$PWD/target/bare-debian"
mkdir -p "$out"
rm -rf "$out/src"
git clone -q --no-local "$PWD" "$out/src"
docker run --rm --name sas-bare-debian \
  -v "$out/src:/src:ro" -v "$out:/out" \
  -v /etc/ssl/certs/ca-certificates.crt:/host-ca.crt:ro \
  -e WHAT="$what" \
  debian:bookworm-slim bash -c '
set -euo pipefail
stamp() { date +%s; }
t0=$(stamp)
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq git curl ca-certificates >/dev/null
cp /host-ca.crt /usr/local/share/ca-certificates/host.crt && update-ca-certificates >/dev/null 2>&1 || true
# sh.rustup.rs serves this same script; this machine reaches only static.rust-lang.org.
curl -sSf https://static.rust-lang.org/rustup/rustup-init.sh | sh -s -- -y -q --profile minimal
. "$HOME/.cargo/env"
git clone -q /src /work/sas && cd /work/sas
echo "setup (git, curl, rustup): $(( $(stamp) - t0 )) s" | tee /out/times
if [ "$WHAT" != test ]; then
  t=$(stamp)
  DEMO_EXIT=1 scripts/demo.sh 2>&1 | while IFS= read -r l; do printf "%s %s\n" "$(( $(stamp) - t ))" "$l"; done > /out/demo.log
  echo "demo: $(( $(stamp) - t )) s, first order processed at $(grep -m1 " processed" /out/demo.log | cut -d" " -f1) s" | tee -a /out/times
fi
if [ "$WHAT" != demo ]; then
  t=$(stamp)
  scripts/test.sh > /out/test.log 2>&1 && rc=0 || rc=$?
  echo "test: $(( $(stamp) - t )) s, exit $rc" | tee -a /out/times
  exit $rc
fi
'
