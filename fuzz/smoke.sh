#!/usr/bin/env bash
# A short fuzz smoke for CI: every cargo-fuzz target for SECONDS (default 20) over its committed
# corpus; fails on any crash. The long runs (10 minutes each) are `bash fuzz/run.sh 600 TARGET`.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-20}"
log="$(mktemp)"
for target in kv_event_decoder request_body extproc_stream conversation_body; do
  echo "--- fuzz smoke: $target (${secs}s)"
  if ! bash fuzz/run.sh "$secs" "$target" >"$log" 2>&1; then
    tail -60 "$log"
    echo "fuzz smoke: $target failed" >&2
    exit 1
  fi
  grep -E "^Done|stat::number_of_executed_units" "$log" || tail -3 "$log"
done
rm -f "$log"
