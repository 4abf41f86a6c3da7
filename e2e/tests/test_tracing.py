"""End-to-end OpenTelemetry tracing (docs/observability.md, "Tracing"): a real Envoy with its own
OpenTelemetry tracer in front of kvpick, both exporting OTLP/gRPC to a receiver on loopback
(e2e/otlp_receiver.py), and a fake upstream that records the headers it gets.

What is asserted is the trace's shape: one trace id across Envoy's spans, kvpick's spans and the
upstream's `traceparent`; kvpick's stream span is a child of the span Envoy made for the ext_proc
call; the pick is a child of the stream span. Waiting is on the receiver's condition (woken per
export), never on sleeps."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest

import harness
from harness import worker
from otlp_receiver import OtlpReceiver, ReceivedSpan

CHAT = "/v1/chat/completions"
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
# Export at once: Envoy flushes after every span, kvpick's batch processor every 50 ms.
FAST_EXPORT = {"OTEL_BSP_SCHEDULE_DELAY": "50"}


def traced_envoy_config(receiver_port: int) -> dict[str, Any]:
    """The reference config with Envoy's OpenTelemetry tracer on the gateway listener (every
    request sampled), exporting OTLP/gRPC to ``receiver_port`` through cluster ``otlp``."""
    cfg = harness.load_envoy_template()
    main = next(l for l in cfg["static_resources"]["listeners"]
                if l["name"] == harness.MAIN_LISTENER)
    hcm = harness._hcm(main)
    hcm["tracing"] = {
        "random_sampling": {"value": 100},
        "provider": {
            "name": "envoy.tracers.opentelemetry",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.config.trace.v3.OpenTelemetryConfig",
                "grpc_service": {"envoy_grpc": {"cluster_name": "otlp"}, "timeout": "5s"},
                "service_name": "envoy-gateway",
            },
        },
    }
    cfg["static_resources"]["clusters"].append({
        "name": "otlp",
        "type": "STATIC",
        "connect_timeout": "5s",
        "typed_extension_protocol_options": {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            },
        },
        "load_assignment": {"cluster_name": "otlp", "endpoints": [{"lb_endpoints": [{
            "endpoint": {"address": {"socket_address": {
                "address": "127.0.0.1", "port_value": receiver_port}}}}]}]},
    })
    cfg["layered_runtime"] = {"layers": [{"name": "static", "static_layer": {
        "tracing.opentelemetry.min_flush_spans": 1,
        "tracing.opentelemetry.flush_interval_ms": 100,
    }}]}
    return cfg


@pytest.fixture
def receiver():
    r = OtlpReceiver().start()
    yield r
    r.stop()


@pytest.fixture
def upstream():
    u = harness.Upstream("traced").start()
    yield u
    u.stop()


def by_trace(spans: list[ReceivedSpan], trace_id: str) -> list[ReceivedSpan]:
    return [s for s in spans if s.trace_id == trace_id]


def named(spans: list[ReceivedSpan], service: str, name: str) -> ReceivedSpan | None:
    return next((s for s in spans if s.service == service and s.name == name), None)


def test_one_trace_from_envoy_through_kvpick_to_the_engine(kvpick_bin, receiver, upstream):
    env_args = ["--otlp-endpoint", receiver.endpoint, "--trace-sampling-ratio", "1",
                "--otel-service-name", "kvpick-e2e"]
    stack = harness.Stack([worker("w0", ports=[upstream.port])], name="tracing",
                          extra_args=env_args, envoy_config=traced_envoy_config(receiver.port))
    stack.kvpick.process.env.update(FAST_EXPORT)
    with stack:
        resp = httpx.post(stack.url() + CHAT, json=harness.chat_body(), timeout=30)
        assert resp.status_code == 200, resp.text
        seen = resp.json()["headers"]
        m = TRACEPARENT.match(seen.get("traceparent", ""))
        assert m, f"upstream got no valid traceparent: {seen}"
        trace_id, upstream_parent, flags = m.groups()
        assert flags == "01", seen["traceparent"]

        def complete(spans: list[ReceivedSpan]) -> bool:
            mine = by_trace(spans, trace_id)
            return all(named(mine, svc, n) for svc, n in (
                ("kvpick-e2e", "kvpick.ext_proc"), ("kvpick-e2e", "kvpick.pick"),
                ("kvpick-e2e", "kvpick.body"))) and \
                any(s.service == "envoy-gateway" and s.parent_span_id == "" for s in mine)

        spans = by_trace(receiver.wait_for(complete, desc=f"trace {trace_id}"), trace_id)
    ids = {s.span_id: s for s in spans}
    stream = named(spans, "kvpick-e2e", "kvpick.ext_proc")
    pick = named(spans, "kvpick-e2e", "kvpick.pick")
    body = named(spans, "kvpick-e2e", "kvpick.body")
    envoy_spans = [s for s in spans if s.service == "envoy-gateway"]
    # kvpick's stream span continues the ext_proc call's context: its parent is an Envoy span.
    assert stream.parent_span_id in ids, (stream, spans)
    assert ids[stream.parent_span_id].service == "envoy-gateway", ids[stream.parent_span_id]
    assert pick.parent_span_id == stream.span_id
    assert body.parent_span_id == stream.span_id
    # The pick's attributes: what was picked and why.
    assert pick.attributes["kvpick.rank.endpoint"] == upstream.endpoint
    assert pick.attributes["gen_ai.request.model"] == "m1"
    assert pick.attributes["kvpick.candidates"] == 1
    assert pick.attributes["kvpick.reason"] in ("load", "cache")
    assert "kvpick.predicted_ttft_ms" in pick.attributes
    assert stream.attributes["http.response.status_code"] == 200
    # However Envoy ends a finished stream (end of stream, reset, or gone first), it is a normal end.
    assert stream.attributes["kvpick.stream.end"] == "completed"
    # Envoy's own spans: the request (root) and its ext_proc call, kvpick's parent.
    ingress = next(s for s in envoy_spans if s.parent_span_id == "")
    ext_proc_call = ids[stream.parent_span_id]
    assert "ExternalProcessor" in ext_proc_call.name, ext_proc_call
    assert ext_proc_call.parent_span_id == ingress.span_id
    # kvpick sets the upstream's traceparent to its pick span, but when Envoy traces, its router
    # injects its own span into the upstream request after every filter ran: the engine's spans
    # then hang under Envoy's request span, in the same trace (docs/observability.md).
    assert upstream_parent == ingress.span_id, (upstream_parent, envoy_spans)


def test_without_envoy_tracing_the_engine_joins_under_the_pick(kvpick_bin, receiver, upstream):
    """Envoy without a tracer passes the client's `traceparent` through to ext_proc: kvpick
    continues it, and the upstream gets kvpick's pick span as its parent (and the tracestate)."""
    stack = harness.Stack([worker("w0", ports=[upstream.port])], name="tracing-plain",
                          extra_args=["--otlp-endpoint", receiver.endpoint])
    stack.kvpick.process.env.update(FAST_EXPORT)
    trace_id, client_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    sent = {"traceparent": f"00-{trace_id}-{client_span}-01", "tracestate": "vendor=abc"}
    with stack:
        resp = httpx.post(stack.url() + CHAT, json=harness.chat_body(), headers=sent,
                          timeout=30)
        assert resp.status_code == 200, resp.text
        seen = resp.json()["headers"]
        m = TRACEPARENT.match(seen.get("traceparent", ""))
        assert m, seen
        assert m.group(1) == trace_id and m.group(3) == "01", seen["traceparent"]
        assert m.group(2) != client_span, "kvpick must name its own span upstream"
        assert seen.get("tracestate") == "vendor=abc", seen

        def complete(spans):
            mine = by_trace(spans, trace_id)
            return named(mine, "kvpick", "kvpick.ext_proc") and named(mine, "kvpick", "kvpick.pick")

        spans = by_trace(receiver.wait_for(complete, desc="kvpick's spans"), trace_id)
    stream = named(spans, "kvpick", "kvpick.ext_proc")
    pick = named(spans, "kvpick", "kvpick.pick")
    assert stream.parent_span_id == client_span
    assert pick.parent_span_id == stream.span_id
    assert m.group(2) == pick.span_id


def test_tracing_off_leaves_the_trace_context_alone(kvpick_bin, upstream):
    """Without --otlp-endpoint (the default) kvpick adds no trace header and changes none."""
    stack = harness.Stack([worker("w0", ports=[upstream.port])], name="tracing-off")
    for var in [v for v in stack.kvpick.process.env if v.startswith("OTEL_")]:
        del stack.kvpick.process.env[var]  # tracing could be on through the environment
    with stack:
        plain = httpx.post(stack.url() + CHAT, json=harness.chat_body(), timeout=30)
        assert plain.status_code == 200, plain.text
        assert "traceparent" not in plain.json()["headers"]
        sent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        kept = httpx.post(stack.url() + CHAT, json=harness.chat_body(),
                          headers={"traceparent": sent}, timeout=30)
        assert kept.json()["headers"].get("traceparent") == sent
