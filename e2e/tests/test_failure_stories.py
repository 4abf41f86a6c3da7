"""The three failure stories of the production-hardening issue, through a real Envoy:

1. an engine restart must not leave a phantom cache (a worker whose KV events announced prefixes
   leaves the catalog and comes back with a fresh engine that announces nothing);
2. a flood of one-shot session ids must not lock new sessions out of affinity;
3. a long stream keeps its booking past --booking-ttl (only API bookings expire).

Every wait is on a condition with a deadline (metrics, the catalog reload counter, gates)."""

from __future__ import annotations

import json
import threading
import uuid

import grpc
import pytest

from harness import Gate, pb_field, wait_until, worker
from kv_events.publisher import KvEventPublisher

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON_CT = {"content-type": "application/json"}
BLOCK = 16


def metric(kv, name: str, **labels: str) -> float:
    return kv.metric(name, **labels) or 0.0


def reload_catalog(kv, workers) -> None:
    applied = metric(kv, "kvpick_catalog_reloads_total", result="applied")
    kv.write_catalog(workers)
    wait_until(lambda: metric(kv, "kvpick_catalog_reloads_total", result="applied") > applied,
               20, desc="kvpick applied the new catalog")


def test_an_engine_restart_leaves_no_phantom_cache(make_stack, make_upstream, client):
    cold, warm = make_upstream("cold"), make_upstream("warm")
    prefixes = [[1_000_000 * (p + 1) + t for t in range(8 * BLOCK)] for p in range(12)]
    with KvEventPublisher("tcp://127.0.0.1", "tcp://127.0.0.1") as old_engine:
        cold_w = {**worker("cold", ports=[cold.port]), "block_size": BLOCK}
        warm_w = {**worker("warm", ports=[warm.port]), "block_size": BLOCK,
                  "kv_events": old_engine.endpoint}
        stack = make_stack([cold_w, warm_w], secure=False, name="phantom")
        kv = stack.kvpick
        for p, tokens in enumerate(prefixes):
            old_engine.store([10_000 * (p + 1) + b for b in range(8)], token_ids=tokens,
                             block_size=BLOCK)
        wait_until(lambda: metric(kv, "kvpick_kv_events_total", result="applied") >= 12, 20,
                   desc="kvpick applied the 12 announced prefixes")
        # The pod goes away (e.g. OOM), and comes back with a fresh engine that announces nothing.
        reload_catalog(kv, [cold_w])
    with KvEventPublisher("tcp://127.0.0.1", "tcp://127.0.0.1") as new_engine:
        reload_catalog(kv, [cold_w, {**warm_w, "kv_events": new_engine.endpoint}])
        overlap_before = kv.metrics()
        landed = []
        for tokens in prefixes[:8]:
            r = client.post(stack.url() + COMPLETIONS, headers=JSON_CT, content=json.dumps(
                {"model": "m1", "prompt": tokens + [7], "max_tokens": 1}))
            assert r.status_code == 200, r.text
            landed.append(r.json()["port"])
        after = kv.metrics()

        def overlap_sum(samples):
            return sum(v for n, _, v in samples if n == "kvpick_predicted_overlap_ratio_sum")

        def picks(samples):
            return sum(v for n, _, v in samples if n == "kvpick_predicted_overlap_ratio_count")

        assert picks(after) - picks(overlap_before) == 8, "every pick was observed"
        assert overlap_sum(after) - overlap_sum(overlap_before) == 0.0, (
            f"picks still saw the old engine's blocks as cached (landed {landed})")


def test_a_session_id_flood_does_not_lock_new_sessions_out(make_stack, make_upstream, client):
    ups = [make_upstream("a"), make_upstream("b")]
    stack = make_stack([worker("w0", ports=[u.port for u in ups])], secure=False, name="flood",
                       extra_args=["--session-max-entries", "500"])
    url = stack.url()
    for i in range(1_200):
        sid = {"x-dynamo-session-id": f"oneshot-{i}"}
        if i % 2:
            r = client.get(url + "/v1/models", headers=sid)
        else:
            r = client.post(url + CHAT, headers={**JSON_CT, **sid}, content=json.dumps(
                {"model": "m1", "messages": [{"role": "user", "content": uuid.uuid4().hex}]}))
        assert r.status_code == 200, r.text
    sticky = 0
    for s in range(20):
        sid = {"x-dynamo-session-id": f"new-{s}-{uuid.uuid4().hex}"}
        ports = set()
        for _ in range(4):
            # Unrelated content every turn: only the binding can keep a session on its rank.
            r = client.post(url + CHAT, headers={**JSON_CT, **sid}, content=json.dumps(
                {"model": "m1", "messages": [{"role": "user", "content": uuid.uuid4().hex}]}))
            assert r.status_code == 200, r.text
            ports.add(r.json()["port"])
        sticky += len(ports) == 1
    assert sticky == 20, f"only {sticky} of 20 new sessions stayed on one rank"
    kv = stack.kvpick
    assert metric(kv, "kvpick_session_bindings") <= 500
    assert metric(kv, "kvpick_session_events_total", outcome="table_full") == 0


def test_a_long_stream_keeps_its_booking_past_the_booking_ttl(make_stack, make_upstream,
                                                               client):
    ups = [make_upstream("a"), make_upstream("b")]
    stack = make_stack([worker("w0", ports=[u.port for u in ups])], secure=False,
                       name="longstream", extra_args=["--booking-ttl", "1", "--selection-api"])
    kv = stack.kvpick
    gate = Gate(release_timeout=120)
    done = threading.Event()

    def stream():
        body = {"model": "m1", "stream": True,
                "messages": [{"role": "user", "content": uuid.uuid4().hex}]}
        with client.stream("POST", stack.url() + CHAT, content=json.dumps(body),
                           headers={**JSON_CT, **gate.headers()}) as resp:
            assert resp.status_code == 200
            for _ in resp.iter_lines():
                pass
        done.set()

    t = threading.Thread(target=stream, daemon=True)
    t.start()
    assert gate.first_sent.wait(20), "the stream never started"
    wait_until(lambda: metric(kv, "kvpick_inflight_total") == 1, 15, desc="the stream is booked")
    # An API booking made now expires after the 1 s TTL: once the reaper has taken it, the
    # reaper has also seen the (older) stream booking, which must survive.
    with grpc.insecure_channel(f"127.0.0.1:{kv.grpc_port}") as ch:
        reserve = ch.unary_unary("/kvpick.v1.Selection/SelectAndReserve",
                                 request_serializer=None, response_deserializer=None)
        reserve(pb_field(1, b"api-booking") + pb_field(2, b"m1"), timeout=10)
    wait_until(lambda: metric(kv, "kvpick_inflight_total") == 2, 15, desc="both booked")
    wait_until(lambda: metric(kv, "kvpick_bookings_expired_total") >= 1, 40,
               desc="the reaper expired the API booking")
    assert metric(kv, "kvpick_inflight_total") == 1, "the open stream lost its booking"
    gate.release.set()
    assert done.wait(30)
    t.join(5)
    wait_until(lambda: metric(kv, "kvpick_inflight_total") == 0, 15,
               desc="the stream's end freed its booking")
