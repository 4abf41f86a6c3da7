"""Adversarial soak: hostile clients on kvpick's ext_proc port while good traffic (~5 req/s,
examples/loadgen.rs streaming chat requests, open loop) flows through a real Envoy.

    bash e2e/soak --adversarial [--attack-seconds 30] [--rate 5] [--attacks a,b,...]
                                [--rss-bound-gib 1.5] [--rss-abort-gib 4] [--short]
    bash e2e/soak --adversarial --mixed [--minutes 5] [--rate 40]   # issue 24's mix, below

Each attack of issue 45 runs on its own (a fresh kvpick + Envoy per attack, so one attack's
leftovers do not blur the next one's memory) for ``--attack-seconds``, while the good traffic
runs from a warm-up before it to a little after it:

- ``padded_body``: 8 streams of ``request_body`` messages, each a 1 KiB chunk plus 1 MB of an
  unknown field (a kept chunk must not keep the message around it);
- ``unfinished_message``: streams each sending all but the last byte of one message of the
  largest size kvpick accepts (``--max-ext-proc-message-bytes`` when the binary has it, else
  tonic's 64 MiB), ~2.5 GiB in all;
- ``prefix_only``: 30,000 streams each sending only a 5-byte gRPC prefix claiming that size;
- ``streams_connections``: 1,000 connections x 200 streams that send headers and nothing else;
- ``held_bookings``: 4 streams that send a whole request (headers + 100 KB body, so kvpick
  routes and books it) and never the response phase, held ``--hold-seconds`` (40);
- ``settings_flood``: SETTINGS frames toggling INITIAL_WINDOW_SIZE, as fast as the socket takes
  them, on a connection with 1,000 open streams;
- ``window_update_flood``: WINDOW_UPDATE frames (increment 1) on the connection and its 100 open
  streams;
- ``issue24_mix``: ``start_attacks`` below, all together: issue 24's header bombs, CONTINUATION
  floods, slow TLS, resets mid-body, 32 MiB bodies, random priorities and selection-API floods,
  with short SETTINGS / WINDOW_UPDATE floods and silent streams (no broken engine);
- ``baseline``: no attack (the good traffic's own cost).

An attacker whose stream or connection kvpick ends opens a new one (a second later, a stream
later each time it is ended), as a real one would. Per attack: kvpick's peak RSS growth over its RSS just before the attack (VmRSS
sampled every 0.1 s), its CPU-seconds during the attack (utime + stime), the good requests sent
/ answered 200 / failed and their p50 / p99, what the attacker got back (GOAWAYs by code and
debug text, RST_STREAMs, grpc-status trailers, closes), the kvpick counters that moved, and
whether kvpick survived. A row fails if kvpick died, a good request failed or was never sent,
or the peak RSS growth passed ``--rss-bound-gib``; an attack is stopped (``exceeded``) when the
growth passes ``--rss-abort-gib``, so a kvpick without the bounds cannot take the machine down.
Writes target/soak-adversarial.json and prints the table. ``--short`` runs each attack for
seconds at a small scale (the e2e suite's smoke run, e2e/tests/test_soak_smoke.py).

``--mixed`` keeps issue 24's run: ``start_attacks`` beside the good traffic (40 req/s) plus one
engine answering every request with an instant 503 (kvpick's outlier detection must eject it),
compared with a clean run of the same good traffic.
"""
from __future__ import annotations

import json
import math
import random
import re
import socket
import ssl
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import hostile_h2  # noqa: E402
import soak_load  # noqa: E402
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
    up, ports = soak_load.start_upstreams()
    body = soak_load.write_body("soak-adv")
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
        load, rss, _ = soak_load.drive(stack, body, seconds, rate, sample_every,
                                  ["--concurrency", "64"])
        if attacks is not None:
            attacks.join()
        inflight = soak_load.bookings_left(stack)
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


# ---------------------------------------------------------------------------------------------
# Issue 45: one attack at a time, measured.

GiB = 1 << 30
MiB = 1 << 20
TONIC_MAX_MESSAGE = 64 << 20  # kvpick's gRPC message limit before --max-ext-proc-message-bytes
H = hostile_h2


@dataclass
class Target:
    """What an attack aims at: kvpick's ext_proc port, and the stack around it."""

    host: str
    port: int
    tls: bool
    max_message: int
    """Largest gRPC message kvpick accepts (the binary's default)."""
    stack: harness.Stack | None = None


def flag_default(binary: Path, flag: str, fallback: int) -> int:
    """The default of ``kvpick serve``'s ``flag`` as its --help prints it, or ``fallback`` when
    the binary has no such flag (a build from before it)."""
    out = subprocess.run([str(binary), "serve", "--help"], capture_output=True, text=True,
                         timeout=30).stdout
    # The flag's own entry: its line, then its help up to the next option's line.
    m = re.search(r"^ +(?:-\w, )?" + re.escape(flag) + r"\b[^\n]*\n((?:(?! +-)[^\n]*\n?)*)",
                  out, re.M)
    default = re.search(r"\[default: (\d+)\]", m.group(0)) if m else None
    if default:
        return int(default.group(1))
    # A default computed from another flag (the message limit: --max-body-bytes + 1 MiB).
    derived = re.search(r"Default: (--[\w-]+) \+ 1 MiB", m.group(0)) if m else None
    if derived:
        return flag_default(binary, derived.group(1), fallback) + (1 << 20)
    return fallback


class Slots:
    """Keeps ``n`` attack streams open, ``per_conn`` to a connection: ``open(client)`` opens one
    and queues what it sends; ``top_up(client, sid)`` (optional) queues more while it lives. A
    stream the server ends is opened again ``reopen_after`` seconds later (that times the
    number of times its slot was ended, up to 8), and a connection it closes or sends GOAWAY on
    is made again ``reopen_after`` seconds later: a persistent attacker, not a hot loop.
    ``tick`` does a bounded amount of connecting per call so ``pump`` stays responsive."""

    def __init__(self, target: Target, n: int, per_conn: int,
                 open_stream: Callable[[H.H2Client], int],
                 top_up: Callable[[H.H2Client, int], None] | None = None,
                 big_windows: bool = True, reopen_after: float = 1.0) -> None:
        self.target, self.open_stream, self.top_up = target, open_stream, top_up
        self.big_windows, self.reopen_after = big_windows, reopen_after
        self.per_conn = per_conn
        conns = math.ceil(n / per_conn)
        self.slot_count = [min(per_conn, n - i * per_conn) for i in range(conns)]
        self.conns: list[H.H2Client | None] = [None] * conns
        self.sids: list[list[int | None]] = [[None] * k for k in self.slot_count]
        self.retry_at = [0.0] * conns
        self.settled: list[tuple | None] = [None] * conns
        self.stream_retry_at = [[0.0] * k for k in self.slot_count]
        self.stream_ends = [[0] * k for k in self.slot_count]
        self.clients: list[H.H2Client] = []  # every client made (pump's list)
        self.counts = H.ClientCounts()
        self.scan_every = 0.02 if n <= 64 else 0.25
        self.last_scan = 0.0

    def tick(self) -> None:
        now = time.monotonic()
        if now - self.last_scan < self.scan_every:
            return
        self.last_scan = now
        budget_end = now + 0.2
        for ci, c in enumerate(self.conns):
            if c is None or not c.alive:
                if c is not None:
                    c.close()
                    self.conns[ci] = None
                    self.retry_at[ci] = now + self.reopen_after
                if time.monotonic() > budget_end or now < self.retry_at[ci]:
                    continue
                c = self._connect()
                if c is None:
                    self.retry_at[ci] = now + self.reopen_after
                    continue
                self.conns[ci] = c
                self.sids[ci] = [None] * self.slot_count[ci]
            self._keep(ci, c, now)

    def _keep(self, ci: int, c: H.H2Client, now: float) -> None:
        sids, retry, ends = self.sids[ci], self.stream_retry_at[ci], self.stream_ends[ci]
        if self.top_up is None and self.settled[ci] == (c, c.counts.streams_ended):
            return  # every slot open and none ended since: nothing to walk
        for si, sid in enumerate(sids):
            if sid is not None and sid in c.windows:
                if self.top_up is not None:
                    self.top_up(c, sid)
                continue
            if sid is not None:  # ended by the server: open again later, later each time
                sids[si] = None
                ends[si] = min(ends[si] + 1, 8)
                retry[si] = now + self.reopen_after * ends[si]
            if now >= retry[si] and c.next_stream < 2**31 - 2:
                sids[si] = self.open_stream(c)
        if None not in sids:
            self.settled[ci] = (c, c.counts.streams_ended)

    def _connect(self) -> H.H2Client | None:
        t = self.target
        try:
            c = H.H2Client(t.host, t.port, tls=t.tls, timeout=5.0, big_windows=self.big_windows)
        except OSError:
            self.counts.connect_failed += 1
            return None
        self.clients.append(c)
        return c

    def close(self) -> dict:
        total = H.ClientCounts(connect_failed=self.counts.connect_failed)
        for c in self.clients:
            c.close()
            total.add(c.counts)
        return asdict(total)


def run_slots(slots: Slots, stop: threading.Event, seconds: float,
              extra_tick: Callable[[], None] | None = None) -> dict:
    def tick() -> None:
        slots.tick()
        if extra_tick is not None:
            extra_tick()

    try:
        H.pump(slots.clients, time.monotonic() + seconds, stop=stop, tick=tick)
    finally:
        counts = slots.close()
    return counts


def ext_proc_start(headers: list[tuple[str, str]], end_of_stream: bool = False) -> bytes:
    return H.grpc_message(H.ext_proc_request_headers(headers, end_of_stream))


CHAT_PREFIX = b'{"model":"m1","messages":[{"role":"user","content":"'


def attack_padded_body(t: Target, stop: threading.Event, seconds: float, streams: int = 8,
                       chunk: int = 1024, padding: int = 1_000_000) -> dict:
    """Streams whose body arrives as ``chunk``-byte chunks, each in a message carrying
    ``padding`` bytes of an unknown field too; never the end of the body."""
    start = ext_proc_start(H.chat_request_headers())
    first = H.grpc_message(H.ext_proc_request_body(
        CHAT_PREFIX + b"x" * max(0, chunk - len(CHAT_PREFIX)), padding=padding))
    more = H.grpc_message(H.ext_proc_request_body(b"x" * chunk, padding=padding))
    sent = [0]

    def open_stream(c: H.H2Client) -> int:
        sid = c.open_stream()
        c.send(sid, start)
        c.send(sid, first)
        return sid

    def top_up(c: H.H2Client, sid: int) -> None:
        queued = c.queued(sid)
        while queued < max(len(more), MiB):  # enough to last until the next tick
            c.send(sid, more)
            queued += len(more)
            sent[0] += 1

    counts = run_slots(Slots(t, streams, 1, open_stream, top_up), stop, seconds)
    return {**counts, "padded_messages_queued": sent[0]}


def attack_unfinished_message(t: Target, stop: threading.Event, seconds: float,
                              total_bytes: int = 40 * TONIC_MAX_MESSAGE,
                              streams: int | None = None, per_conn: int = 8,
                              message_bytes: int | None = None) -> dict:
    """Streams each sending the request headers, then a gRPC prefix announcing the largest
    message (or ``message_bytes``) and all of it but its last byte: ``total_bytes`` in all
    unless ``streams`` is given."""
    size = message_bytes or t.max_message
    n = streams or max(1, min(16_384, round(total_bytes / size)))
    start = ext_proc_start(H.chat_request_headers())
    partial = H.grpc_prefix(size) + bytes(size - 1)

    def open_stream(c: H.H2Client) -> int:
        sid = c.open_stream()
        c.send(sid, start)
        c.send(sid, partial)
        return sid

    counts = run_slots(Slots(t, n, per_conn, open_stream), stop, seconds)
    return {**counts, "streams": n, "message_bytes": size}


def attack_prefix_only(t: Target, stop: threading.Event, seconds: float, streams: int = 30_000,
                       per_conn: int = 1000) -> dict:
    """Streams that send a 5-byte gRPC prefix claiming the largest message, and nothing more."""
    prefix = H.grpc_prefix(t.max_message)

    def open_stream(c: H.H2Client) -> int:
        sid = c.open_stream()
        c.send(sid, prefix)
        return sid

    counts = run_slots(Slots(t, streams, per_conn, open_stream), stop, seconds)
    return {**counts, "claimed_bytes": t.max_message}


def attack_streams_connections(t: Target, stop: threading.Event, seconds: float,
                               connections: int = 1000, streams: int = 200) -> dict:
    """``connections`` connections, each with ``streams`` ext_proc streams that send their
    HEADERS and nothing else."""
    slots = Slots(t, connections * streams, streams, lambda c: c.open_stream())
    return run_slots(slots, stop, seconds)


def attack_held_bookings(t: Target, stop: threading.Event, seconds: float, streams: int = 4,
                         body_bytes: int = 100_000) -> dict:
    """Streams that send a complete request (headers, then a ``body_bytes`` chat body with its
    end), so kvpick routes and books it, and then never the response phase."""
    n = [0]

    def open_stream(c: H.H2Client) -> int:
        n[0] += 1
        words = " ".join(f"w{n[0]}x{i}" for i in range(body_bytes // 8))
        body = json.dumps({"model": "m1", "messages": [
            {"role": "user", "content": words[:max(0, body_bytes - 64)]}]}).encode()
        headers = H.chat_request_headers(extra=[("content-length", str(len(body))),
                                                ("x-request-id", f"held-{n[0]}")])
        sid = c.open_stream()
        c.send(sid, ext_proc_start(headers))
        c.send(sid, H.grpc_message(H.ext_proc_request_body(body, end_of_stream=True)))
        return sid

    counts = run_slots(Slots(t, streams, 1, open_stream), stop, seconds)
    return {**counts, "requests_sent": n[0]}


def flood(slots: Slots, frames: Callable[[H.H2Client], tuple[bytes, int]],
          low_water: int = 64 * 1024) -> Callable[[], None]:
    """A tick that keeps every live connection's output queue above ``low_water`` with the
    frames ``frames(client)`` builds (bytes, count), once its streams are open."""
    def tick() -> None:
        for c in slots.conns:
            if c is not None and c.alive and c.open_streams and len(c.out) < low_water:
                data, count = frames(c)
                c.raw(data, count)
    return tick


def attack_settings_flood(t: Target, stop: threading.Event, seconds: float,
                          open_streams: int = 1000, batch: int = 2000) -> dict:
    """On a connection with ``open_streams`` open streams, SETTINGS frames that toggle
    INITIAL_WINDOW_SIZE (every one makes the server adjust every stream's window)."""
    sizes = (H.DEFAULT_WINDOW, 1 << 20)
    block = b"".join(H.frame(H.SETTINGS, 0, 0, struct.pack(">HI", H.SETTINGS_INITIAL_WINDOW_SIZE,
                                                          sizes[i % 2])) for i in range(batch))
    sent = [0]

    def frames(c: H.H2Client) -> tuple[bytes, int]:
        sent[0] += batch
        return block, batch

    slots = Slots(t, open_streams, open_streams, lambda c: c.open_stream())
    counts = run_slots(slots, stop, seconds, flood(slots, frames))
    return {**counts, "settings_frames_queued": sent[0]}


def attack_window_update_flood(t: Target, stop: threading.Event, seconds: float,
                               open_streams: int = 100, batch: int = 2000) -> dict:
    """WINDOW_UPDATE frames of increment 1, on the connection and on each of its
    ``open_streams`` streams in turn (its own windows left at the default, so the increments
    never overflow one)."""
    sent = [0]

    def frames(c: H.H2Client) -> tuple[bytes, int]:
        ids = [0, *c.windows]
        one = struct.pack(">I", 1)
        sent[0] += batch
        return b"".join(H.frame(H.WINDOW_UPDATE, 0, ids[i % len(ids)], one)
                        for i in range(batch)), batch

    slots = Slots(t, open_streams, open_streams, lambda c: c.open_stream(), big_windows=False)
    counts = run_slots(slots, stop, seconds, flood(slots, frames))
    return {**counts, "window_update_frames_queued": sent[0]}


def attack_issue24_mix(t: Target, stop: threading.Event, seconds: float) -> dict:
    """Issue 24's attacks together (``start_attacks``), for ``seconds``."""
    assert t.stack is not None
    attacks = start_attacks(t.stack, seconds)
    stop.wait(seconds)
    attacks.join()
    return {"outcomes": attacks.counts}


def attack_baseline(t: Target, stop: threading.Event, seconds: float) -> dict:
    stop.wait(seconds)
    return {}


@dataclass
class Attack:
    run: Callable[..., dict]
    full: dict = field(default_factory=dict)
    short: dict = field(default_factory=dict)


ATTACKS: dict[str, Attack] = {
    "baseline": Attack(attack_baseline),
    "padded_body": Attack(attack_padded_body, {}, {"streams": 2, "padding": 64 * 1024}),
    "unfinished_message": Attack(attack_unfinished_message, {},
                                 {"streams": 2, "per_conn": 1, "message_bytes": 1 << 20}),
    "prefix_only": Attack(attack_prefix_only, {}, {"streams": 200, "per_conn": 100}),
    "streams_connections": Attack(attack_streams_connections, {},
                                  {"connections": 10, "streams": 20}),
    "held_bookings": Attack(attack_held_bookings, {}, {"body_bytes": 20_000}),
    "settings_flood": Attack(attack_settings_flood, {}, {"open_streams": 100, "batch": 200}),
    "window_update_flood": Attack(attack_window_update_flood, {},
                                  {"open_streams": 20, "batch": 200}),
    "issue24_mix": Attack(attack_issue24_mix),
}


@dataclass
class Options:
    attack_seconds: float = 30.0
    hold_seconds: float = 40.0
    """held_bookings runs this long (the issue's 40 s: past the 30 s queue timeout)."""
    rate: float = 5.0
    rss_bound: int = int(1.5 * GiB)
    rss_abort: int = 4 * GiB
    warm_seconds: float = 5.0
    tail_seconds: float = 5.0
    short: bool = False
    concurrency: int = 256
    """Good clients at once: a good request that waits (a held rank) does not hold back the
    next ones' sending for the whole hold."""


class RssWatch:
    """Samples a process's VmRSS every ``every`` s; sets ``stop`` (and ``exceeded``) when it
    grows past ``abort`` bytes over ``idle``."""

    def __init__(self, pid: int, every: float = 0.1) -> None:
        self.pid, self.every = pid, every
        self.samples: list[tuple[float, int]] = []
        self.idle: int | None = None
        self.abort: int | None = None
        self.stop: threading.Event | None = None
        self.exceeded = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss-watch")
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._done.is_set():
            try:
                rss = proc_status_kb(self.pid, "VmRSS") * 1024
            except OSError:
                return
            self.samples.append((time.monotonic() - t0, rss))
            if (self.idle is not None and self.abort is not None and self.stop is not None
                    and rss - self.idle > self.abort):
                self.exceeded = True
                self.stop.set()
            self._done.wait(self.every)

    def now(self) -> int:
        return proc_status_kb(self.pid, "VmRSS") * 1024

    def peak_since(self, t: float) -> int:
        return max((rss for at, rss in self.samples if at >= t), default=0)

    def elapsed(self) -> float:
        return self.samples[-1][0] if self.samples else 0.0

    def close(self) -> None:
        self._done.set()
        self._thread.join(5)


COUNTER_RE = re.compile(r"goaway|refused|reset|budget|exhausted|idle|reject|closed|timeout|"
                        r"queue|extproc_streams|http2")


def counters(stack: harness.Stack) -> dict[str, float]:
    """kvpick's counters that say how it defended itself, by name and labels."""
    out = {}
    try:
        samples = stack.kvpick.metrics()
    except Exception:  # kvpick gone: the caller reports that
        return out
    for name, labels, value in samples:
        if name.endswith("_total") and COUNTER_RE.search(name):
            key = name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(labels.items())) + "}"
                          if labels else "")
            out[key] = value
    return out


def good_summary(load: dict, rate: float, seconds: float) -> dict:
    statuses = load.get("statuses", {})
    sent = load.get("completed", 0) + load.get("errors", 0) + load.get("aborted", 0)
    ok = statuses.get("200", 0)
    return {
        "expected": int(rate * seconds), "sent": sent, "ok": ok, "failed": sent - ok,
        "unsent": max(0, int(rate * seconds) - sent - 1),
        "statuses": statuses, "errors": load.get("errors", 0),
        "p50_ms": load.get("latency_ms", {}).get("p50", 0.0),
        "p99_ms": load.get("latency_ms", {}).get("p99", 0.0),
        "max_ms": load.get("latency_ms", {}).get("max", 0.0),
    }


def measure(name: str, opts: Options) -> dict:
    """One attack against a fresh kvpick + Envoy, with the good traffic around it."""
    attack = ATTACKS[name]
    params = dict(attack.short if opts.short else attack.full)
    seconds = opts.hold_seconds if name == "held_bookings" else opts.attack_seconds
    max_message = flag_default(harness.kvpick_binary(), "--max-ext-proc-message-bytes",
                               TONIC_MAX_MESSAGE)
    up, ports = soak_load.start_upstreams()
    body = soak_load.write_body(f"adv-{name}")
    try:
        stack = harness.Stack([harness.worker("w0", ports=ports[:2]),
                               harness.worker("w1", ports=ports[2:])], name=f"adv-{name}").start()
    except BaseException:
        up.kill()
        raise
    pid = stack.kvpick.process.pid
    target = Target("127.0.0.1", stack.kvpick.grpc_port, stack.secure, max_message, stack)
    total = opts.warm_seconds + seconds + opts.tail_seconds
    gen = subprocess.Popen(
        [str(soak_load.LOADGEN), "run", "--url", stack.url() + CHAT, "--body", str(body),
         "--seconds", str(total), "--rate", str(opts.rate),
         "--concurrency", str(opts.concurrency)], stdout=subprocess.PIPE, text=True)
    watch = RssWatch(pid)
    stop = threading.Event()
    result: dict = {}
    try:
        stop.wait(opts.warm_seconds)
        idle = watch.now()
        watch.idle, watch.abort, watch.stop = idle, opts.rss_abort, stop
        began_at = watch.elapsed()
        cpu0, before = H.cpu_seconds(pid), counters(stack)
        t0 = time.monotonic()

        def go() -> None:
            try:
                result.update(attack.run(target, stop, seconds, **params))
            except Exception as e:  # the attack's own failure is reported, not raised
                result["attack_error"] = f"{type(e).__name__}: {e}"

        thread = threading.Thread(target=go, daemon=True, name=name)
        thread.start()
        thread.join(seconds + 120)
        stop.set()
        attack_s = time.monotonic() - t0
        alive = stack.kvpick.process.alive()
        cpu = H.cpu_seconds(pid) - cpu0 if alive else None
        out, _ = gen.communicate(timeout=total + 180)
        load = json.loads(out) if out.strip() else {}
        peak = watch.peak_since(began_at)
        alive = alive and stack.kvpick.process.alive()
        # After the tail: the ends of the attack's streams are counted too.
        moved = {k: v - before.get(k, 0.0) for k, v in counters(stack).items()
                 if v != before.get(k, 0.0)}
        inflight = soak_load.bookings_left(stack) if alive else None
    finally:
        watch.close()
        if gen.poll() is None:
            gen.kill()
        stack.stop()
        up.kill()
    return verdict_row(name, opts, {
        "attack": name, "params": params, "attack_seconds": round(attack_s, 1),
        "rss_idle_mib": idle / MiB, "rss_peak_mib": peak / MiB,
        "rss_growth_mib": max(0, peak - idle) / MiB, "exceeded_abort": watch.exceeded,
        "cpu_seconds": cpu, "good": good_summary(load, opts.rate, total),
        "attacker": result, "kvpick_counters": moved, "kvpick_alive": alive,
        "bookings_left": inflight, "max_message_bytes": target.max_message,
    })


def verdict_row(name: str, opts: Options, row: dict) -> dict:
    why = []
    if not row["kvpick_alive"]:
        why.append("kvpick died")
    good = row["good"]
    if good["failed"]:
        why.append(f"{good['failed']} good requests failed {good['statuses']}")
    if good["unsent"]:
        why.append(f"{good['unsent']} good requests never sent")
    if row["exceeded_abort"]:
        why.append(f"RSS passed the {opts.rss_abort / GiB:g} GiB abort cap: attack stopped")
    elif row["rss_growth_mib"] * MiB > opts.rss_bound:
        why.append(f"RSS +{row['rss_growth_mib']:.0f} MiB over the {opts.rss_bound / GiB:g} GiB "
                   "bound")
    if row["bookings_left"]:
        why.append(f"{row['bookings_left']:.0f} bookings left")
    if "attack_error" in row["attacker"]:
        why.append(f"attack error {row['attacker']['attack_error']}")
    row["status"] = "EXCEEDED" if row["exceeded_abort"] else ("FAIL" if why else "PASS")
    row["why"] = why
    return row


def run_all(names: list[str], opts: Options, log=print) -> dict:
    rows = []
    for name in names:
        log(f"--- {name} ({opts.hold_seconds if name == 'held_bookings' else opts.attack_seconds:g} s)")
        row = measure(name, opts)
        log(table_line(row))
        rows.append(row)
    return {"options": asdict(opts), "kvpick_binary": str(harness.kvpick_binary()),
            "kvpick_version": kvpick_version(), "rows": rows,
            "passed": all(r["status"] == "PASS" for r in rows)}


def kvpick_version() -> str:
    try:
        return subprocess.run([str(harness.kvpick_binary()), "--version"], capture_output=True,
                              text=True, timeout=30).stdout.strip()
    except OSError:
        return "?"


def attacker_summary(a: dict) -> str:
    if "outcomes" in a:
        return "; ".join(f"{k}: {v}" for k, v in sorted(a["outcomes"].items()))
    if not a:
        return ""
    parts = [f"conns {a.get('connections', 0)}", f"streams {a.get('streams_opened', 0)}"]
    if a.get("goaways"):
        parts.append("goaway " + ",".join(f"{k}={v}" for k, v in a["goaways"].items()))
    if a.get("resets"):
        parts.append("rst " + ",".join(f"{int(k):#x}={v}" for k, v in a["resets"].items()))
    if a.get("grpc_status"):
        parts.append("grpc-status " + ",".join(f"{k}={v}" for k, v in a["grpc_status"].items()))
    if a.get("closed_by_server"):
        parts.append(f"closed {a['closed_by_server']}")
    if a.get("connect_failed"):
        parts.append(f"refused {a['connect_failed']}")
    return " ".join(parts)


HEADER = (f"{'attack':<20} {'status':<8} {'idle MiB':>8} {'+peak MiB':>9} {'CPU-s':>6} "
          f"{'good sent/ok/fail':>17} {'p50 ms':>7} {'p99 ms':>8}  attacker got")


def table_line(r: dict) -> str:
    g = r["good"]
    cpu = f"{r['cpu_seconds']:.1f}" if r["cpu_seconds"] is not None else "-"
    return (f"{r['attack']:<20} {r['status']:<8} {r['rss_idle_mib']:>8.0f} "
            f"{r['rss_growth_mib']:>9.0f} {cpu:>6} "
            f"{g['sent']:>7}/{g['ok']}/{g['failed']:<4} {g['p50_ms']:>7.0f} {g['p99_ms']:>8.0f}  "
            f"{attacker_summary(r['attacker'])}")


def print_table(report: dict) -> None:
    print(HEADER)
    for r in report["rows"]:
        print(table_line(r))
        for why in r["why"]:
            print(f"{'':<20} - {why}")
