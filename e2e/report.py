"""The HTML report of the benchmark matrix and the demo: the scripts gather chart data and hand it
to ``kvpick report-html`` (crates/kvpick-sim/src/charts), the renderer ``kvpick replay
--report-html`` uses, so every report looks the same and nothing here draws anything. The
standard library only (e2e/matrix.py runs without the venv).

Chart data (JSON, what ``kvpick replay --chart-data FILE`` writes)::

    {"title": str,
     "sections": [{"title": str, "note": str,
                   "policies": [{"name": str,
                                 "ttft_cdf": [[ms, fraction], ...],   # ascending, ends at 1
                                 "e2e_cdf": [[ms, fraction], ...],
                                 "kv_hit_rate": 0..1,
                                 "requests_per_rank": [int, ...],
                                 "load": {"t_s": [...], "values": [[per rank], ...]},  # optional
                                 "queue": {"t_s": [...], "values": [[...]]}}]}]}       # optional

Charts per section: TTFT CDF, E2E CDF, KV hit rate, requests per rank, load per rank over time
(one per policy with ``load``), router queue length over time (when a policy has ``queue``).
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path
from typing import Any

CDF_POINTS = 200  # as crates/kvpick-sim/src/charts/mod.rs


def cdf(values: list[float], max_points: int = CDF_POINTS) -> list[list[float]]:
    """The empirical CDF of ``values`` as ``[x, F(x)]`` points, the algorithm of the Rust side's
    ``charts::cdf``: every sample when there are few, else evenly spaced quantiles."""
    s = sorted(v for v in values if math.isfinite(v))
    n = len(s)
    if n == 0 or max_points <= 0:
        return []
    if n <= max_points:
        idx = list(range(n))
    elif max_points == 1:
        idx = [n - 1]
    else:
        idx = [(k * (n - 1) + (max_points - 1) // 2) // (max_points - 1) for k in range(max_points)]
    out: list[list[float]] = []
    for i in idx:
        point = [s[i], (i + 1) / n]
        if out and out[-1][0] == point[0]:
            out[-1] = point
        else:
            out.append(point)
    return out


def section_from_chart_data(path: Path, title: str, note: str = "") -> dict[str, Any]:
    """The (single) section of a ``kvpick replay --chart-data`` file, retitled."""
    data = json.loads(Path(path).read_text())
    section = data["sections"][0]
    section["title"] = title
    if note:
        section["note"] = note
    return section


def write_report(binary: str | Path, title: str, sections: list[dict[str, Any]],
                 out_html: Path) -> Path:
    """Writes ``out_html`` (and its chart data beside it, ``.json``) with ``kvpick report-html``;
    raises ``RuntimeError`` with kvpick's message when it refuses the data."""
    out_html = Path(out_html)
    data_path = out_html.with_suffix(".charts.json")
    data_path.write_text(json.dumps({"title": title, "sections": sections}) + "\n")
    done = subprocess.run([str(binary), "report-html", "--input", str(data_path),
                           "--out", str(out_html)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"kvpick report-html: {done.stderr.strip()}")
    return out_html
