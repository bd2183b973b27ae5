#!/usr/bin/env bash
# Prints the path of promtool (Prometheus's rule checker), installing it when
# missing. Debian's prometheus package ships it; the package is downloaded
# with apt-get and unpacked into target/tools/ rather than installed, so no
# Prometheus server is set up or started on the machine.
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v promtool >/dev/null; then
  command -v promtool
  exit 0
fi
tools="$PWD/target/tools/prometheus"
if [ ! -x "$tools/usr/bin/promtool" ]; then
  as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi
  }
  mkdir -p "$tools/deb"
  cd "$tools/deb"
  if ! apt-get download prometheus >/dev/null 2>&1; then
    as_root apt-get update -qq >/dev/null
    apt-get download prometheus >/dev/null 2>&1 ||
      { echo "promtool: cannot download Debian's prometheus package (apt-get download prometheus)" >&2; exit 1; }
  fi
  dpkg-deb -x "$(ls -t prometheus_*.deb | head -1)" "$tools"
  cd - >/dev/null
fi
echo "$tools/usr/bin/promtool"
