"""kvpick demo: the routing gain on a real trace, through a real Envoy, against simulated vLLM workers.

Replays the first requests of the Mooncake trace (``../shared/data/mooncake_trace_1000.jsonl``)
twice, each time on a fresh ``kvpick sim`` fleet of 4 workers (vLLM-like: paged prefix cache,
continuous batching, KV events over ZeroMQ):

1. through Envoy's own ``ROUND_ROBIN`` cluster (a plain Kubernetes Service, no endpoint picker);
2. through Envoy + kvpick (ext_proc), which follows the engines' KV events and its own bookings.

It prints progress while it runs, then the side-by-side table built from client-side timings and
the ``usage.prompt_tokens_details.cached_tokens`` the workers return, and finally the offline
(virtual-clock) replay of the same requests through every policy kvpick compares itself with.
Flags: ``--limit N`` (default 500), ``--sim-speedup K`` (default 4), ``--workers N`` (default 4),
``--arrival-speedup A`` (default 1.15: ~80% load for 4 workers). The whole trace on 8 workers:
``--limit 1000 --workers 8 --arrival-speedup 2.3``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

E2E = Path(__file__).resolve().parent
sys.path.insert(0, str(E2E))
sys.path.insert(0, str(E2E / "replay"))

import harness  # noqa: E402
import online  # noqa: E402

TRACE = E2E.parent.parent / "shared" / "data" / "mooncake_trace_1000.jsonl"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--limit", type=int, default=500)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--arrival-speedup", type=float, default=1.15,
                    help="1.15 loads 4 default workers to ~80%% of their prefill capacity")
    ap.add_argument("--sim-speedup", type=float, default=4.0)
    args = ap.parse_args()
    if not Path(args.trace).exists():
        print(f"demo: trace not found: {args.trace}", file=sys.stderr)
        return 2
    print(f"kvpick demo: first {args.limit} requests of {Path(args.trace).name}, {args.workers} "
          f"simulated vLLM workers, arrivals x{args.arrival_speedup}, sim speedup x{args.sim_speedup}")
    print("client -> Envoy 1.40 -> (round-robin cluster | ext_proc kvpick) -> kvpick sim workers")
    print()
    try:
        report = online.run_online(args.trace, limit=args.limit, workers=args.workers,
                                   arrival_speedup=args.arrival_speedup,
                                   sim_speedup=args.sim_speedup)
    finally:
        harness.stop_all()
    print()
    print("Online (through Envoy):")
    print()
    print(online.markdown(report))
    print("Offline replay of the same requests (kvpick replay: same engine model, virtual clock, "
          "no sockets):")
    print()
    offline = subprocess.run(
        [str(harness.kvpick_binary()), "replay", "--trace", args.trace, "--limit", str(args.limit),
         "--workers", str(args.workers), "--arrival-speedup", str(args.arrival_speedup)],
        capture_output=True, text=True)
    print(offline.stdout if offline.returncode == 0 else offline.stderr)
    errors = sum(p["errors"] for p in report["policies"])
    return 0 if errors == 0 and offline.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
