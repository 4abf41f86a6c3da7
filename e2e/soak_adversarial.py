"""Adversarial soak: good traffic through Envoy + kvpick beside hostile clients and a broken
engine, compared with a clean run of the same good traffic.

    bash e2e/soak --adversarial [--minutes 5] [--rate 40]

Good traffic: examples/loadgen.rs streaming chat requests at a steady rate (open loop), as in
e2e/soak.py. Beside it, for the whole run:

- header-block bombs and CONTINUATION floods on kvpick's gRPC port (e2e/hostile_h2.py), each on
  its own connection, which kvpick must close;
- SETTINGS floods on connections with 1,000 open ext_proc streams, WINDOW_UPDATE floods, and
  streams opened and left silent (kvpick ends them at --ext-proc-idle-timeout);
- slow TLS handshakes (sockets that dribble a ClientHello) and idle connections;
- clients that reset mid-body, 32 MiB bodies, and requests with random or garbage priorities
  through Envoy;
- a flood of selection-API bookings (`SelectAndReserve`, refused: the API books only with
  `--selection-api`);
- one engine that answers every request with an instant 503 (kvpick's outlier detection must eject
  it).

Reports good traffic's errors and p99 against the clean run, kvpick's peak RSS against the clean
run's, and the bookings left. Writes target/soak-adversarial.json.
"""
from __future__ import annotations

import json
import random
import socket
import ssl
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import hostile_h2  # noqa: E402
import soak  # noqa: E402
from bench_overhead import proc_status_kb  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
BAD = {"x-soak-bad": "1"}
CHAT = "/v1/chat/completions"


class Attacks:
    """Runs each attack in its own thread until `stop`, counting what happened to it."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.counts: dict[str, dict[str, int]] = {}
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def count(self, attack: str, outcome: str) -> None:
        with self.lock:
            per = self.counts.setdefault(attack, {})
            per[outcome] = per.get(outcome, 0) + 1

    def run(self, name: str, once: Callable[[], str], pause: float) -> None:
        def loop() -> None:
            while not self.stop.is_set():
                try:
                    outcome = once()
                except Exception as e:  # an attack's own failure is an outcome, not a crash
                    outcome = type(e).__name__
                self.count(name, outcome)
                self.stop.wait(pause)

        t = threading.Thread(target=loop, daemon=True, name=name)
        t.start()
        self.threads.append(t)

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)


def slow_tls_handshake(port: int, seconds: float) -> str:
    """A TCP connection that sends a TLS record header and then one byte a second: kvpick's
    handshake timeout must close it."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"\x16\x03\x01\x02\x00")
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                s.sendall(b"\x01")
                s.settimeout(1.0)
                if s.recv(1) == b"":
                    return "closed_by_kvpick"
            except socket.timeout:
                continue
            except OSError:
                return "closed_by_kvpick"
        return "still_open"


def reset_mid_body(url: str) -> str:
    """POSTs headers announcing 200 kB and 10 kB of body, then resets the connection."""
    host, port = url.split("//", 1)[1].split(":")
    s = socket.create_connection((host, int(port)), timeout=5)
    body = json.dumps(harness.chat_body()).encode()
    s.sendall(b"POST " + CHAT.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
              b"\r\nx-soak-bad: 1\r\nContent-Length: 200000\r\n\r\n" + body[:10] + b" " * 10_000)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()
    return "reset"


def big_body(client: httpx.Client, url: str, blob: bytes) -> str:
    r = client.post(url + CHAT, content=blob, headers={"content-type": "application/json", **BAD})
    return str(r.status_code)


PRIORITIES = ["2147483647", "-2147483648", "99999999999", "abc", "1.5", "", "7", "-1", "0"]


def random_priority(client: httpx.Client, url: str, rng: random.Random) -> str:
    headers = {"content-type": "application/json", **BAD,
               "x-dynamo-request-priority": rng.choice(PRIORITIES + [str(rng.randint(-2**31, 2**31 - 1))])}
    r = client.post(url + CHAT, content=json.dumps(harness.chat_body()), headers=headers)
    return str(r.status_code)


def api_flood(port: int) -> Callable[[], str]:
    """SelectAndReserve calls over TLS (kvpick's self-signed certificate names localhost)."""
    import grpc

    pem = ssl.get_server_certificate(("127.0.0.1", port)).encode()
    channel = grpc.secure_channel(f"localhost:{port}", grpc.ssl_channel_credentials(pem))
    reserve = channel.unary_unary("/kvpick.v1.Selection/SelectAndReserve",
                                  request_serializer=None, response_deserializer=None)
    n = [0]

    def once() -> str:
        n[0] += 1
        request = harness.pb_field(1, f"flood-{n[0]}".encode()) + harness.pb_field(2, b"m1")
        try:
            reserve(request, timeout=5)
            return "booked"
        except grpc.RpcError as e:
            return e.code().name

    return once


def verdict(outcome) -> str:
    """A hostile connection's end, as a count key: the GOAWAY code, or how it closed."""
    if outcome.goaway_code is not None:
        return f"goaway_{outcome.goaway_code:#x}"
    return "closed" if outcome.closed else "left_open"


def flood_verdict(outcome: hostile_h2.FloodOutcome) -> str:
    """A flood's end, as a count key: the GOAWAY code, or `left_open`."""
    codes = sorted(outcome.goaways)
    return f"goaway_{codes[0]:#x}" if codes else "left_open"


def idle_streams(port: int, tls: bool, streams: int = 100) -> str:
    """Opens `streams` ext_proc streams and never sends them a message; kvpick ends each at
    --ext-proc-idle-timeout (60 s) with DEADLINE_EXCEEDED (4)."""
    held = hostile_h2.HeldStreams("127.0.0.1", port, streams, tls=tls)
    try:
        statuses = set(held.poll(75.0).values())
    finally:
        held.close()
    return "status_" + "_".join(sorted(statuses)) if statuses else "left_open"


def start_attacks(stack: harness.Stack, seconds: float) -> Attacks:
    attacks = Attacks()
    url = stack.url()
    grpc_port = stack.kvpick.grpc_port
    client = httpx.Client(trust_env=False, timeout=httpx.Timeout(30.0))
    rng = random.Random(7)
    blob = b'{"model":"m1","prompt":"' + b"x" * (32 << 20) + b'"}'
    attacks.run("header_bomb_64k", lambda: verdict(hostile_h2.header_bomb(
        "127.0.0.1", grpc_port, block_bytes=64 << 10, tls=stack.secure)), 1.0)
    attacks.run("header_bomb_256k", lambda: verdict(hostile_h2.header_bomb(
        "127.0.0.1", grpc_port, block_bytes=256 << 10, tls=stack.secure)), 2.0)
    attacks.run("continuation_flood", lambda: verdict(hostile_h2.continuation_flood(
        "127.0.0.1", grpc_port, tls=stack.secure)), 1.0)
    for i in range(4):
        attacks.run(f"slow_tls_{i}", lambda: slow_tls_handshake(grpc_port, seconds), 0.5)
    attacks.run("settings_flood", lambda: flood_verdict(hostile_h2.settings_flood(
        "127.0.0.1", grpc_port, streams=1000, seconds=5.0, reconnect=False,
        tls=stack.secure)), 1.0)
    attacks.run("window_update_flood", lambda: flood_verdict(hostile_h2.window_update_flood(
        "127.0.0.1", grpc_port, seconds=5.0, reconnect=False, tls=stack.secure)), 1.0)
    attacks.run("idle_streams", lambda: idle_streams(grpc_port, stack.secure), 1.0)
    attacks.run("reset_mid_body", lambda: reset_mid_body(url), 0.2)
    attacks.run("body_32mib", lambda: big_body(client, url, blob), 3.0)
    attacks.run("random_priority", lambda: random_priority(client, url, rng), 0.2)
    attacks.run("api_flood", api_flood(grpc_port), 0.05)
    return attacks


def run(seconds: float, rate: float, adversarial: bool, sample_every: float = 2.0,
        extra_args: list[str] | None = None) -> dict:
    """One run of the good traffic, with the attacks and the broken engine when `adversarial`."""
    up, ports = soak.start_upstreams()
    body = soak.write_body("soak-adv")
    workers = [harness.worker("w0", ports=ports[:2]), harness.worker("w1", ports=ports[2:])]
    broken = harness.FailingEngine() if adversarial else None
    if broken is not None:
        workers.append(harness.worker("broken", ports=[broken.port]))
    args = ["--outlier-base-ejection-secs", "30"] + (extra_args or [])
    stack = harness.Stack(workers, name="soak-adv", extra_args=args).start()
    attacks = None
    try:
        pid = stack.kvpick.process.pid
        attacks = start_attacks(stack, seconds) if adversarial else None
        load, rss, _ = soak.drive(stack, body, seconds, rate, sample_every,
                                  ["--concurrency", "64"])
        if attacks is not None:
            attacks.join()
        inflight = soak.bookings_left(stack)
        peak_kb = proc_status_kb(pid, "VmHWM")
        alive = stack.kvpick.process.alive()
    finally:
        if attacks is not None:
            attacks.stop.set()
        stack.stop()
        up.kill()
        if broken is not None:
            broken.stop()
    statuses = load["statuses"]
    not_ok = sum(v for k, v in statuses.items() if k != "200")
    engine_503 = broken.count(status=503, hostile=False) if broken is not None else 0
    return {
        "seconds": seconds, "rate": rate, "adversarial": adversarial,
        "load": load, "good_non_200": not_ok,
        "good_answered_by_broken_engine": engine_503,
        "good_errors": load["errors"] + not_ok - engine_503,
        "p99_ms": load["latency_ms"]["p99"],
        "peak_rss_kb": peak_kb, "rss_samples": rss,
        "bookings_left": inflight, "kvpick_alive": alive,
        "attacks": attacks.counts if attacks is not None else {},
        "broken_engine_hostile_requests": broken.count(hostile=True) if broken is not None else 0,
    }


def compare(seconds: float, rate: float) -> dict:
    clean = run(seconds, rate, adversarial=False)
    hostile = run(seconds, rate, adversarial=True)
    return {
        "clean": clean, "adversarial": hostile,
        "p99_ratio": hostile["p99_ms"] / max(clean["p99_ms"], 1e-9),
        "rss_ratio": hostile["peak_rss_kb"] / max(clean["peak_rss_kb"], 1),
    }


def report(r: dict) -> bool:
    c, a = r["clean"], r["adversarial"]
    print(f"clean:       {c['load']['completed']} requests, p99 {c['p99_ms']:.1f} ms, "
          f"errors {c['good_errors']}, peak RSS {c['peak_rss_kb'] / 1024:.1f} MiB")
    print(f"adversarial: {a['load']['completed']} requests, p99 {a['p99_ms']:.1f} ms, "
          f"errors {a['good_errors']} (+{a['good_answered_by_broken_engine']} answered 503 by the "
          f"broken engine before its ejection), peak RSS {a['peak_rss_kb'] / 1024:.1f} MiB, "
          f"bookings left {a['bookings_left']:.0f}")
    print(f"p99 ratio {r['p99_ratio']:.2f} (target <= 1.5), RSS ratio {r['rss_ratio']:.2f} "
          f"(target <= 1.2)")
    for name, outcomes in sorted(a["attacks"].items()):
        print(f"  {name}: {outcomes}")
    return (a["kvpick_alive"] and a["good_errors"] == 0 and a["bookings_left"] == 0
            and r["p99_ratio"] <= 1.5 and r["rss_ratio"] <= 1.2)
