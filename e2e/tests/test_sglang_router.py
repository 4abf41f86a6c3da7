"""SGLang's router (PyPI ``sglang-router``, ``cache_aware``) in the online replay, in front of real
``kvpick sim`` workers, with the trace's text form (the router takes text prompts only). Asserts what
does not depend on timing: the text form is one sim token per word and kvpick's tokenizer config
computes the same ids; every request through sglang-router (and through kvpick on the same text)
succeeds; each repeated prefix lands on the worker that caches it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

E2E_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(E2E_DIR / "replay"))

import mooncake  # noqa: E402
import online  # noqa: E402


def test_kvpick_tokenizes_the_text_form_to_the_sims_token_ids(tmp_path, kvpick_bin):
    mooncake.text_self_check()
    config = mooncake.write_text_tokenizer(tmp_path, online.MODEL)
    texts = [mooncake.synthesize_text(mooncake.Record(0, n, 1, [3, 4, 5])) for n in (1, 600, 1500)]
    bodies = "".join(json.dumps({"model": online.MODEL, "prompt": t}) + "\n" for t in texts)
    out = subprocess.run([str(kvpick_bin), "tokenize", "--tokenizer-config", str(config)],
                         input=bodies, capture_output=True, text=True, timeout=60, check=True)
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert [a.get("ids") for a in answers] == [mooncake.sim_text_tokens(t) for t in texts]
    assert [len(a["ids"]) for a in answers] == [1, 600, 1500]


def test_sglang_router_keeps_each_prefix_family_on_the_worker_that_caches_it(tmp_path):
    # 2 families x 4 identical 1024-token prompts, alternating, 3 s (model time; 600 ms wall)
    # apart, so each request has finished before the next: the router sees an idle fleet.
    lines = [json.dumps({"timestamp": i * 3000, "input_length": 1024, "output_length": 4,
                         "hash_ids": [i % 2, 100 + i % 2]}) for i in range(8)]
    trace = tmp_path / "families.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    report = online.run_online(trace, limit=None, workers=2, arrival_speedup=1.0, sim_speedup=5.0,
                               policies=("sglang-router", "kvpick"), progress=None)
    assert report["prompt_form"] == "text"
    for p in report["policies"]:
        assert p["errors"] == 0, (p["policy"], p["first_error"])
        assert sum(p["per_worker_requests"]) == 8
        assert p["output_tokens"] == 8 * 4
        # Every repeat (3 per family) lands where its family ran and hits all but the last
        # 16-token block (1008 of 1024 tokens).
        assert p["kv_hit_rate"] == (6 * 1008) / (8 * 1024), p


def test_token_prompts_are_refused_for_a_text_only_router():
    with pytest.raises(ValueError, match="text prompts only"):
        online.run_online("unused.jsonl", limit=1, workers=1, arrival_speedup=1.0, sim_speedup=1.0,
                          policies=("sglang-router",), prompt_form="tokens", progress=None)
