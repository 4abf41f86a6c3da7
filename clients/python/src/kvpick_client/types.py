"""The values ``kvpick_client`` returns: frozen dataclasses, one per message of the selection API
(``proto/kvpick/v1/selection.proto``), so callers never handle generated protobuf classes."""

from __future__ import annotations

from dataclasses import dataclass

from ._proto import selection_pb2 as pb


@dataclass(frozen=True)
class Endpoint:
    """One rank: the ``(worker_id, dp_rank)`` key and the ``ip:port`` to send the request to."""

    worker_id: int
    dp_rank: int
    #: ``ip:port`` of the rank's engine.
    address: str
    #: Several ranks share this address (a data-parallel engine behind one port): the caller
    #: names the rank to the engine, e.g. vLLM's ``X-data-parallel-rank`` header.
    multiplexed_rank: bool
    worker_name: str

    @classmethod
    def from_pb(cls, m: pb.Endpoint) -> Endpoint:
        return cls(m.worker_id, m.dp_rank, m.address, m.multiplexed_rank, m.worker_name)


@dataclass(frozen=True)
class Selection:
    """A pick: where to send the request, and (after ``select_and_reserve``) the booking id."""

    primary: Endpoint
    #: Next-best ranks, best first (as many as asked for with ``fallbacks``).
    fallbacks: tuple[Endpoint, ...]
    #: The booking id to ``free`` / ``prefill_complete`` (the request id; empty for ``select``).
    request_id: str
    #: Prompt blocks already cached on ``primary``.
    overlap_blocks: int
    #: The pick's cost (lower is better; in blocks of prefill work).
    cost: float
    prompt_blocks: int
    #: With prefill/decode-split workers: the rank that prefills for ``primary`` (the decode
    #: rank); None when ``primary`` prefills itself.
    prefill: Endpoint | None

    @classmethod
    def from_pb(cls, m: pb.SelectResponse) -> Selection:
        return cls(
            primary=Endpoint.from_pb(m.primary),
            fallbacks=tuple(Endpoint.from_pb(e) for e in m.fallbacks),
            request_id=m.request_id,
            overlap_blocks=m.overlap_blocks,
            cost=m.cost,
            prompt_blocks=m.prompt_blocks,
            prefill=Endpoint.from_pb(m.prefill) if m.HasField("prefill") else None,
        )


@dataclass(frozen=True)
class OverlapScore:
    """How many leading blocks of a prompt one rank holds, per tier. Each tier counts blocks held
    there *or in a faster tier* (``gpu_blocks <= host_blocks <= disk_blocks``)."""

    rank: Endpoint
    gpu_blocks: int
    host_blocks: int
    disk_blocks: int


@dataclass(frozen=True)
class OverlapScores:
    """Per-rank cached prefix of a prompt (``overlap_scores``); nothing is booked."""

    scores: tuple[OverlapScore, ...]
    prompt_blocks: int

    @classmethod
    def from_pb(cls, m: pb.OverlapScoresResponse) -> OverlapScores:
        return cls(
            scores=tuple(
                OverlapScore(Endpoint.from_pb(s.rank), s.gpu_blocks, s.host_blocks, s.disk_blocks)
                for s in m.scores
            ),
            prompt_blocks=m.prompt_blocks,
        )

    def by_address(self) -> dict[str, int]:
        """GPU-tier blocks per rank address (multiplexed ranks: the last one listed wins)."""
        return {s.rank.address: s.gpu_blocks for s in self.scores}


@dataclass(frozen=True)
class RankLoad:
    """One rank's booked load as kvpick sees it."""

    dp_rank: int
    address: str
    active_requests: int
    active_prefill_tokens: int
    active_decode_blocks: int
    #: The engine is unreachable: the rank takes no picks until it answers again.
    unreachable: bool
    #: The block size the rank's KV events carry when it differs from the worker's (0 = none).
    kv_events_block_size: int

    @classmethod
    def from_pb(cls, m: pb.RankLoad) -> RankLoad:
        return cls(m.dp_rank, m.address, m.active_requests, m.active_prefill_tokens,
                   m.active_decode_blocks, m.unreachable, m.kv_events_block_size)


@dataclass(frozen=True)
class Worker:
    """A worker of the catalog (``list_workers``, ``loads``) with its ranks' loads."""

    worker_id: int
    name: str
    namespace: str
    model: str
    routing_group: str
    #: ``Schedulable``, ``Draining``, ``Unschedulable`` or ``Incomplete``; ``reason`` says why
    #: when it takes no picks.
    lifecycle: str
    reason: str
    ranks: tuple[RankLoad, ...]
    #: The partition's block size (declared, or learnt from the first KV event; 0 = not known yet).
    block_size: int
    lora_adapters: tuple[str, ...]
    kv_events: str

    @classmethod
    def from_pb(cls, m: pb.Worker) -> Worker:
        return cls(
            worker_id=m.worker_id, name=m.name, namespace=m.namespace, model=m.model,
            routing_group=m.routing_group, lifecycle=m.lifecycle, reason=m.reason,
            ranks=tuple(RankLoad.from_pb(r) for r in m.ranks), block_size=m.block_size,
            lora_adapters=tuple(m.lora_adapters), kv_events=m.kv_events,
        )
