#!/usr/bin/env bash
# The optimised build of what scripts/demo.sh and scripts/bench.sh run, not the
# whole workspace.
#
#   scripts/build-release.sh        the release profile: the services the demo
#                                   runs, quick to build (target/release)
#   scripts/build-release.sh dist   the dist profile: each program optimised
#                                   whole (fat LTO), as production images are
#                                   built, and the benchmark (target/dist)
set -euo pipefail
cd "$(dirname "$0")/.."
services=(-p scheduler -p agent -p supervisor -p remote-sim -p sasctl -p sas-console)
case "${1:-release}" in
  release) exec cargo build --release "${services[@]}" ;;
  dist) exec cargo build --profile dist "${services[@]}" -p sas-bench ;;
  *) echo "build-release.sh: unknown profile '$1' (release or dist)" >&2; exit 2 ;;
esac
