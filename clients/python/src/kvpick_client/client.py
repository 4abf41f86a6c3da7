"""`KvpickClient`: the blocking client of kvpick's gRPC selection API (``kvpick.v1.Selection``).

A thin, typed layer over the generated stub: requests are built from keyword arguments, answers
come back as the dataclasses of `kvpick_client.types`, and failures as the exceptions of
`kvpick_client.errors`. It holds no state of its own beyond the channel: bookings live in kvpick
until `free` (or ``--booking-ttl``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any

import grpc

from ._proto import selection_pb2 as pb
from ._proto import selection_pb2_grpc as pb_grpc
from ._request import SelectOptions, select_request, timeout_of, worker_spec
from .errors import from_rpc_error
from .types import OverlapScores, Selection, Worker

if TYPE_CHECKING:
    from typing_extensions import Unpack

#: Seconds a call waits for its answer unless the client or the call says otherwise.
DEFAULT_TIMEOUT = 10.0


class KvpickClient:
    """Blocking client of one kvpick (``host:port`` of its ext_proc/gRPC port, ``--grpc-port``).

    ``KvpickClient("127.0.0.1:9002")`` opens a plaintext (h2c) channel; pass ``credentials``
    (``grpc.ssl_channel_credentials(...)``) for a kvpick serving TLS (``--secure-serving``), or
    ``channel`` to reuse one. Thread-safe (gRPC channels are); use it as a context manager or
    call `close`.
    """

    def __init__(self, target: str = "", *, credentials: grpc.ChannelCredentials | None = None,
                 channel: grpc.Channel | None = None,
                 options: Sequence[tuple[str, Any]] = (),
                 timeout: float | None = DEFAULT_TIMEOUT) -> None:
        if channel is None:
            if not target:
                raise ValueError("KvpickClient needs a target (host:port) or a channel")
            channel = (grpc.secure_channel(target, credentials, options=options)
                       if credentials is not None
                       else grpc.insecure_channel(target, options=options))
        self._channel = channel
        # The generated stub is untyped; each call site names its response type.
        self._stub: Any = pb_grpc.SelectionStub(channel)  # type: ignore[no-untyped-call]
        self.timeout = timeout

    def close(self) -> None:
        """Closes the channel (also when it was passed in)."""
        self._channel.close()

    def __enter__(self) -> KvpickClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, timeout=timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e) from e

    # -- selection -------------------------------------------------------------------------

    def select(self, model: str, token_ids: Sequence[int] | None = None, *,
               request_id: str = "", **options: Unpack[SelectOptions]) -> Selection:
        """The rank kvpick would pick for this prompt, without booking it (no load changes).

        ``token_ids`` are the prompt's engine token ids; see `SelectOptions` for the rest
        (``session_id`` follows a session's binding without making one). Raises `Unavailable`
        when no rank of ``model`` can take it, `InvalidRequest` for malformed input.
        """
        req = select_request(request_id, model, token_ids, options)
        return Selection.from_pb(self._call(self._stub.Select, req,
                                            timeout_of(options, self.timeout)))

    def select_and_reserve(self, request_id: str, model: str,
                           token_ids: Sequence[int] | None = None,
                           **options: Unpack[SelectOptions]) -> Selection:
        """Picks a rank and books the request on it under ``request_id``: the rank's load counts
        it (prefill tokens until `prefill_complete`, the request until `free`), its prompt is
        predicted cached there, and a ``session_id`` binds to the rank.

        Call `free` when the request ends (or use `reservation`); an unfreed booking expires
        after ``--booking-ttl``. Needs kvpick's ``--selection-api`` (else `PermissionDenied`); a
        live booking with the same id raises `Conflict`, a saturated pool `Overloaded`.
        """
        req = select_request(request_id, model, token_ids, options)
        return Selection.from_pb(self._call(self._stub.SelectAndReserve, req,
                                            timeout_of(options, self.timeout)))

    @contextmanager
    def reservation(self, request_id: str, model: str, token_ids: Sequence[int] | None = None,
                    **options: Unpack[SelectOptions]) -> Iterator[Selection]:
        """`select_and_reserve` as a context manager: the booking is freed when the block exits,
        also on an exception (so a failed request never leaves load booked)."""
        selection = self.select_and_reserve(request_id, model, token_ids, **options)
        try:
            yield selection
        finally:
            self.free(request_id, timeout=options.get("timeout", self.timeout))

    def prefill_complete(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Marks the booking's prefill done (call it on the first response token): its prompt
        tokens leave the rank's prefill load. False when no API booking has this id."""
        ack: pb.BookingAck = self._call(
            self._stub.PrefillComplete, pb.BookingRef(request_id=request_id),
            self._timeout(timeout))
        return ack.found

    def free(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Ends the booking: the rank's load drops it. False when there was none (already freed,
        expired, never made): freeing twice is harmless."""
        ack: pb.BookingAck = self._call(
            self._stub.Free, pb.BookingRef(request_id=request_id), self._timeout(timeout))
        return ack.found

    def overlap_scores(self, model: str, token_ids: Sequence[int] | None = None,
                       **options: Unpack[SelectOptions]) -> OverlapScores:
        """How many leading blocks of the prompt each rank of ``model`` holds, per tier (GPU,
        host, disk). Books nothing."""
        req = select_request("", model, token_ids, options)
        return OverlapScores.from_pb(self._call(self._stub.OverlapScores, req,
                                                timeout_of(options, self.timeout)))

    # -- sessions --------------------------------------------------------------------------

    def session(self, session_id: str, *, parent_session_id: str = "") -> Session:
        """A handle whose calls all carry ``session_id`` (and ``parent_session_id``, for a child
        session): its first reserved request binds the session to a rank, and later ones go to
        that rank (``--session-affinity-mode hard``) or prefer it (``soft``) while it is
        schedulable. The binding idles out ``--session-ttl`` seconds after the session's last
        booking ends, or as soon as a booking made with ``session_final=True`` is freed."""
        return Session(self, session_id, parent_session_id)

    # -- catalog and load ------------------------------------------------------------------

    def list_workers(self, model: str = "", *, timeout: float | None = None) -> list[Worker]:
        """The catalog as the core sees it (every model, or only ``model``), with each rank's
        load."""
        resp: pb.ListWorkersResponse = self._call(
            self._stub.ListWorkers, pb.ListWorkersRequest(model=model), self._timeout(timeout))
        return [Worker.from_pb(w) for w in resp.workers]

    def loads(self, model: str, routing_group: str = "", *,
              timeout: float | None = None) -> list[Worker]:
        """The workers of one model's partition (and routing group) with per-rank load."""
        resp: pb.LoadsResponse = self._call(
            self._stub.Loads, pb.LoadsRequest(model=model, routing_group=routing_group),
            self._timeout(timeout))
        return [Worker.from_pb(w) for w in resp.workers]

    def upsert_worker(self, name: str, model: str, address: str, *,
                      ports: Sequence[int] = (), port: int = 0, data_parallel_size: int = 0,
                      routing_group: str = "", block_size: int = 0, kv_events: str = "",
                      lora_adapters: Sequence[str] = (), roles: Sequence[str] = (),
                      timeout: float | None = None) -> int:
        """Adds or replaces a worker of the ``api`` catalog source (one rank per entry of
        ``ports``, or ``port`` with ``data_parallel_size`` multiplexed ranks); returns its
        worker id. Needs kvpick's ``--worker-api`` (else `PermissionDenied`)."""
        spec = worker_spec(name, model, address, ports=ports, port=port,
                           data_parallel_size=data_parallel_size, routing_group=routing_group,
                           block_size=block_size, kv_events=kv_events,
                           lora_adapters=lora_adapters, roles=roles)
        ack: pb.CatalogAck = self._call(self._stub.UpsertWorker, spec, self._timeout(timeout))
        return ack.worker_id

    def delete_worker(self, name: str, *, timeout: float | None = None) -> bool:
        """Removes a worker added with `upsert_worker`; False when there was none."""
        ack: pb.CatalogAck = self._call(
            self._stub.DeleteWorker, pb.DeleteWorkerRequest(name=name), self._timeout(timeout))
        return ack.found


class Session:
    """The calls of `KvpickClient` with one ``session_id`` filled in (`KvpickClient.session`)."""

    def __init__(self, client: KvpickClient, session_id: str, parent_session_id: str = "") -> None:
        self.client = client
        self.session_id = session_id
        self.parent_session_id = parent_session_id

    def _options(self, options: SelectOptions) -> SelectOptions:
        merged: SelectOptions = {**options, "session_id": self.session_id}
        if self.parent_session_id:
            merged["parent_session_id"] = self.parent_session_id
        return merged

    def child(self, session_id: str) -> Session:
        """A child session (a subagent) of this one: its first pick prefers this session's rank."""
        return Session(self.client, session_id, self.session_id)

    def select(self, model: str, token_ids: Sequence[int] | None = None,
               **options: Unpack[SelectOptions]) -> Selection:
        """`KvpickClient.select` in this session: the rank the session is bound to, if any."""
        return self.client.select(model, token_ids, **self._options(options))

    def select_and_reserve(self, request_id: str, model: str,
                           token_ids: Sequence[int] | None = None,
                           **options: Unpack[SelectOptions]) -> Selection:
        """`KvpickClient.select_and_reserve` in this session (the first one binds it)."""
        return self.client.select_and_reserve(request_id, model, token_ids,
                                              **self._options(options))

    def reservation(self, request_id: str, model: str, token_ids: Sequence[int] | None = None,
                    **options: Unpack[SelectOptions]) -> AbstractContextManager[Selection]:
        """`KvpickClient.reservation` in this session."""
        return self.client.reservation(request_id, model, token_ids,
                                       **self._options(options))
