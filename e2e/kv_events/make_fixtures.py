#!/usr/bin/env python3
"""Generates kvpick's recorded KV-event payload fixtures (tests/fixtures/kv_events/*.msgpack).

Each fixture is one msgpack ``EventBatch`` payload (the third ZeroMQ frame) built from the
engines' own ``msgspec.Struct`` definitions (see ``wire.py``) and encoded with
``msgspec.msgpack.Encoder()``, so the bytes are what a vLLM / SGLang publisher puts on the wire.
The Rust decoder's unit tests (src/sources/events/decode.rs) pin the exact decoded contents; the fuzz
seeds (fuzz/seeds/kv_event_decoder/seed_*) are the same files.

    .venv/bin/python e2e/kv_events/make_fixtures.py           # (re)write the fixtures + README
    .venv/bin/python e2e/kv_events/make_fixtures.py --check   # exit 1 if any file would change

Output is deterministic: fixed timestamps, hashes and token ids.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import msgspec

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))

from kv_events import wire  # noqa: E402

REPO = HERE.parent.parent
OUT = REPO / "tests" / "fixtures" / "kv_events"
FUZZ_SEEDS = REPO / "fuzz" / "seeds" / "kv_event_decoder"


def _tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def vllm_array() -> bytes:
    ns = wire.structs("vllm-array")
    return wire.encode(
        ns.EventBatch(
            ts=1718000000.5,
            events=[
                # Two blocks in one event (token_ids = 2 * block_size); the second hash is above
                # i64::MAX, so msgpack carries it as uint64.
                ns.BlockStored(
                    block_hashes=[0x1111111111111111, 0xF222222222222222],
                    parent_block_hash=None,
                    token_ids=_tokens(1000, 32),
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                ),
                # Every optional field set.
                ns.BlockStored(
                    block_hashes=[0x3333333333333333],
                    parent_block_hash=0xF222222222222222,
                    token_ids=_tokens(1032, 16),
                    block_size=16,
                    lora_id=7,
                    medium="GPU",
                    lora_name="adapter-a",
                    extra_keys=[("adapter-a", "salt-1")],
                    group_idx=1,
                    kv_cache_spec_kind="full_attention",
                    kv_cache_spec_sliding_window=4096,
                ),
                ns.BlockRemoved(block_hashes=[0x1111111111111111], medium="GPU"),
                ns.BlockRemoved(block_hashes=[0x3333333333333333], medium="GPU", group_idx=1),
            ],
            data_parallel_rank=0,
        )
    )


def vllm_map() -> bytes:
    ns = wire.structs("vllm-map")
    return wire.encode(
        ns.EventBatch(
            ts=1718000001.25,
            events=[
                # Three blocks of 8; parent 0 means "sequence start"; medium nil means GPU.
                ns.BlockStored(
                    block_hashes=[0x0102030405060708, 0x1112131415161718, 0x2122232425262728],
                    parent_block_hash=0,
                    token_ids=_tokens(2000, 24),
                    block_size=8,
                    lora_id=None,
                    medium=None,
                    lora_name=None,
                ),
                ns.BlockStored(
                    block_hashes=[0x3132333435363738],
                    parent_block_hash=0x2122232425262728,
                    token_ids=_tokens(2024, 8),
                    block_size=8,
                    lora_id=None,
                    medium="GPU",
                    lora_name="adapter-b",
                    group_idx=0,
                ),
                ns.BlockRemoved(block_hashes=[0x2122232425262728, 0x3132333435363738], medium=None),
                ns.AllBlocksCleared(),
            ],
            data_parallel_rank=3,
        )
    )


def vllm_mixed() -> bytes:
    ns = wire.structs("vllm-mixed")
    return wire.encode(
        ns.EventBatch(
            ts=1718000002.0,
            events=[
                ns.BlockStored(
                    block_hashes=[0x4142434445464748],
                    parent_block_hash=None,
                    token_ids=_tokens(3000, 16),
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                ),
                ns.BlockRemoved(block_hashes=[0x4142434445464748], medium="GPU", group_idx=2),
            ],
            data_parallel_rank=1,
        )
    )


BIN_A = bytes(range(0, 32))  # sha256-sized; last 8 bytes 18..1f
BIN_B = bytes(range(32, 64))  # last 8 bytes 38..3f
BIN_PARENT = bytes([0xAB] * 24) + bytes(range(1, 9))  # last 8 bytes 01..08
BIN_XXH128 = bytes(range(0xF0, 0x100))  # 16 bytes (vLLM's xxhash option); last 8 f8..ff


def vllm_bin_hashes() -> bytes:
    ns = wire.structs("vllm-mixed")
    return wire.encode(
        ns.EventBatch(
            ts=1718000003.75,
            events=[
                ns.BlockStored(
                    block_hashes=[BIN_A, BIN_B],
                    parent_block_hash=BIN_PARENT,
                    token_ids=_tokens(4000, 32),
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                ),
                ns.BlockStored(
                    block_hashes=[BIN_XXH128],
                    parent_block_hash=BIN_B,
                    token_ids=_tokens(4032, 16),
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                ),
                ns.BlockRemoved(block_hashes=[BIN_A], medium="GPU"),
            ],
            data_parallel_rank=0,
        )
    )


# SGLang: hash_str_to_int64(sha256 hex digest) -> signed int64 (negative when the top bit is set).
SG_HEX = [
    "fedcba9876543210" + "00" * 24,
    "8000000000000001" + "11" * 24,
    "0123456789abcdef" + "22" * 24,
]


def sglang() -> bytes:
    ns = wire.structs("sglang")
    h = [wire.hash_str_to_int64(x) for x in SG_HEX]
    tokens = _tokens(500, 10)
    events = []
    parent = None
    # One event per page (page_size 4), the last page partial (2 tokens), chained by parent.
    for i, start in enumerate(range(0, 10, 4)):
        page = tokens[start : start + 4]
        events.append(
            ns.BlockStored(
                block_hashes=[h[i]],
                parent_block_hash=parent,
                token_ids=page,
                block_size=len(page),
                lora_id=None,
            )
        )
        parent = h[i]
    events.append(ns.BlockRemoved(block_hashes=[h[2]]))
    events.append(ns.AllBlocksCleared())
    return wire.encode(ns.EventBatch(ts=1718000004.5, events=events))


def sglang_v2() -> bytes:
    ns = wire.structs("sglang-v2")
    h = [wire.hash_str_to_int64(x) for x in SG_HEX]
    events = [
        ns.BlockStored(
            block_hashes=[h[0]],
            parent_block_hash=None,
            token_ids=_tokens(600, 4),
            block_size=4,
            lora_id=None,
            medium="GPU",
        ),
        # cache_salt rides in a `metadata` map at position 7 (vLLM's lora_name slot).
        ns.BlockStoredWithMetadata(
            block_hashes=[h[1]],
            parent_block_hash=h[0],
            token_ids=_tokens(604, 4),
            block_size=4,
            lora_id=None,
            medium="GPU",
            metadata=ns.BlockStoredMetadata(cache_salt="tenant-7"),
        ),
        # HiCache host tier.
        ns.BlockStored(
            block_hashes=[h[0]],
            parent_block_hash=None,
            token_ids=_tokens(600, 4),
            block_size=4,
            lora_id=None,
            medium="CPU_PINNED",
        ),
        # EAGLE bigram page: token_ids are (t_j, t_j+1) pairs.
        ns.BlockStored(
            block_hashes=[h[2]],
            parent_block_hash=h[1],
            token_ids=[(608, 609), (609, 610), (610, 611), (611, 612)],
            block_size=4,
            lora_id=None,
            medium="GPU",
        ),
        ns.BlockRemoved(block_hashes=[h[0]], medium="CPU_PINNED"),
        ns.BlockRemoved(block_hashes=[h[2]], medium=None),
    ]
    return wire.encode(ns.EventBatch(ts=1718000005.25, events=events, attn_dp_rank=2))


def all_blocks_cleared() -> bytes:
    ns = wire.structs("vllm-array")
    return wire.encode(ns.EventBatch(ts=1718000006.0, events=[ns.AllBlocksCleared()]))


def cpu_medium() -> bytes:
    ns = wire.structs("vllm-array")
    return wire.encode(
        ns.EventBatch(
            ts=1718000007.5,
            events=[
                ns.BlockStored(
                    block_hashes=[0x5151515151515151],
                    parent_block_hash=None,
                    token_ids=_tokens(7000, 16),
                    block_size=16,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                ),
                ns.BlockStored(
                    block_hashes=[0x5252525252525252],
                    parent_block_hash=0x5151515151515151,
                    token_ids=_tokens(7016, 16),
                    block_size=16,
                    lora_id=None,
                    medium="cpu",
                    lora_name=None,
                ),
                ns.BlockRemoved(block_hashes=[0x5151515151515151], medium="CPU"),
                ns.BlockRemoved(block_hashes=[0x5252525252525252], medium="DISK"),
                ns.BlockRemoved(block_hashes=[0x5353535353535353], medium="EXTERNAL"),
            ],
            data_parallel_rank=0,
        )
    )


def tokenless_store() -> bytes:
    ns = wire.structs("vllm-array")
    return wire.encode(
        ns.EventBatch(
            ts=1718000008.0,
            events=[
                ns.BlockStored(
                    block_hashes=[0x6161616161616161, 0x6262626262626262, 0x6363636363636363],
                    parent_block_hash=0x6060606060606060,
                    token_ids=[],
                    block_size=16,
                    lora_id=None,
                    medium="CPU",
                    lora_name=None,
                ),
            ],
            data_parallel_rank=0,
        )
    )


def _future_array_structs():
    """A hypothetical newer vLLM (array layout) with extra trailing fields at both levels."""

    class EventBatch(msgspec.Struct, array_like=True, gc=False):
        ts: float
        events: list
        data_parallel_rank: int | None
        publisher_epoch: str
        reconciliation: dict

    class KVCacheEvent(msgspec.Struct, array_like=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list
        parent_block_hash: int | None
        token_ids: list
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list | None
        group_idx: int | None
        kv_cache_spec_kind: str | None
        kv_cache_spec_sliding_window: int | None
        locality: str
        future_list: list

    class BlockRemoved(KVCacheEvent):
        block_hashes: list
        medium: str | None
        group_idx: int | None
        locality: str

    class AllBlocksCleared(KVCacheEvent):
        reason: str

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def unknown_fields_array() -> bytes:
    EventBatch, BlockStored, BlockRemoved, AllBlocksCleared = _future_array_structs()
    return wire.encode(
        EventBatch(
            ts=1718000009.5,
            events=[
                BlockStored(
                    block_hashes=[0x7171717171717171],
                    parent_block_hash=None,
                    token_ids=_tokens(9000, 16),
                    block_size=16,
                    lora_id=None,
                    medium="GPU",
                    lora_name=None,
                    extra_keys=[("mm-hash-0", ("nested", [1, 2, {"k": b"\x00\x01"}]))],
                    group_idx=0,
                    kv_cache_spec_kind="sliding_window",
                    kv_cache_spec_sliding_window=1024,
                    locality="remote",
                    future_list=[1.5, None, True, {"x": [1, 2]}],
                ),
                BlockRemoved(
                    block_hashes=[0x7171717171717171], medium="GPU", group_idx=0, locality="remote"
                ),
                AllBlocksCleared(reason="reset"),
            ],
            data_parallel_rank=5,
            publisher_epoch="epoch-1",
            reconciliation={"digest": b"\xde\xad", "n": 3},
        )
    )


def unknown_fields_map() -> bytes:
    # Plain dicts so key order differs from the struct order ("type" last, unknown keys
    # interleaved) and optional fields are absent, as a map encoder may legitimately produce.
    return wire.encode(
        {
            "publisher_epoch": "epoch-2",
            "events": [
                {
                    "token_ids": _tokens(9100, 8),
                    "locality": "local",
                    "block_hashes": [0x7272727272727272],
                    "cache_salt": "tenant-9",
                    "block_size": 8,
                    "session_id": "s-1",
                    "type": "BlockStored",
                },
                {"medium": "DISK", "type": "BlockRemoved", "block_hashes": [0x7272727272727272],
                 "future": {"a": [1, 2, 3]}},
                {"type": "AllBlocksCleared", "reason": "reset"},
            ],
            "ts": 1718000010.25,
            "unknown_batch_key": [1, 2, 3],
            "data_parallel_rank": 4,
        }
    )


# name -> (builder, one-line description for the README)
FIXTURES: dict[str, tuple] = {
    "vllm_array.msgpack": (
        vllm_array,
        "vLLM `array_like` layout at both levels (`[ts, events, rank]`, events tag-first "
        "arrays, all 11 fields): a 2-block store (uint64 hash above i64::MAX), a store with "
        "every optional field (lora_id 7, lora_name, extra_keys, group_idx 1, spec kind/window), "
        "two removes (one with group_idx). Rank 0.",
    ),
    "vllm_map.msgpack": (
        vllm_map,
        "Current vLLM main: map batch `{ts, events, data_parallel_rank}` and `\"type\"`-tagged "
        "map events. A 3-block store with parent 0 and nil medium, a LoRA store with "
        "group_idx 0, a 2-hash remove with nil medium, AllBlocksCleared. Rank 3.",
    ),
    "vllm_mixed.msgpack": (
        vllm_mixed,
        "vLLM mid-2025 / TensorRT-LLM layout: array batch, map events. One store, one remove "
        "with group_idx 2. Rank 1.",
    ),
    "vllm_bin_hashes.msgpack": (
        vllm_bin_hashes,
        "vLLM bytes hashes (array batch, map events): 32-byte sha256-style block and parent "
        "hashes and one 16-byte (xxhash option) hash; decoded as the last 8 bytes big-endian.",
    ),
    "sglang.msgpack": (
        sglang,
        "SGLang original shape: batch `[ts, events]` (no rank), BlockStored as 5-field tuples "
        "(no medium), one event per page (page_size 4, last page partial with block_size 2), "
        "signed int64 hashes from `hash_str_to_int64` (two negative), BlockRemoved with only "
        "`block_hashes`, AllBlocksCleared.",
    ),
    "sglang_v2.msgpack": (
        sglang_v2,
        "Newer SGLang: batch `[ts, events, attn_dp_rank=2]`, medium appended (`GPU`, "
        "`CPU_PINNED`, nil), a BlockStoredWithMetadata whose position 7 is a "
        "`{cache_salt}` map, and an EAGLE bigram page (token pairs).",
    ),
    "all_blocks_cleared.msgpack": (
        all_blocks_cleared,
        "vLLM array layout, a single AllBlocksCleared, rank nil.",
    ),
    "cpu_medium.msgpack": (
        cpu_medium,
        "vLLM array layout, offload tiers: stores with medium `CPU` and `cpu`, removes with "
        "`CPU`, `DISK` and `EXTERNAL` (an unknown tier, kept as Other).",
    ),
    "tokenless_store.msgpack": (
        tokenless_store,
        "vLLM array layout: a 3-block CPU store with empty token_ids (offload tier) and a parent.",
    ),
    "unknown_fields_array.msgpack": (
        unknown_fields_array,
        "A hypothetical newer array layout: two unknown trailing batch fields, unknown trailing "
        "fields on every event (including AllBlocksCleared), nested extra_keys.",
    ),
    "unknown_fields_map.msgpack": (
        unknown_fields_map,
        "Map layout written as plain dicts: unknown keys at both levels, `\"type\"` not first, "
        "optional fields (parent, lora, medium) absent.",
    ),
}


def render_readme() -> str:
    lines = [
        "# KV-event payload fixtures",
        "",
        "Recorded msgpack `EventBatch` payloads (the third frame of a KV-event ZeroMQ message),",
        "generated by `e2e/kv_events/make_fixtures.py` from the engines' own `msgspec.Struct`",
        "definitions (`e2e/kv_events/wire.py`) and `msgspec.msgpack.Encoder()`. Do not edit by",
        "hand: change the generator and run",
        "",
        "    .venv/bin/python e2e/kv_events/make_fixtures.py",
        "",
        "(`--check` verifies the files are current). `src/sources/events/decode.rs` asserts the exact",
        "decoded contents of each; `fuzz/seeds/kv_event_decoder/seed_*` are the same payloads.",
        "",
        "| file | contents |",
        "| --- | --- |",
    ]
    for name, (_, desc) in FIXTURES.items():
        lines.append(f"| `{name}` | {desc} |")
    lines.append("")
    return "\n".join(lines)


def framed(payload: bytes, topic: bytes = b"kv", seq: int = 0) -> bytes:
    """Fuzz-seed encoding of a 3-frame message: [topic_len u8][topic][seq BE u64][payload]."""
    return bytes([len(topic)]) + topic + seq.to_bytes(8, "big") + payload


def outputs() -> dict[Path, bytes]:
    out: dict[Path, bytes] = {}
    for name, (build, _) in FIXTURES.items():
        payload = build()
        out[OUT / name] = payload
        stem = name.removesuffix(".msgpack")
        out[FUZZ_SEEDS / f"seed_{stem}"] = payload
        out[FUZZ_SEEDS / f"seed_framed_{stem}"] = framed(payload, seq=7)
    out[OUT / "README.md"] = render_readme().encode()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="fail if any output would change")
    args = ap.parse_args()
    stale = []
    for path, data in outputs().items():
        current = path.read_bytes() if path.exists() else None
        if current == data:
            continue
        stale.append(path)
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    for path in stale:
        verb = "stale" if args.check else "wrote"
        print(f"{verb}: {path.relative_to(REPO)}")
    if args.check and stale:
        return 1
    if not stale:
        print("fixtures up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
