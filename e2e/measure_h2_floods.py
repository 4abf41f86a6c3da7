"""Measures what a SETTINGS or WINDOW_UPDATE flood costs kvpick (issue 45): its CPU-seconds
during the flood, and a good client's health-check latency beside it, with the flood limits off
(`--http2-max-settings-per-second 0 --http2-max-window-updates-per-second 0`, kvpick before the
limits) and at their defaults. With `--reconnect` the attacker starts over on a new connection
(opening its streams again) whenever it is sent away.

    KVPICK_BIN=$PWD/target/debug/kvpick .venv/bin/python e2e/measure_h2_floods.py \\
        [--seconds 30] [--streams 1000] [--attack settings|window_update] [--reconnect]
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402
import hostile_h2 as hostile  # noqa: E402

HOST = "127.0.0.1"
OFF = ["--http2-max-settings-per-second", "0", "--http2-max-window-updates-per-second", "0"]


def good_latencies(port: int, stop: threading.Event, out: list[float]) -> None:
    while not stop.is_set():
        began = time.monotonic()
        ok = hostile.health_check(HOST, port, timeout=30.0)
        out.append(time.monotonic() - began if ok else float("inf"))
        time.sleep(0.2)


def run(extra: list[str], attack: str, seconds: float, streams: int, reconnect: bool) -> str:
    kv = harness.Kvpick([harness.worker("w0", port=harness.free_port())], secure=False,
                        extra_args=extra).start()
    try:
        pid = kv.process.pid
        stop, latencies = threading.Event(), []
        good = threading.Thread(target=good_latencies, args=(kv.grpc_port, stop, latencies))
        good.start()
        cpu = hostile.cpu_seconds(pid)
        fn = hostile.settings_flood if attack == "settings" else hostile.window_update_flood
        out = fn(HOST, kv.grpc_port, streams=streams, seconds=seconds, reconnect=reconnect)
        # Without reconnecting, the rest of the time is quiet: CPU counts over the same span.
        time.sleep(max(0.0, seconds - out.elapsed))
        cpu = hostile.cpu_seconds(pid) - cpu
        stop.set()
        good.join()
        latencies.sort()
        p99 = latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))]
        return (f"{attack} flood, {streams} streams, {out.elapsed:.1f} s of {seconds:.0f}, "
                f"{'reconnecting, ' if reconnect else ''}limits "
                f"{'off' if extra else 'default'}: kvpick CPU {cpu:.1f} s, "
                f"{out.frames_sent} frames on {out.connections} connections, "
                f"GOAWAYs {out.goaways} {sorted(out.debug)}, good calls {len(latencies)} "
                f"p99 {p99 * 1000:.1f} ms")
    finally:
        kv.stop()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--attack", choices=["settings", "window_update"], default="settings")
    p.add_argument("--reconnect", action="store_true")
    args = p.parse_args()
    for extra in (OFF, []):
        print(run(extra, args.attack, args.seconds, args.streams, args.reconnect), flush=True)


if __name__ == "__main__":
    main()
