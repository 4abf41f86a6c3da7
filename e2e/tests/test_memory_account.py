"""The memory account against a real kvpick (issue 45, item 1): every memory attack of the issue at
once (prefixes claiming the largest message on many streams, unfinished messages, body chunks
padded with unknown fields, thousands of headers-only streams), each on raw HTTP/2 frames
(e2e/hostile_h2.py). kvpick's RSS stays under docs/security.md's worst-case arithmetic evaluated
at this test's limits, the account never passes its limit, the streams it cannot charge are reset
and counted, and a good ext_proc request and health checks are served throughout.

Why an e2e test on scaled-down limits: the bound is a property of the whole process (h2, tonic,
the allocator), so it is measured on the real binary's /proc/PID/status; the arithmetic is
linear in each limit, so the defaults' 1,440 MiB is checked at a 64 MiB account that a shared
2-core CI box fills in seconds."""

from __future__ import annotations

import json
import socket
import struct
import time

import h2.config
import h2.connection
import h2.events
import pytest

import harness
import hostile_h2 as hostile
from harness import pb_field

HOST = "127.0.0.1"
KiB, MiB = 1 << 10, 1 << 20
ACCOUNT = 64 * MiB
SHARE = 16 * MiB
MAX_BODY = 4 * MiB
MESSAGE = MAX_BODY + MiB  # --max-ext-proc-message-bytes' default
BODY_BUDGET = 32 * MiB
EXTPROC = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"
# docs/security.md "Memory account": what is not charged, per stream and per connection.
STREAM_STATE = 16 * KiB
CONNECTION_STATE = 160 * KiB
WINDOW_UPDATE, SETTINGS_ACK = 0x8, 0x1


def varint_field(number: int, value: int) -> bytes:
    out, n = bytearray([number << 3]), value
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def request_headers_message(request_id: str) -> bytes:
    """ProcessingRequest.request_headers (field 2): HttpHeaders{headers: HeaderMap}."""
    pairs = [(":method", "POST"), (":path", "/v1/completions"),
             ("content-type", "application/json"), ("x-request-id", request_id)]
    values = b"".join(pb_field(1, pb_field(1, k.encode()) + pb_field(3, v.encode()))
                      for k, v in pairs)
    return pb_field(2, pb_field(1, values))


def request_body_message(chunk: bytes, end: bool, padding: int = 0) -> bytes:
    """ProcessingRequest.request_body (field 4), plus an unknown field 999 of ``padding`` bytes."""
    body = pb_field(1, chunk) + (varint_field(2, 1) if end else b"")
    out = pb_field(4, body)
    if padding:
        out += pb_field(999, bytes(padding))
    return out


def grpc(message: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", len(message)) + message


def grpc_prefix(length: int) -> bytes:
    return b"\x00" + struct.pack(">I", length)


def open_attack(port: int, streams: list[bytes]) -> socket.socket:
    """A connection whose stream i (id 2i+1) sends HEADERS for the ext_proc method, then
    ``streams[i]`` as DATA, never ending. Waits for kvpick's connection WINDOW_UPDATE first, and
    each connection sends less than the 1 MiB window, so nothing breaks flow control."""
    assert sum(len(s) for s in streams) < 1_000_000
    sock = hostile.connect(HOST, port, timeout=10.0)
    received, deadline = b"", time.monotonic() + 10
    while time.monotonic() < deadline:
        chunk = sock.recv(65536)
        assert chunk, "closed before its SETTINGS"
        received += chunk
        if any(f.type == WINDOW_UPDATE and f.stream_id == 0
               for f in hostile._server_frames(received)):
            break
    out = hostile.frame(hostile.SETTINGS, SETTINGS_ACK, 0, b"")
    for i, data in enumerate(streams):
        sid = 2 * i + 1
        out += hostile.block_frames(hostile.request_block(EXTPROC), sid, end_stream=False)
        for at in range(0, len(data), hostile.MAX_FRAME_SIZE):
            out += hostile.frame(hostile.DATA, 0, sid, data[at:at + hostile.MAX_FRAME_SIZE])
    sock.sendall(out)
    sock.setblocking(False)
    return sock


def flood(port: int, payloads: list[bytes], timeout: float = 60.0) -> tuple[socket.socket, int]:
    """One connection (PyPI ``h2``, flow control honoured, so kvpick's windows are the only
    brake) sending ``payloads[i]`` on its stream i, never ending them. Returns the open socket
    and how many of its streams kvpick reset."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    sock = hostile.open_socket(HOST, port, timeout=timeout)
    conn.initiate_connection()
    ids = []
    for _ in payloads:
        sid = conn.get_next_available_stream_id()
        conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", EXTPROC),
                                (":authority", "kvpick"), ("content-type", "application/grpc"),
                                ("te", "trailers")])
        ids.append(sid)
    sock.sendall(conn.data_to_send())
    sent, reset = dict.fromkeys(ids, 0), set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [(sid, p) for sid, p in zip(ids, payloads) if sid not in reset and sent[sid] < len(p)]
        if not busy:
            break
        for sid, payload in busy:
            while sent[sid] < len(payload):
                room = min(conn.local_flow_control_window(sid), conn.max_outbound_frame_size)
                if room <= 0:
                    break
                n = min(room, len(payload) - sent[sid])
                conn.send_data(sid, payload[sent[sid]:sent[sid] + n])
                sent[sid] += n
        sock.sendall(conn.data_to_send())
        sock.settimeout(0.5)
        try:
            chunk = sock.recv(1 << 20)
        except (socket.timeout, TimeoutError):
            continue
        assert chunk, "kvpick closed the connection"
        for event in conn.receive_data(chunk):
            if isinstance(event, h2.events.StreamReset):
                reset.add(event.stream_id)
        sock.sendall(conn.data_to_send())
    sock.setblocking(False)
    return sock, len(reset)


def drain(socks: list[socket.socket]) -> None:
    """Reads what kvpick sent (RST_STREAMs, WINDOW_UPDATEs), so its writes never stall."""
    for s in socks:
        try:
            while s.recv(65536):
                pass
        except (BlockingIOError, OSError):
            pass


def good_extproc_request(port: int, timeout: float = 10.0) -> bytes:
    """A well-behaved ext_proc stream (PyPI ``h2``): request headers and a small body, then the
    answers until one names the picked endpoint. Returns the answers' bytes."""
    body = json.dumps({"model": "m1", "prompt": "hello"}).encode()
    payload = grpc(request_headers_message("good")) + grpc(request_body_message(body, True))
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    sock = hostile.open_socket(HOST, port, timeout=timeout)
    deadline, answers = time.monotonic() + timeout, b""
    try:
        conn.initiate_connection()
        conn.send_headers(1, [(":method", "POST"), (":scheme", "http"), (":path", EXTPROC),
                              (":authority", "kvpick"), ("content-type", "application/grpc"),
                              ("te", "trailers")])
        conn.send_data(1, payload)
        sock.sendall(conn.data_to_send())
        while b"x-gateway-destination-endpoint" not in answers:
            assert time.monotonic() < deadline, f"no pick within {timeout}s: {answers!r}"
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(65536)
            assert chunk, "closed"
            for event in conn.receive_data(chunk):
                if isinstance(event, h2.events.DataReceived):
                    answers += event.data
                    conn.acknowledge_received_data(event.flow_controlled_length, 1)
                assert not isinstance(event, (h2.events.StreamReset,
                                              h2.events.ConnectionTerminated)), event
            sock.sendall(conn.data_to_send())
    finally:
        sock.close()
    return answers


@pytest.fixture(scope="module")
def kv():
    kv = harness.Kvpick(
        [harness.worker("w0", port=harness.free_port())], secure=False,
        max_body_bytes=MAX_BODY,
        extra_args=["--memory-account-bytes", str(ACCOUNT),
                    "--connection-memory-bytes", str(SHARE),
                    "--max-buffered-body-bytes", str(BODY_BUDGET)]).start()
    yield kv
    kv.stop()


def test_every_memory_attack_at_once_stays_under_the_documented_bound(kv):
    pid, port = kv.process.pid, kv.grpc_port
    for _ in range(20):  # warm up: the first connections grow the allocator's arenas
        assert hostile.health_check(HOST, port)
    good_extproc_request(port)
    idle = hostile.process_memory(pid)["VmRSS"]
    hostile.reset_peak_memory(pid)
    assert kv.metric("kvpick_memory_account_limit_bytes") == ACCOUNT

    socks: list[socket.socket] = []
    try:
        # Prefixes claiming the largest message: 5 MiB charged each, far more than the account.
        socks += [open_attack(port, [grpc_prefix(MESSAGE)] * 24) for _ in range(24)]
        # Unfinished messages: the largest message but one byte, 2 per connection (160 MiB, issue
        # 45: 40 x 64 MiB - 1 grew RSS by 2.5 GB).
        resets = 0
        for _ in range(16):
            sock, n = flood(port, [grpc_prefix(MESSAGE) + bytes(MESSAGE - 1)] * 2)
            socks.append(sock)
            resets += n
        # Body chunks of 1 KiB each padded with 200 KB of unknown fields, 40 per stream, the body
        # never ending (64 MB sent, 320 KiB of chunks; issue 45: +5.3 GB at 1 MB a chunk).
        padded = grpc(request_headers_message("pad")) + grpc(
            request_body_message(b"x" * KiB, False, padding=200_000)) * 40
        for _ in range(2):
            sock, n = flood(port, [padded] * 4)
            socks.append(sock)
            resets += n
        assert resets > 0, "the unfinished messages went over the account: some streams reset"
        # Thousands of headers-only streams (per-stream state).
        socks += [open_attack(port, [b""] * 250) for _ in range(40)]
        streams = 24 * 24 + 16 * 2 + 2 * 4 + 40 * 250

        def account_full_and_resets_counted():
            drain(socks)
            refused = sum(kv.metric("kvpick_memory_account_refused_total", reason=r) or 0
                          for r in ("account", "connection_share"))
            return refused > 0 and kv.metric("kvpick_memory_account_bytes") or None
        used = harness.wait_until(account_full_and_resets_counted, 30,
                                  desc="the account refusing streams")
        assert used <= ACCOUNT
        # kvpick still serves, with every attack connection open.
        assert hostile.health_check(HOST, port)
        assert b"x-gateway-destination-endpoint" in good_extproc_request(port)
        drain(socks)
        mem = hostile.process_memory(pid)
        bound = ACCOUNT + streams * STREAM_STATE + len(socks) * CONNECTION_STATE
        grown = mem["VmHWM"] - idle
        print(f"idle RSS {idle / MiB:.1f} MiB, peak +{grown / MiB:.1f} MiB, "
              f"bound {bound / MiB:.1f} MiB, account {used / MiB:.1f} MiB")
        assert grown <= bound, f"peak RSS grew {grown / MiB:.1f} MiB > {bound / MiB:.1f} MiB"
        # The padded chunks are held as their 1 KiB, not their 200 KB messages (plus the good
        # request's body until its stream's end reaches kvpick).
        assert (kv.metric("kvpick_body_bytes_buffered") or 0) <= 2 * 4 * 40 * KiB + KiB
    finally:
        for s in socks:
            s.close()
    # Everything given back once the connections are gone.
    harness.wait_until(lambda: (kv.metric("kvpick_memory_account_bytes") or 0) == 0 or None, 30,
                       desc="the account back to 0")
