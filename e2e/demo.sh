#!/usr/bin/env bash
# The main job: builds kvpick (release), installs Envoy 1.40 into .venv, starts upstream ranks +
# kvpick + Envoy on loopback, sends traffic through them and prints the result table.
set -euo pipefail
cd "$(dirname "$0")/.."
bash e2e/setup.sh
cargo build --locked --release --bin kvpick
KVPICK_BIN="$PWD/target/release/kvpick" exec .venv/bin/python e2e/demo.py "$@"
