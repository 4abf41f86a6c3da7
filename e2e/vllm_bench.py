"""The real-engine routing benchmark: agentic sessions through a real Envoy to two real vLLM 0.32
CPU servers (one core each, the tiny model of e2e/vllm/make_model.py), Envoy round-robin vs Envoy
+ kvpick, with the engines' own `cached_tokens` and client-side TTFT; then the simulator
calibrated against the same engines (`kvpick sim`: prefill and decode cost fitted from timed
requests) replaying the same requests, so the two can be compared.

    bash e2e/demo.sh --engine vllm                 # one seed, the side-by-side table + HTML report
    .venv/bin/python e2e/vllm_bench.py --seeds 1,2,3,4 --sim --out bench.json   # docs/benchmarks.md

The workload: sessions of growing prompts (an agent's turns) over a few shared 600-token tool
prefixes; token-id prompts (random ids, so no tokenizer is involved and every router hashes the
engine's ids), open-loop arrivals. The engines' caches (7,264 tokens each) hold a few sessions,
so routing decides what is reused. Between policies the engines' prefix caches are reset.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

E2E = Path(__file__).resolve().parent
sys.path.insert(0, str(E2E))
sys.path.insert(0, str(E2E / "replay"))
sys.path.insert(0, str(E2E / "tests"))

import harness  # noqa: E402
import online  # noqa: E402
from vllm_engine import BLOCK, KV_BYTES, MODEL, VllmEngine, vllm_available  # noqa: E402
from vllm_support import envoy_config_with_upstream_header  # noqa: E402

POLICIES = ("envoy-round-robin", "kvpick")


def workload(seed: int, sessions: int = 24, prefixes: int = 4, rate: float = 1.6,
             turn_gap: float = 3.0) -> list[online.Prepared]:
    """Sessions of 2-5 turns: turn k = a shared 600-token prefix + the session's first k
    250-token segments; sessions start as a Poisson process of ``rate`` a second and a turn
    follows the previous one by ``turn_gap`` seconds (open loop: arrivals do not wait)."""
    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(10, 4000) for _ in range(n)]

    shared = [ids(600) for _ in range(prefixes)]
    out: list[tuple[float, list[int], int]] = []
    start = 0.0
    for _ in range(sessions):
        start += rng.expovariate(rate)
        prefix = shared[rng.randrange(prefixes)]
        history: list[int] = []
        for turn in range(rng.randint(2, 5)):
            history += ids(250)
            out.append((start + turn * turn_gap, prefix + history, rng.randint(8, 24)))
    out.sort(key=lambda r: r[0])
    return [online.Prepared(i, at, prompt, len(prompt), max_tokens)
            for i, (at, prompt, max_tokens) in enumerate(out)]


def run_policy(policy: str, catalog: list[dict[str, Any]], ports: list[int],
               requests: list[online.Prepared], model: str) -> dict[str, Any]:
    envoy = stack = None
    try:
        if policy == "envoy-round-robin":
            # Envoy's own ROUND_ROBIN cluster (no picker), answering with the upstream it used.
            envoy = online.round_robin_envoy(ports, envoy_config_with_upstream_header())
            url = envoy.url()
        else:
            stack = harness.Stack(catalog, secure=False, name="vllm-bench",
                                  envoy_config=envoy_config_with_upstream_header()).start()
            kv = stack.kvpick
            harness.wait_until(lambda: (kv.metric("kvpick_kv_subscriptions") or 0) >= len(ports),
                               30, desc="kvpick subscribed to every engine")
            url = stack.url()
        results, wall = asyncio.run(online.replay(url, requests, policy, None, model=model,
                                                  worker_header="x-e2e-upstream"))
    finally:
        if envoy is not None:
            envoy.stop()
        if stack is not None:
            stack.stop()
    by_port = {f"127.0.0.1:{p}": str(i) for i, p in enumerate(ports)}
    for r in results:
        r.worker = by_port.get(r.worker or "", r.worker)
    row = online.summarize(policy, results, len(ports), 1.0)
    ttft = sorted(r.ttft * 1000 for r in results if r.ttft is not None)
    row["ttft_ms"]["p90"] = online._pct(ttft, 0.9)
    row["wall_s"] = wall
    return row


# ------------------------------------------------------------------------------------------------
# calibration: the simulator's engine model fitted to the real engine


def _ttft(engine_url: str, prompt: list[int], max_tokens: int = 1) -> tuple[float, float]:
    """(time to first token, end-to-end) of one streamed completion, seconds."""
    import httpx

    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    start = time.monotonic()
    first = None
    with httpx.Client(timeout=120, trust_env=False) as c, \
            c.stream("POST", engine_url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and first is None and line != "data: [DONE]":
                first = time.monotonic()
    end = time.monotonic()
    return (first or end) - start, end - start


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares line y = a + b x."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def calibrate(engine: VllmEngine, seed: int = 5) -> dict[str, Any]:
    """Cold prefill time against prompt length (cache reset before each), decode time per token
    at batch 1 (a 64-token answer minus its first token): the sim's `--prefill-overhead-ms`,
    `--prefill-us-per-token` and `--itl-ms`."""
    rng = random.Random(seed)
    sizes = [256, 512, 1024, 2048, 3072]
    xs, ys = [], []
    for n in sizes * 2:
        engine.reset_prefix_cache()
        ttft, _ = _ttft(engine.url, [rng.randrange(10, 4000) for _ in range(n)])
        xs.append(n)
        ys.append(ttft * 1000)
    overhead_ms, ms_per_token = _fit(xs, ys)
    itls = []
    for _ in range(3):
        engine.reset_prefix_cache()
        ttft, e2e = _ttft(engine.url, [rng.randrange(10, 4000) for _ in range(64)], 64)
        itls.append((e2e - ttft) * 1000 / 63)
    fit_err = [abs(y - (overhead_ms + ms_per_token * x)) / y for x, y in zip(xs, ys)]
    return {"prefill_overhead_ms": max(overhead_ms, 0.0), "prefill_us_per_token": ms_per_token * 1000,
            "itl_ms": statistics.median(itls), "points": list(zip(xs, [round(y, 1) for y in ys])),
            "fit_max_rel_error": max(fit_err)}


def sim_args(cal: dict[str, Any]) -> list[str]:
    blocks = KV_BYTES // (9216 * BLOCK)     # the tiny model's 9 KiB of KV per token
    return ["--block-size", str(BLOCK), "--num-gpu-blocks", str(blocks),
            "--prefill-overhead-ms", f"{cal['prefill_overhead_ms']:.2f}",
            "--prefill-us-per-token", f"{cal['prefill_us_per_token']:.1f}",
            "--itl-ms", f"{cal['itl_ms']:.2f}", "--itl-ms-per-seq", "0",
            "--max-num-batched-tokens", "8192", "--model", MODEL]


# ------------------------------------------------------------------------------------------------


def run(seeds: list[int], with_sim: bool, progress=print,
        engines: list[VllmEngine] | None = None, sessions: int = 24) -> dict[str, Any]:
    """Every seed through both policies on ``engines`` (two started here when None, and stopped
    at the end; given ones are left running unless ``with_sim`` needs their cores)."""
    why = vllm_available()
    if why:
        raise SystemExit(f"vllm_bench: {why}")
    owned = engines is None
    if engines is None:
        engines = [VllmEngine("a", cpu=0), VllmEngine("b", cpu=1)]
        for e in engines:
            e.start(wait=False)
    report: dict[str, Any] = {"seeds": seeds, "runs": []}
    try:
        for e in engines:
            e.wait_ready()
        progress("engines ready: " + ", ".join(e.endpoint for e in engines))
        catalog = [e.catalog_entry() for e in engines]
        ports = [e.port for e in engines]
        for seed in seeds:
            requests = workload(seed, sessions)
            for policy in POLICIES:
                for e in engines:
                    e.reset_prefix_cache()
                row = run_policy(policy, catalog, ports, requests, MODEL)
                row.update(seed=seed, engine="vllm")
                report["runs"].append(row)
                progress(_line(row))
        if with_sim:
            cal = calibrate(engines[0])
            report["calibration"] = cal
            progress(f"calibration: {json.dumps({k: v for k, v in cal.items() if k != 'points'})}")
            for e in engines:
                e.stop()
            for seed in seeds:
                requests = workload(seed, sessions)
                for policy in POLICIES:
                    sim = online.Sim(2, 1.0, sim_args(cal)).start()
                    try:
                        catalog = sim.catalog()
                        for w in catalog:
                            w.update(block_size=BLOCK, model=MODEL)
                        row = run_policy(policy, catalog, sim.http_ports(), requests, MODEL)
                    finally:
                        sim.stop()
                    row.update(seed=seed, engine="sim")
                    report["runs"].append(row)
                    progress(_line(row))
    finally:
        if owned:
            for e in engines:
                e.stop()
    report["summary"] = summary(report["runs"])
    return report


def _line(row: dict[str, Any]) -> str:
    return (f"  {row['engine']} seed {row['seed']} {row['policy']}: cached {row['kv_hit_rate']:.1%}, "
            f"TTFT mean {row['ttft_ms']['mean']:.0f} ms, p90 {row['ttft_ms']['p90']:.0f} ms, "
            f"errors {row['errors']}, per engine {row['per_worker_requests']}")


def summary(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Medians over seeds per (engine, policy)."""
    out = []
    for engine in ("vllm", "sim"):
        for policy in POLICIES:
            rows = [r for r in runs if r["engine"] == engine and r["policy"] == policy]
            if not rows:
                continue
            out.append({"engine": engine, "policy": policy, "seeds": len(rows),
                        "cached": statistics.median(r["kv_hit_rate"] for r in rows),
                        "ttft_mean_ms": statistics.median(r["ttft_ms"]["mean"] for r in rows),
                        "ttft_p50_ms": statistics.median(r["ttft_ms"]["p50"] for r in rows),
                        "ttft_p90_ms": statistics.median(r["ttft_ms"]["p90"] for r in rows),
                        "errors": sum(r["errors"] for r in rows)})
    return out


def markdown(report: dict[str, Any]) -> str:
    lines = [f"Medians over {len(report['seeds'])} seed(s) ({', '.join(map(str, report['seeds']))});"
             " engine-reported cached prompt tokens, client-side TTFT.", "",
             "| engine | policy | cached prompt tokens | TTFT mean | TTFT p50 | TTFT p90 | errors |",
             "|---|---|---|---|---|---|---|"]
    for s in report["summary"]:
        lines.append(f"| {'real vLLM 0.32' if s['engine'] == 'vllm' else 'kvpick sim (calibrated)'} "
                     f"| {s['policy']} | {s['cached']:.1%} | {s['ttft_mean_ms']:.0f} ms | "
                     f"{s['ttft_p50_ms']:.0f} ms | {s['ttft_p90_ms']:.0f} ms | {s['errors']} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1", help="comma-separated workload seeds")
    ap.add_argument("--sim", action="store_true",
                    help="also calibrate kvpick sim against the engines and replay the same requests")
    ap.add_argument("--out", help="write the JSON report here")
    args = ap.parse_args()
    report = run([int(s) for s in args.seeds.split(",")], args.sim)
    print()
    print(markdown(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
    return 0 if all(r["errors"] == 0 for r in report["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
