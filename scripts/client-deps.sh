#!/usr/bin/env bash
# Installs what the client examples' tests (tests/tests/e2e/contract.rs) need:
#   - Python's pika for examples/python: kept if python3 already imports it,
#     else pip-installed (examples/python/requirements.txt) into
#     target/client-deps/python, which the tests put on PYTHONPATH; without
#     pip, Debian's python3-pika;
#   - Node and npm (Debian's nodejs and npm when missing), and the Node
#     example's packages from its lock file (npm ci, in examples/node).
# Fails, naming what is missing, rather than letting a test be skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
apt_install() {
  echo "client-deps.sh: installing $* from Debian's packages"
  as_root apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}
keep=target/client-deps/python
if ! PYTHONPATH="$keep${PYTHONPATH:+:$PYTHONPATH}" python3 -c 'import pika' 2>/dev/null; then
  if python3 -m pip --version >/dev/null 2>&1; then
    echo "client-deps.sh: pip-installing pika into $keep"
    PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check \
      --target "$keep" -r examples/python/requirements.txt
  else
    apt_install python3 python3-pika
  fi
fi
PYTHONPATH="$keep${PYTHONPATH:+:$PYTHONPATH}" python3 -c 'import pika' \
  || { echo "client-deps.sh: python3 cannot import pika" >&2; exit 1; }
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  apt_install nodejs npm
fi
npm ci --prefix examples/node --no-audit --no-fund --loglevel=error
