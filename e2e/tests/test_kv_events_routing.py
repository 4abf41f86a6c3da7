"""Precise KV-aware routing end to end: a rank announces a prefix through real ZeroMQ KV events
(pyzmq + msgspec, encoded as vLLM does); requests through Envoy that share the prefix go to that
rank, unrelated requests spread by load."""

from __future__ import annotations

import json

from harness import wait_until, worker
from kv_events.publisher import KvEventPublisher

COMPLETIONS = "/v1/completions"
JSON_CT = {"content-type": "application/json"}
BLOCK = 16


def served_port(client, url: str, prompt: list[int]) -> int:
    r = client.post(url + COMPLETIONS, headers=JSON_CT,
                    content=json.dumps({"model": "m1", "prompt": prompt, "max_tokens": 1}))
    assert r.status_code == 200, r.text
    return r.json()["port"]


def test_rank_warmed_by_kv_events_attracts_its_prefix(make_stack, make_upstream, client):
    cold, warm = make_upstream("cold"), make_upstream("warm")
    with KvEventPublisher("tcp://127.0.0.1", "tcp://127.0.0.1") as pub:
        workers = [
            {**worker("cold", ports=[cold.port]), "block_size": BLOCK},
            {**worker("warm", ports=[warm.port]), "block_size": BLOCK,
             "kv_events": pub.endpoint, "kv_replay": pub.replay_endpoint},
        ]
        stack = make_stack(workers, secure=False, name="kvwarm")
        kv = stack.kvpick
        prefix = list(range(50_000, 50_000 + 16 * BLOCK))      # a 16-block shared prefix
        pub.store([7_000 + i for i in range(16)], token_ids=prefix, block_size=BLOCK)
        wait_until(lambda: (kv.metric("kvpick_kv_events_total", result="applied") or 0) >= 1, 20,
                   desc="kvpick applied the warm rank's BlockStored event")

        url = stack.url()
        shared = [served_port(client, url, prefix + [900_000 + i] * 5) for i in range(20)]
        assert shared == [warm.port] * 20, "every request sharing the announced prefix goes warm"

        unrelated = [served_port(client, url, [1_000_000 + 100 * i + t for t in range(64)])
                     for i in range(40)]
        assert {cold.port, warm.port} == set(unrelated), "unrelated prompts spread over both"

        # The engine evicts the prefix: new requests no longer have a reason to prefer the rank
        # beyond the short-lived predictions of the last picks (2 s), which the event-driven
        # index replaces; the index holds no event-sourced block of it any more.
        pub.remove([7_000 + i for i in range(16)])
        wait_until(lambda: (kv.metric("kvpick_kv_events_total", result="applied") or 0) >= 2, 20,
                   desc="kvpick applied the BlockRemoved event")
        assert (kv.metric("kvpick_kv_event_gaps_total") or 0) == 0
        assert (kv.metric("kvpick_kv_events_total", result="decode_error") or 0) == 0
