"""The load both soaks drive (e2e/soak.py, the steady soak; e2e/soak_adversarial.py, the attacks
with good traffic beside them): the streaming upstreams, the request body, the loadgen run that
samples kvpick's RSS, and the in-flight bookings left afterwards. Imports neither soak, so each can
use it without the two importing each other.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
from bench_overhead import LOADGEN, proc_status_kb  # noqa: E402


def start_upstreams() -> tuple[subprocess.Popen, list[int]]:
    """The soak's four streaming upstreams (loadgen, 8 events 25 ms apart) and their ports."""
    up = subprocess.Popen([str(LOADGEN), "upstream", "--count", "4", "--events", "8",
                           "--event-ms", "25"], stdout=subprocess.PIPE, text=True,
                          preexec_fn=harness._die_with_parent)
    return up, [int(p) for p in up.stdout.readline().split()[1].split(",")]


def write_body(prefix: str) -> Path:
    """The request body loadgen sends, in a fresh work directory: a shared system prompt plus a
    unique user turn, so bookings, index inserts and lookups all work."""
    body = harness.new_workdir(prefix) / "body.json"
    body.write_text(json.dumps({
        "model": "m1", "stream": True,
        "messages": [{"role": "system", "content": "You are terse. " * 200},
                     {"role": "user", "content": "question REQ"}],
    }, separators=(",", ":")).replace("REQ", "{n}"))
    return body


def drive(stack: harness.Stack, body: Path, seconds: float, rate: float, sample_every: float,
          loadgen_args: list[str]) -> tuple[dict, list[tuple[float, int]], float]:
    """Runs loadgen against the stack, sampling kvpick's RSS every `sample_every` s; returns the
    load report, the samples (seconds since start, KiB) and the clock's start."""
    pid = stack.kvpick.process.pid
    gen = subprocess.Popen(
        [str(LOADGEN), "run", "--url", stack.url() + "/v1/chat/completions",
         "--body", str(body), "--seconds", str(seconds), "--rate", str(rate)] + loadgen_args,
        stdout=subprocess.PIPE, text=True)
    start = time.monotonic()
    samples: list[tuple[float, int]] = []
    while gen.poll() is None:
        samples.append((time.monotonic() - start, proc_status_kb(pid, "VmRSS")))
        try:
            gen.wait(timeout=sample_every)
        except subprocess.TimeoutExpired:
            pass
    return json.loads(gen.stdout.read()), samples, start


def bookings_left(stack: harness.Stack) -> float:
    """In-flight bookings once they had 30 s to come back (aborted streams end on kvpick's side
    when Envoy resets them); a count above 0 is the caller's failure to report."""
    try:
        harness.wait_until(lambda: stack.kvpick.metric("kvpick_inflight_total") == 0, 30,
                           desc="in-flight bookings back to 0")
    except TimeoutError:
        pass
    return stack.kvpick.metric("kvpick_inflight_total")
