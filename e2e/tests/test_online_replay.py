"""Online replay smoke: a trace through Envoy round-robin and through Envoy + kvpick, each on a fresh
``kvpick sim`` fleet (e2e/replay). Asserts what does not depend on timing: every request answered
with usage, Envoy's round-robin spreads exactly evenly, and kvpick keeps repeated prompts on the rank
that holds them (so they hit the simulated prefix cache)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

E2E_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(E2E_DIR / "replay"))

import mooncake  # noqa: E402
import online  # noqa: E402

# Shipped in the repository (data/mooncake/README.md: provenance and licence).
TRACE_1000 = E2E_DIR.parent / "data" / "mooncake" / "mooncake_trace_1000.jsonl"


def test_token_synthesis_matches_the_rust_side():
    mooncake.self_check()
    rec = mooncake.Record(0, 700, 1, [0, 1])
    assert len(mooncake.synthesize(rec)) == 700
    assert mooncake.synthesize(rec)[:512] == mooncake.synthesize(mooncake.Record(0, 600, 1, [0, 9]))[:512]


def _row(policy: str, **extra) -> dict:
    return {"policy": policy, "requests": 40, "errors": 0, "kv_hit_rate": 0.5,
            "ttft_ms": {"mean": 400.0, "p50": 300.0, "p99": 900.0},
            "e2e_ms": {"mean": 2000.0, "p99": 5000.0}, "per_worker_requests": [20, 20], **extra}


def test_the_table_rounds_its_figures_and_prints_no_empty_list():
    # The demo's token-id prompts: kvpick tokenized nothing, so there are no outcomes to list.
    idle = {"outcomes": {}, "skipped": {}, "skipped_fraction": 0.0, "queue_wait_ms": {"count": 0}}
    report = {"requests": 40, "workers": 2, "arrival_speedup": 0.6562185358190088,
              "sim_speedup": 2.0,
              "policies": [_row("envoy-round-robin"),
                           _row("kvpick", tokenize=idle, kvpick_cpu_s=0.6)]}
    text = online.markdown(report)
    assert "arrival speedup 0.656, " in text, text
    assert "outcomes ," not in text and "outcomes \n" not in text, text
    assert "kvpick tokenization: no prompt to tokenize, kvpick CPU 15.0 ms per request" in text
    # Text prompts: the outcomes are listed and the queue-wait bounds read as milliseconds.
    busy = {"outcomes": {"ok": 38, "skipped": 2}, "skipped": {"queue_timeout": 2},
            "skipped_fraction": 0.05,
            "queue_wait_ms": {"count": 40, "p50_le": 0.005 * 1000, "p90_le": 0.075 * 1000,
                              "p99_le": None}}
    report["policies"][1]["tokenize"] = busy
    text = online.markdown(report)
    assert ("kvpick tokenization: 5.0% skipped (2 queue_timeout); outcomes ok 38, skipped 2, "
            "kvpick CPU 15.0 ms per request; queue wait p50/p90/p99 <= 5/75/? ms") in text, text


def test_repeated_prompts_follow_their_rank_through_kvpick(tmp_path, kvpick_bin):
    # 3 families x 4 identical prompts of 1024 tokens, 3 s (model time; 600 ms wall) apart: each
    # request is long finished (~60 ms model, ~100 ms wall through Envoy) before the next arrives, so
    # kvpick sees an idle fleet and the announced blocks, and routes a repeat to the rank holding it.
    lines = []
    for i in range(12):
        fam = (i // 2) % 3  # not aligned with a 3-way round-robin
        lines.append(json.dumps({"timestamp": i * 3000, "input_length": 1024, "output_length": 4,
                                 "hash_ids": [fam, 100 + fam]}))
    trace = tmp_path / "families.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    report = online.run_online(trace, limit=None, workers=3, arrival_speedup=1.0, sim_speedup=5.0,
                               progress=None)
    rr, kv = report["policies"]
    assert rr["policy"] == "envoy-round-robin" and kv["policy"] == "kvpick"
    for p in (rr, kv):
        assert p["errors"] == 0, p["first_error"]
        assert sum(p["per_worker_requests"]) == 12
        assert p["output_tokens"] == 12 * 4
    assert rr["per_worker_requests"] == [4, 4, 4]
    # kvpick: each family on one rank; its 3 repeats hit all but the last block (1008 tokens).
    assert kv["kv_hit_rate"] == (9 * 1008) / (12 * 1024)
    assert kv["kv_hit_rate"] > rr["kv_hit_rate"]


def test_first_requests_of_the_mooncake_trace_replay_online(kvpick_bin):
    report = online.run_online(TRACE_1000, limit=30, workers=3, arrival_speedup=1.0,
                               sim_speedup=20.0, progress=None)
    for p in report["policies"]:
        assert p["errors"] == 0, p["first_error"]
        assert sum(p["per_worker_requests"]) == 30
        assert 0.0 <= p["kv_hit_rate"] < 1.0
    assert "| kvpick |" in online.markdown(report)
