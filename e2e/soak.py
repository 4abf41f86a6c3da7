"""Soak and leak test: a steady request rate through Envoy + kvpick to streaming upstreams, with a
share of clients disconnecting mid-stream. Afterwards every booking must be back (in-flight 0),
and kvpick's RSS must stay flat: the last sample within 10% of the sample taken once warm (after
the first tenth of the run).

    bash e2e/soak [--minutes 10] [--rate 40] [--abort-fraction 0.1]
    bash e2e/soak --adversarial [--attack-seconds 30] [--rate 5] [--attacks a,b]   # e2e/soak_adversarial.py
    bash e2e/soak --adversarial --mixed [--minutes 5] [--rate 40]

Load: examples/loadgen.rs (`run --rate`, open-loop pacing, `--abort-fraction` drops the
connection after the response head). Writes target/soak.json.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from bench_overhead import proc_status_kb  # noqa: E402
from soak_load import bookings_left, drive, start_upstreams, write_body  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


def soak(seconds: float, rate: float, abort_fraction: float, concurrency: int = 64,
         sample_every: float = 5.0) -> dict:
    up, ports = start_upstreams()
    body = write_body("soak")
    stack = harness.Stack([harness.worker("w0", ports=ports[:2]),
                           harness.worker("w1", ports=ports[2:])], name="soak").start()
    try:
        pid = stack.kvpick.process.pid
        result, samples, start = drive(
            stack, body, seconds, rate, sample_every,
            ["--concurrency", str(concurrency), "--abort-fraction", str(abort_fraction)])
        inflight = bookings_left(stack)
        samples.append((time.monotonic() - start, proc_status_kb(pid, "VmRSS")))
        streams = {k: v for (n, labels, v) in stack.kvpick.metrics()
                   if n == "kvpick_extproc_streams_total" for k in [labels.get("end", "")]}
    finally:
        stack.stop()
        up.kill()
    warm = next((kb for t, kb in samples if t >= seconds / 10), samples[0][1])
    final = samples[-1][1]
    return {
        "seconds": seconds, "rate": rate, "abort_fraction": abort_fraction,
        "load": result, "inflight_after": inflight, "stream_ends": streams,
        "rss_kb_samples": samples, "rss_warm_kb": warm, "rss_final_kb": final,
        "rss_growth": (final - warm) / warm,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--rate", type=float, default=None,
                    help="good requests per second (total); default 40, 5 with --adversarial")
    ap.add_argument("--abort-fraction", type=float, default=0.1)
    ap.add_argument("--out", default=None)
    adv = ap.add_argument_group("--adversarial (e2e/soak_adversarial.py)")
    adv.add_argument("--adversarial", action="store_true",
                     help="each of issue 45's attacks on kvpick's ext_proc port in turn, beside "
                          "good traffic through Envoy; a table of memory, CPU and good requests")
    adv.add_argument("--attacks", default=None,
                     help="comma-separated attacks to run (default: all): "
                          + ", ".join(soak_attack_names()))
    adv.add_argument("--attack-seconds", type=float, default=30.0, help="each attack's length")
    adv.add_argument("--hold-seconds", type=float, default=40.0,
                     help="how long held_bookings holds its bookings")
    adv.add_argument("--rss-bound-gib", type=float, default=1.5,
                     help="documented bound of kvpick's RSS growth over idle: a row above it fails")
    adv.add_argument("--rss-abort-gib", type=float, default=4.0,
                     help="an attack is stopped (EXCEEDED) when kvpick's RSS grows past this")
    adv.add_argument("--short", action="store_true",
                     help="seconds per attack at a small scale (the e2e suite's smoke run)")
    adv.add_argument("--mixed", action="store_true",
                     help="issue 24's run instead: its attacks and a broken engine together, "
                          "compared with a clean run (--minutes, --rate)")
    args = ap.parse_args()
    if args.adversarial:
        adversarial(args)
    args.rate = args.rate or 40.0
    args.out = args.out or str(REPO / "target" / "soak.json")
    r = soak(args.minutes * 60, args.rate, args.abort_fraction)
    Path(args.out).write_text(json.dumps(r, indent=2))
    load = r["load"]
    print(f"requests completed {load['completed']}, aborted mid-stream {load['aborted']}, "
          f"errors {load['errors']}, statuses {load['statuses']}")
    print(f"latency ms p50 {load['latency_ms']['p50']:.1f} p99 {load['latency_ms']['p99']:.1f}")
    print(f"in-flight bookings after: {r['inflight_after']:.0f}; ext_proc stream ends {r['stream_ends']}")
    print(f"kvpick RSS warm {r['rss_warm_kb'] / 1024:.1f} MiB -> final "
          f"{r['rss_final_kb'] / 1024:.1f} MiB ({100 * r['rss_growth']:+.1f}%)")
    ok = r["inflight_after"] == 0 and r["rss_growth"] <= 0.10 and load["errors"] == 0
    print("PASS" if ok else "FAIL")
    print(f"written to {args.out}")
    sys.exit(0 if ok else 1)


def soak_attack_names() -> list[str]:
    import soak_adversarial
    return list(soak_adversarial.ATTACKS)


def adversarial(args: argparse.Namespace) -> None:
    import soak_adversarial as adv
    out = Path(args.out or REPO / "target" / "soak-adversarial.json")
    if args.mixed:
        r = adv.compare(args.minutes * 60, args.rate or 40.0)
        out.write_text(json.dumps(r, indent=2))
        ok = adv.report(r)
    else:
        names = args.attacks.split(",") if args.attacks else list(adv.ATTACKS)
        unknown = [n for n in names if n not in adv.ATTACKS]
        if unknown:
            sys.exit(f"unknown attacks {unknown}; known: {', '.join(adv.ATTACKS)}")
        opts = adv.Options(attack_seconds=args.attack_seconds, hold_seconds=args.hold_seconds,
                           rate=args.rate or 5.0, rss_bound=int(args.rss_bound_gib * adv.GiB),
                           rss_abort=int(args.rss_abort_gib * adv.GiB), short=args.short)
        if args.short:
            opts.warm_seconds = opts.tail_seconds = 1.0
        r = adv.run_all(names, opts, log=lambda line: print(line, flush=True))
        out.write_text(json.dumps(r, indent=2))
        print()
        adv.print_table(r)
        ok = r["passed"]
    print("PASS" if ok else "FAIL")
    print(f"written to {out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
