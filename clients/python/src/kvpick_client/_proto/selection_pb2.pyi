from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SelectRequest(_message.Message):
    __slots__ = ("request_id", "model", "token_ids", "subset", "fallbacks", "session_id", "routing_group", "block_hashes", "prompt_tokens", "pin_worker_id", "pin_dp_rank", "priority", "temperature", "cache_salt", "parent_session_id", "session_final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SUBSET_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    ROUTING_GROUP_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PIN_WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    PIN_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    PARENT_SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    model: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    subset: _containers.RepeatedScalarFieldContainer[str]
    fallbacks: int
    session_id: str
    routing_group: str
    block_hashes: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    pin_worker_id: int
    pin_dp_rank: int
    priority: int
    temperature: float
    cache_salt: str
    parent_session_id: str
    session_final: bool
    def __init__(self, request_id: _Optional[str] = ..., model: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., subset: _Optional[_Iterable[str]] = ..., fallbacks: _Optional[int] = ..., session_id: _Optional[str] = ..., routing_group: _Optional[str] = ..., block_hashes: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., pin_worker_id: _Optional[int] = ..., pin_dp_rank: _Optional[int] = ..., priority: _Optional[int] = ..., temperature: _Optional[float] = ..., cache_salt: _Optional[str] = ..., parent_session_id: _Optional[str] = ..., session_final: _Optional[bool] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("worker_id", "dp_rank", "address", "multiplexed_rank", "worker_name")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MULTIPLEXED_RANK_FIELD_NUMBER: _ClassVar[int]
    WORKER_NAME_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    dp_rank: int
    address: str
    multiplexed_rank: bool
    worker_name: str
    def __init__(self, worker_id: _Optional[int] = ..., dp_rank: _Optional[int] = ..., address: _Optional[str] = ..., multiplexed_rank: _Optional[bool] = ..., worker_name: _Optional[str] = ...) -> None: ...

class SelectResponse(_message.Message):
    __slots__ = ("primary", "fallbacks", "request_id", "overlap_blocks", "cost", "prompt_blocks", "prefill")
    PRIMARY_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OVERLAP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    primary: Endpoint
    fallbacks: _containers.RepeatedCompositeFieldContainer[Endpoint]
    request_id: str
    overlap_blocks: int
    cost: float
    prompt_blocks: int
    prefill: Endpoint
    def __init__(self, primary: _Optional[_Union[Endpoint, _Mapping]] = ..., fallbacks: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ..., request_id: _Optional[str] = ..., overlap_blocks: _Optional[int] = ..., cost: _Optional[float] = ..., prompt_blocks: _Optional[int] = ..., prefill: _Optional[_Union[Endpoint, _Mapping]] = ...) -> None: ...

class BookingRef(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class BookingAck(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class ListWorkersRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class RankLoad(_message.Message):
    __slots__ = ("dp_rank", "address", "active_requests", "active_prefill_tokens", "active_decode_blocks", "unreachable", "kv_events_block_size")
    DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_DECODE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    dp_rank: int
    address: str
    active_requests: int
    active_prefill_tokens: int
    active_decode_blocks: int
    unreachable: bool
    kv_events_block_size: int
    def __init__(self, dp_rank: _Optional[int] = ..., address: _Optional[str] = ..., active_requests: _Optional[int] = ..., active_prefill_tokens: _Optional[int] = ..., active_decode_blocks: _Optional[int] = ..., unreachable: _Optional[bool] = ..., kv_events_block_size: _Optional[int] = ...) -> None: ...

class Worker(_message.Message):
    __slots__ = ("worker_id", "name", "model", "routing_group", "lifecycle", "reason", "ranks", "block_size", "lora_adapters", "kv_events", "namespace")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROUTING_GROUP_FIELD_NUMBER: _ClassVar[int]
    LIFECYCLE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    name: str
    model: str
    routing_group: str
    lifecycle: str
    reason: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankLoad]
    block_size: int
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    kv_events: str
    namespace: str
    def __init__(self, worker_id: _Optional[int] = ..., name: _Optional[str] = ..., model: _Optional[str] = ..., routing_group: _Optional[str] = ..., lifecycle: _Optional[str] = ..., reason: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankLoad, _Mapping]]] = ..., block_size: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., kv_events: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class ListWorkersResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ...) -> None: ...

class WorkerSpec(_message.Message):
    __slots__ = ("name", "model", "routing_group", "address", "ports", "port", "data_parallel_size", "block_size", "kv_events", "lora_adapters", "roles")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROUTING_GROUP_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_EVENTS_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    ROLES_FIELD_NUMBER: _ClassVar[int]
    name: str
    model: str
    routing_group: str
    address: str
    ports: _containers.RepeatedScalarFieldContainer[int]
    port: int
    data_parallel_size: int
    block_size: int
    kv_events: str
    lora_adapters: _containers.RepeatedScalarFieldContainer[str]
    roles: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., model: _Optional[str] = ..., routing_group: _Optional[str] = ..., address: _Optional[str] = ..., ports: _Optional[_Iterable[int]] = ..., port: _Optional[int] = ..., data_parallel_size: _Optional[int] = ..., block_size: _Optional[int] = ..., kv_events: _Optional[str] = ..., lora_adapters: _Optional[_Iterable[str]] = ..., roles: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteWorkerRequest(_message.Message):
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

class CatalogAck(_message.Message):
    __slots__ = ("worker_id", "found")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    FOUND_FIELD_NUMBER: _ClassVar[int]
    worker_id: int
    found: bool
    def __init__(self, worker_id: _Optional[int] = ..., found: _Optional[bool] = ...) -> None: ...

class LoadsRequest(_message.Message):
    __slots__ = ("model", "routing_group")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    ROUTING_GROUP_FIELD_NUMBER: _ClassVar[int]
    model: str
    routing_group: str
    def __init__(self, model: _Optional[str] = ..., routing_group: _Optional[str] = ...) -> None: ...

class LoadsResponse(_message.Message):
    __slots__ = ("workers",)
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    workers: _containers.RepeatedCompositeFieldContainer[Worker]
    def __init__(self, workers: _Optional[_Iterable[_Union[Worker, _Mapping]]] = ...) -> None: ...

class OverlapScore(_message.Message):
    __slots__ = ("rank", "gpu_blocks", "host_blocks", "disk_blocks")
    RANK_FIELD_NUMBER: _ClassVar[int]
    GPU_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    HOST_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DISK_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    rank: Endpoint
    gpu_blocks: int
    host_blocks: int
    disk_blocks: int
    def __init__(self, rank: _Optional[_Union[Endpoint, _Mapping]] = ..., gpu_blocks: _Optional[int] = ..., host_blocks: _Optional[int] = ..., disk_blocks: _Optional[int] = ...) -> None: ...

class OverlapScoresResponse(_message.Message):
    __slots__ = ("scores", "prompt_blocks")
    SCORES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    scores: _containers.RepeatedCompositeFieldContainer[OverlapScore]
    prompt_blocks: int
    def __init__(self, scores: _Optional[_Iterable[_Union[OverlapScore, _Mapping]]] = ..., prompt_blocks: _Optional[int] = ...) -> None: ...
