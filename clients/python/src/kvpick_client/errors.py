"""The exceptions of ``kvpick_client``: one class per gRPC status kvpick answers with.

kvpick's selection API uses the gRPC codes of its HTTP table (``proto/kvpick/v1/selection.proto``):

- ``INVALID_ARGUMENT`` (400) -> `InvalidRequest`: missing ``model`` or ``request_id``, both
  ``token_ids`` and ``block_hashes``, an over-long ``session_id``, a bad pin or worker spec;
- ``ALREADY_EXISTS`` (409) -> `Conflict`: a live booking already has this ``request_id``;
- ``RESOURCE_EXHAUSTED`` (429) -> `Overloaded`: every eligible rank is saturated;
- ``UNAVAILABLE`` (503) -> `Unavailable`: no schedulable rank for the model (unknown model, none
  ready), or kvpick cannot be reached;
- ``PERMISSION_DENIED`` -> `PermissionDenied`: bookings without ``--selection-api``, catalog
  writes without ``--worker-api``;
- ``DEADLINE_EXCEEDED`` -> `DeadlineExceeded`: the call's ``timeout`` passed.

Any other status raises the base class, `KvpickError`. Every exception keeps the gRPC status
(``code``) and kvpick's message (``details``); catching `KvpickError` catches them all.
"""

from __future__ import annotations

import grpc


class KvpickError(Exception):
    """A failed kvpick call: the gRPC status ``code`` and the server's message ``details``."""

    #: The HTTP status kvpick's ext_proc host answers for the same condition (None: no equivalent).
    http_status: int | None = None

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details


class InvalidRequest(KvpickError):
    """``INVALID_ARGUMENT``: the request is malformed; retrying it unchanged fails again."""

    http_status = 400


class Conflict(KvpickError):
    """``ALREADY_EXISTS``: a live booking already holds this ``request_id``."""

    http_status = 409


class Overloaded(KvpickError):
    """``RESOURCE_EXHAUSTED``: every eligible rank is saturated; retry later or shed the request."""

    http_status = 429


class Unavailable(KvpickError):
    """``UNAVAILABLE``: no rank can take the request now, or kvpick itself is unreachable."""

    http_status = 503


class PermissionDenied(KvpickError):
    """``PERMISSION_DENIED``: the server was not started with the flag this call needs."""


class DeadlineExceeded(KvpickError):
    """``DEADLINE_EXCEEDED``: no answer within the call's ``timeout``."""


_BY_CODE: dict[grpc.StatusCode, type[KvpickError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.ALREADY_EXISTS: Conflict,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
}


def from_status(code: grpc.StatusCode, details: str | None) -> KvpickError:
    """The exception for a gRPC status (the base class for codes kvpick does not document)."""
    return _BY_CODE.get(code, KvpickError)(code, details or "")


def from_rpc_error(err: grpc.RpcError) -> KvpickError:
    """The exception for a failed call: a sync ``grpc.Call`` error or a ``grpc.aio.AioRpcError``
    (both carry ``code()`` and ``details()``, but only the first is a ``grpc.Call``)."""
    code = getattr(err, "code", None)
    details = getattr(err, "details", None)
    if not callable(code) or not callable(details):
        return KvpickError(grpc.StatusCode.UNKNOWN, str(err))
    return from_status(code(), details())
