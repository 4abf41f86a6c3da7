"""The three ways kvpick's view of a real vLLM's cache goes silently wrong, each caught by the
cache-view accuracy metrics (kvpick's predicted cached tokens against the engine's
`usage.prompt_tokens_details.cached_tokens`): a chat template rendered without the model's BOS, a
declared block size that is not the engine's, and KV events that never arrive. The healthy
configuration is the control: every comparable response agrees."""

from __future__ import annotations

import json
import time

import harness
from vllm_engine import MODEL, MODEL_DIR
from vllm_support import envoy_config_with_upstream_header, send, text

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
ERROR = "kvpick_cache_prediction_error_tokens"
DRIFT = "kvpick_cache_prediction_drift_tokens"


def accuracy(kv) -> tuple[int, int, dict[str, float]]:
    """(comparable responses, exact agreements, drift per worker) from kvpick's /metrics."""
    samples = kv.metrics()
    buckets = {labels.get("le"): value for name, labels, value in samples
               if name == ERROR + "_bucket"}
    total = int(harness.metric_sum(samples, ERROR + "_count") or 0)
    exact = int(buckets.get("0", 0) - buckets.get("-1", 0))
    drift = {labels["worker"]: value for name, labels, value in samples if name == DRIFT}
    return total, exact, drift


class Seen:
    """What kvpick exported and logged by the end of a run (read before it stops)."""

    def __init__(self, samples, log: str) -> None:
        self.samples, self.log = samples, log

    def metric(self, name: str, **labels: str) -> float | None:
        return harness.metric_sum(self.samples, name, **labels)


def run(vllm_pair, client, name: str, catalog: list[dict], path: str, bodies: list[dict],
        extra_args: list[str] | None = None, round_size: int = 3):
    for e in vllm_pair:
        e.reset_prefix_cache()
    stack = harness.Stack(catalog, secure=False, name=name,
                          envoy_config=envoy_config_with_upstream_header(),
                          extra_args=extra_args or [])
    stack.start()
    try:
        for i, body in enumerate(bodies):
            if round_size and i and i % round_size == 0:
                # The next round repeats this one's prompts after a pause longer than the
                # prediction end grace (1 s), as a user's next turn would: within the grace,
                # kvpick's own unconfirmed predictions of a prompt still stand (in its own
                # hashes), which hides a wrong view for a prompt repeated at once.
                time.sleep(1.5)
            served = send(client, stack.url(), path, body)
            assert served.status == 200, served.body
        kv = stack.kvpick
        return accuracy(kv), Seen(kv.metrics(), kv.log())
    finally:
        stack.stop()


def chat_bodies() -> list[dict]:
    system = {"role": "system", "content": text(50, 500)}
    return [{"messages": [system, {"role": "user", "content": text(60 + i % 3, 60)}]}
            for i in range(9)]


def completion_bodies(engine, prompts: int = 3, rounds: int = 3, words: int = 700) -> list[dict]:
    """``prompts`` distinct prompts of ~1.5 tokens a word, ``rounds`` times over. Each is padded
    until the engine's token count n has (n - 1) mod 32 >= 16, so no prompt is block-aligned in
    either size."""
    out = []
    for p in range(prompts):
        prompt = text(70 + p, words)
        while (len(engine.tokenize({"prompt": prompt})) - 1) % 32 < 16:
            prompt += " x"
        # The engine's token ids: kvpick hashes them as they are (no tokenizer in these configs).
        out.append({"prompt": engine.tokenize({"prompt": prompt})})
    return out * rounds


def test_the_healthy_configuration_agrees(vllm_pair, client):
    (total, exact, drift), _ = run(vllm_pair, client, "acc-ok",
                                   [e.catalog_entry() for e in vllm_pair], CHAT, chat_bodies(),
                                   ["--tokenizer-dir", f"{MODEL}={MODEL_DIR}"])
    assert total == 9
    assert exact >= total - 1, (total, exact, drift)
    assert drift and all(abs(d) < 32 for d in drift.values()), drift


def test_a_template_without_bos_shows_as_hits_kvpick_never_predicted(vllm_pair, client, tmp_path):
    config = tmp_path / "tokenizers.yaml"
    template = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())["chat_template"]
    body = template.replace("{{ bos_token }}", "")
    config.write_text(json.dumps({"tokenizers": [{
        "model": MODEL, "tokenizer_json": str(MODEL_DIR / "tokenizer.json"),
        "chat_template": body}]}))
    (total, exact, drift), _ = run(vllm_pair, client, "acc-tok",
                                   [e.catalog_entry() for e in vllm_pair], CHAT, chat_bodies(),
                                   ["--tokenizer-config", str(config)])
    assert total == 9
    assert exact <= 3, "only cold first turns can agree (both 0)"
    assert min(drift.values()) < -100, f"the engines served hits kvpick never saw: {drift}"


def test_a_wrong_block_size_is_reported_and_shows_in_the_accuracy(vllm_pair, client):
    catalog = [e.catalog_entry(block_size=16) for e in vllm_pair]
    (total, exact, drift), kv = run(vllm_pair, client, "acc-bs", catalog, COMPLETIONS,
                                    completion_bodies(vllm_pair[0]))
    used = [e.name for e in vllm_pair if e.name in drift]
    assert used and all(kv.metric("kvpick_rank_kv_block_size_mismatch", worker=w) == 32
                        for w in used), "the engine's size is reported per rank"
    errors = [line for line in kv.log.splitlines() if "ERROR" in line and "block size" in line]
    assert 1 <= len(errors) <= len(vllm_pair), f"one ERROR per rank, not per event: {errors}"
    # Every store is dropped: kvpick's picks are forgotten at each request's end, the engines
    # serve the warm requests from cache all the same.
    assert total == 9 and exact <= total - 2, (total, exact, drift)
    assert min(drift.values()) < -100, f"the engines served hits kvpick never saw: {drift}"


def test_events_that_never_arrive_show_as_predictions_the_engine_does_not_serve(vllm_pair,
                                                                                client):
    """The catalog names an events endpoint nothing publishes on (the engine was started without
    --kv-events-config, or a wrong port): the rank stays in the picks and kvpick falls back to
    its own picks (approximate mode), which cannot see the engine evict. Eight ~2k-token prompts
    cycled over two 7k-token caches: the engines keep evicting what kvpick believes they hold."""
    import vllm_engine

    dead = vllm_engine.engine_ports(1)
    catalog = [e.catalog_entry(kv_events=f"tcp://127.0.0.1:{dead}") for e in vllm_pair]
    for w in catalog:
        w.pop("kv_replay")
    bodies = completion_bodies(vllm_pair[0], prompts=8, rounds=2, words=1400)
    (total, exact, drift), kv = run(vllm_pair, client, "acc-noev", catalog, COMPLETIONS, bodies,
                                    round_size=8)
    assert (kv.metric("kvpick_kv_subscriptions") or 0) == 0
    assert total == len(bodies)
    assert exact < total - 4, (total, exact, drift)
    assert max(drift.values()) > 100, f"kvpick predicted hits the engines had evicted: {drift}"
