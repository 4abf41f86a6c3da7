"""Flow-control benchmark on the simulator (issue: flow control). Writes docs/bench/flow.md.

Scenarios (8 simulated ranks, `kvpick replay`, seeded traces from `kvpick workload`):
1. bands: 20% high (priority 5), 50% normal (0), 30% sheddable (-1) at 1.3x offered load, per
   family, against the same trace at 0.3 load (the "unloaded" reference) and against peers;
2. sensitivity: `--saturation-wait` 0.25 .. 2 s and inf (no saturation: dispatch at once);
3. tenants: one band, two tenants sending 4:1, at 6x load (both backlogged): each tenant's share of
   the band's work while both are backlogged;
4. SLOs: high 1.5 s, normal 3 s TTFT SLOs at 1.3x: attainment per band.

Usage: cargo build --release -p kvpick -p kvpick-lab &&
       python3 e2e/flow_bench.py [--bin target/release/kvpick] [--out docs/bench/flow.md]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MIX = "5:0.2,0:0.5,-1:0.3"
PEERS = ["round-robin", "least-loaded", "gie-default", "sglang-cache-aware"]


def run(binary: str, *args: str) -> None:
    subprocess.run([binary, *args], check=True, stdout=subprocess.DEVNULL)


def replay(binary: str, trace: Path, load: float, policies: list[str], out: Path, *extra: str) -> dict:
    run(binary, "replay", "--trace", str(trace), "--offered-load", str(load),
        "--policy", ",".join(policies), "--report", str(out), *extra)
    return json.loads(out.read_text())


def bands(policy: dict) -> dict[int, dict]:
    return {b["priority"]: b for b in policy.get("bands", [])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=str(ROOT / "target" / "release" / "kvpick"))
    ap.add_argument("--out", default=str(ROOT / "docs" / "bench" / "flow.md"))
    ap.add_argument("--requests", type=int, default=3000)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kvpick-flow-"))
    lines = ["# Flow-control benchmark", "",
             f"`python3 e2e/flow_bench.py` ({a.requests} requests per trace, 8 simulated ranks, "
             "seeded; TTFT includes the wait in kvpick's queue; refused = 429 unless noted).", ""]

    lines += ["## Priority bands at 1.3x offered load", "",
              f"Priority mix {MIX} (high / normal / sheddable). `unloaded` = kvpick on the same "
              "trace at 0.3 load.", "",
              "| family | policy | high p99 (ms) | high p99 / unloaded | normal p99 | normal served | "
              "sheddable served / shed | output tok/s |", "|---|---|---|---|---|---|---|---|"]
    for family, seed in [("no-reuse", 1), ("chat", 2), ("agentic", 3)]:
        trace = tmp / f"{family}.jsonl"
        run(a.bin, "workload", "--family", family, "--seed", str(seed), "--requests",
            str(a.requests), "--out", str(trace), "--priority-mix", MIX)
        base = bands(replay(a.bin, trace, 0.3, ["kvpick"], tmp / "u.json")["policies"][0])
        unloaded = base[5]["ttft_ms"]["p99"]
        loaded = replay(a.bin, trace, 1.3, ["kvpick"] + PEERS, tmp / "l.json")["policies"]
        nofc = replay(a.bin, trace, 1.3, ["kvpick"], tmp / "n.json", "--flow-control", "false")
        nofc["policies"][0]["policy"] = "kvpick --flow-control false"
        for p in loaded[:1] + nofc["policies"] + loaded[1:]:
            b = bands(p)
            h, n, s = b[5], b[0], b[-1]
            lines.append(
                f"| {family} | {p['policy']} | {h['ttft_ms']['p99']:.0f} | "
                f"{h['ttft_ms']['p99'] / unloaded:.2f}x | {n['ttft_ms']['p99']:.0f} | "
                f"{n['completed']}/{n['requests']} | {s['completed']}/{s['refused_429']} | "
                f"{p['throughput_tok_s']:.0f} |")
        if family == "no-reuse":
            sens = []
            for w in ["0.25", "0.5", "1", "2", "inf"]:
                p = replay(a.bin, trace, 1.3, ["kvpick"], tmp / "s.json",
                           "--saturation-wait", w)["policies"][0]
                b = bands(p)
                sens.append(f"| {w} | {b[5]['ttft_ms']['p99']:.0f} "
                            f"({b[5]['ttft_ms']['p99'] / unloaded:.2f}x) | "
                            f"{b[0]['ttft_ms']['p99']:.0f} | {b[-1]['refused_429']} | "
                            f"{p['throughput_tok_s']:.0f} |")
    lines += ["", "## Sensitivity: `--saturation-wait` (no-reuse, 1.3x)", "",
              "| saturation wait (s) | high p99 (ms, / unloaded) | normal p99 | sheddable shed | "
              "output tok/s |", "|---|---|---|---|---|"] + sens

    trace = tmp / "tenants.jsonl"
    run(a.bin, "workload", "--family", "no-reuse", "--seed", "4", "--requests", str(a.requests),
        "--out", str(trace), "--tenant-mix", "a:4,b:1")
    lines += ["", "## Fairness: two tenants 4:1 in one band, 6x load", "",
              "| policy | tenant | requests | served | share of work while both backlogged | "
              "TTFT p99 (ms) |", "|---|---|---|---|---|---|"]
    for p in replay(a.bin, trace, 6.0, ["kvpick", "round-robin"], tmp / "t.json")["policies"]:
        for t in p["tenants"]:
            lines.append(f"| {p['policy']} | {t['tenant']} | {t['requests']} | {t['completed']} | "
                         f"{t['backlogged_work_share'] * 100:.1f}% | {t['ttft_ms']['p99']:.0f} |")

    trace = tmp / "slo.jsonl"
    run(a.bin, "workload", "--family", "no-reuse", "--seed", "1", "--requests", str(a.requests),
        "--out", str(trace), "--priority-mix", MIX, "--slo-ttft", "5:1500,0:3000")
    lines += ["", "## SLOs: TTFT SLO 1.5 s (high), 3 s (normal), 1.3x", "",
              "| policy | high attainment | normal attainment | high p99 (ms) | refused 429 "
              "(high / normal / sheddable) |", "|---|---|---|---|---|"]
    for p in replay(a.bin, trace, 1.3, ["kvpick"] + PEERS, tmp / "o.json")["policies"]:
        b = bands(p)
        lines.append(f"| {p['policy']} | {b[5]['slo_attainment'] * 100:.1f}% | "
                     f"{b[0]['slo_attainment'] * 100:.1f}% | {b[5]['ttft_ms']['p99']:.0f} | "
                     f"{b[5]['refused_429']} / {b[0]['refused_429']} / {b[-1]['refused_429']} |")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
