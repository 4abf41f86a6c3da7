"""Real-process harness for kvpick end-to-end tests and demos.

Pieces:
  * ``Upstream``  - a fake OpenAI-ish model server (threaded HTTP/1.1, port 0) that echoes what it
                    received (own port, sha256/len of the body, lower-cased headers) and can stream SSE
                    gated by a ``Gate`` the test controls, or stream forever until the client leaves.
  * ``Kvpick``    - starts ``kvpick serve`` with a YAML catalog written to a work dir and waits for
                    its port file (the readiness signal); metrics and gRPC-health helpers.
  * ``Envoy``     - starts Envoy from ``e2e/envoy.yaml`` patched for the test (ephemeral ports,
                    kvpick's real port, TLS on/off, extra listeners that inject a subset hint).
  * ``Stack``     - kvpick + Envoy together.

Synchronisation is always "wait for a condition with a deadline" (``wait_until``), never a fixed
sleep. Every process logs to a file in its work dir; ``ALL_PROCS`` lists them so a test runner can
print the logs of a failed test.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import http.server
import itertools
import json
import os
import re
import signal
import socketserver
import subprocess
import tempfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml

E2E_DIR = Path(__file__).resolve().parent
REPO_DIR = E2E_DIR.parent
WORK_ROOT = REPO_DIR / ".e2e-work"
ENVOY_TEMPLATE = E2E_DIR / "envoy.yaml"

MAIN_LISTENER = "kvpick_gateway"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"


class HarnessError(RuntimeError):
    pass


# --------------------------------------------------------------------------------------------
# small utilities


def kvpick_binary() -> Path:
    return Path(os.environ.get("KVPICK_BIN", REPO_DIR / "target" / "debug" / "kvpick"))


def envoy_binary() -> Path:
    if os.environ.get("ENVOY_BIN"):
        return Path(os.environ["ENVOY_BIN"])
    venv = REPO_DIR / ".venv" / "bin" / "envoy"
    return venv if venv.exists() else Path("envoy")


WORKDIRS: list[Path] = []


def new_workdir(prefix: str) -> Path:
    """A fresh directory under .e2e-work/ (git-ignored) for one run's files and logs."""
    WORK_ROOT.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=prefix + "-", dir=WORK_ROOT))
    WORKDIRS.append(path)
    return path


def remove_workdirs() -> None:
    """Deletes the work dirs this process created (call after a fully green run)."""
    import shutil

    while WORKDIRS:
        shutil.rmtree(WORKDIRS.pop(), ignore_errors=True)


def wait_until(
    cond: Callable[[], Any],
    timeout: float = 30.0,
    interval: float = 0.05,
    desc: str = "condition",
) -> Any:
    """Polls ``cond`` until it returns a truthy value (returned) or ``timeout`` passes (raises).

    Exceptions from ``cond`` count as "not yet"; the last one is reported on timeout."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while True:
        try:
            value = cond()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - the condition is retried
            last_exc = exc
        if time.monotonic() >= deadline:
            extra = f" (last error: {last_exc!r})" if last_exc else ""
            raise TimeoutError(f"timed out after {timeout:.1f}s waiting for {desc}{extra}")
        time.sleep(interval)


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    req = urllib.request.Request(url)
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(req, timeout=timeout) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode("utf-8", "replace")


def tls_alpn(port: int, host: str = "127.0.0.1", timeout: float = 5.0) -> str | None:
    """TLS handshake without verification offering ALPN h2; returns the negotiated protocol.
    Raises ssl.SSLError / OSError when the port does not speak TLS."""
    import socket
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    with socket.create_connection((host, port), timeout=timeout) as raw:
        with ctx.wrap_socket(raw, server_hostname="kvpick") as tls:
            return tls.selected_alpn_protocol()


def pb_field(number: int, value: bytes) -> bytes:
    """One length-delimited protobuf field (wire type 2): enough to hand-encode the small
    requests of the selection API without generated stubs."""
    key, out = (number << 3) | 2, bytearray()
    for n in (key, len(value)):
        while n >= 0x80:
            out.append((n & 0x7F) | 0x80)
            n >>= 7
        out.append(n)
    return bytes(out) + value


def tail(path: Path, lines: int = 150) -> str:
    try:
        data = path.read_text(errors="replace").splitlines()
    except FileNotFoundError:
        return "(no log file)"
    return "\n".join(data[-lines:])


# --------------------------------------------------------------------------------------------
# processes


@dataclass
class ManagedProcess:
    label: str
    argv: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    stopped_at: float | None = None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        log.write(f"$ {' '.join(self.argv)}\n".encode())
        log.flush()
        self.started_at = time.time()
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )
        log.close()
        ALL_PROCS.append(self)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if self.proc is not None and self.proc.poll() is not None:
            raise HarnessError(
                f"{self.label} exited with code {self.proc.returncode}; log {self.log_path}:\n"
                + tail(self.log_path, 60)
            )

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL. Only ever signals our own child."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self.stopped_at is None:
            self.stopped_at = time.time()
        return self.proc.returncode


ALL_PROCS: list[ManagedProcess] = []


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the harness process dies (Linux prctl)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - best effort; atexit below covers normal exits
        pass


def stop_all() -> None:
    for p in reversed(ALL_PROCS):
        if p.alive():
            p.stop()


atexit.register(stop_all)


# --------------------------------------------------------------------------------------------
# fake upstream model server


class Gate:
    """Test-controlled synchronisation for one streamed upstream response.

    The request carries header ``x-e2e-gate: <gate.id>``. For an SSE response the upstream sends the
    first event, sets ``first_sent`` and blocks until the test sets ``release``; then it sends the
    rest and sets ``final_sent``. In ``forever`` mode (header ``x-e2e-mode: forever``) it streams
    events until a write fails and then sets ``disconnected``."""

    _registry: dict[str, "Gate"] = {}
    _lock = threading.Lock()

    def __init__(self, release_timeout: float = 60.0) -> None:
        self.id = uuid.uuid4().hex
        self.release_timeout = release_timeout
        self.started = threading.Event()
        self.first_sent = threading.Event()
        self.release = threading.Event()
        self.final_sent = threading.Event()
        self.disconnected = threading.Event()
        self.released_in_time: bool | None = None
        self.events_sent = 0
        with Gate._lock:
            Gate._registry[self.id] = self

    @classmethod
    def lookup(cls, gate_id: str | None) -> "Gate | None":
        if not gate_id:
            return None
        with cls._lock:
            return cls._registry.get(gate_id)

    def headers(self, forever: bool = False) -> dict[str, str]:
        h = {"x-e2e-gate": self.id}
        if forever:
            h["x-e2e-mode"] = "forever"
        return h


@dataclass
class ReceivedRequest:
    port: int
    method: str
    path: str
    headers: dict[str, str]
    body_len: int
    sha256: str
    at: float = field(default_factory=time.time)


class _UpstreamHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    disable_nagle_algorithm = True  # header and body writes must not wait for delayed ACKs
    server: "_UpstreamServer"

    def log_message(self, fmt: str, *args: Any) -> None:  # quiet
        pass

    # -- request body -------------------------------------------------------------------------
    def _read_body(self) -> bytes:
        te = (self.headers.get("Transfer-Encoding") or "").lower()
        if "chunked" in te:
            chunks = []
            while True:
                line = self.rfile.readline()
                if not line:
                    raise ConnectionError("eof in chunked body")
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    # trailers until blank line
                    while True:
                        t = self.rfile.readline()
                        if t in (b"\r\n", b"\n", b""):
                            break
                    break
                chunks.append(self.rfile.read(size))
                self.rfile.readline()  # CRLF
            return b"".join(chunks)
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _handle(self) -> None:
        body = self._read_body()
        headers = {k.lower(): v for k, v in self.headers.items()}
        port = self.server.server_address[1]
        digest = hashlib.sha256(body).hexdigest()
        rec = ReceivedRequest(port, self.command, self.path, headers, len(body), digest)
        self.server.owner._record(rec)

        wants_stream = False
        if body:
            try:
                parsed = json.loads(body)
                wants_stream = isinstance(parsed, dict) and parsed.get("stream") is True
            except ValueError:
                pass
        gate = Gate.lookup(headers.get("x-e2e-gate"))
        if headers.get("x-e2e-mode") == "forever":
            self._stream_forever(port, gate)
        elif wants_stream:
            self._stream_sse(port, gate, digest, len(body), headers)
        else:
            payload = json.dumps(
                {"port": port, "sha256": digest, "len": len(body), "headers": headers,
                 "method": self.command, "path": self.path}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    do_GET = do_POST = do_PUT = do_DELETE = _handle

    # -- streaming ----------------------------------------------------------------------------
    def _chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _sse_headers(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()

    @staticmethod
    def _event(obj: Any) -> bytes:
        return b"data: " + json.dumps(obj).encode() + b"\n\n"

    def _stream_sse(self, port: int, gate: Gate | None, digest: str, n: int,
                    headers: dict[str, str]) -> None:
        self._sse_headers()
        base = {"id": "chatcmpl-e2e", "object": "chat.completion.chunk", "port": port}
        self._chunk(self._event({**base, "seq": 0, "sha256": digest, "len": n,
                                 "headers": headers,
                                 "choices": [{"index": 0, "delta": {"content": "Hel"}}]}))
        if gate is not None:
            gate.started.set()
            gate.events_sent = 1
            gate.first_sent.set()
            gate.released_in_time = gate.release.wait(gate.release_timeout)
        self._chunk(self._event({**base, "seq": 1,
                                 "choices": [{"index": 0, "delta": {"content": "lo"}}]}))
        self._chunk(self._event({**base, "seq": 2, "choices": [
            {"index": 0, "delta": {}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9,
                      "prompt_tokens_details": {"cached_tokens": 0}}}))
        self._chunk(b"data: [DONE]\n\n")
        if gate is not None:
            gate.events_sent = 4
            gate.final_sent.set()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _stream_forever(self, port: int, gate: Gate | None) -> None:
        self._sse_headers()
        if gate is not None:
            gate.started.set()
        deadline = time.monotonic() + 300
        seq = 0
        try:
            while time.monotonic() < deadline:
                self._chunk(self._event({"port": port, "seq": seq,
                                         "choices": [{"index": 0, "delta": {"content": "x"}}]}))
                seq += 1
                if gate is not None:
                    gate.events_sent = seq
                    if seq == 1:
                        gate.first_sent.set()
                # pacing of the fake token stream (not test synchronisation)
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError, OSError):
            if gate is not None:
                gate.disconnected.set()
            self.close_connection = True
            return
        self.wfile.write(b"0\r\n\r\n")


class _UpstreamServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    block_on_close = False
    owner: "Upstream"


class Upstream:
    """A fake model server on 127.0.0.1:<ephemeral port>."""

    def __init__(self, name: str = "upstream") -> None:
        self.name = name
        self._server = _UpstreamServer(("127.0.0.1", 0), _UpstreamHandler)
        self._server.owner = self
        self.port: int = self._server.server_address[1]
        self._lock = threading.Lock()
        self.requests: list[ReceivedRequest] = []
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name=f"upstream-{self.port}", daemon=True)

    def start(self) -> "Upstream":
        self._thread.start()
        return self

    def _record(self, rec: ReceivedRequest) -> None:
        with self._lock:
            self.requests.append(rec)

    def received(self) -> list[ReceivedRequest]:
        with self._lock:
            return list(self.requests)

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"


# --------------------------------------------------------------------------------------------
# kvpick


class FailingEngine:
    """An engine whose HTTP path is broken while `failing` is set: every request gets an instant
    503 (else a 200 JSON answer). Counts what it answered, split by the `x-soak-bad` marker
    hostile clients put on theirs."""

    def __init__(self) -> None:
        owner = self
        self.failing = True
        self.answers: list[tuple[int, bool]] = []  # (status, from a hostile client)
        self.lock = threading.Lock()

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                status = 503 if owner.failing else 200
                with owner.lock:
                    owner.answers.append((status, bool(self.headers.get("x-soak-bad"))))
                payload = b'{"error":"engine broken"}' if status == 503 else b'{"choices":[]}'
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            do_GET = do_POST = _handle

        self.server = _ThreadingServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def count(self, status: int | None = None, hostile: bool | None = None) -> int:
        with self.lock:
            return sum(1 for s, h in self.answers
                       if (status is None or s == status) and (hostile is None or h == hostile))

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _ThreadingServer(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True


def worker(name: str, ports: Iterable[int] | None = None, *, port: int | None = None,
           dp_size: int | None = None, model: str = "m1",
           address: str = "127.0.0.1") -> dict[str, Any]:
    """A catalog entry: ``ports`` = one DP rank per port, or ``port`` (+ ``dp_size`` multiplexed)."""
    w: dict[str, Any] = {"name": name, "model": model, "address": address}
    if ports is not None:
        w["ports"] = list(ports)
    if port is not None:
        w["port"] = port
    if dp_size is not None:
        w["data_parallel_size"] = dp_size
    return w


def catalog_yaml(workers: list[dict[str, Any]]) -> str:
    return yaml.safe_dump({"workers": workers}, sort_keys=False)


_METRIC_LINE = re.compile(
    r'^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)'
)
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        if not m:
            continue
        labels = dict(_LABEL.findall(m.group("labels") or ""))
        out.append((m.group("name"), labels, float(m.group("value"))))
    return out


def metric_sum(samples, name: str, **labels: str) -> float | None:
    """Sum of the samples named ``name`` whose labels include ``labels``; None if there is none."""
    vals = [v for n, l, v in samples if n == name and all(l.get(k) == x for k, x in labels.items())]
    return sum(vals) if vals else None


def histogram(samples, name: str) -> tuple[list[tuple[float, float]], float, float]:
    """(sorted [(le, cumulative count)], sum, count) for histogram ``name``."""
    buckets = []
    for n, l, v in samples:
        if n == name + "_bucket":
            le = l.get("le", "+Inf")
            buckets.append((float("inf") if le == "+Inf" else float(le), v))
    buckets.sort()
    return buckets, metric_sum(samples, name + "_sum") or 0.0, metric_sum(samples, name + "_count") or 0.0


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus-style estimate (linear interpolation inside the bucket)."""
    if not buckets or buckets[-1][1] <= 0:
        return float("nan")
    total = buckets[-1][1]
    rank = q * total
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return prev_le
            if count == prev_count:
                return le
            return prev_le + (le - prev_le) * (rank - prev_count) / (count - prev_count)
        prev_le, prev_count = le, count
    return prev_le


class Kvpick:
    def __init__(self, workers: list[dict[str, Any]], *, workdir: Path | None = None,
                 secure: bool = True, extra_args: Iterable[str] = (),
                 max_body_bytes: int | None = None, fallbacks: int | None = None,
                 conformance_test_mode: bool = False, log_format: str = "text") -> None:
        self.workdir = workdir or new_workdir("kvpick")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.catalog_path = self.workdir / "catalog.yaml"
        self.port_file = self.workdir / "ports.json"
        self.secure = secure
        self.write_catalog(workers)
        argv = [
            str(kvpick_binary()), "serve",
            "--config", str(self.catalog_path),
            "--bind", "127.0.0.1",
            "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0",
            f"--secure-serving={'true' if secure else 'false'}",
            "--port-file", str(self.port_file),
            "--log-format", log_format,
        ]
        if max_body_bytes is not None:
            argv += ["--max-body-bytes", str(max_body_bytes)]
        if fallbacks is not None:
            argv += ["--fallbacks", str(fallbacks)]
        if conformance_test_mode:
            argv.append("--conformance-test-mode")
        argv += list(extra_args)
        env = dict(os.environ)
        env.setdefault("RUST_BACKTRACE", "1")
        env.setdefault("RUST_LOG", "info")
        self.process = ManagedProcess("kvpick", argv, self.workdir / "kvpick.log", env=env)
        self.ports: dict[str, int] = {}

    def write_catalog(self, workers: list[dict[str, Any]]) -> None:
        atomic_write(self.catalog_path, catalog_yaml(workers))

    def start(self, timeout: float = 30.0) -> "Kvpick":
        binary = kvpick_binary()
        if not binary.exists():
            raise HarnessError(
                f"kvpick binary not found at {binary} (build it with `cargo build -p kvpick -p kvpick-lab`, "
                "or point KVPICK_BIN at it)")
        self.process.start()

        def ready():
            self.process.check_alive()
            if not self.port_file.exists():
                return None
            return json.loads(self.port_file.read_text())

        ports = wait_until(ready, timeout, desc=f"kvpick port file {self.port_file}")
        self.ports = {k: int(ports[k]) for k in ("grpc", "health", "metrics")}
        return self

    @property
    def grpc_port(self) -> int:
        return self.ports["grpc"]

    @property
    def health_port(self) -> int:
        return self.ports["health"]

    @property
    def metrics_port(self) -> int:
        return self.ports["metrics"]

    def metrics_text(self) -> str:
        status, text = http_get(f"http://127.0.0.1:{self.metrics_port}/metrics")
        if status != 200:
            raise HarnessError(f"/metrics answered {status}: {text[:200]}")
        return text

    def metrics(self):
        return parse_metrics(self.metrics_text())

    def metric(self, name: str, **labels: str) -> float | None:
        return metric_sum(self.metrics(), name, **labels)

    def health(self, service: str, port: int | None = None, timeout: float = 5.0) -> str:
        """gRPC health status name (SERVING / NOT_SERVING / ...) of ``service`` over h2c."""
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        with grpc.insecure_channel(f"127.0.0.1:{port or self.health_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
            return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def stop(self) -> int | None:
        return self.process.stop()

    def log(self) -> str:
        return tail(self.process.log_path, 10_000)


    def kill(self) -> None:
        """SIGKILL (no drain, no goodbye to Redis), as a crashed pod."""
        proc = self.process.proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        self.process.stopped_at = time.time()

    def restart(self, timeout: float = 30.0) -> "Kvpick":
        """Starts the binary again on the ports it had (so Envoy's static cluster finds it)."""
        argv = list(self.process.argv)
        for flag, port in (("--grpc-port", self.grpc_port), ("--grpc-health-port", self.health_port),
                           ("--metrics-port", self.metrics_port)):
            argv[argv.index(flag) + 1] = str(port)
        self.port_file.unlink(missing_ok=True)
        self.process = ManagedProcess(self.process.label, argv, self.process.log_path,
                                      env=self.process.env)
        return self.start(timeout)


# --------------------------------------------------------------------------------------------
# Redis (the shared state of kvpick replicas)


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (for servers that cannot bind port 0 and report
    it, like redis-server; a restarted one must come back on the same port anyway)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_binary() -> str:
    return os.environ.get("REDIS_SERVER_BIN", "redis-server")


class RedisServer:
    """A real ``redis-server`` (Debian package) on 127.0.0.1, without persistence: a restart
    starts empty, like a Redis that lost its data."""

    def __init__(self, workdir: Path | None = None, port: int | None = None) -> None:
        self.workdir = workdir or new_workdir("redis")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.process: ManagedProcess | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self, timeout: float = 20.0) -> "RedisServer":
        argv = [redis_binary(), "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir)]
        self.process = ManagedProcess("redis", argv, self.workdir / "redis.log")
        self.process.start()

        def ready():
            self.process.check_alive()
            return self.command("PING") == "PONG"

        wait_until(ready, timeout, desc=f"redis-server on {self.port} answers PING")
        return self

    def command(self, *args: str, timeout: float = 2.0) -> Any:
        """One RESP command over a fresh connection; the decoded reply."""
        import socket

        payload = f"*{len(args)}\r\n".encode() + b"".join(
            f"${len(a.encode())}\r\n".encode() + a.encode() + b"\r\n" for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as sock:
            sock.sendall(payload)
            reader = sock.makefile("rb")
            return _resp_reply(reader)

    def keys(self, pattern: str) -> list[str]:
        return self.command("KEYS", pattern)

    def kill(self) -> None:
        assert self.process is not None
        self.process.proc.kill()
        self.process.proc.wait(timeout=10)
        self.process.stopped_at = time.time()

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections but answers nothing (a hung Redis)."""
        assert self.process is not None
        self.process.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.process is not None
        self.process.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.alive():
            self.resume()
            self.process.stop()


def _resp_reply(reader) -> Any:
    line = reader.readline()
    if not line:
        raise HarnessError("redis closed the connection")
    kind, rest = line[:1], line[1:].rstrip(b"\r\n")
    if kind in (b"+", b"-"):
        text = rest.decode()
        if kind == b"-":
            raise HarnessError(f"redis error: {text}")
        return text
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = reader.read(n + 2)[:n]
        return data.decode("utf-8", "replace")
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [_resp_reply(reader) for _ in range(n)]
    raise HarnessError(f"unexpected redis reply {line!r}")


# --------------------------------------------------------------------------------------------
# Envoy

_base_ids = itertools.count(1)


def load_envoy_template() -> dict[str, Any]:
    return yaml.safe_load(ENVOY_TEMPLATE.read_text())


def _hcm(listener: dict[str, Any]) -> dict[str, Any]:
    for f in listener["filter_chains"][0]["filters"]:
        if f["name"] == "envoy.filters.network.http_connection_manager":
            return f["typed_config"]
    raise HarnessError("listener without HCM")


def patch_envoy_config(cfg: dict[str, Any], *, kvpick_port: int, secure: bool,
                       subset_hints: dict[str, Any] | None = None,
                       access_log: Path | None = None) -> dict[str, Any]:
    """Returns a copy of the reference config for a test run.

    ``subset_hints``: listener name -> value placed in dynamic metadata
    ``envoy.lb.subset_hint`` / ``x-gateway-destination-endpoint-subset`` by a set_metadata filter
    in front of ext_proc (a list of strings, or one comma-separated string)."""
    cfg = copy.deepcopy(cfg)
    cfg["admin"]["address"]["socket_address"].update(address="127.0.0.1", port_value=0)
    listeners = cfg["static_resources"]["listeners"]
    main = next(l for l in listeners if l["name"] == MAIN_LISTENER)
    main["address"]["socket_address"].update(address="127.0.0.1", port_value=0)
    if access_log is not None:
        _hcm(main)["access_log"] = [{
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                "path": str(access_log),
                "log_format": {"text_format_source": {"inline_string":
                    "[%START_TIME%] %DOWNSTREAM_LOCAL_ADDRESS% \"%REQ(:METHOD)% %REQ(:PATH)%\" "
                    "%RESPONSE_CODE% %RESPONSE_FLAGS% %RESPONSE_CODE_DETAILS% up=%UPSTREAM_HOST% "
                    "dst=%REQ(x-gateway-destination-endpoint)% "
                    "md=%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint)% "
                    "scores=%DYNAMIC_METADATA(envoy.lb:x-gateway-destination-endpoint-scores)% "
                    "in=%BYTES_RECEIVED% out=%BYTES_SENT% dur=%DURATION%ms\n"}},
            },
        }]
    for name, hint in (subset_hints or {}).items():
        extra = copy.deepcopy(main)
        extra["name"] = name
        hcm = _hcm(extra)
        hcm["stat_prefix"] = name
        set_md = {
            "name": "envoy.filters.http.set_metadata",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
                "metadata": [{"metadata_namespace": SUBSET_NAMESPACE,
                              "value": {SUBSET_KEY: hint}}],
            },
        }
        hcm["http_filters"].insert(0, set_md)
        listeners.append(extra)
    kv = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "kvpick")
    sa = kv["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    sa["socket_address"].update(address="127.0.0.1", port_value=kvpick_port)
    if not secure:
        kv.pop("transport_socket", None)
    return cfg


def replicas_config(kvpick_ports: list[int], secure: bool = False) -> dict[str, Any]:
    """Envoy in front of several kvpick replicas (docs/replicas.md): the ``kvpick`` cluster
    balances ext_proc streams round-robin over all of them, with gRPC health checks so a dead
    replica is taken out; and, for tests that must place a request on one replica, a listener
    ``via_replica_<i>`` per replica whose ext_proc calls only that one (cluster ``kvpick_<i>``)."""
    cfg = load_envoy_template()
    clusters = cfg["static_resources"]["clusters"]
    kv = next(c for c in clusters if c["name"] == "kvpick")
    if not secure:
        kv.pop("transport_socket", None)
    kv["health_checks"] = [{
        "timeout": "1s", "interval": "1s", "no_traffic_interval": "1s",
        "unhealthy_interval": "1s", "unhealthy_threshold": 1, "healthy_threshold": 1,
        "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
    }]

    def endpoint(port: int) -> dict[str, Any]:
        return {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1",
                                                            "port_value": port}}}}

    main = next(l for l in cfg["static_resources"]["listeners"] if l["name"] == MAIN_LISTENER)
    for i, port in enumerate(kvpick_ports):
        one = copy.deepcopy(kv)
        one["name"] = f"kvpick_{i}"
        one["load_assignment"] = {"cluster_name": one["name"],
                                  "endpoints": [{"lb_endpoints": [endpoint(port)]}]}
        clusters.append(one)
        listener = copy.deepcopy(main)
        listener["name"] = f"via_replica_{i}"
        listener["address"]["socket_address"].update(address="127.0.0.1", port_value=0)
        hcm = _hcm(listener)
        hcm["stat_prefix"] = listener["name"]
        ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
        ext["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = one["name"]
        cfg["static_resources"]["listeners"].append(listener)
    # patch_envoy_config (called by Envoy) sets the first endpoint; the others follow it.
    kv["load_assignment"]["endpoints"][0]["lb_endpoints"] = [endpoint(p) for p in kvpick_ports]
    return cfg


def healthy_hosts(envoy: "Envoy", cluster: str = "kvpick") -> set[str]:
    """``ip:port`` of the cluster's hosts Envoy's health checks pass."""
    _, text = http_get(f"http://{envoy.admin}/clusters")
    hosts = set()
    for line in text.splitlines():
        parts = line.split("::")
        if len(parts) == 4 and parts[0] == cluster and parts[2] == "health_flags" \
                and parts[3] == "healthy":
            hosts.add(parts[1])
    return hosts


class Replicas:
    """Several kvpick replicas (same catalog, same extra flags) behind one Envoy."""

    def __init__(self, workers: list[dict[str, Any]], n: int, *, name: str = "replicas",
                 extra_args: Iterable[str] = ()) -> None:
        self.workdir = new_workdir(name)
        self.kvpicks = [Kvpick(workers, workdir=self.workdir / f"kvpick-{i}", secure=False,
                               extra_args=list(extra_args)) for i in range(n)]
        for i, k in enumerate(self.kvpicks):
            k.process.label = f"kvpick-{i}"
        self.envoy: Envoy | None = None

    def start(self) -> "Replicas":
        try:
            for k in self.kvpicks:
                k.start()
            ports = [k.grpc_port for k in self.kvpicks]
            self.envoy = Envoy(kvpick_port=ports[0], secure=False, workdir=self.workdir / "envoy",
                               config=replicas_config(ports))
            self.envoy.start()
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, timeout: float = 30.0) -> None:
        want = {f"127.0.0.1:{k.grpc_port}" for k in self.kvpicks}
        wait_until(lambda: healthy_hosts(self.envoy) >= want, timeout,
                   desc="Envoy sees every kvpick replica healthy")

    def url(self, listener: str = MAIN_LISTENER) -> str:
        assert self.envoy is not None
        return self.envoy.url(listener)

    def via(self, i: int) -> str:
        return self.url(f"via_replica_{i}")

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        for k in self.kvpicks:
            k.stop()

    def __enter__(self) -> "Replicas":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


FALLBACK_CLUSTER = "inference_pool_fallback"


def failopen_config(pool_endpoints: list[str],
                    cfg: dict[str, Any] | None = None) -> dict[str, Any]:
    """The FailOpen wiring (docs/failure-modes.md): ``failure_mode_allow: true`` on ext_proc, and
    two routes instead of one. The first matches only when kvpick has set its pick in the
    dynamic metadata ``envoy.lb`` (which clients cannot forge) and goes to the ORIGINAL_DST
    cluster; kvpick's ``clear_route_cache`` makes Envoy re-match after the pick. The second,
    taken when kvpick is down (ext_proc skipped), sends the request to ``inference_pool_fallback``,
    a plain cluster over the pool's endpoints with Envoy's own least-request balancing, and drops
    any client-supplied destination header. ``pool_endpoints``: ``ip:port`` of every rank."""
    cfg = copy.deepcopy(cfg or load_envoy_template())
    main = next(l for l in cfg["static_resources"]["listeners"] if l["name"] == MAIN_LISTENER)
    hcm = _hcm(main)
    ext = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    ext["typed_config"]["failure_mode_allow"] = True
    vhost = hcm["route_config"]["virtual_hosts"][0]
    picked = copy.deepcopy(vhost["routes"][0])
    picked["match"]["dynamic_metadata"] = [{
        "filter": "envoy.lb",
        "path": [{"key": "x-gateway-destination-endpoint"}],
        "value": {"present_match": True},
    }]
    fallback = {
        "match": {"prefix": "/"},
        "route": {"cluster": FALLBACK_CLUSTER, "timeout": "0s"},
        "request_headers_to_remove": ["x-gateway-destination-endpoint"],
    }
    vhost["routes"] = [picked, fallback]
    lb_endpoints = []
    for ep in pool_endpoints:
        host, port = ep.rsplit(":", 1)
        lb_endpoints.append({"endpoint": {"address": {"socket_address": {
            "address": host, "port_value": int(port)}}}})
    # Envoy can fail open in FULL_DUPLEX_STREAMED only until it has streamed the first body chunk
    # to kvpick, and it streams the body at once, before an asynchronous connect to a dead kvpick
    # has failed. So Envoy must already KNOW kvpick is down when the request arrives: active gRPC
    # health checks mark the host unhealthy, and with panic routing off (threshold 0) the
    # ext_proc stream then fails synchronously, before any body is sent, and the filter fails
    # open. Between the crash and the next failed check requests still get the FailClose 500.
    kv = next(c for c in cfg["static_resources"]["clusters"] if c["name"] == "kvpick")
    kv["health_checks"] = [{
        "timeout": "1s",
        "interval": "1s",
        "no_traffic_interval": "1s",
        "no_traffic_healthy_interval": "1s",
        "unhealthy_interval": "1s",
        "unhealthy_threshold": 1,
        "healthy_threshold": 1,
        "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
    }]
    kv["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
    cfg["static_resources"]["clusters"].append({
        "name": FALLBACK_CLUSTER,
        "type": "STATIC",
        "lb_policy": "LEAST_REQUEST",
        "connect_timeout": "5s",
        "load_assignment": {"cluster_name": FALLBACK_CLUSTER,
                            "endpoints": [{"lb_endpoints": lb_endpoints}]},
    })
    return cfg


class Envoy:
    def __init__(self, *, kvpick_port: int, secure: bool = True,
                 subset_hints: dict[str, Any] | None = None, workdir: Path | None = None,
                 config: dict[str, Any] | None = None, log_level: str | None = None,
                 concurrency: int = 1) -> None:
        self.workdir = workdir or new_workdir("envoy")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / "envoy.yaml"
        self.admin_path = self.workdir / "admin-address.txt"
        self.access_log = self.workdir / "envoy-access.log"
        cfg = patch_envoy_config(config or load_envoy_template(), kvpick_port=kvpick_port,
                                 secure=secure, subset_hints=subset_hints,
                                 access_log=self.access_log)
        self.config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.listener_names = [l["name"] for l in cfg["static_resources"]["listeners"]]
        level = log_level or os.environ.get("E2E_ENVOY_LOG_LEVEL", "info")
        argv = [
            str(envoy_binary()), "-c", str(self.config_path),
            "--admin-address-path", str(self.admin_path),
            "--use-dynamic-base-id",
            "--base-id-path", str(self.workdir / "base-id.txt"),
            "--concurrency", str(concurrency),
            "-l", level,
            "--component-log-level", os.environ.get("E2E_ENVOY_COMPONENT_LOG", "ext_proc:debug"),
            "--drain-time-s", "1",
        ]
        self.process = ManagedProcess("envoy", argv, self.workdir / "envoy.log")
        self.admin: str | None = None
        self.listener_ports: dict[str, int] = {}

    def start(self, timeout: float = 30.0) -> "Envoy":
        self.process.start()

        def admin_ready():
            self.process.check_alive()
            if not self.admin_path.exists():
                return None
            addr = self.admin_path.read_text().strip()
            return addr or None

        self.admin = wait_until(admin_ready, timeout, desc="envoy admin address file")

        def listeners_ready():
            self.process.check_alive()
            status, text = http_get(f"http://{self.admin}/listeners?format=json")
            if status != 200:
                return None
            ports = {}
            for st in json.loads(text).get("listener_statuses", []):
                sa = st.get("local_address", {}).get("socket_address", {})
                if sa.get("port_value"):
                    ports[st["name"]] = int(sa["port_value"])
            if set(self.listener_names) <= set(ports):
                return ports
            return None

        self.listener_ports = wait_until(listeners_ready, timeout, desc="envoy listeners bound")
        wait_until(lambda: http_get(f"http://{self.admin}/ready")[0] == 200, timeout,
                   desc="envoy /ready")
        return self

    def url(self, listener: str = MAIN_LISTENER) -> str:
        return f"http://127.0.0.1:{self.listener_ports[listener]}"

    def stats(self, filter_re: str = "") -> dict[str, int]:
        _, text = http_get(f"http://{self.admin}/stats?filter={filter_re}")
        out = {}
        for line in text.splitlines():
            k, _, v = line.partition(": ")
            try:
                out[k] = int(v)
            except ValueError:
                pass
        return out

    def stop(self) -> int | None:
        return self.process.stop()


# --------------------------------------------------------------------------------------------
# both together


class Stack:
    """kvpick + Envoy in front of it. Upstreams are owned by the caller."""

    def __init__(self, workers: list[dict[str, Any]], *, secure: bool = True,
                 subset_hints: dict[str, Any] | None = None, name: str = "stack",
                 envoy_config: dict[str, Any] | None = None,
                 **kvpick_kwargs: Any) -> None:
        self.workdir = new_workdir(name)
        self.kvpick = Kvpick(workers, workdir=self.workdir / "kvpick", secure=secure,
                             **kvpick_kwargs)
        self.secure = secure
        self.subset_hints = subset_hints
        self.envoy_config = envoy_config
        self.envoy: Envoy | None = None

    def start(self) -> "Stack":
        try:
            self.kvpick.start()
            self.envoy = Envoy(kvpick_port=self.kvpick.grpc_port, secure=self.secure,
                               subset_hints=self.subset_hints, workdir=self.workdir / "envoy",
                               config=self.envoy_config)
            self.envoy.start()
        except BaseException:
            self.stop()
            raise
        return self

    def url(self, listener: str = MAIN_LISTENER) -> str:
        assert self.envoy is not None
        return self.envoy.url(listener)

    def stop(self) -> None:
        if self.envoy is not None:
            self.envoy.stop()
        self.kvpick.stop()

    def __enter__(self) -> "Stack":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def chat_body(model: str = "m1", content: str | None = None, stream: bool = False,
              **extra: Any) -> dict[str, Any]:
    """A chat-completions body with a unique prompt (so no KV-prefix overlap biases picks)."""
    body = {"model": model,
            "messages": [{"role": "user", "content": content or f"{uuid.uuid4().hex} hi"}]}
    if stream:
        body["stream"] = True
    body.update(extra)
    return body


def _main() -> None:
    """Manual demo: two fake ranks behind kvpick + Envoy; prints a curl line; Ctrl-C stops."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--h2c", action="store_true", help="kvpick serves h2c instead of TLS")
    args = ap.parse_args()
    ups = [Upstream("rank0").start(), Upstream("rank1").start()]
    stack = Stack([worker("w0", ports=[u.port for u in ups])], secure=not args.h2c, name="demo")
    stack.start()
    try:
        print(f"envoy:   {stack.url()}   (admin http://{stack.envoy.admin})")
        print(f"kvpick:  ports {stack.kvpick.ports}   metrics "
              f"http://127.0.0.1:{stack.kvpick.metrics_port}/metrics")
        print(f"ranks:   {[u.endpoint for u in ups]}   logs under {stack.workdir}")
        print(f"try:     curl -s {stack.url()}/v1/chat/completions -H 'content-type: application/json' "
              "-d '{\"model\":\"m1\",\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}]}'")
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        stack.stop()
        for u in ups:
            u.stop()


if __name__ == "__main__":
    _main()
