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


# --- text form --------------------------------------------------------------------------------
# Routers that take only text (sglang-router 0.3.x refuses token-id prompts, and its cache-aware
# tree works on characters) get the same trace as text: each hash id is 512 four-byte words
# "abc " (three lowercase letters and a space) drawn from the same LCG stream as its tokens.
# `kvpick sim` tokenizes text as 4-byte little-endian words, so every word is exactly one engine
# token (id = the word's bytes read little-endian) and a record's text is `input_length` tokens;
# equal leading hash ids give equal leading text. kvpick gets the sim's tokenizer as a
# `tokenizer.json` (a WordLevel vocabulary of the same words and ids, `write_text_tokenizer`), so it
# computes the engine's token ids from the text, as it would with a real model's tokenizer.

TEXT_LETTERS = "abcdefghijklmnopqrstuvwxyz"
TEXT_WORDS = [a + b + c + " " for a in TEXT_LETTERS for b in TEXT_LETTERS for c in TEXT_LETTERS]
_text_cache: dict[int, str] = {}


def block_text(hash_id: int) -> str:
    text = _text_cache.get(hash_id)
    if text is None:
        x = splitmix64(hash_id)
        words = []
        for _ in range(MOONCAKE_BLOCK):
            x = (x * 6364136223846793005 + 1442695040888963407) & _M
            words.append(TEXT_WORDS[(x >> 33) % len(TEXT_WORDS)])
        text = "".join(words)
        _text_cache[hash_id] = text
    return text


def synthesize_text(rec: Record) -> str:
    """The record's prompt as text: its blocks' words, the last block cut to `input_length`."""
    parts: list[str] = []
    left = rec.input_length
    for h in rec.hash_ids:
        if left <= 0:
            break
        take = min(left, MOONCAKE_BLOCK)
        parts.append(block_text(h)[: 4 * take])
        left -= take
    return "".join(parts)


def sim_text_tokens(text: str) -> list[int]:
    """`kvpick sim`'s tokenizer (crates/kvpick-sim/src/sim/server.rs `tokenize`): 4-byte words."""
    data = text.encode()
    return [int.from_bytes(data[i:i + 4].ljust(4, b"\0"), "little") for i in range(0, len(data), 4)]


def text_tokenizer_json() -> dict:
    """The sim's tokenizer on this text form, as a HuggingFace `tokenizer.json`."""
    vocab = {w: int.from_bytes(w.encode(), "little") for w in TEXT_WORDS}
    vocab["[UNK]"] = 0
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
            "normalizer": None,
            "pre_tokenizer": {"type": "Split", "pattern": {"String": " "},
                              "behavior": "MergedWithPrevious", "invert": False},
            "post_processor": None, "decoder": None,
            "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}}


def write_text_tokenizer(directory: Path, model: str) -> Path:
    """A `kvpick serve --tokenizer-config` file for `model` with the text form's tokenizer."""
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer = directory / "text-form-tokenizer.json"
    tokenizer.write_text(json.dumps(text_tokenizer_json()))
    config = directory / "text-form-tokenizers.yaml"
    config.write_text(json.dumps({"tokenizers": [{"model": model,
                                                  "tokenizer_json": str(tokenizer)}]}))
    return config


def text_self_check() -> None:
    a = Record(0, 700, 1, [0, 1])
    b = Record(0, 700, 1, [0, 2])
    ta, tb = synthesize_text(a), synthesize_text(b)
    assert len(sim_text_tokens(ta)) == 700, "one sim token per word"
    assert ta[: 4 * MOONCAKE_BLOCK] == tb[: 4 * MOONCAKE_BLOCK] and ta != tb
    assert all(t >= 0x20000000 for t in sim_text_tokens(ta)), "every word ends in a space"
