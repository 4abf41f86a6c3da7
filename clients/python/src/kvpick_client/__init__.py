"""Python client of kvpick's gRPC selection API (``kvpick.v1.Selection``).

    from kvpick_client import KvpickClient

    with KvpickClient("127.0.0.1:9002") as kv:
        with kv.reservation("req-1", "my-model", token_ids) as pick:
            send_to(pick.primary.address)       # the booking is freed when the block ends

`KvpickClient` blocks; `AsyncKvpickClient` (``kvpick_client.aio``) is the asyncio twin. Results
are the dataclasses of `kvpick_client.types`; failures raise the `KvpickError` subclasses of
`kvpick_client.errors`, one per gRPC status kvpick answers with.
"""

from ._request import SelectOptions
from .aio import AsyncKvpickClient, AsyncSession
from .client import DEFAULT_TIMEOUT, KvpickClient, Session
from .errors import (
    Conflict,
    DeadlineExceeded,
    InvalidRequest,
    KvpickError,
    Overloaded,
    PermissionDenied,
    Unavailable,
)
from .types import Endpoint, OverlapScore, OverlapScores, RankLoad, Selection, Worker

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TIMEOUT",
    "AsyncKvpickClient",
    "AsyncSession",
    "Conflict",
    "DeadlineExceeded",
    "Endpoint",
    "InvalidRequest",
    "KvpickClient",
    "KvpickError",
    "Overloaded",
    "OverlapScore",
    "OverlapScores",
    "PermissionDenied",
    "RankLoad",
    "SelectOptions",
    "Selection",
    "Session",
    "Unavailable",
    "Worker",
]
