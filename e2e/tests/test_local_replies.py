"""Envoy's own answers (local replies) through the ext_proc filter. When Envoy answers a request
itself before kvpick routed it (here: a client too slow to send its body hits the HCM's
`request_timeout`, 408), it still runs the reply's response path (headers, body) through
ext_proc; kvpick passes those messages through unchanged, so the client gets Envoy's status
instead of a reset, and nothing is booked."""

from __future__ import annotations

import json
import socket

import harness
from harness import chat_body, worker

CHAT = "/v1/chat/completions"
JSON_CT = {"content-type": "application/json"}


def read_all(port: int, data: bytes) -> bytes:
    """Sends `data` on a new connection and reads until Envoy closes it (bounded by 10 s)."""
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        while chunk := s.recv(65536):
            reply += chunk
    return reply


def test_envoy_request_timeout_reply_reaches_the_client(make_stack, make_upstream, client):
    up = make_upstream("slow-client")
    cfg = harness.load_envoy_template()
    main = next(l for l in cfg["static_resources"]["listeners"]
                if l["name"] == harness.MAIN_LISTENER)
    # Envoy answers 408 itself when the whole request has not arrived within this.
    harness._hcm(main)["request_timeout"] = "1s"
    stack = make_stack([worker("w0", ports=[up.port])], secure=False, name="local-reply",
                       envoy_config=cfg)
    kv = stack.kvpick
    body = json.dumps(chat_body()).encode()
    # Announce ten bytes more than are sent: the body never ends, kvpick never routes.
    partial = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
               b"content-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
               % (len(body) + 10, body))
    reply = read_all(stack.envoy.listener_ports[harness.MAIN_LISTENER], partial)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:300]
    assert b"request timeout" in reply, reply[:300]
    assert up.count() == 0, "never routed"
    assert (kv.metric("kvpick_extproc_streams_total", end="protocol_error") or 0) == 0
    assert (kv.metric("kvpick_inflight_total") or 0) == 0
    assert (kv.metric("kvpick_body_bytes_buffered") or 0) == 0
    r = client.post(stack.url() + CHAT, content=json.dumps(chat_body()), headers=JSON_CT)
    assert r.status_code == 200, r.text
