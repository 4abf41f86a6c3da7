"""Flow control through a real Envoy (issue: flow control): requests wait in kvpick while every
rank is saturated, and come out by priority; the queue timeout answers 503 (429 for sheddable
requests); a client that disconnects while queued leaves the queue at once; and an overloaded
``kvpick sim`` fleet serves its high band first.

Saturation is made exact with ``--saturation-max-requests 1`` on one fake upstream, whose
responses a test holds open with a Gate. Every wait is on a condition with a deadline (metrics,
gates, the upstream's received list)."""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import httpx

import harness
from harness import Gate, chat_body, wait_until, worker

E2E_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(E2E_DIR / "replay"))

import online  # noqa: E402

CHAT = "/v1/chat/completions"
JSON_CT = {"content-type": "application/json"}


def metric(kv, name: str, **labels: str) -> float:
    return kv.metric(name, **labels) or 0.0


def bands_config() -> str:
    """A --flow-config defining the bands these tests use: client priorities are clamped to the
    bands objectives define (0 and -1 always exist)."""
    path = harness.new_workdir("flow-bands") / "flow.yaml"
    path.write_text("objectives:\n  - {name: high, priority: 7}\n  - {name: urgent, priority: 5}\n")
    return str(path)


def one_slot_stack(make_stack, up, timeout: float = 30.0):
    return make_stack([worker("w", ports=[up.port])], secure=False, name="flow",
                      extra_args=["--saturation-max-requests", "1",
                                  "--queue-timeout", str(timeout),
                                  "--flow-config", bands_config()])


def hold_the_rank(stack, client, gate):
    """Starts a streamed request the upstream holds after its first event (the rank's one slot)."""
    done = threading.Event()

    def run():
        with client.stream("POST", stack.url() + CHAT, content=json.dumps(chat_body(stream=True)),
                           headers={**JSON_CT, **gate.headers()}) as resp:
            assert resp.status_code == 200
            for _ in resp.iter_lines():
                pass
        done.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert gate.first_sent.wait(20), "the holding request never reached the upstream"
    return t, done


def post_in_background(url: str, headers: dict, results: dict, key: str, timeout: float = 60.0):
    def run():
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(timeout)) as c:
            try:
                r = c.post(url + CHAT, content=json.dumps(chat_body()), headers={**JSON_CT, **headers})
                results[key] = (r.status_code, r.text)
            except httpx.HTTPError as e:  # the disconnect test's client gives up
                results[key] = (None, repr(e))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def queued(kv) -> float:
    return sum(v for name, _, v in kv.metrics() if name == "kvpick_queue_depth")


def test_queued_streams_are_released_by_priority(make_stack, make_upstream, client):
    up = make_upstream("slot")
    stack = one_slot_stack(make_stack, up)
    kv = stack.kvpick
    gate = Gate()
    holder, holder_done = hold_the_rank(stack, client, gate)
    results: dict = {}
    threads = [post_in_background(stack.url(), {"x-dynamo-request-priority": "-1",
                                                "x-request-id": "low"}, results, "low")]
    wait_until(lambda: queued(kv) == 1, 20, desc="the sheddable request waits in kvpick")
    threads.append(post_in_background(stack.url(), {"x-dynamo-request-priority": "0",
                                                    "x-request-id": "normal"}, results, "normal"))
    wait_until(lambda: queued(kv) == 2, 20, desc="the normal request waits too")
    threads.append(post_in_background(stack.url(), {"x-dynamo-request-priority": "7",
                                                    "x-request-id": "high"}, results, "high"))
    wait_until(lambda: queued(kv) == 3, 20, desc="and the high one")
    assert up.count() == 1, "nothing queued reached the upstream"
    gate.release.set()
    for t in threads:
        t.join(30)
    holder.join(30)
    assert holder_done.is_set()
    assert {k: v[0] for k, v in results.items()} == {"low": 200, "normal": 200, "high": 200}
    order = [r.headers.get("x-request-id") for r in up.received()[1:]]
    assert order == ["high", "normal", "low"], order
    assert metric(kv, "kvpick_queue_depth", priority="7") == 0
    wait_until(lambda: metric(kv, "kvpick_inflight_total") == 0, 20, desc="every booking freed")
    # Waits are recorded per band and fairness key.
    assert metric(kv, "kvpick_queue_wait_seconds_count", priority="-1", fairness="default") == 1


def test_the_queue_timeout_answers_503_and_429_for_sheddable(make_stack, make_upstream, client):
    up = make_upstream("slot")
    stack = one_slot_stack(make_stack, up, timeout=1.0)
    kv = stack.kvpick
    gate = Gate()
    holder, _ = hold_the_rank(stack, client, gate)
    normal = client.post(stack.url() + CHAT, content=json.dumps(chat_body()), headers=JSON_CT)
    assert normal.status_code == 503, normal.text
    assert "queue timeout" in normal.text, normal.text
    shed = client.post(stack.url() + CHAT, content=json.dumps(chat_body()),
                       headers={**JSON_CT, "x-dynamo-request-priority": "-2"})
    assert shed.status_code == 429, shed.text
    assert "sheddable" in shed.text, shed.text
    assert metric(kv, "kvpick_queue_rejected_total", priority="0", reason="timeout") == 1
    # -2 names no band: it is queued in the sheddable band -1.
    assert metric(kv, "kvpick_queue_rejected_total", priority="-1", reason="timeout") == 1
    assert up.count() == 1
    gate.release.set()
    holder.join(30)


def test_a_client_that_disconnects_while_queued_leaves_the_queue(make_stack, make_upstream, client):
    up = make_upstream("slot")
    stack = one_slot_stack(make_stack, up)
    kv = stack.kvpick
    gate = Gate()
    holder, _ = hold_the_rank(stack, client, gate)
    results: dict = {}
    gone = post_in_background(stack.url(), {"x-request-id": "gone"}, results, "gone", timeout=1.0)
    gone.join(20)
    assert results["gone"][0] is None, results  # the client gave up while queued
    wait_until(lambda: metric(kv, "kvpick_queue_rejected_total", priority="0",
                              reason="cancelled") == 1, 20,
               desc="kvpick took the request out of the queue when Envoy reset its stream")
    assert queued(kv) == 0
    gate.release.set()
    holder.join(30)
    # The rank freed with nobody waiting: the gone request was never routed.
    after = client.post(stack.url() + CHAT, content=json.dumps(chat_body()),
                        headers={**JSON_CT, "x-request-id": "after"})
    assert after.status_code == 200
    assert [r.headers.get("x-request-id") for r in up.received()[1:]] == ["after"]
    wait_until(lambda: metric(kv, "kvpick_inflight_total") == 0, 20, desc="no booking leaked")


def test_an_overloaded_sim_fleet_serves_the_high_band_first(make_stack, client):
    """Two simulated ranks, 24 requests at once (several times what they serve without queueing):
    the 8 high-priority ones all come out of kvpick's queue before any sheddable one."""
    sim = online.Sim(workers=2, speedup=1.0).start()
    try:
        stack = make_stack(sim.catalog(), secure=False, name="flow-sim",
                           extra_args=["--saturation-max-requests", "2",
                                       "--flow-config", bands_config()])
        kv = stack.kvpick
        results: dict = {}
        threads = []
        order_lock = threading.Lock()
        finished: list[str] = []

        def send(key: str, priority: int):
            body = {"model": online.MODEL, "prompt": [7 + (hash(key) % 1000)] * 2048,
                    "max_tokens": 200}
            with httpx.Client(trust_env=False, timeout=httpx.Timeout(120.0)) as c:
                r = c.post(stack.url() + "/v1/completions", content=json.dumps(body),
                           headers={**JSON_CT, "x-dynamo-request-priority": str(priority),
                                    "x-request-id": key})
            results[key] = r.status_code
            with order_lock:
                finished.append(key)

        for i in range(16):
            threads.append(threading.Thread(target=send, args=(f"shed-{i}", -1), daemon=True))
        for t in threads:
            t.start()
        wait_until(lambda: queued(kv) == 12, 30, desc="the sheddable flood waits in kvpick")
        high = [threading.Thread(target=send, args=(f"high-{i}", 5), daemon=True) for i in range(8)]
        for t in high:
            t.start()
        for t in threads + high:
            t.join(120)
        assert all(code == 200 for code in results.values()), results
        assert len(results) == 24
        # Every high request finished before the last sheddable ones were even dispatched: the
        # 8 high ones are all among the first 8 + 4 (the ranks' 4 slots were busy with sheddable
        # requests when they arrived) + 4 (those dispatched as the high ones drained).
        last_high = max(finished.index(f"high-{i}") for i in range(8))
        assert last_high < 16, finished
        assert metric(kv, "kvpick_queue_wait_seconds_count", priority="5",
                      fairness="default") == 8
    finally:
        sim.stop()
