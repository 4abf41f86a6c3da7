"""The KV-event wire structs, defined the way the engines define them.

Every engine builds its ZeroMQ payload with ``msgspec.msgpack.Encoder().encode(batch)`` over
``msgspec.Struct`` classes; the only differences are the struct options and field lists, which
change the bytes on the wire. This module reproduces each known layout:

``vllm-array``
    vLLM as first released with KV events (and the layout kvpick's ARCHITECTURE.md §7 describes):
    ``EventBatch`` and the tagged ``KVCacheEvent`` base both ``array_like=True,
    omit_defaults=True, gc=False`` (events ``tag=True``). Batch ``[ts, events, rank?]``, each event
    ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window]``.
    Note: msgspec ignores ``omit_defaults`` for ``array_like`` structs, so every field is on the
    wire (defaults as nil) and the batch always has 3 elements; only older engine versions,
    whose structs had fewer fields, send shorter arrays.
``vllm-mixed``
    Later vLLM (and TensorRT-LLM's wire module): the batch stays ``array_like`` but events
    dropped ``array_like``, so each event is a msgpack map whose tag is under ``"type"``.
``vllm-map``
    Current vLLM main: neither the batch nor the events are ``array_like`` (maps at both levels).
``sglang``
    SGLang's original shape: ``array_like`` everywhere, batch ``[ts, events]`` (no rank),
    ``BlockStored`` = 5 fields (up to ``lora_id``), ``BlockRemoved`` = only ``block_hashes``;
    hashes are signed int64 (``hash_str_to_int64``), one event per page.
``sglang-v2``
    Newer SGLang: batch ``[ts, events, attn_dp_rank]`` (no ``omit_defaults``, so nil is sent),
    ``medium`` appended to both events (``"GPU"``, ``"CPU_PINNED"``, ``"DISK"``, ``"EXTERNAL"``;
    bigram (EAGLE) pages send ``token_ids`` as ``[[t_j, t_j+1], ...]`` pairs),
    and ``BlockStoredWithMetadata`` (same tag) appends a ``metadata`` map ``{"cache_salt": ...}``
    at position 7, where vLLM has ``lora_name``.

``ExternalBlockHash`` in vLLM is ``bytes | int``: a 32-byte sha256 (16 bytes for the xxhash
option) unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` makes it
``int.from_bytes(h, "big") & (2**64 - 1)`` (the last 8 bytes).
"""

from types import SimpleNamespace
from typing import Any, Optional, Union

import msgspec

ExternalBlockHash = Union[bytes, int]

LAYOUTS = ("vllm-array", "vllm-mixed", "vllm-map", "sglang", "sglang-v2")


def _vllm_structs(array_batch: bool, array_events: bool) -> SimpleNamespace:
    """vLLM's ``vllm/distributed/kv_events.py`` structs with the given ``array_like`` options."""

    class EventBatch(
        msgspec.Struct,
        array_like=array_batch,  # type: ignore[call-arg]
        omit_defaults=True,  # type: ignore[call-arg]
        gc=False,  # type: ignore[call-arg]
    ):
        ts: float
        events: list[Any]
        data_parallel_rank: Optional[int] = None

    class KVCacheEvent(
        msgspec.Struct,
        array_like=array_events,  # type: ignore[call-arg]
        omit_defaults=True,  # type: ignore[call-arg]
        gc=False,  # type: ignore[call-arg]
        tag=True,
    ):
        """Base class for all KV cache-related events"""

    class BlockStored(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        parent_block_hash: Optional[ExternalBlockHash]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str]
        lora_name: Optional[str]
        extra_keys: Optional[list[Optional[tuple[Any, ...]]]] = None
        group_idx: Optional[int] = None
        kv_cache_spec_kind: Optional[str] = None
        kv_cache_spec_sliding_window: Optional[int] = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[ExternalBlockHash]
        medium: Optional[str]
        group_idx: Optional[int] = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]

    return SimpleNamespace(
        EventBatch=KVEventBatch,
        BlockStored=BlockStored,
        BlockRemoved=BlockRemoved,
        AllBlocksCleared=AllBlocksCleared,
        rank_field="data_parallel_rank",
    )


def _sglang_structs() -> SimpleNamespace:
    """SGLang's original ``python/sglang/srt/disaggregation/kv_events.py`` structs."""

    class EventBatch(
        msgspec.Struct,
        array_like=True,  # type: ignore[call-arg]
        omit_defaults=True,  # type: ignore[call-arg]
        gc=False,  # type: ignore[call-arg]
    ):
        ts: float
        events: list[Any]

    class KVCacheEvent(
        msgspec.Struct,
        array_like=True,  # type: ignore[call-arg]
        omit_defaults=True,  # type: ignore[call-arg]
        gc=False,  # type: ignore[call-arg]
        tag=True,
    ):
        """Base class for all KV cache-related events"""

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: Optional[int]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]

    return SimpleNamespace(
        EventBatch=KVEventBatch,
        BlockStored=BlockStored,
        BlockRemoved=BlockRemoved,
        AllBlocksCleared=AllBlocksCleared,
        rank_field=None,
    )


def _sglang_v2_structs() -> SimpleNamespace:
    """Newer SGLang: attn_dp_rank, medium, and BlockStoredWithMetadata (no omit_defaults)."""

    class EventBatch(
        msgspec.Struct,
        array_like=True,  # type: ignore[call-arg]
        gc=False,  # type: ignore[call-arg]
    ):
        ts: float
        events: list[Any]
        attn_dp_rank: Optional[int] = None

    class KVCacheEvent(
        msgspec.Struct,
        array_like=True,  # type: ignore[call-arg]
        gc=False,  # type: ignore[call-arg]
        tag=True,
    ):
        """Base class for all KV cache-related events"""

    class BlockStoredMetadata(msgspec.Struct, omit_defaults=True, gc=False):
        cache_salt: str

    class BlockStored(KVCacheEvent):
        block_hashes: list[int]
        parent_block_hash: Optional[int]
        token_ids: list[int]
        block_size: int
        lora_id: Optional[int]
        medium: Optional[str] = None

    class BlockStoredWithMetadata(BlockStored, tag="BlockStored", kw_only=True):
        metadata: BlockStoredMetadata

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[int]
        medium: Optional[str] = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    return SimpleNamespace(
        EventBatch=EventBatch,
        BlockStored=BlockStored,
        BlockStoredWithMetadata=BlockStoredWithMetadata,
        BlockStoredMetadata=BlockStoredMetadata,
        BlockRemoved=BlockRemoved,
        AllBlocksCleared=AllBlocksCleared,
        rank_field="attn_dp_rank",
    )


_CACHE: dict[str, SimpleNamespace] = {}


def structs(layout: str) -> SimpleNamespace:
    """The struct classes of one layout (see the module docstring)."""
    if layout not in _CACHE:
        if layout == "vllm-array":
            _CACHE[layout] = _vllm_structs(True, True)
        elif layout == "vllm-mixed":
            _CACHE[layout] = _vllm_structs(True, False)
        elif layout == "vllm-map":
            _CACHE[layout] = _vllm_structs(False, False)
        elif layout == "sglang":
            _CACHE[layout] = _sglang_structs()
        elif layout == "sglang-v2":
            _CACHE[layout] = _sglang_v2_structs()
        else:
            raise ValueError(f"unknown layout {layout!r}; known: {', '.join(LAYOUTS)}")
    return _CACHE[layout]


_ENCODER = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    """Encode exactly as the engines do: one shared ``msgspec.msgpack.Encoder``."""
    return _ENCODER.encode(obj)


def _hash(value: Any) -> ExternalBlockHash:
    """JSON-friendly hash: an int, ``{"bin": "<hex>"}`` or bytes."""
    if isinstance(value, dict) and "bin" in value:
        return bytes.fromhex(value["bin"])
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    if isinstance(value, int):
        return value
    raise TypeError(f"block hash must be int, bytes or {{'bin': hex}}, got {value!r}")


def event(layout: str, spec: dict) -> msgspec.Struct:
    """Build one event struct of ``layout`` from a neutral dict ``{"type": ..., field: value}``.

    Fields the layout's struct does not have are dropped (e.g. ``lora_name`` for ``sglang``);
    required fields that are absent are sent as nil, as the engines do for "not set".
    """
    ns = structs(layout)
    kind = spec.get("type")
    if kind == "BlockStored" and "cache_salt" in spec and hasattr(ns, "BlockStoredWithMetadata"):
        cls = ns.BlockStoredWithMetadata
    elif kind in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        cls = getattr(ns, kind)
    else:
        raise ValueError(f"unknown event type {kind!r}")
    fields = cls.__struct_fields__
    kwargs: dict[str, Any] = {}
    for name in fields:
        if name == "metadata":
            kwargs[name] = ns.BlockStoredMetadata(cache_salt=spec["cache_salt"])
        elif name in spec:
            value = spec[name]
            if name == "block_hashes":
                value = [_hash(h) for h in value]
            elif name == "parent_block_hash" and value is not None:
                value = _hash(value)
            elif name == "extra_keys" and value is not None:
                value = [tuple(k) if k is not None else None for k in value]
            kwargs[name] = value
    tail = fields[len(fields) - len(cls.__struct_defaults__) :]
    defaults = {
        n: d for n, d in zip(tail, cls.__struct_defaults__) if d is not msgspec.NODEFAULT
    }
    for name in fields:
        if name not in kwargs and name not in defaults:
            if name == "token_ids":
                kwargs[name] = []
            elif name == "block_size":
                raise ValueError("BlockStored needs block_size")
            else:
                kwargs[name] = None
    return cls(**kwargs)


def batch(layout: str, events: list, ts: float, rank: Optional[int] = None) -> msgspec.Struct:
    """An ``EventBatch`` of ``layout``; ``events`` are structs or neutral dicts."""
    ns = structs(layout)
    evs = [e if isinstance(e, msgspec.Struct) else event(layout, e) for e in events]
    kwargs: dict[str, Any] = {"ts": ts, "events": evs}
    if ns.rank_field is not None:
        kwargs[ns.rank_field] = rank
    return ns.EventBatch(**kwargs)


def encode_batch(layout: str, events: list, ts: float, rank: Optional[int] = None) -> bytes:
    """The msgpack payload of one batch, byte-for-byte what the engine of ``layout`` sends."""
    return encode(batch(layout, events, ts, rank))


def hash_str_to_int64(hash_str: str) -> int:
    """SGLang's conversion of a hex digest to the signed int64 it puts on the wire."""
    uint64_val = int(hash_str[:16], 16)
    if uint64_val >= 2**63:
        return uint64_val - 2**64
    return uint64_val
