"""Cache-view accuracy on real engines: two vLLM 0.32 CPU servers behind Envoy + kvpick (given the
model directory), prompts of 8 prefix groups (~1.3k tokens each, more than the two 7,264-token
caches hold: evictions), completions and chat. Before each request kvpick's predicted blocks on
the rank Envoy then uses (OverlapScores on the engine's own token ids) are compared with the
engine's `cached_tokens` / 32; at the end, kvpick's own accuracy metrics for the same run.

    bash e2e/vllm/setup.sh && cargo build --bins
    .venv/bin/python e2e/vllm_accuracy.py --seeds 1,2 --requests 60
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

E2E = Path(__file__).resolve().parent
sys.path[:0] = [str(E2E), str(E2E / "tests")]

import httpx  # noqa: E402

import harness  # noqa: E402
import vllm_engine  # noqa: E402
from vllm_engine import BLOCK, MODEL, MODEL_DIR  # noqa: E402
from vllm_support import (envoy_config_with_upstream_header, predicted_blocks,  # noqa: E402
                          reusable_blocks, send, text)


def body(kind: str, seed: int, i: int) -> tuple[str, dict, dict]:
    group, tail = seed * 100 + i % 8, text(5000 + seed * 1000 + i, 40)
    if kind == "completions":
        b = {"prompt": text(group, 900) + " " + tail}
        return "/v1/completions", b, b
    b = {"messages": [{"role": "system", "content": text(group, 900)},
                      {"role": "user", "content": tail}]}
    return "/v1/chat/completions", b, {**b, "add_generation_prompt": True}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--requests", type=int, default=60, help="per seed and prompt kind")
    args = ap.parse_args()
    why = vllm_engine.vllm_available()
    if why:
        print(f"vllm_accuracy: {why}", file=sys.stderr)
        return 2
    engines = [vllm_engine.VllmEngine("a", cpu=0), vllm_engine.VllmEngine("b", cpu=1)]
    for e in engines:
        e.start(wait=False)
    stack = None
    try:
        for e in engines:
            e.wait_ready()
        stack = harness.Stack([e.catalog_entry() for e in engines], secure=False, name="accuracy",
                              envoy_config=envoy_config_with_upstream_header(),
                              extra_args=["--tokenizer-dir", f"{MODEL}={MODEL_DIR}"]).start()
        kv = stack.kvpick
        harness.wait_until(lambda: (kv.metric("kvpick_kv_subscriptions") or 0) >= 2, 30,
                           desc="kvpick subscribed to both engines")
        print("| prompts | seed | predicted == engine cached_tokens/32 | requests with engine hits |")
        print("|---|---|---|---|")
        with httpx.Client(trust_env=False, timeout=120) as client:
            for kind in ("completions", "chat"):
                for seed in (int(s) for s in args.seeds.split(",")):
                    for e in engines:
                        e.reset_prefix_cache()
                    agree = hits = 0
                    for i in range(args.requests):
                        path, request, tokenize = body(kind, seed, i)
                        tokens = engines[0].tokenize(tokenize)
                        before = predicted_blocks(kv.grpc_port, tokens)
                        served = send(client, stack.url(), path, request)
                        if served.status != 200:
                            print(f"request failed: {served.status} {served.body}", file=sys.stderr)
                            return 1
                        predicted = min(before.get(served.upstream, 0),
                                        reusable_blocks(len(tokens)))
                        agree += predicted == served.cached // BLOCK
                        hits += served.cached > 0
                    print(f"| {kind} | {seed} | {agree} / {args.requests} | {hits} |", flush=True)
        samples = kv.metrics()
        count = harness.metric_sum(samples, "kvpick_cache_prediction_error_tokens_count")
        buckets = {labels.get("le"): v for name, labels, v in samples
                   if name == "kvpick_cache_prediction_error_tokens_bucket"}
        drift = {labels["worker"]: v for name, labels, v in samples
                 if name == "kvpick_cache_prediction_drift_tokens"}
        print(f"\nkvpick's accuracy metrics: {count:.0f} comparable responses, "
              f"{buckets.get('0', 0) - buckets.get('-1', 0):.0f} exact, drift {drift}")
    finally:
        if stack is not None:
            stack.stop()
        for e in engines:
            e.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
