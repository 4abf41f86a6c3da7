"""SIGTERM during traffic: kvpick answers NOT_SERVING, stops taking new streams, lets open ones
finish, frees everything and exits 0 within the grace period."""

from __future__ import annotations

import json
import signal

from harness import Gate, chat_body, wait_until, worker

CHAT = "/v1/chat/completions"
JSON_CT = {"content-type": "application/json"}


def test_sigterm_drains_open_streams_and_refuses_new_ones(make_stack, make_upstream, client):
    up = make_upstream("drain")
    stack = make_stack([worker("w0", ports=[up.port])], secure=False, name="drain",
                       extra_args=["--shutdown-grace", "20"])
    kv = stack.kvpick
    gate = Gate()
    with client.stream("POST", stack.url() + CHAT, content=json.dumps(chat_body(stream=True)),
                       headers={**JSON_CT, **gate.headers()}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        next(l for l in lines if l.startswith("data:"))
        assert kv.metric("kvpick_inflight_total") == 1

        kv.process.proc.send_signal(signal.SIGTERM)
        # While draining, both gRPC ports keep answering: readiness NOT_SERVING (what the
        # kubelet and Envoy's health checks must see), liveness SERVING.
        wait_until(lambda: kv.health("readiness") == "NOT_SERVING"
                   and kv.health("readiness", port=kv.grpc_port) == "NOT_SERVING", 10,
                   desc="readiness NOT_SERVING on both ports after SIGTERM")
        assert kv.health("liveness") == "SERVING"
        # New requests are refused while the open stream is still running.
        def refused():
            r = client.post(stack.url() + CHAT, content=json.dumps(chat_body()), headers=JSON_CT)
            return r.status_code >= 500 and r.status_code
        status = wait_until(refused, 15, desc="new requests refused after SIGTERM")
        assert status in (500, 502, 503, 504), status
        assert kv.process.alive(), "kvpick waits for the open stream"
        assert not gate.final_sent.is_set()

        gate.release.set()
        events = [l[len("data:"):].strip() for l in lines if l.startswith("data:")]
    assert events[-1] == "[DONE]", "the open stream completed after SIGTERM"
    code = wait_until(lambda: (not kv.process.alive()) and kv.process.proc.returncode is not None
                      and ("exited", kv.process.proc.returncode), 20,
                      desc="kvpick exits once drained")
    assert code == ("exited", 0)
    log = kv.process.log_path.read_text()
    assert "shutting down" in log
    assert "grace period over" not in log, "drained before the grace period ended"
