"""The benchmark matrix (issue 16): workload families x offered loads x every policy `kvpick replay`
knows x 3 seeds, 8 ranks, plus the sensitivity of kvpick's result to +-50% on each of its tunables.

``bash e2e/matrix.sh`` builds the release binary and runs this; ``python3 e2e/matrix.py --help`` for
the knobs (the standard library only: no venv needed). For every (family, seed) it writes a trace
with ``kvpick workload``; for every load it runs ``kvpick replay --offered-load L`` (all policies in
one process, on a virtual clock), two processes at a time. It writes ``matrix.json`` (every seed's
numbers and the medians) and ``matrix.md`` (per cell: medians of the seeds, the best policy per
metric in bold, and whether kvpick meets issue 16's targets) into ``--out``, and ``matrix.html``
(e2e/report.py: per family and load, the first seed's TTFT and E2E CDFs, KV hit rate, requests per
rank, load per rank and kvpick's queue over time; inline SVG, opens offline).

Offered load is the replay's definition (``crates/kvpick-sim/src/replay/mod.rs``,
``offered_load``): arrival rate x mean no-cache prefill time per request (the engine model's
``prefill_overhead + prefill_per_token x input``) / ranks.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import report as html_report  # noqa: E402

# kvpick's tunables in `kvpick replay`: flag -> default. The sensitivity section replays kvpick alone
# with each at 0.5x and 1.5x its default (an integer flag is rounded; a zero default is skipped,
# since +-50% of 0 is 0). Update this table when the scheduler's knobs change.
KVPICK_PARAMS: dict[str, float | int] = {
    "--overlap-score-credit": 1.0,
    "--prefill-load-scale": 1.0,
    "--decode-block-weight": 0.01,
    "--decode-active-request-weight": 0.0,
    "--predicted-ttl": 300,
    "--stall-weight": 1.0,
    "--ttft-slack": 1.5,
}

# Flags whose range starts above 0: +-50% applies to the distance from that floor (a slack of 1.5
# varies 1.25..1.75; 1 is its smallest value).
KVPICK_PARAM_FLOORS: dict[str, float] = {"--ttft-slack": 1.0}

# Requests per trace, per family: long enough that chat shows several turns per conversation
# (~4.5 min of arrivals) and small-families has 2,000+ families, short enough that the whole matrix
# (~850 s of CPU, 180 replays) takes ~7-10 minutes on 2 idle cores. On a machine shared with other
# builds it can take several times that: `--scale 0.45` keeps it near 20 minutes there.
FAMILIES: dict[str, int] = {
    "chat": 6000,
    "agentic": 2000,
    "shared-docs": 3000,
    "small-families": 3200,
    "no-reuse": 2000,
}
LOADS = [0.5, 0.75, 0.9, 0.95]
SEEDS = [1, 2, 3]
WORKERS = 8
SENSITIVITY_LOAD = 0.9
OPTIONAL_POLICIES = ["dynamo"]  # in the matrix when the binary knows them (a cargo feature)

METRICS = [  # (key in the report, label, lower is better)
    ("kv_hit_rate", "KV hit", False),
    ("ttft_mean", "TTFT mean (ms)", True),
    ("ttft_p50", "TTFT p50", True),
    ("ttft_p99", "TTFT p99", True),
    ("e2e_mean", "E2E mean (ms)", True),
    ("e2e_p99", "E2E p99", True),
    ("throughput", "output tok/s", False),
]

ROOT = Path(__file__).resolve().parent.parent


def flatten(p: dict) -> dict[str, float]:
    return {
        "kv_hit_rate": p["kv_hit_rate"],
        "ttft_mean": p["ttft_ms"]["mean"],
        "ttft_p50": p["ttft_ms"]["p50"],
        "ttft_p99": p["ttft_ms"]["p99"],
        "e2e_mean": p["e2e_ms"]["mean"],
        "e2e_p99": p["e2e_ms"]["p99"],
        "throughput": p["throughput_tok_s"],
    }


def run(cmd: list[str]) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")


def policies_of(binary: str, trace: Path, work: Path) -> list[str]:
    """The policies the binary replays by default, plus optional ones it accepts."""
    probe = work / "probe.json"
    run([binary, "replay", "--trace", str(trace), "--limit", "20", "--workers", "2",
         "--report", str(probe)])
    names = [p["policy"] for p in json.loads(probe.read_text())["policies"]]
    for extra in OPTIONAL_POLICIES:
        if extra in names:
            continue
        ok = subprocess.run([binary, "replay", "--trace", str(trace), "--limit", "20",
                             "--workers", "2", "--policy", extra], capture_output=True)
        if ok.returncode == 0:
            names.append(extra)
    return names


def sensitivity_values() -> list[tuple[str, float | int]]:
    out = []
    for flag, default in KVPICK_PARAMS.items():
        if default == 0:
            continue
        floor = KVPICK_PARAM_FLOORS.get(flag, 0.0)
        for factor in (0.5, 1.5):
            v = floor + (default - floor) * factor
            out.append((flag, max(1, round(v)) if isinstance(default, int) else v))
    return out


def median_cells(rows: list[dict]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in rows) for k, _, _ in METRICS}


def fmt(key: str, v: float) -> str:
    return f"{v * 100:.1f}%" if key == "kv_hit_rate" else f"{v:.0f}"


def targets(cell: dict[str, dict[str, float]], load: float) -> dict[str, tuple[bool, str]]:
    """Issue 16's targets for kvpick in one (family, load) cell, each with a short reason."""
    kv = cell["kvpick"]
    others = {p: m for p, m in cell.items() if p != "kvpick"}
    out: dict[str, tuple[bool, str]] = {}
    for key, label in (("ttft_mean", "TTFT mean"), ("ttft_p99", "TTFT p99"),
                       ("e2e_mean", "E2E mean")):
        best = min(others, key=lambda p: others[p][key])
        ok = kv[key] < others[best][key]
        out[label] = (ok, f"{kv[key]:.0f} vs {others[best][key]:.0f} {best}")
    best = max(others, key=lambda p: others[p]["kv_hit_rate"])
    ok = kv["kv_hit_rate"] >= others[best]["kv_hit_rate"] - 0.005
    out["hit rate"] = (ok, f"{kv['kv_hit_rate'] * 100:.1f}% vs {others[best]['kv_hit_rate'] * 100:.1f}% {best}")
    if load >= 0.9 and "round-robin" in others:
        gain = others["round-robin"]["ttft_mean"] / max(kv["ttft_mean"], 1e-9)
        out["8x RR"] = (gain >= 8.0, f"{gain:.1f}x")
    else:
        out["8x RR"] = (True, "n/a")
    return out


def compact(result: dict) -> list[str]:
    """One row per (family, load): kvpick against the best other policy and round-robin."""
    lines = [
        "| family | load | kvpick TTFT mean / p99 (ms) | best other TTFT mean | round-robin TTFT mean "
        "| vs RR | KV hit kvpick / best other | E2E mean kvpick / best other | targets met |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fam, loads in result["cells"].items():
        for load, cell in loads.items():
            med = cell["median"]
            kv = med["kvpick"]
            others = {p: m for p, m in med.items() if p != "kvpick"}
            best_t = min(others, key=lambda p: others[p]["ttft_mean"])
            best_h = max(others, key=lambda p: others[p]["kv_hit_rate"])
            best_e = min(others, key=lambda p: others[p]["e2e_mean"])
            rr = others.get("round-robin", {}).get("ttft_mean", 0.0)
            t = targets(med, float(load))
            lines.append(
                f"| {fam} | {load} | {kv['ttft_mean']:.0f} / {kv['ttft_p99']:.0f} | "
                f"{others[best_t]['ttft_mean']:.0f} ({best_t}) | {rr:.0f} | "
                f"{rr / max(kv['ttft_mean'], 1e-9):.1f}x | {kv['kv_hit_rate'] * 100:.1f}% / "
                f"{others[best_h]['kv_hit_rate'] * 100:.1f}% ({best_h}) | {kv['e2e_mean']:.0f} / "
                f"{others[best_e]['e2e_mean']:.0f} ({best_e}) | "
                f"{sum(ok for ok, _ in t.values())}/{len(t)}"
                + ("" if all(ok for ok, _ in t.values()) else
                   " (misses: " + ", ".join(k for k, (ok, _) in t.items() if not ok) + ")")
                + " |")
    return lines


def markdown(result: dict) -> str:
    lines = [
        "# Benchmark matrix",
        "",
        f"`{result['command']}`: {result['workers']} ranks, seeds {result['seeds']}, "
        f"medians of the seeds; requests per trace {result['requests']}; "
        f"policies {', '.join(result['policies'])}; default engine model; "
        f"{result['wall_s']:.0f} s on this machine.",
        "",
        "## Summary",
        "",
        *compact(result),
        "",
        "## kvpick against issue 16's targets",
        "",
        "Each cell: met (yes/no), kvpick's value vs the best other policy's. Targets: TTFT mean, TTFT "
        "p99 and E2E mean lower than every other policy; KV hit rate at least the best other's "
        "minus 0.5 points; at loads >= 0.9 mean TTFT at least 8x below round-robin.",
        "",
        "| family | load | TTFT mean | TTFT p99 | E2E mean | hit rate | 8x RR | all |",
        "|---|---|---|---|---|---|---|---|",
    ]
    met = total = 0
    for fam, loads in result["cells"].items():
        for load, cell in loads.items():
            t = targets(cell["median"], float(load))
            every = all(ok for ok, _ in t.values())
            met += every
            total += 1
            lines.append(f"| {fam} | {load} | " + " | ".join(
                f"{'yes' if ok else '**no**'} {why}" for ok, why in t.values())
                + f" | {'yes' if every else '**no**'} |")
    lines += ["", f"kvpick meets every target in {met} of {total} cells.", ""]
    lines += ["## Results", "",
              "Medians of the seeds; the best value per metric and load in bold.", ""]
    for fam, loads in result["cells"].items():
        lines += [f"### {fam}", "",
                  "| load | policy | " + " | ".join(label for _, label, _ in METRICS) + " |",
                  "|---|---|" + "---|" * len(METRICS)]
        for load, cell in loads.items():
            med = cell["median"]
            best = {}
            for key, _, lower in METRICS:
                vals = [m[key] for m in med.values()]
                best[key] = min(vals) if lower else max(vals)
            for pol, m in med.items():
                cols = []
                for key, _, _ in METRICS:
                    s = fmt(key, m[key])
                    cols.append(f"**{s}**" if m[key] == best[key] else s)
                lines.append(f"| {load} | {pol} | " + " | ".join(cols) + " |")
        lines.append("")
    if result.get("sensitivity"):
        lines += [f"## Sensitivity of kvpick (load {result['sensitivity_load']})", "",
                  "kvpick alone with one tunable at 0.5x / 1.5x its default (medians of the seeds): "
                  "mean TTFT in ms (change vs the default) and KV hit rate.", "",
                  "| parameter | value | " + " | ".join(result["cells"]) + " |",
                  "|---|---|" + "---|" * len(result["cells"])]
        base = {fam: result["cells"][fam][str(result["sensitivity_load"])]["median"]["kvpick"]
                for fam in result["cells"] if str(result["sensitivity_load"]) in result["cells"][fam]}
        lines.append("| (defaults) | | " + " | ".join(
            f"{base[f]['ttft_mean']:.0f}, {base[f]['kv_hit_rate'] * 100:.1f}%" if f in base else ""
            for f in result["cells"]) + " |")
        for entry in result["sensitivity"]:
            cols = []
            for fam in result["cells"]:
                m = entry["median"].get(fam)
                if m is None or fam not in base:
                    cols.append("")
                    continue
                d = (m["ttft_mean"] / base[fam]["ttft_mean"] - 1) * 100 if base[fam]["ttft_mean"] else 0
                cols.append(f"{m['ttft_mean']:.0f} ({d:+.0f}%), {m['kv_hit_rate'] * 100:.1f}%")
            lines.append(f"| `{entry['flag']}` | {entry['value']} | " + " | ".join(cols) + " |")
        zero = [f for f, d in KVPICK_PARAMS.items() if d == 0]
        if zero:
            lines += ["", f"Skipped (default 0, so +-50% is the default): {', '.join(zero)}."]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bin", default=os.environ.get("KVPICK_BIN",
                                                    str(ROOT / "target/release/kvpick")))
    ap.add_argument("--out", default=str(ROOT / "target/matrix"))
    ap.add_argument("--replay-bin", default=None,
                    help="binary for the replays (default --bin), e.g. crates/kvpick-peers/target/"
                         "release/kvpick-peers to add the dynamo peer; --bin still writes the traces")
    ap.add_argument("--jobs", type=int, default=2, help="replay processes at once")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--loads", default=",".join(str(l) for l in LOADS))
    ap.add_argument("--seeds", default=",".join(str(s) for s in SEEDS))
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply every family's request count (e.g. 0.1 for a smoke run)")
    ap.add_argument("--no-sensitivity", action="store_true")
    ap.add_argument("--from-json", help="only re-render matrix.md from this matrix.json")
    args = ap.parse_args()
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        (Path(args.from_json).parent / "matrix.md").write_text(markdown(result))
        return 0
    binary = args.bin
    if not Path(binary).exists():
        print(f"matrix: no kvpick binary at {binary} (cargo build --release -p kvpick -p kvpick-lab)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    families = [f for f in args.families.split(",") if f]
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        print(f"matrix: unknown families {unknown} (known: {', '.join(FAMILIES)})", file=sys.stderr)
        return 2
    loads = [float(l) for l in args.loads.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    sizes = {f: max(50, int(FAMILIES[f] * args.scale)) for f in families}
    t0 = time.monotonic()

    traces: dict[tuple[str, int], Path] = {}
    for fam in families:
        for seed in seeds:
            path = work / f"{fam}-{seed}.jsonl"
            run([binary, "workload", "--family", fam, "--seed", str(seed), "--requests",
                 str(sizes[fam]), "--out", str(path), "--stats", str(work / f"{fam}-{seed}.stats.json")])
            traces[(fam, seed)] = path
    replay_bin = args.replay_bin or binary
    policies = policies_of(replay_bin, next(iter(traces.values())), work)
    print(f"matrix: policies {', '.join(policies)}; {len(families)} families x {len(loads)} loads "
          f"x {len(seeds)} seeds", flush=True)

    jobs: list[tuple[tuple, list[str], Path]] = []
    for (fam, seed), path in traces.items():
        for load in loads:
            report = work / f"{fam}-{seed}-{load}.json"
            # The HTML report charts the first seed of each cell.
            charts = (["--chart-data", str(work / f"{fam}-{seed}-{load}.charts.json")]
                      if seed == seeds[0] else [])
            jobs.append((("cell", fam, load, seed), [
                replay_bin, "replay", "--trace", str(path), "--workers", str(WORKERS), "--seed",
                str(seed), "--offered-load", str(load), "--policy", ",".join(policies),
                "--report", str(report), *charts], report))
        if not args.no_sensitivity and SENSITIVITY_LOAD in loads:
            for flag, value in sensitivity_values():
                report = work / f"{fam}-{seed}-sens{flag}={value}.json"
                jobs.append((("sens", fam, flag, value, seed), [
                    replay_bin, "replay", "--trace", str(path), "--workers", str(WORKERS), "--seed",
                    str(seed), "--offered-load", str(SENSITIVITY_LOAD), "--policy", "kvpick",
                    flag, str(value), "--report", str(report)], report))

    done = 0

    def one(job):
        run(job[1])
        return job

    results: dict[tuple, dict] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
        for key, _, report in pool.map(one, jobs):
            results[key] = json.loads(report.read_text())
            done += 1
            if done % 10 == 0 or done == len(jobs):
                print(f"matrix: {done}/{len(jobs)} replays ({time.monotonic() - t0:.0f} s)",
                      flush=True)

    cells: dict[str, dict[str, dict]] = {}
    for fam in families:
        cells[fam] = {}
        for load in loads:
            per_seed = {s: {p["policy"]: flatten(p) for p in results[("cell", fam, load, s)]["policies"]}
                        for s in seeds}
            median = {p: median_cells([per_seed[s][p] for s in seeds]) for p in policies}
            cells[fam][str(load)] = {"median": median, "per_seed": per_seed,
                                     "targets": {k: ok for k, (ok, _) in targets(median, load).items()}}
    sensitivity = []
    for flag, value in ([] if args.no_sensitivity or SENSITIVITY_LOAD not in loads
                        else sensitivity_values()):
        med = {}
        for fam in families:
            rows = [flatten(results[("sens", fam, flag, value, s)]["policies"][0]) for s in seeds]
            med[fam] = median_cells(rows)
        sensitivity.append({"flag": flag, "value": value, "median": med})
    result = {
        "command": "bash e2e/matrix.sh" + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else ""),
        "workers": WORKERS,
        "seeds": seeds,
        "requests": sizes,
        "policies": policies,
        "kvpick_params": KVPICK_PARAMS,
        "sensitivity_load": SENSITIVITY_LOAD,
        "workload_stats": {f"{fam}-{seed}": json.loads((work / f"{fam}-{seed}.stats.json").read_text())
                           for fam, seed in traces},
        "cells": cells,
        "sensitivity": sensitivity,
        "wall_s": time.monotonic() - t0,
    }
    (out / "matrix.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "matrix.md").write_text(markdown(result))
    sections = [html_report.section_from_chart_data(
        work / f"{fam}-{seeds[0]}-{load}.charts.json", f"{fam}, offered load {load}",
        f"{sizes[fam]} requests, {WORKERS} ranks, seed {seeds[0]} (of {len(seeds)}; the tables "
        "give the medians)") for fam in families for load in loads]
    html = html_report.write_report(binary, "kvpick benchmark matrix", sections, out / "matrix.html")
    print(f"matrix: wrote {out / 'matrix.md'}, {out / 'matrix.json'} and {html} "
          f"({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
