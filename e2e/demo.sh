#!/usr/bin/env bash
# The main job: builds kvpick (release), installs Envoy 1.40 into .venv, then replays the first
# 500 requests of ../shared/data/mooncake_trace_1000.jsonl through a real Envoy to 4 simulated vLLM
# workers (`kvpick sim`) twice - Envoy round-robin vs Envoy + kvpick - and prints the side-by-side
# table (about a minute), then the offline replay of the same requests through every policy.
set -euo pipefail
cd "$(dirname "$0")/.."
bash e2e/setup.sh
cargo build --locked --release --bin kvpick
KVPICK_BIN="$PWD/target/release/kvpick" exec .venv/bin/python e2e/demo.py "$@"
