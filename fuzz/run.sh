#!/usr/bin/env bash
# Fuzzes one kvpick target with cargo-fuzz / libFuzzer.
#
#   bash fuzz/run.sh [SECONDS] [TARGET]   # default 600 s, target kv_event_decoder
#   bash fuzz/run.sh --list               # every target, one per line
#
# The targets are the [[bin]] entries of fuzz/Cargo.toml, the one list fuzz/smoke.sh (CI) also
# reads: adding a target there is all it takes. Today: kv_event_decoder (src/sources/events/decode.rs),
# request_body (crates/kvpick-tokenize/src/body.rs + src/usage.rs), extproc_stream (the ext_proc stream machine),
# conversation_body (crates/kvpick-tokenize/src/body/ read by conversation.rs, against serde), h2_front (the HTTP/2 front layer,
# src/transport/h2_authority, against an independent HPACK decoder).
#
# Inputs: fuzz/seeds/TARGET (committed, at most ~100 inputs chosen for coverage by
# fuzz/pick_seeds.py; kv_event_decoder's seed_* files are e2e/kv_events/make_fixtures.py's
# recorded payloads) is read, never written. Whatever new coverage a run finds goes to
# fuzz/corpus/TARGET, which git ignores and later runs reuse; refresh the seeds from it with
# `python3 fuzz/pick_seeds.py TARGET`. Crashes go to fuzz/artifacts/TARGET (ignored by git).
# Exits non-zero if the fuzzer finds a crash.
#
# Installs cargo-fuzz if missing. cargo-fuzz needs nightly-only rustc flags (sanitizers); on a
# stable toolchain RUSTC_BOOTSTRAP=1 unlocks them.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--list" ]; then
  # `name = "..."` lines of the [[bin]] sections of fuzz/Cargo.toml.
  awk '/^\[\[bin\]\]/ {bin = 1; next} /^\[/ {bin = 0} bin && /^name *=/ {gsub(/[" ]/, "", $0); sub(/^name=/, ""); print}' fuzz/Cargo.toml
  exit 0
fi
secs="${1:-600}"
target="${2:-kv_event_decoder}"
if ! bash fuzz/run.sh --list | grep -qx "$target"; then
  echo "fuzz/run.sh: no target $target in fuzz/Cargo.toml (targets: $(bash fuzz/run.sh --list | tr '\n' ' '))" >&2
  exit 2
fi
if ! cargo fuzz --version >/dev/null 2>&1; then
  cargo install cargo-fuzz --locked
fi
export RUSTC_BOOTSTRAP=1
mkdir -p "fuzz/corpus/$target" "fuzz/seeds/$target"
# libFuzzer writes new inputs into the first corpus directory only: the grown, ignored one.
# -rss_limit_mb: the decoder caps payloads at 4 MiB; 2 GiB is ample and catches runaway growth.
# -max_len: real payloads are KiBs; 64 KiB keeps mutations meaningful.
exec cargo fuzz run "$target" "fuzz/corpus/$target" "fuzz/seeds/$target" -- \
  -max_total_time="$secs" -max_len=65536 -rss_limit_mb=2048 -print_final_stats=1
