"""Prefill/decode disaggregation end to end: client -> real Envoy -> ext_proc -> kvpick, which
picks a decode rank (the destination) and a prefill rank and names the prefill rank in llm-d's
(`x-prefiller-host-port`) or Dynamo's (`x-dynamo-prefill-*`) headers; the simulated decode worker
(`kvpick sim --role decode`) has the named prefill worker (`--role prefill`) run the prefill over
HTTP, pulls the blocks and decodes. Asserted from the sims' own response headers and metrics, and
kvpick's load gauges (both bookings freed once the response ended).

All waiting is on conditions with deadlines (port files, metrics)."""

from __future__ import annotations

import json

import pytest

import harness
from harness import wait_until, worker

COMPLETIONS = "/v1/completions"
JSON_CT = {"content-type": "application/json"}
MODEL = "kvpick-sim"
PROMPT = [10_000 + 3 * i for i in range(2048)]       # 128 blocks of 16: well over the threshold


class Sim:
    """One `kvpick sim` worker with a role, on ephemeral ports."""

    def __init__(self, role: str, extra: list[str] | None = None) -> None:
        self.workdir = harness.new_workdir(f"sim-{role}")
        self.port_file = self.workdir / "ports.json"
        argv = [str(harness.kvpick_binary()), "sim", "--workers", "1", "--role", role,
                "--base-port", "0", "--kv-events-port", "0", "--kv-replay-port", "0",
                "--speedup", "20", "--port-file", str(self.port_file)] + (extra or [])
        self.process = harness.ManagedProcess(f"sim-{role}", argv, self.workdir / "sim.log")

    def start(self) -> "Sim":
        self.process.start()

        def ready():
            self.process.check_alive()
            return json.loads(self.port_file.read_text()) if self.port_file.exists() else None

        self.ports = harness.wait_until(ready, 30, desc="kvpick sim port file")["workers"][0]
        return self

    @property
    def http(self) -> int:
        return self.ports["http"]

    def catalog_entry(self, name: str, role: str) -> dict:
        entry = worker(name, ports=[self.http], model=MODEL)
        entry["block_size"] = 16
        entry["kv_events"] = f"tcp://127.0.0.1:{self.ports['ranks'][0]['events']}"
        entry["kv_replay"] = f"tcp://127.0.0.1:{self.ports['ranks'][0]['replay']}"
        entry["role"] = role
        return entry

    def metric(self, name: str) -> float:
        status, text = harness.http_get(f"http://127.0.0.1:{self.http}/metrics")
        assert status == 200, text
        return harness.metric_sum(harness.parse_metrics(text), name) or 0.0

    def stop(self) -> None:
        self.process.stop()


@pytest.fixture
def sims():
    started: list[Sim] = []

    def make(role: str, extra: list[str] | None = None) -> Sim:
        s = Sim(role, extra).start()
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def completion(client, url: str, prompt: list[int]):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
    return client.post(url + COMPLETIONS, headers=JSON_CT, content=json.dumps(body))


def idle(kv) -> bool:
    return (kv.metric("kvpick_inflight_total") or 0) == 0


@pytest.mark.parametrize("protocol", ["llm-d", "dynamo"])
def test_a_long_prompt_is_prefilled_on_the_prefill_rank_and_decoded_on_the_decode_rank(
        protocol, sims, make_stack, client):
    prefill = sims("prefill")
    decode = sims("decode", ["--prefill-peer", f"sim-p=127.0.0.1:{prefill.http}"])
    workers = [prefill.catalog_entry("sim-p", "prefill"), decode.catalog_entry("sim-d", "decode")]
    # Idle ranks: splitting ties with prefilling locally when the transfer is free, and ties split.
    stack = make_stack(workers, secure=False, name=f"pd-{protocol}",
                       extra_args=["--pd-protocol", protocol, "--pd-transfer-block-cost", "0"])
    kv, url = stack.kvpick, stack.url()

    r = completion(client, url, PROMPT)
    assert r.status_code == 200, r.text
    h = r.headers
    assert h["x-sim-role"] == "decode", "Envoy routed to the decode rank"
    assert h["x-sim-prefill-host-port"] == f"127.0.0.1:{prefill.http}", h
    assert h["x-sim-prefill-worker"] == "0"
    assert h["x-sim-transferred-blocks"] == "128", "nothing was cached on the decode rank"
    assert r.json()["usage"]["completion_tokens"] == 4
    # The prefill worker ran the prompt (its engine saw its tokens), the decode worker admitted it.
    assert prefill.metric("vllm:prefix_cache_queries_total") == len(PROMPT)
    assert decode.metric("vllm:prefix_cache_queries_total") == len(PROMPT)
    wait_until(lambda: idle(kv), 10, desc="both bookings freed at stream end")
    assert (kv.metric("kvpick_active_prefill_tokens") or 0) == 0

    # A short prompt is prefilled on the decode rank: no prefill header reaches it.
    r = completion(client, url, [500_000 + i for i in range(64)])
    assert r.status_code == 200, r.text
    assert r.headers["x-sim-role"] == "decode"
    assert "x-sim-prefill-worker" not in r.headers
    assert prefill.metric("vllm:prefix_cache_queries_total") == len(PROMPT), "prefill untouched"
    wait_until(lambda: idle(kv), 10, desc="the booking freed")


def test_a_client_cannot_name_the_prefill_rank(sims, make_stack, client):
    """A spoofed `x-prefiller-host-port` is dropped by kvpick: the short prompt stays local."""
    prefill = sims("prefill")
    decode = sims("decode")
    workers = [prefill.catalog_entry("sim-p", "prefill"), decode.catalog_entry("sim-d", "decode")]
    stack = make_stack(workers, secure=False, name="pd-spoof")
    body = {"model": MODEL, "prompt": [700_000 + i for i in range(64)], "max_tokens": 2}
    r = client.post(stack.url() + COMPLETIONS, content=json.dumps(body),
                    headers={**JSON_CT, "x-prefiller-host-port": f"127.0.0.1:{prefill.http}"})
    assert r.status_code == 200, r.text
    assert r.headers["x-sim-role"] == "decode"
    assert "x-sim-prefill-worker" not in r.headers
    assert prefill.metric("vllm:prefix_cache_queries_total") == 0
