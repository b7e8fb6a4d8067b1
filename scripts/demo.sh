#!/usr/bin/env bash
# The main job on an embedded default: a local source and target etcd, a seeded source (100 000
# keys, --keys N), the real `mirror-agent run` mirroring with a progress bar, then a live tail
# view while a paced writer changes the source (--rate N, --no-writer). Ctrl-C (or --duration D)
# stops the writer, runs `mirror-agent verify`, shows `mirror-agent status` and stops
# everything; --keep leaves it all running and prints how to reach it.
# Options: harness demo --help. Installs what it lacks first (scripts/setup.sh).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash scripts/setup.sh
cargo build --quiet -p harness -p mirror-agent
exec target/debug/harness demo "$@"
