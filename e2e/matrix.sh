#!/usr/bin/env bash
# The benchmark matrix (issue 16): builds the release kvpick, then runs e2e/matrix.py (workload
# families x offered loads {0.5, 0.75, 0.9, 0.95} x every replay policy x 3 seeds, 8 ranks, and
# kvpick's sensitivity to +-50% on each tunable). Writes target/matrix/matrix.{md,json}.
# WITH_PEERS=1 also builds crates/kvpick-peers (Dynamo's router, its own Cargo workspace) and
# replays through it, adding the `dynamo` policy. Extra arguments go to e2e/matrix.py (--help).
# Not part of CI: ~5-10 minutes on 2 cores at --scale 0.5.
set -euo pipefail
cd "$(dirname "$0")/.."
# kvpick and the lab beside it: `kvpick replay|workload` run target/release/kvpick-lab.
cargo build --locked --release -p kvpick -p kvpick-lab
args=()
if [ "${WITH_PEERS:-0}" = 1 ]; then
  cargo build --locked --release --manifest-path crates/kvpick-peers/Cargo.toml
  args+=(--replay-bin "$PWD/crates/kvpick-peers/target/release/kvpick-peers")
fi
KVPICK_BIN="$PWD/target/release/kvpick" exec python3 e2e/matrix.py "${args[@]}" "$@"
