"""End-to-end: model rewrite (--flow-config rewrite rules) through a real Envoy 1.40.

The upstream must receive the rewritten body exactly (only the top-level `model` value changed),
with no stale content-length (Envoy drops it in FULL_DUPLEX_STREAMED), for bodies that grow,
shrink, and span several ext_proc chunks. All waiting is on conditions with deadlines."""

from __future__ import annotations

import hashlib
import json

from harness import worker

CHAT = "/v1/chat/completions"
JSON_CT = {"content-type": "application/json"}


def expected(body: bytes, old: str, new: str) -> bytes:
    needle = f'"model": {json.dumps(old)}'.encode()
    assert body.count(needle) == 1
    return body.replace(needle, f'"model": {json.dumps(new)}'.encode())


def test_rewritten_body_reaches_the_upstream_intact(make_stack, make_upstream, client, tmp_path):
    up = make_upstream()
    flow = tmp_path / "flow.yaml"
    flow.write_text(
        "rewrites:\n"
        "  - matches: [alias]\n"
        "    targets: [{model: m1-with-a-much-longer-name}]\n"
        "  - matches: [a-rather-long-alias-that-shrinks]\n"
        "    targets: [{model: m1}]\n"
    )
    s = make_stack([worker("w0", ports=[up.port], model="m1-with-a-much-longer-name"),
                    worker("w1", ports=[up.port], model="m1")],
                   extra_args=["--flow-config", str(flow)], name="rewrite")
    cases = [
        ("alias", "m1-with-a-much-longer-name", "hi"),
        ("a-rather-long-alias-that-shrinks", "m1", "hi"),
        ("alias", "m1-with-a-much-longer-name", "lorem ipsum " * 20_000),  # several 62 kB chunks
    ]
    for old, new, content in cases:
        body = json.dumps({"messages": [{"role": "user", "content": content, "model": "inner"}],
                           "model": old, "temperature": 0.25}).encode()
        resp = client.post(s.url() + CHAT, content=body, headers=JSON_CT)
        assert resp.status_code == 200, f"{resp.status_code}: {resp.text[:300]!r}"
        j = resp.json()
        want = expected(body, old, new)
        assert j["len"] == len(want), (old, j["len"], len(want))
        assert j["sha256"] == hashlib.sha256(want).hexdigest(), old
        cl = j["headers"].get("content-length")
        assert cl is None or int(cl) == len(want), f"stale content-length {cl} for {len(want)} bytes"

    # A model without a rule is forwarded byte-identical.
    body = json.dumps({"model": "m1", "messages": [{"role": "user", "content": "x"}]}).encode()
    j = client.post(s.url() + CHAT, content=body, headers=JSON_CT).json()
    assert j["sha256"] == hashlib.sha256(body).hexdigest()
