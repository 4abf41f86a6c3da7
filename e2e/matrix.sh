#!/usr/bin/env bash
# The benchmark matrix (issue 16): builds the release kvpick, then runs e2e/matrix.py (workload
# families x offered loads {0.5, 0.75, 0.9, 0.95} x every replay policy x 3 seeds, 8 ranks, and
# kvpick's sensitivity to +-50% on each tunable). Writes target/matrix/matrix.{md,json}.
# Extra arguments go to e2e/matrix.py (--help). Not part of CI: about 20 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
# CARGO_FEATURES=... builds optional peers in (e.g. the dynamo policy); the matrix detects them.
cargo build --locked --release --bin kvpick ${CARGO_FEATURES:+--features "$CARGO_FEATURES"}
KVPICK_BIN="$PWD/target/release/kvpick" exec python3 e2e/matrix.py "$@"
