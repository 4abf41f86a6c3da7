#!/usr/bin/env bash
# Runs every test kvpick has: Rust unit + integration tests, then the end-to-end suite that puts
# a real Envoy 1.40 in front of kvpick and real upstream processes, and the offline check of the
# Kubernetes manifests and Helm chart, and the real-engine tier (vLLM 0.32 CPU processes with a
# tiny random-weight model, e2e/tests/test_vllm_*.py). Installs what it needs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash e2e/setup.sh
bash e2e/vllm/setup.sh   # vLLM's venv (.vllm-venv) and the tiny model (.e2e-work/vllm-model)
# The serving binary and the lab beside it (`kvpick sim|replay|workload` run `kvpick-lab`).
cargo build --locked -p kvpick -p kvpick-lab --bins --examples
# crates/kvpick-peers is a workspace of its own with its own Cargo.lock, which goes stale when the
# core gains a dependency (docs/benchmarks.md builds it --locked). Resolving it is enough to notice:
# this fetches its manifests but builds none of the heavy peer crates.
cargo metadata --locked --format-version 1 --manifest-path crates/kvpick-peers/Cargo.toml >/dev/null
cargo test --locked --workspace --all-targets
bash e2e/check-manifests.sh
KVPICK_BIN="$PWD/target/debug/kvpick" LOADGEN_BIN="$PWD/target/debug/examples/loadgen" \
  .venv/bin/python -m pytest e2e/tests -q -p no:cacheprovider "$@"
# A short cargo-fuzz smoke of every fuzz target (the 10-minute runs: bash fuzz/run.sh 600 TARGET).
bash fuzz/smoke.sh 20
