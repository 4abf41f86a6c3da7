"""The real-engine demo and benchmark (`bash e2e/demo.sh --engine vllm`, e2e/vllm_bench.py) on
the session's two vLLM servers, one short seed: both policies run through Envoy without an error,
the report carries the engines' own cache figures and its markdown table renders them."""

from __future__ import annotations

import vllm_bench


def test_the_vllm_demo_runs_both_policies_on_real_engines(vllm_pair):
    report = vllm_bench.run([3], with_sim=False, progress=lambda _: None, engines=vllm_pair,
                            sessions=6)
    runs = {r["policy"]: r for r in report["runs"]}
    assert set(runs) == {"envoy-round-robin", "kvpick"}
    for row in runs.values():
        assert row["errors"] == 0, row["first_error"]
        assert row["requests"] == len(vllm_bench.workload(3, 6))
        assert sum(row["per_worker_requests"]) == row["requests"], "every answer names its engine"
        assert 0 < row["kv_hit_rate"] < 1, "turns of a session share their history"
    table = vllm_bench.markdown(report)
    assert "| real vLLM 0.32 | kvpick |" in table
