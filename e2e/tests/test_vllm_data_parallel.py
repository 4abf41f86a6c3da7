"""Real vLLM with data parallelism: one server with `--data-parallel-size 2` behind one port (one
engine core per CPU core), its ranks multiplexed. kvpick subscribes to each rank's KV events (ports
offset by rank), names the rank it picks in `x-data-parallel-rank`, and vLLM's own per-engine
metrics confirm which rank served each request from cache."""

from __future__ import annotations

import pytest

import harness
from vllm_engine import BLOCK, VllmEngine
from vllm_support import envoy_config_with_upstream_header, send, text


@pytest.fixture(scope="module")
def dp_engine(vllm_pair):
    # The pair stays up but idle; the DP engine's two cores are the machine's two cores.
    engine = VllmEngine("dp", cpu=0, dp_size=2)
    engine.start()
    yield engine
    engine.stop()


def test_kvpick_chooses_the_rank_and_the_engine_agrees(dp_engine, client):
    stack = harness.Stack([dp_engine.catalog_entry()], secure=False, name="vllm-dp",
                          envoy_config=envoy_config_with_upstream_header())
    stack.start()
    try:
        kv, url = stack.kvpick, stack.url()
        harness.wait_until(lambda: (kv.metric("kvpick_kv_subscriptions") or 0) >= 2, 30,
                           desc="one KV-event subscription per data-parallel rank")
        hits_before = {r: dp_engine.metric("vllm:prefix_cache_hits_total", engine=str(r)) or 0
                       for r in (0, 1)}
        cached_by_rank = {"0": 0, "1": 0}
        rows = []
        for i in range(16):
            group = 400 + i % 4
            prompt = text(group, 700) + " " + text(4000 + i, 30)
            tokens = dp_engine.tokenize({"prompt": prompt})
            served = send(client, url, "/v1/completions", {"prompt": prompt})
            assert served.status == 200, served.body
            assert served.dp_rank in cached_by_rank, f"no rank named: {served.dp_rank!r}"
            cached_by_rank[served.dp_rank] += served.cached
            rows.append((i, served.dp_rank, len(tokens), served.cached // BLOCK))
        assert {r[1] for r in rows} == {"0", "1"}, f"both ranks used: {rows}"
        # vLLM's per-engine prefix-cache hits: exactly the cached tokens of the requests
        # kvpick sent to that rank.
        for r in (0, 1):
            hits = (dp_engine.metric("vllm:prefix_cache_hits_total", engine=str(r)) or 0) \
                - hits_before[r]
            assert hits == cached_by_rank[str(r)], (r, hits, cached_by_rank, rows)
        # Followers of a prefix went to the rank holding it: the engine served their prefixes.
        followers = rows[4:]
        assert all(r[3] * BLOCK >= 0.8 * r[2] for r in followers), rows
    finally:
        stack.stop()
