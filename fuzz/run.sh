#!/usr/bin/env bash
# Fuzzes the KV-event decoder (src/events/decode.rs) with cargo-fuzz / libFuzzer.
#
#   bash fuzz/run.sh [SECONDS] [TARGET]   # default 600 s, target kv_event_decoder
#
# Targets: kv_event_decoder (src/events/decode.rs), request_body (src/request.rs + src/usage.rs),
# extproc_stream (the ext_proc stream machine), conversation_body (src/tokenize/conversation.rs).
#
# Installs cargo-fuzz if missing. cargo-fuzz needs nightly-only rustc flags (sanitizers); on a
# stable toolchain RUSTC_BOOTSTRAP=1 unlocks them. The corpus lives in the repo
# (fuzz/corpus/kv_event_decoder, seeded from tests/fixtures/kv_events by
# e2e/kv_events/make_fixtures.py) and grows with whatever new coverage a run finds; crashes go to
# fuzz/artifacts/kv_event_decoder (ignored by git). Exits non-zero if the fuzzer finds a crash.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-600}"
target="${2:-kv_event_decoder}"
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1
mkdir -p "fuzz/corpus/$target"
# -rss_limit_mb: the decoder caps payloads at 4 MiB; 2 GiB is ample and catches runaway growth.
# -max_len: real payloads are KiBs; 64 KiB keeps mutations meaningful.
exec cargo fuzz run "$target" "fuzz/corpus/$target" -- \
  -max_total_time="$secs" -max_len=65536 -rss_limit_mb=2048 -print_final_stats=1
