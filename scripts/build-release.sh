#!/usr/bin/env bash
# The release build of what scripts/demo.sh and scripts/bench.sh run, not the
# whole workspace: the release profile optimises each program whole (fat LTO,
# Cargo.toml), so every extra binary costs minutes. One list for both scripts,
# so that either reuses the other's build (another list would unify other
# features and rebuild the services).
set -euo pipefail
cd "$(dirname "$0")/.."
exec cargo build --release -p scheduler -p agent -p supervisor -p remote-sim -p sasctl -p sas-console -p sas-bench
