"""`AsyncKvpickClient`: the asyncio client of kvpick's selection API (``grpc.aio``), for
orchestrators that run an event loop. The same calls, options, results and exceptions as
`kvpick_client.KvpickClient`, awaited; see its docstrings for what each call does."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from ._proto import selection_pb2 as pb
from ._proto import selection_pb2_grpc as pb_grpc
from ._request import SelectOptions, select_request, timeout_of, worker_spec
from .client import DEFAULT_TIMEOUT
from .errors import from_rpc_error
from .types import OverlapScores, Selection, Worker

if TYPE_CHECKING:
    from typing_extensions import Unpack


class AsyncKvpickClient:
    """asyncio client of one kvpick; create it inside the running event loop, and ``await
    client.close()`` (or ``async with``) when done."""

    def __init__(self, target: str = "", *, credentials: grpc.ChannelCredentials | None = None,
                 channel: grpc.aio.Channel | None = None,
                 options: Sequence[tuple[str, Any]] = (),
                 timeout: float | None = DEFAULT_TIMEOUT) -> None:
        if channel is None:
            if not target:
                raise ValueError("AsyncKvpickClient needs a target (host:port) or a channel")
            channel = (grpc.aio.secure_channel(target, credentials, options=options)
                       if credentials is not None
                       else grpc.aio.insecure_channel(target, options=options))
        self._channel = channel
        # The generated stub is untyped; each call site names its response type.
        self._stub: Any = pb_grpc.SelectionStub(channel)  # type: ignore[no-untyped-call]
        self.timeout = timeout

    async def close(self) -> None:
        await self._channel.close(None)

    async def __aenter__(self) -> AsyncKvpickClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, timeout=timeout)
        except grpc.RpcError as e:  # grpc.aio.AioRpcError
            raise from_rpc_error(e) from e

    def _timeout(self, timeout: float | None) -> float | None:
        return timeout if timeout is not None else self.timeout

    async def select(self, model: str, token_ids: Sequence[int] | None = None, *,
                     request_id: str = "", **options: Unpack[SelectOptions]) -> Selection:
        """See `KvpickClient.select`."""
        req = select_request(request_id, model, token_ids, options)
        return Selection.from_pb(await self._call(self._stub.Select, req,
                                                  timeout_of(options, self.timeout)))

    async def select_and_reserve(self, request_id: str, model: str,
                                 token_ids: Sequence[int] | None = None,
                                 **options: Unpack[SelectOptions]) -> Selection:
        """See `KvpickClient.select_and_reserve`."""
        req = select_request(request_id, model, token_ids, options)
        return Selection.from_pb(await self._call(self._stub.SelectAndReserve, req,
                                                  timeout_of(options, self.timeout)))

    @asynccontextmanager
    async def reservation(self, request_id: str, model: str,
                          token_ids: Sequence[int] | None = None,
                          **options: Unpack[SelectOptions]) -> AsyncIterator[Selection]:
        """See `KvpickClient.reservation` (``async with``)."""
        selection = await self.select_and_reserve(request_id, model, token_ids, **options)
        try:
            yield selection
        finally:
            await self.free(request_id, timeout=options.get("timeout", self.timeout))

    async def prefill_complete(self, request_id: str, *, timeout: float | None = None) -> bool:
        """See `KvpickClient.prefill_complete`."""
        ack: pb.BookingAck = await self._call(
            self._stub.PrefillComplete, pb.BookingRef(request_id=request_id),
            self._timeout(timeout))
        return ack.found

    async def free(self, request_id: str, *, timeout: float | None = None) -> bool:
        """See `KvpickClient.free`."""
        ack: pb.BookingAck = await self._call(
            self._stub.Free, pb.BookingRef(request_id=request_id), self._timeout(timeout))
        return ack.found

    async def overlap_scores(self, model: str, token_ids: Sequence[int] | None = None,
                             **options: Unpack[SelectOptions]) -> OverlapScores:
        """See `KvpickClient.overlap_scores`."""
        req = select_request("", model, token_ids, options)
        return OverlapScores.from_pb(await self._call(self._stub.OverlapScores, req,
                                                      timeout_of(options, self.timeout)))

    def session(self, session_id: str, *, parent_session_id: str = "") -> AsyncSession:
        """See `KvpickClient.session`."""
        return AsyncSession(self, session_id, parent_session_id)

    async def list_workers(self, model: str = "", *,
                           timeout: float | None = None) -> list[Worker]:
        """See `KvpickClient.list_workers`."""
        resp: pb.ListWorkersResponse = await self._call(
            self._stub.ListWorkers, pb.ListWorkersRequest(model=model), self._timeout(timeout))
        return [Worker.from_pb(w) for w in resp.workers]

    async def loads(self, model: str, routing_group: str = "", *,
                    timeout: float | None = None) -> list[Worker]:
        """See `KvpickClient.loads`."""
        resp: pb.LoadsResponse = await self._call(
            self._stub.Loads, pb.LoadsRequest(model=model, routing_group=routing_group),
            self._timeout(timeout))
        return [Worker.from_pb(w) for w in resp.workers]

    async def upsert_worker(self, name: str, model: str, address: str, *,
                            ports: Sequence[int] = (), port: int = 0,
                            data_parallel_size: int = 0, routing_group: str = "",
                            block_size: int = 0, kv_events: str = "",
                            lora_adapters: Sequence[str] = (), roles: Sequence[str] = (),
                            timeout: float | None = None) -> int:
        """See `KvpickClient.upsert_worker`."""
        spec = worker_spec(name, model, address, ports=ports, port=port,
                           data_parallel_size=data_parallel_size, routing_group=routing_group,
                           block_size=block_size, kv_events=kv_events,
                           lora_adapters=lora_adapters, roles=roles)
        ack: pb.CatalogAck = await self._call(self._stub.UpsertWorker, spec, self._timeout(timeout))
        return ack.worker_id

    async def delete_worker(self, name: str, *, timeout: float | None = None) -> bool:
        """See `KvpickClient.delete_worker`."""
        ack: pb.CatalogAck = await self._call(
            self._stub.DeleteWorker, pb.DeleteWorkerRequest(name=name), self._timeout(timeout))
        return ack.found


class AsyncSession:
    """The calls of `AsyncKvpickClient` with one ``session_id`` filled in."""

    def __init__(self, client: AsyncKvpickClient, session_id: str,
                 parent_session_id: str = "") -> None:
        self.client = client
        self.session_id = session_id
        self.parent_session_id = parent_session_id

    def _options(self, options: SelectOptions) -> SelectOptions:
        merged: SelectOptions = {**options, "session_id": self.session_id}
        if self.parent_session_id:
            merged["parent_session_id"] = self.parent_session_id
        return merged

    def child(self, session_id: str) -> AsyncSession:
        """A child session (a subagent) of this one: its first pick prefers this session's rank."""
        return AsyncSession(self.client, session_id, self.session_id)

    async def select(self, model: str, token_ids: Sequence[int] | None = None,
                     **options: Unpack[SelectOptions]) -> Selection:
        return await self.client.select(model, token_ids,
                                        **self._options(options))

    async def select_and_reserve(self, request_id: str, model: str,
                                 token_ids: Sequence[int] | None = None,
                                 **options: Unpack[SelectOptions]) -> Selection:
        return await self.client.select_and_reserve(
            request_id, model, token_ids, **self._options(options))

    def reservation(self, request_id: str, model: str, token_ids: Sequence[int] | None = None,
                    **options: Unpack[SelectOptions]
                    ) -> AbstractAsyncContextManager[Selection]:
        return self.client.reservation(request_id, model, token_ids,
                                       **self._options(options))
