#!/usr/bin/env bash
# cargo-deny against deny.toml: licenses, duplicate versions (bans) and
# sources always; advisories when RustSec's advisory database (a git
# repository on GitHub) can be fetched, otherwise one line saying they were
# not checked and why. Installs the pinned cargo-deny when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
# Pinned: `cargo install --locked` builds the same thing every time, and a new
# release cannot change what fails here unannounced.
version=0.20.2
if [ "$(cargo deny --version 2>/dev/null | awk '{print $2}')" != "$version" ]; then
  echo "installing cargo-deny $version (built from source, once: several minutes)" >&2
  cargo install --locked cargo-deny --version "$version"
fi
cargo deny --locked check licenses bans sources
mkdir -p target
if timeout 180 cargo deny --locked fetch db >target/deny-fetch.log 2>&1; then
  cargo deny --locked check --disable-fetch advisories
else
  echo "cargo-deny: advisories NOT checked: RustSec's advisory database (https://github.com/rustsec/advisory-db) could not be fetched: $(grep -v '^ *$' target/deny-fetch.log | tail -n1 | cut -c1-200) (target/deny-fetch.log)" >&2
fi
