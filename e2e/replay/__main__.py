"""``python e2e/replay --trace FILE``: the same trace through Envoy round-robin, Envoy + kvpick
and (``--policy ...,sglang-router``) SGLang's router, each on a fresh ``kvpick sim`` fleet; prints the
side-by-side table."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import online  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(Path(__file__).resolve().parents[2]
                                           / "data/mooncake/mooncake_trace_1000.jsonl"))
    ap.add_argument("--limit", type=int, default=None, help="first N requests")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--arrival-speedup", type=float, default=1.15,
                    help="divide inter-arrival times (1.15 loads 4 default workers to ~80%%)")
    ap.add_argument("--sim-speedup", type=float, default=2.0,
                    help="kvpick sim --speedup (arrivals are compressed by the same factor)")
    ap.add_argument("--policy", default="envoy-round-robin,kvpick",
                    help="comma-separated: envoy-round-robin, kvpick, sglang-router")
    ap.add_argument("--prompt-form", choices=online.PROMPT_FORMS, default=None,
                    help="token ids or the trace's text form (default: text when sglang-router "
                         "runs, since it takes text only; every policy gets the same prompts)")
    ap.add_argument("--report", help="write the JSON report here")
    ap.add_argument("--kvpick-arg", action="append", default=[], help="extra `kvpick serve` flag")
    ap.add_argument("--sim-arg", action="append", default=[], help="extra `kvpick sim` flag")
    args = ap.parse_args()
    try:
        report = online.run_online(args.trace, limit=args.limit, workers=args.workers,
                                   arrival_speedup=args.arrival_speedup,
                                   sim_speedup=args.sim_speedup, sim_args=args.sim_arg,
                                   kvpick_args=args.kvpick_arg,
                                   policies=tuple(args.policy.split(",")),
                                   prompt_form=args.prompt_form)
    finally:
        online.harness.stop_all()
    print()
    print(online.markdown(report))
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(p["errors"] == 0 for p in report["policies"]) else 1


if __name__ == "__main__":
    sys.exit(main())
