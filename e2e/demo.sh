#!/usr/bin/env bash
# The main job: builds kvpick (release), installs Envoy 1.40 into .venv, generates an agentic
# workload (`kvpick workload --family agentic`: tool loops on shared 4-16k-token prefixes, sub-agents)
# and replays it at offered load 0.85 through a real Envoy to 4 simulated vLLM workers (`kvpick sim`)
# twice - Envoy round-robin vs Envoy + kvpick - and prints the side-by-side table (about a minute),
# then the offline replay of the same requests through every policy, and the path of its HTML report
# (.e2e-work/demo-*/report.html). e2e/demo.py --help for the
# knobs (--family, --load, --policy ...,sglang-router, --trace FILE for a Mooncake trace).
# `bash e2e/demo.sh --engine vllm`: the same comparison on two real vLLM servers (e2e/vllm_bench.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash e2e/setup.sh
case " $* " in *" --engine vllm "*|*" --engine=vllm "*) bash e2e/vllm/setup.sh ;; esac
# kvpick and the lab beside it: `kvpick sim|replay|workload` run target/release/kvpick-lab.
cargo build --locked --release -p kvpick -p kvpick-lab
KVPICK_BIN="$PWD/target/release/kvpick" exec .venv/bin/python e2e/demo.py "$@"
