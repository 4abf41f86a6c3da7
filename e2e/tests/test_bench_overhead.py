"""The overhead benchmark's cell sizing (e2e/bench_overhead.py) at any concurrency: a unit test, no
benchmark run. `bash e2e/bench-overhead --concurrency 64` once died with a KeyError there."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import bench_overhead  # noqa: E402
from bench_overhead import requests_for  # noqa: E402

SMALL, LARGE = bench_overhead.SIZES["32KB"], bench_overhead.SIZES["220KB"]


def test_the_published_concurrencies_keep_their_request_counts():
    assert [requests_for(SMALL, c, False) for c in (1, 16, 150)] == [300, 2000, 3000]
    assert [requests_for(LARGE, c, False) for c in (1, 16, 150)] == [100, 666, 1000]
    assert [requests_for(SMALL, c, True) for c in (1, 16, 150)] == [30, 200, 300]


def test_any_other_concurrency_gets_a_count_between_its_neighbours():
    assert requests_for(SMALL, 64, False) == 2358  # 2000 + 1000 * 48 / 134
    assert requests_for(SMALL, 8, False) == 1093  # 300 + 1700 * 7 / 15
    assert requests_for(SMALL, 2, False) == 413
    assert requests_for(SMALL, 151, False) == 3000 == requests_for(SMALL, 1000, False)
    assert requests_for(LARGE, 64, True) == 78
    counts = [requests_for(SMALL, c, False) for c in range(1, 300)]
    assert counts == sorted(counts)


def test_a_concurrency_below_one_is_a_clear_error():
    with pytest.raises(ValueError, match="at least 1"):
        requests_for(SMALL, 0, False)
    assert bench_overhead.concurrency_list("1,64,150") == [1, 64, 150]
    for bad in ("0", "16,-1", "sixteen", ""):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_overhead.concurrency_list(bad)
