#!/usr/bin/env bash
# The main job on an embedded default: a local source and target etcd, seeded with demo keys.
# Installs what it lacks first (scripts/setup.sh). Ctrl-C stops everything.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash scripts/setup.sh
cargo build --quiet -p harness -p mirror-agent
exec target/debug/harness demo "$@"
