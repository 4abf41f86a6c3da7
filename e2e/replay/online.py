"""Online replay: a Mooncake trace through a real Envoy to ``kvpick sim``, twice on a fresh (cold)
simulated fleet each time:

* ``envoy-round-robin``: Envoy's own ``ROUND_ROBIN`` cluster over the sim workers, no ext_proc (a
  plain Kubernetes Service / gateway without an endpoint picker);
* ``kvpick``: Envoy with the ext_proc filter and kvpick (precise mode: it subscribes to the sim's
  KV events), routing through the ``ORIGINAL_DST`` cluster (e2e/envoy.yaml).

Each request is ``POST /v1/completions`` with the synthesized token ids (``mooncake.py``) as
``prompt``, ``max_tokens = output_length``, streamed with ``include_usage``. The table comes from
client-side timings and the ``usage`` fields only. Times are reported in *model time* (wall time
multiplied by the sim's ``--speedup``), so they compare with ``kvpick replay``'s virtual-time table.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import harness  # noqa: E402

try:
    from . import mooncake  # type: ignore[no-redef]
except ImportError:  # run as a script directory
    import mooncake  # type: ignore[no-redef]

MODEL = "kvpick-sim"


@dataclass
class Result:
    index: int
    worker: str | None
    status: int
    ttft: float | None  # seconds (wall)
    e2e: float | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    error: str | None = None


@dataclass
class Prepared:
    index: int
    at: float  # wall seconds after the start
    tokens: list[int]
    max_tokens: int


def prepare(records: list[mooncake.Record], arrival_speedup: float,
            sim_speedup: float) -> list[Prepared]:
    base = min(r.timestamp for r in records)
    return [Prepared(i, (r.timestamp - base) / 1000.0 / arrival_speedup / sim_speedup,
                     mooncake.synthesize(r), max(1, r.output_length))
            for i, r in enumerate(records)]


async def _one(client: httpx.AsyncClient, url: str, req: Prepared, t0: float) -> Result:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + req.at - loop.time()))
    start = loop.time()
    body = {"model": MODEL, "prompt": req.tokens, "max_tokens": req.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    first = None
    usage: dict[str, Any] = {}
    worker = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            worker = resp.headers.get("x-sim-worker")
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return Result(req.index, worker, resp.status_code, None, None, len(req.tokens), 0,
                              0, text[:200])
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if first is None and obj.get("choices"):
                    first = loop.time()
                if obj.get("usage"):
                    usage = obj["usage"]
    except httpx.HTTPError as exc:
        return Result(req.index, worker, 0, None, None, len(req.tokens), 0, 0, repr(exc))
    end = loop.time()
    details = usage.get("prompt_tokens_details") or {}
    return Result(req.index, worker, 200, None if first is None else first - start, end - start,
                  int(usage.get("prompt_tokens", len(req.tokens))),
                  int(details.get("cached_tokens", 0)), int(usage.get("completion_tokens", 0)))


async def replay(url: str, requests: list[Prepared], label: str,
                 progress: Callable[[str], None] | None = print) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.2
        tasks = [asyncio.create_task(_one(client, url, r, t0)) for r in requests]
        done = 0
        results: list[Result] = []
        step = max(1, len(tasks) // 10)
        for fut in asyncio.as_completed(tasks):
            results.append(await fut)
            done += 1
            if progress and (done % step == 0 or done == len(tasks)):
                progress(f"  [{label}] {done}/{len(tasks)} requests done "
                         f"({loop.time() - t0:.1f}s)")
        wall = loop.time() - t0
    results.sort(key=lambda r: r.index)
    return results, wall


def _pct(values: list[float], p: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s), max(1, math.ceil(p * len(s)))) - 1]


def summarize(label: str, results: list[Result], workers: int, sim_speedup: float) -> dict[str, Any]:
    ok = [r for r in results if r.status == 200 and r.ttft is not None and r.e2e is not None]
    ms = 1000.0 * sim_speedup
    ttft = [r.ttft * ms for r in ok]  # type: ignore[operator]
    e2e = [r.e2e * ms for r in ok]  # type: ignore[operator]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_worker = [0] * workers
    for r in ok:
        if r.worker is not None and r.worker.isdigit() and int(r.worker) < workers:
            per_worker[int(r.worker)] += 1
    return {
        "policy": label,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "first_error": next((r.error for r in results if r.error), None),
        "kv_hit_rate": cached / prompt if prompt else 0.0,
        "ttft_ms": {"mean": sum(ttft) / len(ttft) if ttft else 0.0, "p50": _pct(ttft, 0.5),
                    "p99": _pct(ttft, 0.99)},
        "e2e_ms": {"mean": sum(e2e) / len(e2e) if e2e else 0.0, "p99": _pct(e2e, 0.99)},
        "per_worker_requests": per_worker,
        "output_tokens": sum(r.completion_tokens for r in ok),
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"{report['requests']} requests, {report['workers']} workers, arrival speedup "
        f"{report['arrival_speedup']}, sim speedup {report['sim_speedup']} "
        "(times in model ms = wall x sim speedup)",
        "",
        "| policy | KV hit rate | TTFT mean (ms) | TTFT p50 | TTFT p99 | E2E mean (ms) | E2E p99 "
        "| errors | requests per worker |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for p in report["policies"]:
        lines.append(
            f"| {p['policy']} | {p['kv_hit_rate'] * 100:.1f}% | {p['ttft_ms']['mean']:.0f} | "
            f"{p['ttft_ms']['p50']:.0f} | {p['ttft_ms']['p99']:.0f} | {p['e2e_ms']['mean']:.0f} | "
            f"{p['e2e_ms']['p99']:.0f} | {p['errors']} | "
            f"{'/'.join(str(n) for n in p['per_worker_requests'])} |")
    pols = {p["policy"]: p for p in report["policies"]}
    rr, kv = pols.get("envoy-round-robin"), pols.get("kvpick")
    if rr and kv and kv["ttft_ms"]["mean"] > 0:
        lines.append("")
        lines.append(f"kvpick vs Envoy round-robin: mean TTFT {rr['ttft_ms']['mean'] / kv['ttft_ms']['mean']:.1f}x "
                     f"lower, KV hit rate {kv['kv_hit_rate'] * 100:.1f}% vs {rr['kv_hit_rate'] * 100:.1f}%")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# processes


class Sim:
    """``kvpick sim`` on ephemeral ports (a fresh, cold fleet per instance)."""

    def __init__(self, workers: int, speedup: float, extra: list[str] | None = None) -> None:
        self.workdir = harness.new_workdir("sim")
        self.port_file = self.workdir / "ports.json"
        argv = [str(harness.kvpick_binary()), "sim", "--workers", str(workers),
                "--base-port", "0", "--kv-events-port", "0", "--kv-replay-port", "0",
                "--speedup", str(speedup), "--port-file", str(self.port_file)] + (extra or [])
        self.process = harness.ManagedProcess("kvpick-sim", argv, self.workdir / "sim.log")
        self.workers: list[dict[str, Any]] = []

    def start(self) -> "Sim":
        self.process.start()

        def ready():
            self.process.check_alive()
            return json.loads(self.port_file.read_text()) if self.port_file.exists() else None

        self.workers = harness.wait_until(ready, 30, desc="kvpick sim port file")["workers"]
        return self

    def http_ports(self) -> list[int]:
        return [w["http"] for w in self.workers]

    def catalog(self) -> list[dict[str, Any]]:
        out = []
        for i, w in enumerate(self.workers):
            entry = harness.worker(f"sim-{i}", ports=[w["http"]], model=MODEL)
            entry["block_size"] = 16
            entry["kv_events"] = f"tcp://127.0.0.1:{w['ranks'][0]['events']}"
            entry["kv_replay"] = f"tcp://127.0.0.1:{w['ranks'][0]['replay']}"
            out.append(entry)
        return out

    def stop(self) -> None:
        self.process.stop()


def round_robin_envoy(ports: list[int]) -> harness.Envoy:
    """The reference Envoy config without ext_proc, routing to a STATIC ROUND_ROBIN cluster."""
    cfg = harness.load_envoy_template()
    main = next(l for l in cfg["static_resources"]["listeners"] if l["name"] == harness.MAIN_LISTENER)
    hcm = harness._hcm(main)
    hcm["http_filters"] = [f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"]
    for vh in hcm["route_config"]["virtual_hosts"]:
        for route in vh["routes"]:
            route["route"]["cluster"] = "sim_round_robin"
            route.pop("request_headers_to_add", None)
    cfg["static_resources"]["clusters"].append({
        "name": "sim_round_robin",
        "type": "STATIC",
        "lb_policy": "ROUND_ROBIN",
        "connect_timeout": "5s",
        "per_connection_buffer_limit_bytes": 67108864,
        "load_assignment": {"cluster_name": "sim_round_robin", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
            for p in ports]}]},
    })
    return harness.Envoy(kvpick_port=1, secure=False, config=cfg).start()


def run_online(trace: Path | str, *, limit: int | None, workers: int, arrival_speedup: float,
               sim_speedup: float, sim_args: list[str] | None = None,
               kvpick_args: list[str] | None = None, policies: tuple[str, ...] = ("envoy-round-robin", "kvpick"),
               progress: Callable[[str], None] | None = print) -> dict[str, Any]:
    mooncake.self_check()
    records = mooncake.load(trace, limit)
    if progress:
        progress(f"synthesizing {len(records)} prompts from {trace} ...")
    requests = prepare(records, arrival_speedup, sim_speedup)
    sim_extra = ["--stream-interval", "8"] + list(sim_args or [])
    report: dict[str, Any] = {"trace": str(trace), "requests": len(requests), "workers": workers,
                              "arrival_speedup": arrival_speedup, "sim_speedup": sim_speedup,
                              "policies": []}
    for policy in policies:
        sim = Sim(workers, sim_speedup, sim_extra).start()
        stack = envoy = None
        try:
            if policy == "envoy-round-robin":
                envoy = round_robin_envoy(sim.http_ports())
                url = envoy.url()
            elif policy == "kvpick":
                stack = harness.Stack(sim.catalog(), secure=False, name="replay",
                                      extra_args=list(kvpick_args or [])).start()
                url = stack.url()
            else:
                raise ValueError(f"unknown online policy {policy!r}")
            if progress:
                progress(f"{policy}: replaying {len(requests)} requests through Envoy "
                         f"({requests[-1].at:.0f}s of arrivals) ...")
            results, wall = asyncio.run(replay(url, requests, policy, progress))
            row = summarize(policy, results, workers, sim_speedup)
            row["wall_s"] = wall
            report["policies"].append(row)
        finally:
            if envoy is not None:
                envoy.stop()
            if stack is not None:
                stack.stop()
            sim.stop()
    return report
