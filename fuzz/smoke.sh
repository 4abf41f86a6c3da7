#!/usr/bin/env bash
# A short fuzz smoke for CI: every cargo-fuzz target (`bash fuzz/run.sh --list`, i.e. the [[bin]]
# entries of fuzz/Cargo.toml) for SECONDS (default 20), starting from its committed seeds
# (fuzz/seeds/TARGET) and whatever an earlier run grew in fuzz/corpus/TARGET (ignored by git);
# fails on any crash. The long runs (10 minutes each) are `bash fuzz/run.sh 600 TARGET`.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-20}"
log="$(mktemp)"
targets="$(bash fuzz/run.sh --list)"
[ -n "$targets" ] || { echo "fuzz smoke: no targets in fuzz/Cargo.toml" >&2; exit 1; }
for target in $targets; do
  echo "--- fuzz smoke: $target (${secs}s)"
  if ! bash fuzz/run.sh "$secs" "$target" >"$log" 2>&1; then
    tail -60 "$log"
    echo "fuzz smoke: $target failed" >&2
    exit 1
  fi
  grep -E "^Done|stat::number_of_executed_units" "$log" || tail -3 "$log"
done
rm -f "$log"
