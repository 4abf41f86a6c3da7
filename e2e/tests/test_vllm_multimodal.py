"""Real vLLM serving a multimodal model: two engines with the tiny LLaVA of
`e2e/vllm/tiny_llava.py` (random weights, `--load-format dummy`; 64 placeholder tokens per image),
kvpick given its directory, requests with images through Envoy. kvpick must predict exactly the
cached tokens the engines report (its keys for the image blocks equal the engines' `extra_keys`),
route a repeated image to the engine holding it, and never credit another image's blocks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import harness
import vllm_engine
from vllm_engine import BLOCK
from vllm_support import envoy_config_with_upstream_header, send

CHAT = "/v1/chat/completions"
LLAVA = "llava"
FIXTURES = harness.REPO_DIR / "tests/fixtures/kv_events/multimodal"
ERROR = "kvpick_cache_prediction_error_tokens"


def image(name: str) -> str:
    return "data:image/png;base64," + (FIXTURES / f"{name}.b64").read_text()


def body(text: str, *images: str) -> dict:
    content = [{"type": "text", "text": text}]
    content += [{"type": "image_url", "image_url": {"url": image(i)}} for i in images]
    return {"model": LLAVA, "messages": [{"role": "user", "content": content}]}


@pytest.fixture(scope="module")
def llava_dir() -> Path:
    out = harness.new_workdir("llava-model")
    subprocess.run([sys.executable, str(harness.REPO_DIR / "e2e/vllm/tiny_llava.py"), str(out)],
                   check=True)
    return out


@pytest.fixture(scope="module")
def llava_pair(kvpick_bin, llava_dir):
    why = vllm_engine.vllm_available()
    if why:
        pytest.fail(f"the real-engine tier cannot run: {why}. The e2e suite never skips.",
                    pytrace=False)
    args = ["--model", str(llava_dir), "--served-model-name", LLAVA, "--load-format", "dummy",
            "--limit-mm-per-prompt", '{"image": 2}', "--max-model-len", "2048"]
    engines = [vllm_engine.VllmEngine(f"llava-{n}", cpu=c, extra_args=args)
               for n, c in (("a", 0), ("b", 1))]
    for e in engines:
        e.start(wait=False)
    for e in engines:
        e.wait_ready(timeout=600)
    yield engines
    for e in engines:
        e.stop()


@pytest.fixture(scope="module")
def llava_stack(llava_pair, llava_dir):
    config = harness.new_workdir("llava-tokenizer") / "tokenizers.yaml"
    # vLLM hashes images with its `--model` (the directory's path): `engine_model` says so.
    config.write_text(f"tokenizers:\n  - model: {LLAVA}\n    tokenizer_dir: {llava_dir}\n"
                      f"    engine_model: {llava_dir}\n")
    stack = harness.Stack([e.catalog_entry(model=LLAVA) for e in llava_pair], secure=False,
                          name="vllm-llava", envoy_config=envoy_config_with_upstream_header(),
                          extra_args=["--tokenizer-config", str(config)])
    stack.start()
    harness.wait_until(lambda: (stack.kvpick.metric("kvpick_kv_subscriptions") or 0) >= 2, 30,
                       desc="kvpick subscribed to both engines")
    yield stack
    stack.stop()


def test_image_requests_are_predicted_exactly_and_follow_their_image(llava_stack, llava_pair,
                                                                     client):
    for e in llava_pair:
        e.reset_prefix_cache()
    kv, url = llava_stack.kvpick, llava_stack.url()
    question = "what is in this picture? describe it in detail please, every part of it"
    rows = []

    def ask(name, b):
        served = send(client, url, CHAT, b)
        assert served.status == 200, served.body
        rows.append((name, served.upstream, served.prompt_tokens, served.cached))
        return served

    first = ask("red", body(question, "red"))
    # The same image and text again: routed to the engine that holds it, served from its cache
    # (the image sits in block 0, so any hit means the image's blocks matched).
    again = ask("red again", body(question, "red"))
    assert again.upstream == first.upstream, rows
    assert again.cached == (again.prompt_tokens - 1) // BLOCK * BLOCK > 0, rows
    # Another image, the same text: nothing of the first image's blocks is reused anywhere.
    other = ask("blue", body(question, "blue"))
    assert other.cached == 0, rows
    # Two images, the first the cached one: the engine holding it reuses block 0 (the red image
    # starts there), and kvpick sends it there.
    both = ask("red+blue", body("compare these two pictures", "red", "blue"))
    assert both.upstream == first.upstream, rows
    # Every response: kvpick's predicted cached tokens equal the engine's (cache-view accuracy).
    samples = kv.metrics()
    buckets = {labels.get("le"): v for n, labels, v in samples if n == ERROR + "_bucket"}
    total = int(harness.metric_sum(samples, ERROR + "_count") or 0)
    exact = int(buckets.get("0", 0) - buckets.get("-1", 0))
    assert total == len(rows) and exact == total, (total, exact, rows)
    assert (kv.metric("kvpick_tokenize_total", model=LLAVA, outcome="fallback") or 0) == 0
