#!/usr/bin/env bash
# The whole test suite, as CI runs it. Installs what it lacks first (scripts/setup.sh).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
bash scripts/setup.sh

# Containers of a test run that was killed outright (its Drop never ran).
if command -v docker >/dev/null 2>&1 && docker info >/dev/null 2>&1; then
  stale="$(docker ps -aq --filter label=etcd-mirror.harness)"
  if [ -n "$stale" ]; then docker rm -f $stale >/dev/null; fi
fi

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --quiet -- -D warnings
# Scenario tests run the real agent binary; build it before the tests that look for it. Built
# with every test target in one go, so nextest finds its build done: the agent built alone
# compiles a few crates a second time with another feature set (without the dev-dependencies').
cargo build --quiet --workspace --all-targets
# The agent image for tests/image.rs and the agent-container scenario, packed from the debug
# binary just built (scripts/image.sh: same layout; no release build of every dependency, and
# no build of the agent alone, which would compile its dependencies again with other features).
MIRROR_IMAGE_BIN="${CARGO_TARGET_DIR:-$repo/target}/debug/mirror-agent" bash scripts/image.sh
# No crate has a doc test (examples in docs are `text` blocks); nextest does not run doc tests,
# so one that is added must bring back `cargo test --workspace --doc` here, before nextest.
# The ten slowest tests are printed whatever the outcome (where CI time goes: issue #24).
rc=0
cargo nextest run --workspace --profile ci --no-fail-fast || rc=$?
python3 scripts/slowest.py "${CARGO_TARGET_DIR:-target}/nextest/ci/junit.xml" 10 || true
exit "$rc"
