"""The HTML report of the matrix and the demo (e2e/report.py -> ``kvpick report-html``): rendered from
a small fixture of chart data, it must be self-contained (no external reference, no script), hold
one SVG per chart and name every policy; bad data gets kvpick's error, not a page."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

E2E_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(E2E_DIR))

import report  # noqa: E402

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "report_results.json"


def expected_charts(section: dict) -> int:
    """TTFT CDF, E2E CDF, KV hit rate, requests per rank, a load chart per policy with load, and
    one queue chart when any policy has a queue."""
    policies = section["policies"]
    return (4 + sum(1 for p in policies if p.get("load"))
            + (1 if any(p.get("queue") for p in policies) else 0))


def test_report_from_fixture_is_self_contained_with_one_svg_per_chart(tmp_path, kvpick_bin):
    data = json.loads(FIXTURE.read_text())
    html_path = report.write_report(kvpick_bin, data["title"], data["sections"],
                                    tmp_path / "report.html")
    html = html_path.read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert "http://" not in html and "https://" not in html
    assert "<script" not in html and "<link" not in html and "@import" not in html
    sections = re.findall(r"<section>.*?</section>", html, re.S)
    assert len(sections) == len(data["sections"])
    for text, section in zip(sections, data["sections"]):
        assert text.count("<svg ") == text.count("</svg>") == expected_charts(section)
        for p in section["policies"]:
            assert f">{p['name']}<" in text, p["name"]
    # The chart data is kept beside the page.
    assert json.loads((tmp_path / "report.charts.json").read_text())["sections"] == data["sections"]


def test_cdf_matches_the_rust_side():
    # The cases of crates/kvpick-sim/src/charts/tests.rs.
    assert report.cdf([30.0, 10.0, 20.0, 20.0, float("nan")], 100) == [
        [10.0, 0.25], [20.0, 0.75], [30.0, 1.0]]
    assert report.cdf([], 10) == []
    many = report.cdf([float(v) for v in range(10_000, 0, -1)], 200)
    assert len(many) == 200
    assert many[0] == [1.0, 1e-4] and many[-1] == [10_000.0, 1.0]
    assert all(a[0] < b[0] and a[1] < b[1] for a, b in zip(many, many[1:]))


def test_bad_chart_data_gets_kvpicks_error(tmp_path, kvpick_bin):
    data = json.loads(FIXTURE.read_text())
    section = data["sections"][1]
    section["policies"][0]["load"]["values"][0].pop()  # one value short of t_s
    with pytest.raises(RuntimeError, match="one value per t_s"):
        report.write_report(kvpick_bin, "bad", data["sections"], tmp_path / "bad.html")
    assert not (tmp_path / "bad.html").exists()
