"""The request side shared by the sync and asyncio clients: the options of a selection and the
``SelectRequest`` built from them (client-side type errors raised as `InvalidRequest`, like the
server's own validation)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypedDict

import grpc

from ._proto import selection_pb2 as pb
from .errors import InvalidRequest


class SelectOptions(TypedDict, total=False):
    """The optional inputs of ``select``, ``select_and_reserve`` and ``overlap_scores``.

    The prompt is ``token_ids`` (the engine's token ids) or, instead, ``block_hashes`` (chained
    block hashes the caller computed) with ``prompt_tokens``; with neither, the pick is by load
    alone.
    """

    #: Chained block hashes computed by the caller, instead of ``token_ids``.
    block_hashes: Sequence[int]
    #: The prompt's length in tokens, with ``block_hashes``.
    prompt_tokens: int
    #: Requests of one session stick to the rank that holds its KV cache
    #: (``--session-affinity-mode``); at most 256 bytes.
    session_id: str
    #: The parent of a child session (a subagent): the child's first pick prefers the parent's
    #: bound rank within ``--session-soft-margin`` blocks; at most 256 bytes.
    parent_session_id: str
    #: The session's last request: routed on its binding, which ``select_and_reserve`` then
    #: releases (``select`` only reads it).
    session_final: bool
    routing_group: str
    #: Restrict the pick to these endpoints (``"ip:port"`` or a bare ``"ip"``).
    subset: Iterable[str]
    #: How many next-best ranks to return beside the pick.
    fallbacks: int
    #: Pin the pick to this worker (and, with ``pin_dp_rank``, this rank of it). Honoured only
    #: when kvpick runs with ``--allow-pins``; otherwise ignored (the pick is kvpick's own).
    pin_worker_id: int
    pin_dp_rank: int
    #: Negative = sheddable (refused first when the pool is saturated).
    priority: int
    #: Overrides ``--router-temperature`` for this request (0 = always the cheapest rank).
    temperature: float
    #: Isolates the prompt's cache (vLLM's ``cache_salt``): a different salt shares no blocks.
    cache_salt: str
    #: Seconds before the call fails with `DeadlineExceeded` (default: the client's).
    timeout: float


#: The options that go into the request message (``timeout`` is the call's).
_FIELDS = frozenset(SelectOptions.__annotations__) - {"timeout"}


def select_request(request_id: str, model: str, token_ids: Sequence[int] | None,
                   options: SelectOptions) -> pb.SelectRequest:
    """The ``SelectRequest`` for these inputs; `InvalidRequest` for a value protobuf refuses
    (a negative or 2^32+ token id, a string where a number goes) or an unknown option."""
    fields: dict[str, Any] = {k: v for k, v in options.items()
                              if k != "timeout" and v is not None}
    unknown = set(fields) - _FIELDS
    if unknown:
        raise TypeError(f"unknown selection option(s): {', '.join(sorted(unknown))}")
    if "subset" in fields:
        fields["subset"] = list(fields["subset"])
    try:
        return pb.SelectRequest(request_id=request_id, model=model,
                                token_ids=list(token_ids or ()), **fields)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"bad selection input: {e}") from e


def timeout_of(options: SelectOptions, default: float | None) -> float | None:
    return options.get("timeout", default)


def worker_spec(name: str, model: str, address: str, *, ports: Sequence[int], port: int,
                data_parallel_size: int, routing_group: str, block_size: int, kv_events: str,
                lora_adapters: Sequence[str], roles: Sequence[str]) -> pb.WorkerSpec:
    """The ``WorkerSpec`` of ``upsert_worker``; `InvalidRequest` for a value protobuf refuses."""
    try:
        return pb.WorkerSpec(name=name, model=model, address=address, ports=list(ports),
                             port=port, data_parallel_size=data_parallel_size,
                             routing_group=routing_group, block_size=block_size,
                             kv_events=kv_events, lora_adapters=list(lora_adapters),
                             roles=list(roles))
    except (ValueError, TypeError) as e:
        raise InvalidRequest(grpc.StatusCode.INVALID_ARGUMENT, f"bad worker spec: {e}") from e
