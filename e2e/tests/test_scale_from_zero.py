"""Scale from zero through a real Envoy (``--hold-when-no-endpoints``): with no worker in the
catalog kvpick stays ready (the gateway keeps calling it) and a request waits in its queue; when
a worker joins, the waiting request is routed to it. A request still waiting at
``--queue-timeout`` gets the queue-timeout 503. Every wait is on a condition with a deadline."""

from __future__ import annotations

import json
import threading

import httpx

from harness import chat_body, wait_until, worker

CHAT = "/v1/chat/completions"
JSON_CT = {"content-type": "application/json"}


def queue_length(kv) -> float:
    return kv.metric("kvpick_queue_length") or 0.0


def post_in_background(url: str, results: dict) -> threading.Thread:
    def run():
        with httpx.Client(trust_env=False, timeout=httpx.Timeout(60.0)) as c:
            r = c.post(url + CHAT, content=json.dumps(chat_body()), headers=JSON_CT)
            results["answer"] = (r.status_code, r.text)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def held_stack(make_stack, timeout: float):
    return make_stack([], secure=False, name="hold",
                      extra_args=["--hold-when-no-endpoints", "--queue-timeout", str(timeout)])


def test_a_request_waits_for_the_first_worker_and_is_routed_to_it(make_stack, make_upstream):
    s = held_stack(make_stack, 60.0)
    kv = s.kvpick
    wait_until(lambda: kv.health("readiness") == "SERVING", 20,
               desc="kvpick ready with an empty catalog (it holds requests)")
    results: dict = {}
    t = post_in_background(s.url(), results)
    wait_until(lambda: queue_length(kv) == 1, 20, desc="the request waits in kvpick's queue")
    assert "answer" not in results
    up = make_upstream("first")
    kv.write_catalog([worker("w0", ports=[up.port])])
    t.join(30)
    assert results["answer"][0] == 200, results
    assert up.count() == 1
    assert queue_length(kv) == 0


def test_a_request_still_waiting_at_the_timeout_gets_503(make_stack, client):
    s = held_stack(make_stack, 1.0)
    r = client.post(s.url() + CHAT, content=json.dumps(chat_body()), headers=JSON_CT)
    assert r.status_code == 503, r.text
    assert "queue timeout" in r.text, r.text
