"""Real vLLM killed and restarted under kvpick (the last real-engine test of the pair: it leaves
both engines running again). A killed engine leaves the picks before clients see 503s, although
kvpick's index still says it holds the prompt best; a restarted engine's rank is cleared as soon as
kvpick sees the engine again, before any request reaches it."""

from __future__ import annotations

import time

import harness
from vllm_engine import BLOCK
from vllm_support import (envoy_config_with_upstream_header, predicted_blocks, reusable_blocks,
                          send, text)

COMPLETIONS = "/v1/completions"


def test_killed_engine_leaves_the_picks_and_restarted_one_is_cleared(vllm_pair, client):
    stack = harness.Stack([e.catalog_entry() for e in vllm_pair], secure=False,
                          name="vllm-restart", envoy_config=envoy_config_with_upstream_header())
    stack.start()
    try:
        kv, url = stack.kvpick, stack.url()
        harness.wait_until(lambda: (kv.metric("kvpick_kv_subscriptions") or 0) >= 2, 30,
                           desc="kvpick subscribed to both engines")
        prompt = text(800, 900)
        tokens = vllm_pair[0].tokenize({"prompt": prompt})
        first = send(client, url, COMPLETIONS, {"prompt": prompt})
        assert first.status == 200, first.body
        victim = next(e for e in vllm_pair if e.endpoint == first.upstream)
        survivor = next(e for e in vllm_pair if e is not victim)
        harness.wait_until(
            lambda: predicted_blocks(kv.grpc_port, tokens).get(victim.endpoint, 0)
            >= reusable_blocks(len(tokens)), 10, desc="kvpick indexed the victim's blocks")
        resets = kv.metric("kvpick_kv_resets_total") or 0

        # Killed: the index still names the victim as the prompt's best rank.
        killed_at = time.monotonic()
        victim.kill()
        harness.wait_until(
            lambda: kv.metric("kvpick_rank_unreachable", worker=victim.name) == 1, 10,
            interval=0.01, desc="kvpick reported the killed engine unreachable")
        out_after = time.monotonic() - killed_at
        assert out_after < 2.0, f"a killed engine left the picks only after {out_after:.2f}s"
        for i in range(5):
            served = send(client, url, COMPLETIONS, {"prompt": prompt + f" again{i}"})
            assert served.status == 200, f"request {i} after the kill: {served.status}"
            assert served.upstream == survivor.endpoint

        # Restarted on the same ports: an empty cache. kvpick must know before a request does.
        survivor_requests = survivor.metric("vllm:request_success_total") or 0
        victim.start()
        harness.wait_until(
            lambda: kv.metric("kvpick_rank_unreachable", worker=victim.name) == 0, 60,
            desc="the restarted engine is back in the picks")
        assert (kv.metric("kvpick_kv_resets_total") or 0) > resets, "the new run cleared the rank"
        assert predicted_blocks(kv.grpc_port, tokens).get(victim.endpoint, 0) == 0, \
            "kvpick still believes the restarted engine holds the old prompt"
        assert (victim.metric("vllm:request_success_total") or 0) == 0, \
            "no request reached the new engine before kvpick cleared its rank"
        assert (survivor.metric("vllm:request_success_total") or 0) == survivor_requests

        # And kvpick's view of the new engine is right again once it serves.
        harness.wait_until(lambda: (kv.metric("kvpick_kv_subscriptions") or 0) >= 2, 30,
                           desc="the new engine's events subscribed")
        fresh = text(801, 900)
        fresh_tokens = vllm_pair[0].tokenize({"prompt": fresh})
        rows = []
        for i in range(4):
            before = predicted_blocks(kv.grpc_port, fresh_tokens)
            served = send(client, url, COMPLETIONS, {"prompt": fresh})
            assert served.status == 200, served.body
            rows.append((served.upstream, min(before.get(served.upstream, 0),
                                              reusable_blocks(len(fresh_tokens))),
                         served.cached // BLOCK))
        assert all(p == c for _, p, c in rows[1:]), f"(rank, predicted, engine): {rows}"
    finally:
        stack.stop()
        for e in vllm_pair:
            if e.process is None or not e.process.alive():
                e.start()
