"""A minimal OTLP/gRPC trace receiver for the e2e tests (PyPI `opentelemetry-proto` + `grpcio`):
it binds 127.0.0.1 port 0, answers every `TraceService/Export`, and keeps the spans it received,
flattened, so a test can look a trace up by id and wait for the spans it expects."""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass
class ReceivedSpan:
    service: str
    name: str
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    kind: int
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    status_code: int = 0


def _value(v) -> Any:
    kind = v.WhichOneof("value")
    if kind is None:
        return None
    if kind in ("array_value", "kvlist_value"):
        return str(getattr(v, kind))
    return getattr(v, kind)


class _Service(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, owner: "OtlpReceiver") -> None:
        self.owner = owner

    def Export(self, request, context):  # noqa: N802 (gRPC method name)
        spans = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            service = str(resource.get("service.name", ""))
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(ReceivedSpan(
                        service=service, name=s.name, trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(), parent_span_id=s.parent_span_id.hex(),
                        kind=s.kind, attributes={a.key: _value(a.value) for a in s.attributes},
                        events=[e.name for e in s.events], status_code=s.status.code))
        self.owner._add(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """``endpoint`` is ``http://127.0.0.1:<port>`` (what kvpick's --otlp-endpoint takes)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Service(self), self._server)
        self.port = self._server.add_insecure_port("127.0.0.1:0")

    def start(self) -> "OtlpReceiver":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop(grace=None)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _add(self, spans: list[ReceivedSpan]) -> None:
        with self._cond:
            self._spans.extend(spans)
            self._cond.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        with self._cond:
            return list(self._spans)

    def wait_for(self, pred: Callable[[list[ReceivedSpan]], bool], timeout: float = 30.0,
                 desc: str = "spans") -> list[ReceivedSpan]:
        """Blocks until ``pred(all spans received)`` holds (woken by each export)."""
        with self._cond:
            if not self._cond.wait_for(lambda: pred(self._spans), timeout):
                got = [(s.service, s.name, s.trace_id) for s in self._spans]
                raise AssertionError(f"timed out waiting for {desc}; received {got}")
            return list(self._spans)
