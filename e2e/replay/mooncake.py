"""Mooncake JSONL traces and the deterministic token synthesis shared with `kvpick replay`
(`crates/kvpick-sim/src/replay/trace.rs`): each hash id is one 512-token block of a 64-bit LCG seeded by
``splitmix64(id)``, token ``(state >> 33) % 128000``; the last block is truncated to
``input_length``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK = 512
VOCAB = 128_000
_M = (1 << 64) - 1
# crates/kvpick-sim/src/replay/trace.rs asserts the same numbers.
KNOWN_VECTOR = [61292, 1891, 23524, 50541, 66863, 74704]


@dataclass
class Record:
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: list[int]


def splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


_cache: dict[int, list[int]] = {}


def block_tokens(hash_id: int) -> list[int]:
    toks = _cache.get(hash_id)
    if toks is None:
        x = splitmix64(hash_id)
        toks = []
        append = toks.append
        for _ in range(MOONCAKE_BLOCK):
            x = (x * 6364136223846793005 + 1442695040888963407) & _M
            append((x >> 33) % VOCAB)
        _cache[hash_id] = toks
    return toks


def synthesize(rec: Record) -> list[int]:
    out: list[int] = []
    for h in rec.hash_ids:
        left = rec.input_length - len(out)
        if left <= 0:
            break
        out.extend(block_tokens(h)[:left])
    return out


def load(path: Path | str, limit: int | None = None) -> list[Record]:
    out = []
    for line in Path(path).read_text().splitlines():
        if not line.strip():
            continue
        d = json.loads(line)
        out.append(Record(int(d["timestamp"]), int(d["input_length"]), int(d["output_length"]),
                          [int(h) for h in d["hash_ids"]]))
        if limit is not None and len(out) >= limit:
            break
    return out


def self_check() -> None:
    got = block_tokens(0)[:4] + block_tokens(12345)[:2]
    assert got == KNOWN_VECTOR, f"token synthesis drifted from the Rust side: {got}"
