"""kvpick demo: the routing gain on agentic traffic, through a real Envoy, against simulated vLLM workers.

By default it generates an ``agentic`` workload (``kvpick workload``: tool loops on 4-16k-token
tool prefixes, short calls, sub-agents branching off the shared history; seed 1) and replays it at
offered load 0.85 (``kvpick replay --offered-load``: no-cache prefill demand / fleet prefill
capacity) twice, each time on a fresh ``kvpick sim`` fleet of 4 workers (vLLM-like: paged prefix
cache, continuous batching, KV events over ZeroMQ):

1. through Envoy's own ``ROUND_ROBIN`` cluster (a plain Kubernetes Service, no endpoint picker);
2. through Envoy + kvpick (ext_proc), which follows the engines' KV events and its own bookings.

It prints the workload's statistics, progress, the side-by-side table built from client-side
timings and the ``usage.prompt_tokens_details.cached_tokens`` the workers return, and the offline
(virtual-clock) replay of the same requests through every policy kvpick compares itself with, and
ends with the path of an HTML report of both runs (``report.html`` in its work directory; e2e/report.py:
CDFs, hit rates, per-worker counts, the replay's load and queue over time; opens offline).

``--engine vllm`` runs the demo on two real vLLM 0.32 CPU servers instead (e2e/vllm_bench.py:
agentic sessions over shared tool prefixes, the tiny model of e2e/vllm/make_model.py, one core per
engine; ``bash e2e/demo.sh --engine vllm`` installs vLLM first, ~6 GB once): Envoy round-robin vs
Envoy + kvpick, the engines' own reported cached prompt tokens and client-side TTFT, and the HTML
report (``--seeds 1,2,3`` for several seeds, ``--sim`` to add the calibrated simulator's columns).

Flags: ``--family F`` (default agentic), ``--requests N`` (default 200), ``--load L`` (0.85),
``--workers N`` (4), ``--sim-speedup K`` (2), ``--policy`` (the online columns; add
``sglang-router`` once ``e2e/replay/online.py`` knows it). ``--trace FILE --arrival-speedup A``
replays an existing Mooncake trace instead (the trace_1000 run of docs/simulator.md:
``--trace data/mooncake/mooncake_trace_1000.jsonl --limit 1000 --workers 8 --arrival-speedup 2.3``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

E2E = Path(__file__).resolve().parent
sys.path.insert(0, str(E2E))
sys.path.insert(0, str(E2E / "replay"))

import harness  # noqa: E402
import online  # noqa: E402
import report as html_report  # noqa: E402


def kvpick(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(harness.kvpick_binary()), *args], capture_output=True, text=True)


def online_section(what: str, report: dict) -> dict:
    """The online run's charts: client-side CDFs, cached tokens and the worker each answer named
    (no time series: the client sees no engine state)."""
    return {
        "title": "Online, through Envoy (client-side timings)",
        "note": f"{what}; {report['requests']} requests, {report['workers']} kvpick sim workers, "
                f"sim speedup x{report['sim_speedup']} (latencies scaled back to engine time)",
        "policies": [{"name": p["policy"], "ttft_cdf": p["ttft_cdf"], "e2e_cdf": p["e2e_cdf"],
                      "kv_hit_rate": p["kv_hit_rate"], "requests_per_rank": p["per_worker_requests"]}
                     for p in report["policies"]],
    }


def write_html(work: Path, what: str, report: dict, offline_charts: Path) -> Path:
    offline = html_report.section_from_chart_data(
        offline_charts, "Offline replay of the same requests (kvpick replay, virtual clock)")
    return html_report.write_report(harness.kvpick_binary(), "kvpick demo",
                                    [online_section(what, report), offline], work / "report.html")


def vllm_demo(seeds: list[int], with_sim: bool) -> int:
    """The demo on real vLLM engines (e2e/vllm_bench.py)."""
    import vllm_bench

    print("kvpick demo on real engines: 2 x vLLM 0.32 (CPU, one core each, tiny random-weight "
          "Llama), agentic sessions over shared tool prefixes, token-id prompts")
    print("client -> Envoy 1.40 -> (round-robin cluster | ext_proc kvpick) -> vLLM")
    print()
    report = vllm_bench.run(seeds, with_sim)
    print()
    print(vllm_bench.markdown(report))
    work = harness.new_workdir("demo-vllm")
    (work / "report.json").write_text(json.dumps(report, indent=1, default=str))
    sections = []
    for engine, title in (("vllm", "Real vLLM 0.32 through Envoy"),
                          ("sim", "kvpick sim calibrated to the same engines")):
        rows = [r for r in report["runs"] if r["engine"] == engine and r["seed"] == seeds[0]]
        if rows:
            sections.append({
                "title": title,
                "note": f"seed {seeds[0]}, {rows[0]['requests']} requests, 2 engines; "
                        "cached tokens as the engines report them",
                "policies": [{"name": r["policy"], "ttft_cdf": r["ttft_cdf"],
                              "e2e_cdf": r["e2e_cdf"], "kv_hit_rate": r["kv_hit_rate"],
                              "requests_per_rank": r["per_worker_requests"]} for r in rows]})
    html = html_report.write_report(harness.kvpick_binary(), "kvpick demo on real vLLM", sections,
                                    work / "report.html")
    print(f"HTML report (opens offline): {html}")
    return 0 if all(r["errors"] == 0 for r in report["runs"]) else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                    help="simulated workers (default) or two real vLLM servers")
    ap.add_argument("--seeds", default="1", help="with --engine vllm: workload seeds (medians)")
    ap.add_argument("--sim", action="store_true",
                    help="with --engine vllm: add the simulator calibrated to the engines")
    ap.add_argument("--family", default="agentic")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--load", type=float, default=0.85,
                    help="offered load the generated trace is rescaled to")
    ap.add_argument("--trace", help="replay this Mooncake trace instead of generating one")
    ap.add_argument("--limit", type=int, help="with --trace: its first N requests")
    ap.add_argument("--arrival-speedup", type=float,
                    help="with --trace: divide inter-arrival times by this (default: --load)")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--sim-speedup", type=float, default=2.0)
    ap.add_argument("--policy", default="envoy-round-robin,kvpick",
                    help="online columns, comma-separated (e2e/replay/online.py's policies)")
    args = ap.parse_args()
    if args.engine == "vllm":
        return vllm_demo([int(x) for x in args.seeds.split(",")], args.sim)
    work = harness.new_workdir("demo")
    if args.trace:
        trace = Path(args.trace)
        if not trace.exists():
            print(f"demo: trace not found: {trace}", file=sys.stderr)
            return 2
        what = f"{trace.name}" + (f", first {args.limit} requests" if args.limit else "")
    else:
        trace = work / f"{args.family}-{args.seed}.jsonl"
        gen = kvpick("workload", "--family", args.family, "--seed", str(args.seed), "--requests",
                     str(args.requests), "--out", str(trace))
        if gen.returncode != 0:
            print(gen.stderr, file=sys.stderr)
            return 2
        what = f"generated `{args.family}` workload (kvpick workload --seed {args.seed})"
        print(gen.stdout)
    limit = ["--limit", str(args.limit)] if args.limit else []
    pace = (["--arrival-speedup", str(args.arrival_speedup)] if args.arrival_speedup
            else ["--offered-load", str(args.load)])
    offline_report = work / "offline.json"
    offline_charts = work / "offline.charts.json"
    offline = kvpick("replay", "--trace", str(trace), "--workers", str(args.workers), *limit, *pace,
                     "--report", str(offline_report), "--chart-data", str(offline_charts))
    if offline.returncode != 0:
        print(offline.stderr, file=sys.stderr)
        return 2
    offline_json = json.loads(offline_report.read_text())
    speedup = offline_json["arrival_speedup"]
    print(f"kvpick demo: {what}, {offline_json['requests']} requests, {args.workers} simulated vLLM "
          f"workers, offered load {offline_json['offered_load']:.2f} (arrivals x{speedup:.3g}), "
          f"sim speedup x{args.sim_speedup}")
    print("client -> Envoy 1.40 -> (round-robin cluster | ext_proc kvpick) -> kvpick sim workers")
    print()
    try:
        report = online.run_online(trace, limit=args.limit, workers=args.workers,
                                   arrival_speedup=speedup, sim_speedup=args.sim_speedup,
                                   policies=tuple(p for p in args.policy.split(",") if p))
    finally:
        harness.stop_all()
    print()
    print("Online (through Envoy):")
    print()
    print(online.markdown(report))
    print("Offline replay of the same requests (kvpick replay: same engine model, virtual clock, "
          "no sockets):")
    print()
    print(offline.stdout)
    html = write_html(work, what, report, offline_charts)
    print(f"HTML report (charts of both runs, opens offline): {html}")
    errors = sum(p["errors"] for p in report["policies"])
    return 0 if errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
