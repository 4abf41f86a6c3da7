"""Shared pieces of the real-engine tier (test_vllm_*.py): prompts the tiny model's tokenizer
turns into thousands of tokens, an Envoy that says which upstream served a request, the gRPC
OverlapScores query, and one request through the stack with the engine's own cache report."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

import harness
import grpc

from test_faults import _fields, _varint
from vllm_engine import BLOCK, MODEL, cached_tokens

JSON_CT = {"content-type": "application/json"}
WORDS = ("alpha beta gamma delta kernel cache block prefix route engine token model request "
         "server agent tool call result error retry session parent child index shard event").split()


def text(seed: int, words: int) -> str:
    """Deterministic prose of ``words`` words (about 1.2 tokens a word with the tiny tokenizer)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) + str(rng.randint(0, 99)) for _ in range(words))


def envoy_config_with_upstream_header() -> dict[str, Any]:
    """The reference Envoy config, answering clients with the upstream it used
    (``x-e2e-upstream``): the served rank as Envoy saw it, not as kvpick claims."""
    cfg = harness.load_envoy_template()
    listener = cfg["static_resources"]["listeners"][0]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]
    route["response_headers_to_add"] = [
        {"header": {"key": "x-e2e-upstream", "value": "%UPSTREAM_HOST%"},
         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"},
        # The data-parallel rank kvpick named for a multiplexed worker (request header it set).
        {"header": {"key": "x-e2e-dp-rank", "value": "%REQ(x-data-parallel-rank)%"},
         "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
    return cfg


@dataclass
class Served:
    upstream: str          # ip:port Envoy sent the request to
    dp_rank: str           # the x-data-parallel-rank kvpick set ("" or "-": none)
    status: int
    prompt_tokens: int
    cached: int            # engine-reported cached prompt tokens
    body: dict[str, Any]


def send(client, url: str, path: str, body: dict[str, Any],
         headers: dict[str, str] | None = None) -> Served:
    r = client.post(url + path, headers={**JSON_CT, **(headers or {})},
                    content=json.dumps({"model": MODEL, "max_tokens": 2, **body}))
    payload = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    usage = payload.get("usage") or {}
    return Served(r.headers.get("x-e2e-upstream", ""), r.headers.get("x-e2e-dp-rank", ""),
                  r.status_code,
                  int(usage.get("prompt_tokens") or 0), cached_tokens(payload), payload)


def predicted_blocks(grpc_port: int, tokens: list[int], cache_salt: str | None = None
                     ) -> dict[str, int]:
    """kvpick's per-rank cached blocks of ``tokens`` (kvpick.v1.Selection/OverlapScores, GPU
    tier), by address. Hand-encoded SelectRequest: 1 request_id, 2 model, 3 packed token_ids,
    14 cache_salt."""
    packed = b"".join(_varint(t) for t in tokens)
    req = (b"\x0a" + _varint(5) + b"probe" + b"\x12" + _varint(len(MODEL)) + MODEL.encode()
           + b"\x1a" + _varint(len(packed)) + packed)
    if cache_salt:
        req += b"\x72" + _varint(len(cache_salt)) + cache_salt.encode()
    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as ch:
        resp = ch.unary_unary("/kvpick.v1.Selection/OverlapScores")(req, timeout=5)
    scores = {}
    for num, score in _fields(resp):
        if num == 1:
            fields = dict(_fields(score))
            scores[dict(_fields(fields[1]))[3].decode()] = fields.get(2, 0)
    return scores


def reusable_blocks(prompt_tokens: int) -> int:
    """Blocks vLLM can serve from cache for a prompt: it always recomputes the last token."""
    return max(prompt_tokens - 1, 0) // BLOCK
