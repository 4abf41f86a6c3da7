"""Online replay: a Mooncake trace through real routers to ``kvpick sim``, each policy on a fresh
(cold) simulated fleet:

* ``envoy-round-robin``: Envoy's own ``ROUND_ROBIN`` cluster over the sim workers, no ext_proc (a
  plain Kubernetes Service / gateway without an endpoint picker);
* ``kvpick``: Envoy with the ext_proc filter and kvpick (precise mode: it subscribes to the sim's
  KV events), routing through the ``ORIGINAL_DST`` cluster (e2e/envoy.yaml);
* ``sglang-router``: SGLang's own router (PyPI ``sglang-router``, pinned in e2e/requirements.txt)
  with ``--policy cache_aware`` and its defaults, in front of the same fleet.

Each request is ``POST /v1/completions`` with ``max_tokens = output_length``, streamed with
``include_usage``. The prompt is the synthesized token ids (``mooncake.py``), or, in the *text form*
(``prompt_form="text"``, required by ``sglang-router``, which takes only text), the trace's
deterministic text (``mooncake.synthesize_text``: one sim token per 4-byte word); every policy of a run
gets the same prompts, and kvpick gets the sim's tokenizer (``--tokenizer-config``) so it still hashes
the engine's token ids. The table comes from client-side timings and the ``usage`` fields only.
Times are reported in *model time* (wall time multiplied by the sim's ``--speedup``), so they compare
with ``kvpick replay``'s virtual-time table.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import httpx

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

import harness  # noqa: E402
import report as html_report  # noqa: E402  (e2e/report.py: the CDFs of the HTML report)

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
    prompt: list[int] | str  # token ids, or the text form
    prompt_tokens: int
    max_tokens: int


PROMPT_FORMS = ("tokens", "text")
# Policies that cannot take token-id prompts.
TEXT_ONLY = ("sglang-router",)


def prepare(records: list[mooncake.Record], arrival_speedup: float,
            sim_speedup: float, prompt_form: str = "tokens") -> list[Prepared]:
    if prompt_form not in PROMPT_FORMS:
        raise ValueError(f"prompt form {prompt_form!r} is not one of {PROMPT_FORMS}")
    synth = mooncake.synthesize_text if prompt_form == "text" else mooncake.synthesize
    base = min(r.timestamp for r in records)
    return [Prepared(i, (r.timestamp - base) / 1000.0 / arrival_speedup / sim_speedup,
                     synth(r), r.input_length, max(1, r.output_length))
            for i, r in enumerate(records)]


async def _one(client: httpx.AsyncClient, url: str, req: Prepared, t0: float,
               model: str = MODEL, worker_header: str = "x-sim-worker") -> Result:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + req.at - loop.time()))
    start = loop.time()
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    first = None
    usage: dict[str, Any] = {}
    worker = None
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            worker = resp.headers.get(worker_header)
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                return Result(req.index, worker, resp.status_code, None, None, req.prompt_tokens,
                              0, 0, text[:200])
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
        return Result(req.index, worker, 0, None, None, req.prompt_tokens, 0, 0, repr(exc))
    end = loop.time()
    details = usage.get("prompt_tokens_details") or {}
    return Result(req.index, worker, 200, None if first is None else first - start, end - start,
                  int(usage.get("prompt_tokens", req.prompt_tokens)),
                  int(details.get("cached_tokens", 0)), int(usage.get("completion_tokens", 0)))


async def replay(url: str, requests: list[Prepared], label: str,
                 progress: Callable[[str], None] | None = print, model: str = MODEL,
                 worker_header: str = "x-sim-worker") -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=2000)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        loop = asyncio.get_running_loop()
        t0 = loop.time() + 0.2
        tasks = [asyncio.create_task(_one(client, url, r, t0, model, worker_header))
                 for r in requests]
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
        "ttft_cdf": html_report.cdf(ttft),
        "e2e_cdf": html_report.cdf(e2e),
    }


def tokenize_counts(samples: list[tuple[str, dict[str, str], float]]) -> dict[str, Any]:
    """kvpick's tokenization outcomes from its ``/metrics`` samples: requests by outcome, those not
    tokenized by reason, and the skipped fraction (routed on load alone because a bound said so)."""
    outcomes: dict[str, int] = {}
    skipped: dict[str, int] = {}
    for name, labels, value in samples:
        if name == "kvpick_tokenize_total":
            outcome = labels.get("outcome", "")
            outcomes[outcome] = outcomes.get(outcome, 0) + int(value)
        elif name == "kvpick_tokenize_skipped_total":
            reason = labels.get("reason", "")
            skipped[reason] = skipped.get(reason, 0) + int(value)
    total = sum(outcomes.values())
    return {"outcomes": outcomes, "skipped": skipped,
            "skipped_fraction": sum(skipped.values()) / total if total else 0.0,
            "queue_wait_ms": _bucket_quantiles(samples, "kvpick_tokenize_queue_wait_seconds")}


def _bucket_quantiles(samples: list[tuple[str, dict[str, str], float]], name: str) -> dict[str, Any]:
    """p50 / p90 / p99 of a histogram as the upper bound of the bucket holding them (ms)."""
    buckets: dict[float, float] = {}
    for n, labels, value in samples:
        if n == name + "_bucket":
            le = labels.get("le", "+Inf")
            bound = float("inf") if le == "+Inf" else float(le)
            buckets[bound] = buckets.get(bound, 0.0) + value
    cumulative = sorted(buckets.items())
    total = cumulative[-1][1] if cumulative else 0.0
    out: dict[str, Any] = {"count": int(total)}
    for q in (0.5, 0.9, 0.99):
        bound = next((b for b, c in cumulative if total and c >= q * total), None)
        out[f"p{int(q * 100)}_le"] = None if bound is None else bound * 1000
    return out


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"{report['requests']} requests, {report['workers']} workers, arrival speedup "
        f"{report['arrival_speedup']:.3g}, sim speedup {report['sim_speedup']} "
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
    kv = pols.get("kvpick")
    if kv and kv.get("tokenize"):
        tok = kv["tokenize"]
        skipped = ", ".join(f"{n} {r}" for r, n in sorted(tok["skipped"].items())) or "none"
        cpu = kv.get("kvpick_cpu_s")
        per_request = f", kvpick CPU {cpu * 1000 / kv['requests']:.1f} ms per request" if cpu else ""
        lines.append("")
        wait = tok.get("queue_wait_ms") or {}
        bounds = "/".join("?" if wait.get(q) is None else f"{wait[q]:g}"
                          for q in ("p50_le", "p90_le", "p99_le"))
        waits = f"; queue wait p50/p90/p99 <= {bounds} ms" if wait.get("count") else ""
        outcomes = ", ".join(f"{o} {n}" for o, n in sorted(tok["outcomes"].items()))
        # Token-id prompts leave nothing to tokenize: say so rather than print an empty list.
        head = (f"kvpick tokenization: {tok['skipped_fraction'] * 100:.1f}% skipped ({skipped}); "
                f"outcomes {outcomes}") if outcomes else "kvpick tokenization: no prompt to tokenize"
        lines.append(f"{head}{per_request}{waits}")
    for other in ("envoy-round-robin", "sglang-router"):
        peer = pols.get(other)
        if peer and kv and kv["ttft_ms"]["mean"] > 0:
            lines.append("")
            lines.append(f"kvpick vs {other}: mean TTFT "
                         f"{peer['ttft_ms']['mean'] / kv['ttft_ms']['mean']:.1f}x lower, KV hit rate "
                         f"{kv['kv_hit_rate'] * 100:.1f}% vs {peer['kv_hit_rate'] * 100:.1f}%")
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


def round_robin_envoy(ports: list[int], cfg: dict[str, Any] | None = None) -> harness.Envoy:
    """The reference Envoy config (or ``cfg``, one derived from it) without ext_proc, routing to
    a STATIC ROUND_ROBIN cluster."""
    cfg = cfg or harness.load_envoy_template()
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


def _free_port() -> int:
    """A loopback port free right now, for a process that cannot bind port 0 and report it."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SglangRouter:
    """SGLang's router (``sglang-router``, ``--policy cache_aware``, its defaults otherwise) in front
    of ``worker_ports``; ready once it lists every worker healthy."""

    def __init__(self, worker_ports: list[int], policy: str = "cache_aware") -> None:
        self.workdir = harness.new_workdir("sglang-router")
        self.port = _free_port()
        self.worker_ports = worker_ports
        argv = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(self.port), "--prometheus-host", "127.0.0.1",
                "--prometheus-port", str(_free_port()), "--policy", policy, "--worker-urls",
                *[f"http://127.0.0.1:{p}" for p in worker_ports]]
        self.process = harness.ManagedProcess("sglang-router", argv, self.workdir / "router.log")

    def start(self, timeout: float = 60.0) -> "SglangRouter":
        self.process.start()

        def ready():
            self.process.check_alive()
            try:
                status, body = harness.http_get(self.url() + "/workers", timeout=2.0)
            except OSError:
                return None
            if status != 200:
                return None
            listed = json.loads(body).get("workers", [])
            healthy = [w for w in listed if w.get("is_healthy")]
            return True if len(healthy) == len(self.worker_ports) else None

        harness.wait_until(ready, timeout, desc="sglang-router lists every sim worker healthy")
        return self

    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.process.stop()


def run_online(trace: Path | str, *, limit: int | None, workers: int, arrival_speedup: float,
               sim_speedup: float, sim_args: list[str] | None = None,
               kvpick_args: list[str] | None = None, policies: tuple[str, ...] = ("envoy-round-robin", "kvpick"),
               prompt_form: str | None = None,
               progress: Callable[[str], None] | None = print) -> dict[str, Any]:
    """``prompt_form`` defaults to ``"text"`` when a policy takes only text, else ``"tokens"``."""
    if prompt_form is None:
        prompt_form = "text" if any(p in TEXT_ONLY for p in policies) else "tokens"
    if prompt_form == "tokens" and any(p in TEXT_ONLY for p in policies):
        raise ValueError(f"{', '.join(p for p in policies if p in TEXT_ONLY)} takes text prompts "
                         "only: use the text form")
    mooncake.self_check()
    mooncake.text_self_check()
    records = mooncake.load(trace, limit)
    if progress:
        progress(f"synthesizing {len(records)} {prompt_form} prompts from {trace} ...")
    requests = prepare(records, arrival_speedup, sim_speedup, prompt_form)
    sim_extra = ["--stream-interval", "8"] + list(sim_args or [])
    kvpick_extra = list(kvpick_args or [])
    if prompt_form == "text":
        # kvpick gets the engine's tokenizer, as in a real deployment.
        config = mooncake.write_text_tokenizer(harness.new_workdir("text-form"), MODEL)
        kvpick_extra = ["--tokenizer-config", str(config)] + kvpick_extra
    report: dict[str, Any] = {"trace": str(trace), "requests": len(requests), "workers": workers,
                              "arrival_speedup": arrival_speedup, "sim_speedup": sim_speedup,
                              "prompt_form": prompt_form, "policies": []}
    for policy in policies:
        sim = Sim(workers, sim_speedup, sim_extra).start()
        stack = envoy = router = None
        try:
            if policy == "envoy-round-robin":
                envoy = round_robin_envoy(sim.http_ports())
                url = envoy.url()
            elif policy == "kvpick":
                stack = harness.Stack(sim.catalog(), secure=False, name="replay",
                                      extra_args=kvpick_extra).start()
                url = stack.url()
            elif policy == "sglang-router":
                router = SglangRouter(sim.http_ports()).start()
                url = router.url()
            else:
                raise ValueError(f"unknown online policy {policy!r}")
            if progress:
                progress(f"{policy}: replaying {len(requests)} requests "
                         f"({requests[-1].at:.0f}s of arrivals) ...")
            cpu_before = _cpu_seconds(stack.kvpick.process.pid) if stack is not None else None
            results, wall = asyncio.run(replay(url, requests, policy, progress))
            row = summarize(policy, results, workers, sim_speedup)
            row["wall_s"] = wall
            if stack is not None:
                row["tokenize"] = tokenize_counts(stack.kvpick.metrics())
                if cpu_before is not None:
                    cpu = _cpu_seconds(stack.kvpick.process.pid)
                    row["kvpick_cpu_s"] = None if cpu is None else cpu - cpu_before
            report["policies"].append(row)
        finally:
            if envoy is not None:
                envoy.stop()
            if stack is not None:
                stack.stop()
            if router is not None:
                router.stop()
            sim.stop()
    return report
