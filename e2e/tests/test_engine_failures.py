"""End-to-end: an engine that fails its requests loses its traffic (kvpick's outlier detection,
real Envoy 1.40 in front).

Four workers; one answers every request with an instant 503. kvpick reads each response's
`:status`: after five 503s in a row it ejects that rank, so after the first 10 requests at most 5%
reach it while it fails. When it recovers, the half-open probe after the ejection time returns it,
and it takes traffic again within two backoff periods.
"""
from __future__ import annotations

import json
import time

from harness import FailingEngine, chat_body, wait_until, worker

CHAT = "/v1/chat/completions"
JSON_CT = {"content-type": "application/json"}
BASE_EJECTION = 2.0


def post(client, stack) -> int:
    r = client.post(stack.url() + CHAT, content=json.dumps(chat_body()), headers=JSON_CT)
    return r.status_code


def test_a_failing_engine_is_ejected_and_returns_after_it_recovers(make_stack, make_upstream,
                                                                     client):
    healthy = [make_upstream(f"ok{i}") for i in range(3)]
    broken = FailingEngine()
    try:
        workers = [worker(f"ok{i}", ports=[u.port]) for i, u in enumerate(healthy)]
        workers.append(worker("broken", ports=[broken.port]))
        stack = make_stack(workers, secure=False, name="outlier",
                           extra_args=["--outlier-base-ejection-secs", str(BASE_EJECTION)])
        kv = stack.kvpick
        for _ in range(10):
            post(client, stack)
        before = broken.count()
        # After the first 10 requests, while it fails: at most 5% reach it (the rest of its run
        # of five 503s, then one half-open probe per ejection).
        statuses = [post(client, stack) for _ in range(100)]
        reached = broken.count() - before
        assert kv.metric("kvpick_outlier_ejected_ranks") == 1, "the failing rank is ejected"
        assert reached <= 5, f"{reached} of 100 requests reached the failing engine"
        assert statuses.count(200) >= 95, statuses
        assert kv.metric("kvpick_upstream_responses_total", worker="broken", **{"class": "5xx"}) >= 5
        assert kv.metric("kvpick_outlier_ejections_total", worker="broken") >= 1

        # Recovered: within two backoff periods (its next ejection is at most 2 x base) a probe
        # succeeds and it takes traffic again.
        broken.failing = False
        recovered_at = time.monotonic()

        def serves_again():
            before = broken.count(status=200)
            for _ in range(8):
                post(client, stack)
            return broken.count(status=200) > before

        wait_until(serves_again, 4 * BASE_EJECTION + 10, desc="the recovered engine serves again")
        assert time.monotonic() - recovered_at <= 2 * (2 * BASE_EJECTION) + 5
        wait_until(lambda: kv.metric("kvpick_outlier_ejected_ranks") == 0, 10,
                   desc="no rank ejected")
        wait_until(lambda: kv.metric("kvpick_inflight_total") == 0, 10, desc="no booking left")
    finally:
        broken.stop()


def test_envoys_own_connect_failure_reply_counts_against_the_picked_rank(make_stack, make_upstream,
                                                                          client):
    """A worker nothing listens on: Envoy answers 503 "upstream connect error" itself, and that
    local reply reaches kvpick's response path of the routed request (Envoy 1.40), so the rank
    is ejected like an engine answering 503."""
    from harness import free_port

    healthy = [make_upstream(f"ok{i}") for i in range(3)]
    workers = [worker(f"ok{i}", ports=[u.port]) for i, u in enumerate(healthy)]
    workers.append(worker("dead", ports=[free_port()]))
    stack = make_stack(workers, secure=False, name="connect-failure",
                       extra_args=["--outlier-base-ejection-secs", str(BASE_EJECTION)])
    kv = stack.kvpick
    answers = []
    for _ in range(110):
        r = client.post(stack.url() + CHAT, content=json.dumps(chat_body()), headers=JSON_CT)
        answers.append((r.status_code, r.text))
    refused = [i for i, (status, text) in enumerate(answers)
               if status == 503 and "upstream connect error" in text]
    assert len(refused) >= 5, f"the dead port was picked only {len(refused)} times"
    assert all(s == 200 for i, (s, _) in enumerate(answers) if i not in refused), answers
    assert kv.metric("kvpick_outlier_ejected_ranks") == 1, "the dead rank is ejected"
    assert kv.metric("kvpick_upstream_responses_total", worker="dead",
                     **{"class": "5xx"}) == len(refused)
    late = [i for i in refused if i >= 10]
    assert len(late) <= 5, f"after the first 10, {len(late)} of 100 requests went to it: {refused}"
