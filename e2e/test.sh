#!/usr/bin/env bash
# Runs every test kvpick has: Rust unit + integration tests, then the end-to-end suite that puts
# a real Envoy 1.40 in front of kvpick and real upstream processes, and the offline check of the
# Kubernetes manifests and Helm chart. Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash e2e/setup.sh
cargo build --locked --bins --examples
cargo test --locked --workspace --all-targets
bash e2e/check-manifests.sh
KVPICK_BIN="$PWD/target/debug/kvpick" LOADGEN_BIN="$PWD/target/debug/examples/loadgen" \
  .venv/bin/python -m pytest e2e/tests -q -p no:cacheprovider "$@"
# A short cargo-fuzz smoke of every fuzz target (the 10-minute runs: bash fuzz/run.sh 600 TARGET).
bash fuzz/smoke.sh 20
