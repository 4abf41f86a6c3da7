"""ext_proc overhead benchmark: the same load through a real Envoy with the ext_proc filter off
(a plain round-robin cluster over the upstreams) and on (kvpick picks every request).

Prompt sizes 1 KB / 32 KB / 220 KB, as token ids (`/v1/completions`, `prompt: [ids]`) and as chat
text (`/v1/chat/completions`), at concurrency 1 / 16 / 150, against instant upstreams. Reports
requests/s, latency p50/p99 in both modes and what kvpick adds, kvpick CPU-seconds per 1,000
requests and kvpick's peak RSS. Every request is unique (`{n}` in the body), so kvpick hashes and
indexes every prompt: its worst case.

The load generator and the upstreams are `examples/loadgen.rs` (Rust, hyper, one keep-alive
connection per client). Run through `bash e2e/bench-overhead` (builds everything in release).
Writes target/bench-overhead.json and prints a Markdown table.

`--trace-ratio R` measures what OpenTelemetry tracing costs instead: two kvpicks behind two Envoys
(both with ext_proc), one with tracing off, one exporting to an OTLP receiver on loopback
(e2e/otlp_receiver.py) with `--trace-sampling-ratio R`; each cell loads both, alternately.
Writes target/bench-overhead-tracing.json.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from statistics import median

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
LOADGEN = Path(os.environ.get("LOADGEN_BIN", REPO / "target" / "release" / "examples" / "loadgen"))
SIZES = {"1KB": 1024, "32KB": 32 * 1024, "220KB": 220 * 1024}
CONCURRENCY = [1, 16, 150]


def token_body(size: int) -> bytes:
    # `{n}` first: every prompt differs from its first block on (no shared prefixes).
    ids = []
    length = len('{"model":"m1","prompt":[{n}]}')
    i = 0
    while length < size:
        tok = str(1000 + (i * 7919) % 120000)
        ids.append(tok)
        length += len(tok) + 1
        i += 1
    return ('{"model":"m1","prompt":[{n},' + ",".join(ids) + "]}").encode()


def chat_body(size: int) -> bytes:
    words = []
    length = 120
    i = 0
    while length < size:
        w = f"word{(i * 7919) % 5000}"
        words.append(w)
        length += len(w) + 1
        i += 1
    body = {"model": "m1", "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "REQ " + " ".join(words)},
    ]}
    return json.dumps(body).replace("REQ", "{n}", 1).encode()


def plain_envoy_config(upstream_ports: list[int]) -> dict:
    """The reference config without the ext_proc filter, routing round-robin over the ranks."""
    cfg = copy.deepcopy(harness.load_envoy_template())
    listener = cfg["static_resources"]["listeners"][0]
    hcm = harness._hcm(listener)
    hcm["http_filters"] = [f for f in hcm["http_filters"]
                           if f["name"] != "envoy.filters.http.ext_proc"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    route["route"]["cluster"] = "plain"
    route.pop("request_headers_to_add", None)
    cfg["static_resources"]["clusters"].append({
        "name": "plain", "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "5s",
        "per_connection_buffer_limit_bytes": 67108864,
        "load_assignment": {"cluster_name": "plain", "endpoints": [{"lb_endpoints": [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                         "port_value": p}}}}
            for p in upstream_ports]}]},
    })
    return cfg


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime + stime
    return ticks / os.sysconf("SC_CLK_TCK")


def proc_status_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


# The next unused request number: every run numbers its requests from here, so no prompt of one
# run is a prompt an earlier run already indexed (each run would otherwise count from 0).
_next_request = [0]


def load(url: str, body_path: Path, concurrency: int, requests: int,
         rate: float | None = None) -> dict:
    pacing = ["--rate", str(rate)] if rate else []
    warmup = min(requests // 10 + concurrency, 200)
    first = _next_request[0]
    _next_request[0] += warmup + requests
    out = subprocess.run(
        [str(LOADGEN), "run", "--url", url, "--body", str(body_path),
         "--concurrency", str(concurrency), "--requests", str(requests),
         "--warmup", str(warmup), "--first", str(first)] + pacing,
        check=True, capture_output=True, text=True, timeout=900)
    return json.loads(out.stdout)


def fill_index(url: str, workdir: Path, requests: int) -> None:
    """Brings kvpick to its steady state before the measured cells: `requests` distinct 220 KB
    token-id prompts (~2,100 blocks each), closed loop, so the index has grown to its capacity
    (the default 1M blocks takes ~500) and evicts from then on, as in a long-running process."""
    body_path = workdir / "fill.json"
    body_path.write_bytes(token_body(SIZES["220KB"]))
    started = time.time()
    result = load(url + "/v1/completions", body_path, 16, requests)
    print(f"  fill: {result['completed']} requests in {time.time() - started:.0f} s, "
          f"statuses {result['statuses']}, errors {result['errors']}", flush=True)


# Requests per cell at the concurrencies of the published tables (docs/benchmarks.md).
REQUESTS_AT = {1: 300, 16: 2000, 150: 3000}


def requests_for(size: int, concurrency: int, quick: bool) -> int:
    """Requests in a cell: ``REQUESTS_AT`` at its concurrencies, the straight line between the two
    around any other one (flat beyond 150), a third of that for 220 KB bodies, a tenth (at least
    30) with ``--quick``."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be at least 1, not {concurrency}")
    points = sorted(REQUESTS_AT.items())
    base = points[-1][1]
    for (c0, n0), (c1, n1) in zip(points, points[1:]):
        if concurrency <= c1:
            base = round(n0 + (n1 - n0) * (concurrency - c0) / (c1 - c0))
            break
    if size > 100_000:
        base //= 3
    return max(base // 10, 30) if quick else base


def cases(args, workdir: Path, concurrency: list[int], variants: str | None = None):
    """The runs of a benchmark in order, as (size, variant, path, body file, concurrency,
    requests): `--sizes` (and `variants`, a comma list, when given) chosen, each body written
    once per size and variant, the request count capped at 10 s of `--rate`."""
    for size_name, size in SIZES.items():
        if size_name not in args.sizes.split(","):
            continue
        for variant, make, path in (("token ids", token_body, "/v1/completions"),
                                    ("chat text", chat_body, "/v1/chat/completions")):
            if variants is not None and variant not in variants.split(","):
                continue
            body_path = workdir / f"{size_name}-{variant.replace(' ', '-')}.json"
            body_path.write_bytes(make(size))
            for conc in concurrency:
                n = requests_for(size, conc, args.quick)
                if args.rate:
                    n = min(n, int(args.rate * 10))
                yield size_name, variant, path, body_path, conc, n


def concurrency_list(text: str) -> list[int]:
    """``--concurrency``: a comma list of integers >= 1 (checked before anything starts)."""
    try:
        values = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"concurrencies must be at least 1: {text!r}")
    return values


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few requests per cell (smoke run)")
    ap.add_argument("--out", default=str(REPO / "target" / "bench-overhead.json"))
    ap.add_argument("--envoy-concurrency", type=int, default=2)
    ap.add_argument("--sizes", default=",".join(SIZES), help="prompt sizes to run (comma list)")
    ap.add_argument("--rate", type=float, default=None,
                    help="pace every cell at this many requests/s (open loop, at most "
                         "CONCURRENCY in flight) instead of closed-loop as fast as possible: "
                         "latency below saturation rather than throughput at saturation")
    ap.add_argument("--kvpick-args", default="",
                    help="extra `kvpick serve` flags, e.g. \"--metrics-families kvpick\" to compare "
                         "the cost of the EPP series")
    ap.add_argument("--fill", type=int, default=0, metavar="N",
                    help="before the cells, send N distinct 220 KB token-id prompts through "
                         "kvpick (not measured): the cells then see a full index that evicts, "
                         "kvpick's steady state, instead of one still growing (~1,000 for the "
                         "default --index-max-blocks)")
    ap.add_argument("--plaintext", action="store_true",
                    help="Envoy speaks h2c to kvpick (`--secure-serving=false`) instead of TLS; "
                         "with KVPICK_BIN=target/release/examples/extproc_floor this measures "
                         "the floor of the ext_proc stack over h2c (without --plaintext: over TLS, as kvpick)")
    ap.add_argument("--trace-ratio", type=float, default=None,
                    help="compare kvpick with tracing off and on at this sampling ratio")
    ap.add_argument("--rounds", type=int, default=1,
                    help="with --trace-ratio: load each cell this many times per kvpick, "
                         "alternating which goes first; p50/p99 are the rounds' medians, CPU "
                         "the rounds' total (drift on a shared machine cancels out)")
    ap.add_argument("--off-bin", default=None,
                    help="with --trace-ratio: the kvpick binary of the 'off' side (e.g. a build "
                         "of main without tracing); default: the same binary")
    ap.add_argument("--untraced", action="store_true",
                    help="with --trace-ratio: the 'on' side runs without tracing flags too "
                         "(with --off-bin: compare two builds, tracing off in both)")
    ap.add_argument("--concurrency", type=concurrency_list,
                    default=",".join(map(str, CONCURRENCY)),
                    help="concurrencies to run (comma list; any value >= 1)")
    ap.add_argument("--variants", default="token ids,chat text",
                    help="body variants to run (comma list: 'token ids', 'chat text')")
    args = ap.parse_args()
    os.environ.setdefault("E2E_ENVOY_COMPONENT_LOG", "ext_proc:warning")
    if args.trace_ratio is not None:
        return main_tracing(args)

    up = subprocess.Popen([str(LOADGEN), "upstream", "--count", "4"], stdout=subprocess.PIPE,
                          text=True, preexec_fn=harness._die_with_parent)
    line = up.stdout.readline().split()
    ports = [int(p) for p in line[1].split(",")]
    kv = harness.Kvpick([harness.worker("w0", ports=ports)], secure=not args.plaintext,
                        extra_args=["--max-body-bytes", str(4 << 20),
                                    *shlex.split(args.kvpick_args)]).start()
    on = harness.Envoy(kvpick_port=kv.grpc_port, log_level="warning", secure=not args.plaintext,
                       concurrency=args.envoy_concurrency).start()
    off = harness.Envoy(kvpick_port=kv.grpc_port, config=plain_envoy_config(ports),
                        log_level="warning", concurrency=args.envoy_concurrency).start()
    workdir = harness.new_workdir("bench-overhead")
    rows = []
    try:
        if args.fill:
            fill_index(on.url(), workdir, args.fill)
        concurrency = args.concurrency
        for size_name, variant, path, body_path, conc, n in cases(args, workdir, concurrency,
                                                                 args.variants):
            base = load(off.url() + path, body_path, conc, n, args.rate)
            cpu0 = proc_cpu_seconds(kv.process.pid)
            with_kv = load(on.url() + path, body_path, conc, n, args.rate)
            cpu = proc_cpu_seconds(kv.process.pid) - cpu0
            total = with_kv["completed"] + with_kv["errors"]
            row = {
                "size": size_name, "variant": variant, "concurrency": conc,
                "requests": n,
                "rps_off": base["rps"], "rps_on": with_kv["rps"],
                "p50_off_ms": base["latency_ms"]["p50"],
                "p50_on_ms": with_kv["latency_ms"]["p50"],
                "p99_off_ms": base["latency_ms"]["p99"],
                "p99_on_ms": with_kv["latency_ms"]["p99"],
                "added_p50_ms": with_kv["latency_ms"]["p50"] - base["latency_ms"]["p50"],
                "added_p99_ms": with_kv["latency_ms"]["p99"] - base["latency_ms"]["p99"],
                # The warm-up requests ran inside the CPU window too.
                "kvpick_cpu_s_per_1k": 1000 * cpu / max(total + min(n // 10 + conc, 200), 1),
                "errors_off": base["errors"] + sum(v for k, v in base["statuses"].items() if k != "200"),
                "errors_on": with_kv["errors"] + sum(v for k, v in with_kv["statuses"].items() if k != "200"),
            }
            rows.append(row)
            print(f"  {size_name:>5} {variant:<9} c={conc:<3} rps {row['rps_off']:7.0f} -> "
                  f"{row['rps_on']:7.0f}   p50 +{row['added_p50_ms']:.2f} ms   "
                  f"p99 +{row['added_p99_ms']:.2f} ms   "
                  f"{row['kvpick_cpu_s_per_1k']:.3f} CPU-s/1k", flush=True)
        peak_rss_mb = proc_status_kb(kv.process.pid, "VmHWM") / 1024
        inflight = kv.metric("kvpick_inflight_total")
    finally:
        off.stop()
        on.stop()
        kv.stop()
        up.kill()
    result = {"rate": args.rate, "fill": args.fill, "plaintext": args.plaintext, "rows": rows,
              "kvpick_peak_rss_mb": peak_rss_mb, "kvpick_inflight_after": inflight,
              "machine_cpus": os.cpu_count(), "quick": args.quick}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print()
    print("| prompt | variant | conc | req/s off | req/s on | p50 off | p50 on | added p50 | "
          "p99 off | p99 on | added p99 | kvpick CPU-s / 1k req | errors off/on |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['variant']} | {r['concurrency']} | {r['rps_off']:.0f} | "
              f"{r['rps_on']:.0f} | {r['p50_off_ms']:.2f} | {r['p50_on_ms']:.2f} | "
              f"{r['added_p50_ms']:+.2f} | {r['p99_off_ms']:.2f} | {r['p99_on_ms']:.2f} | "
              f"{r['added_p99_ms']:+.2f} | {r['kvpick_cpu_s_per_1k']:.3f} | "
              f"{r['errors_off']}/{r['errors_on']} |")
    print(f"\nkvpick peak RSS: {peak_rss_mb:.1f} MiB; in-flight bookings after the run: {inflight:.0f}")
    print(f"written to {args.out}")


def main_tracing(args) -> None:
    """Tracing off vs on (``--trace-ratio``), same load, same upstreams, cells alternated."""
    from otlp_receiver import OtlpReceiver

    out = Path(args.out).with_name("bench-overhead-tracing.json") \
        if args.out == str(REPO / "target" / "bench-overhead.json") else Path(args.out)
    up = subprocess.Popen([str(LOADGEN), "upstream", "--count", "4"], stdout=subprocess.PIPE,
                          text=True, preexec_fn=harness._die_with_parent)
    ports = [int(p) for p in up.stdout.readline().split()[1].split(",")]
    receiver = OtlpReceiver().start()
    common = ["--max-body-bytes", str(4 << 20)]
    plain = harness.Kvpick([harness.worker("w0", ports=ports)], extra_args=common)
    tracing = [] if args.untraced else [
        "--otlp-endpoint", receiver.endpoint, "--trace-sampling-ratio", str(args.trace_ratio)]
    traced = harness.Kvpick([harness.worker("w0", ports=ports)], extra_args=common + tracing)
    if args.off_bin:
        plain.process.argv[0] = args.off_bin
    for k in (plain, traced):
        for var in [v for v in k.process.env if v.startswith("OTEL_")]:
            del k.process.env[var]
        k.start()
    envoys = {name: harness.Envoy(kvpick_port=k.grpc_port, log_level="warning",
                                  concurrency=args.envoy_concurrency).start()
              for name, k in (("off", plain), ("on", traced))}
    workdir = harness.new_workdir("bench-overhead-tracing")
    rows = []
    try:
        concurrency = args.concurrency
        for size_name, variant, path, body_path, conc, n in cases(args, workdir, concurrency,
                                                                 args.variants):
            row = {"size": size_name, "variant": variant, "concurrency": conc,
                   "requests": n, "rounds": args.rounds}
            runs = {"off": [], "on": []}
            cpu = {"off": 0.0, "on": 0.0}
            pair = [("off", plain), ("on", traced)]
            for rnd in range(args.rounds):
                for name, k in (pair if rnd % 2 == 0 else pair[::-1]):
                    cpu0 = proc_cpu_seconds(k.process.pid)
                    runs[name].append(load(envoys[name].url() + path, body_path, conc,
                                           n, args.rate))
                    cpu[name] += proc_cpu_seconds(k.process.pid) - cpu0
            for name, rs in runs.items():
                total = sum(r["completed"] + r["errors"] + min(n // 10 + conc, 200)
                            for r in rs)
                row.update({f"rps_{name}": median([r["rps"] for r in rs]),
                            f"p50_{name}_ms": median([r["latency_ms"]["p50"] for r in rs]),
                            f"p99_{name}_ms": median([r["latency_ms"]["p99"] for r in rs]),
                            f"cpu_s_per_1k_{name}": 1000 * cpu[name] / max(total, 1),
                            f"errors_{name}": sum(r["errors"] + sum(
                                v for s, v in r["statuses"].items() if s != "200")
                                for r in rs)})
            row["added_p50_ms"] = row["p50_on_ms"] - row["p50_off_ms"]
            row["added_p99_ms"] = row["p99_on_ms"] - row["p99_off_ms"]
            row["added_cpu_s_per_1k"] = row["cpu_s_per_1k_on"] - row["cpu_s_per_1k_off"]
            rows.append(row)
            print(f"  {size_name:>5} {variant:<9} c={conc:<3} p50 {row['p50_off_ms']:.2f}"
                  f" -> {row['p50_on_ms']:.2f} ms   p99 {row['p99_off_ms']:.2f}"
                  f" -> {row['p99_on_ms']:.2f} ms   CPU-s/1k "
                  f"{row['cpu_s_per_1k_off']:.3f} -> {row['cpu_s_per_1k_on']:.3f}",
                  flush=True)
    finally:
        for e in envoys.values():
            e.stop()
        plain.stop()
        traced.stop()  # flushes its last batch to the receiver
        exported = len(receiver.spans())
        receiver.stop()
        up.kill()
    result = {"trace_ratio": args.trace_ratio, "rate": args.rate, "rows": rows,
              "spans_received": exported, "machine_cpus": os.cpu_count(), "quick": args.quick}
    out.write_text(json.dumps(result, indent=2))
    print()
    print(f"| prompt | variant | conc | req/s off | req/s on | p50 off | p50 on | added p50 | "
          f"p99 off | p99 on | added p99 | CPU-s/1k off | CPU-s/1k on | added CPU-s/1k | "
          f"errors off/on |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['size']} | {r['variant']} | {r['concurrency']} | {r['rps_off']:.0f} | "
              f"{r['rps_on']:.0f} | {r['p50_off_ms']:.2f} | {r['p50_on_ms']:.2f} | "
              f"{r['added_p50_ms']:+.2f} | "
              f"{r['p99_off_ms']:.2f} | {r['p99_on_ms']:.2f} | {r['added_p99_ms']:+.2f} | "
              f"{r['cpu_s_per_1k_off']:.3f} | {r['cpu_s_per_1k_on']:.3f} | "
              f"{r['added_cpu_s_per_1k']:+.3f} | {r['errors_off']}/{r['errors_on']} |")
    print(f"\nspans received at ratio {args.trace_ratio}: {exported}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
