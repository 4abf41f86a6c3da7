"""Real vLLM, chat configured the way users configure it: kvpick is given the model directory
vLLM serves (`--tokenizer-dir tiny=DIR`: tokenizer.json, tokenizer_config.json with bos/eos and a
chat template using them) and nothing else. Its token ids must be the engine's own (`/tokenize`),
and chat turns must find, and be credited with, exactly the blocks the engine then serves."""

from __future__ import annotations

import json
import subprocess

import pytest

import harness
from vllm_engine import BLOCK, MODEL, MODEL_DIR
from vllm_support import (envoy_config_with_upstream_header, predicted_blocks, reusable_blocks,
                          send, text)

CHAT = "/v1/chat/completions"


def conversation(session: int, turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are agent. " + text(500, 300)}]
    for t in range(turns):
        messages.append({"role": "user", "content": text(600 + 10 * session + t, 120)})
        if t < turns - 1:
            messages.append({"role": "assistant", "content": text(700 + 10 * session + t, 40)})
    return messages


def kvpick_ids(bodies: list[dict]) -> list[list[int]]:
    out = subprocess.run(
        [str(harness.kvpick_binary()), "tokenize", "--tokenizer-dir", f"{MODEL}={MODEL_DIR}"],
        input="".join(json.dumps(b) + "\n" for b in bodies), capture_output=True, text=True,
        timeout=60)
    assert out.returncode == 0, out.stderr
    answers = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert len(answers) == len(bodies), out.stdout
    return [a.get("ids") for a in answers]


def test_kvpick_tokenizes_chat_and_completions_as_the_engine(vllm_pair):
    engine = vllm_pair[0]
    bodies = [{"model": MODEL, "messages": conversation(s, t), "add_generation_prompt": True}
              for s, t in ((1, 1), (2, 3))]
    bodies.append({"model": MODEL, "prompt": text(900, 200)})
    ours = kvpick_ids(bodies)
    for body, ids in zip(bodies, ours):
        theirs = engine.tokenize({k: v for k, v in body.items() if k != "model"})
        assert ids == theirs, f"kvpick's ids differ from vLLM's for {list(body)}"
    assert ours[0][0] == ours[2][0], "chat and completions both start with the model's BOS"


@pytest.fixture(scope="module")
def chat_stack(vllm_pair):
    stack = harness.Stack([e.catalog_entry() for e in vllm_pair], secure=False, name="vllm-chat",
                          envoy_config=envoy_config_with_upstream_header(),
                          extra_args=["--tokenizer-dir", f"{MODEL}={MODEL_DIR}"])
    stack.start()
    harness.wait_until(lambda: (stack.kvpick.metric("kvpick_kv_subscriptions") or 0) >= 2, 30,
                       desc="kvpick subscribed to both engines")
    yield stack
    stack.stop()


def test_chat_turns_are_predicted_and_served_from_cache(chat_stack, vllm_pair, client):
    """Sessions of growing chat turns: each later turn is routed to the rank holding its history,
    kvpick's predicted blocks there equal the engine-reported cached blocks."""
    for e in vllm_pair:
        e.reset_prefix_cache()
    kv, url = chat_stack.kvpick, chat_stack.url()
    rows = []
    for turn in range(1, 4):
        for session in range(3):
            messages = conversation(session, turn)
            tokens = vllm_pair[0].tokenize({"messages": messages, "add_generation_prompt": True})
            before = predicted_blocks(kv.grpc_port, tokens)
            served = send(client, url, CHAT, {"messages": messages})
            assert served.status == 200, served.body
            predicted = min(before.get(served.upstream, 0), reusable_blocks(len(tokens)))
            rows.append((session, turn, served.upstream, predicted, served.cached // BLOCK))
    later = [r for r in rows if r[1] > 1]
    assert all(r[4] > 0 for r in later), f"a later turn found no cached history: {rows}"
    agree = sum(r[3] == r[4] for r in rows)
    assert agree >= len(rows) - 1, f"(session, turn, rank, predicted, engine): {rows}"
    skipped = kv.metric("kvpick_tokenize_skipped_total") or 0
    assert skipped == 0, "every chat request was tokenized"
