//! Tracing on the stream machine: which context the stream span continues, the spans' shape,
//! the upstream's `traceparent`, and that with tracing off nothing is added.

use super::super::tests::*;
use super::super::*;
use crate::observability::telemetry::testing::{in_memory, Finished};
use crate::observability::telemetry::Telemetry;
use envoy_types::pb::envoy::service::ext_proc::v3::{HeaderMutation, ProcessingRequest};
use opentelemetry::trace::{SpanId, Status as SpanStatus, TraceId};
use opentelemetry_sdk::trace::Sampler;

const TRACE: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const ENVOY_SPAN: &str = "00f067aa0ba902b7";
const CLIENT_SPAN: &str = "b7ad6b7169203331";

fn traced(sampler: Sampler) -> (Telemetry, Finished, StreamMachine) {
    let (telemetry, finished) = in_memory(sampler);
    let settings = ExtProcSettings {
        tracer: Some(telemetry.tracer()),
        ..Default::default()
    };
    let (_, machine) = setup(default_pool(), settings);
    (telemetry, finished, machine)
}

fn parent_based() -> Sampler {
    Sampler::ParentBased(Box::new(Sampler::AlwaysOn))
}

fn post_with(extra: &[(&str, &str)]) -> ProcessingRequest {
    let mut pairs = vec![
        (":method", "POST"),
        (":path", "/v1/chat/completions"),
        ("content-type", "application/json"),
        ("x-request-id", "req-1"),
    ];
    pairs.extend_from_slice(extra);
    headers(&pairs, false)
}

fn grpc(span: &str, flags: &str) -> crate::observability::telemetry::TraceHeaders {
    crate::observability::telemetry::TraceHeaders {
        traceparent: Some(format!("00-{TRACE}-{span}-{flags}")),
        tracestate: None,
    }
}

/// Runs one chat request to its routing answer; the headers response's mutation.
fn route(machine: &mut StreamMachine, extra: &[(&str, &str)]) -> HeaderMutation {
    machine.handle(post_with(extra)).unwrap();
    let step = machine.handle(body(CHAT, true)).unwrap();
    header_mutation(&step.responses[0]).clone()
}

fn id(hex: &str) -> SpanId {
    SpanId::from_hex(hex).unwrap()
}

#[test]
fn tracing_off_adds_no_trace_header_and_leaves_the_clients_alone() {
    let (_, mut machine) = setup(default_pool(), ExtProcSettings::default());
    let client = format!("00-{TRACE}-{CLIENT_SPAN}-01");
    let m = route(
        &mut machine,
        &[("traceparent", &client), ("tracestate", "a=b")],
    );
    assert_eq!(set_value(&m, "traceparent"), None);
    assert_eq!(set_value(&m, "tracestate"), None);
    assert!(
        !m.remove_headers.iter().any(|h| h.starts_with("trace")),
        "{m:?}"
    );
    assert!(machine.trace().is_none());
}

#[test]
fn the_stream_continues_the_ext_proc_calls_context_and_the_upstream_gets_the_pick() {
    let (_telemetry, finished, mut machine) = traced(parent_based());
    machine.set_trace_context(grpc(ENVOY_SPAN, "01"));
    let client = format!("00-{TRACE}-{CLIENT_SPAN}-01");
    let m = route(&mut machine, &[("traceparent", &client)]);
    machine.end_trace("closed");

    let stream = finished.named("kvpick.ext_proc").expect("stream span");
    let pick = finished.named("kvpick.pick").expect("pick span");
    let body_span = finished.named("kvpick.body").expect("body span");
    let trace_id = TraceId::from_hex(TRACE).unwrap();
    for span in [&stream, &pick, &body_span] {
        assert_eq!(span.span_context.trace_id(), trace_id, "{}", span.name);
    }
    // The gRPC metadata (Envoy's span for the ext_proc call) wins over the HTTP header.
    assert_eq!(stream.parent_span_id, id(ENVOY_SPAN));
    assert!(stream.parent_span_is_remote);
    assert_eq!(pick.parent_span_id, stream.span_context.span_id());
    assert_eq!(body_span.parent_span_id, stream.span_context.span_id());
    let pick_id = pick.span_context.span_id();
    assert_eq!(
        set_value(&m, "traceparent").as_deref(),
        Some(format!("00-{TRACE}-{pick_id}-01").as_str())
    );
    let attr = |name: &str| {
        pick.attributes
            .iter()
            .find(|kv| kv.key.as_str() == name)
            .map(|kv| kv.value.to_string())
    };
    assert_eq!(attr("gen_ai.request.model").as_deref(), Some("m"));
    // Two idle ranks: the bounded search costs the first by load and stops (the other cannot
    // be cheaper).
    assert_eq!(attr("kvpick.candidates").as_deref(), Some("1"));
    assert_eq!(attr("kvpick.reason").as_deref(), Some("load"));
    assert_eq!(
        attr("kvpick.rank.endpoint"),
        set_value(&m, DESTINATION_HEADER)
    );
    assert!(attr("kvpick.predicted_ttft_ms").is_some());
}

#[test]
fn without_grpc_context_the_http_traceparent_and_tracestate_are_continued() {
    let (_telemetry, finished, mut machine) = traced(parent_based());
    let client = format!("00-{TRACE}-{CLIENT_SPAN}-01");
    let m = route(
        &mut machine,
        &[("traceparent", &client), ("tracestate", "vendor=abc")],
    );
    machine.end_trace("closed");
    let stream = finished.named("kvpick.ext_proc").unwrap();
    assert_eq!(stream.parent_span_id, id(CLIENT_SPAN));
    assert_eq!(set_value(&m, "tracestate").as_deref(), Some("vendor=abc"));
}

#[test]
fn an_unsampled_parent_exports_nothing_but_still_propagates() {
    let (_telemetry, finished, mut machine) = traced(parent_based());
    machine.set_trace_context(grpc(ENVOY_SPAN, "00"));
    let m = route(&mut machine, &[]);
    machine.end_trace("closed");
    assert!(finished.spans().is_empty(), "{:?}", finished.spans());
    let upstream = set_value(&m, "traceparent").unwrap();
    assert!(upstream.starts_with(&format!("00-{TRACE}-")), "{upstream}");
    assert!(upstream.ends_with("-00"), "{upstream}");
}

#[test]
fn a_root_request_is_sampled_by_the_ratio() {
    let (_telemetry, finished, mut machine) =
        traced(Sampler::ParentBased(Box::new(Sampler::AlwaysOff)));
    let m = route(&mut machine, &[]);
    machine.end_trace("closed");
    assert!(finished.spans().is_empty());
    assert!(set_value(&m, "traceparent").unwrap().ends_with("-00"));

    let (_telemetry, finished, mut machine) = traced(parent_based());
    let m = route(&mut machine, &[]);
    machine.end_trace("closed");
    let stream = finished.named("kvpick.ext_proc").unwrap();
    assert_eq!(stream.parent_span_id, SpanId::INVALID);
    let trace_id = stream.span_context.trace_id();
    assert!(set_value(&m, "traceparent")
        .unwrap()
        .starts_with(&format!("00-{trace_id}-")));
}

#[test]
fn a_refused_request_marks_the_pick_failed_and_the_stream_with_its_status() {
    let (_telemetry, finished, mut machine) = traced(parent_based());
    machine.handle(post_with(&[])).unwrap();
    let step = machine
        .handle(body(
            br#"{"model":"nobody-serves-this","prompt":"x"}"#,
            true,
        ))
        .unwrap();
    assert!(step.finished);
    machine.end_trace("closed");
    let pick = finished.named("kvpick.pick").unwrap();
    assert!(
        matches!(pick.status, SpanStatus::Error { .. }),
        "{:?}",
        pick.status
    );
    let stream = finished.named("kvpick.ext_proc").unwrap();
    let status = stream
        .attributes
        .iter()
        .find(|kv| kv.key.as_str() == "http.response.status_code")
        .map(|kv| kv.value.to_string());
    assert_eq!(status.as_deref(), Some("503"));
}

#[test]
fn a_header_only_request_is_traced_too() {
    let (_telemetry, finished, mut machine) = traced(parent_based());
    let step = machine
        .handle(headers(
            &[(":method", "GET"), (":path", "/v1/models")],
            true,
        ))
        .unwrap();
    let m = header_mutation(&step.responses[0]).clone();
    machine.end_trace("closed");
    assert!(finished.named("kvpick.body").is_none());
    let pick = finished.named("kvpick.pick").unwrap();
    assert!(set_value(&m, "traceparent")
        .unwrap()
        .contains(&pick.span_context.span_id().to_string()));
}

/// A traced request queued behind an untraced one holding the only slot: (its telemetry, kept
/// alive for the test, the running request, the waiting one, its finished spans, its queue place).
fn queued_behind_a_running_request() -> (
    Telemetry,
    StreamMachine,
    StreamMachine,
    Finished,
    Option<Waiter>,
) {
    let core = one_at_a_time(std::time::Duration::from_secs(30));
    let mut running = StreamMachine::new(Arc::clone(&core), Arc::new(ExtProcSettings::default()));
    running.handle(post_with(&[])).unwrap();
    running.handle(body(CHAT, true)).unwrap();
    let (telemetry, finished) = in_memory(parent_based());
    let settings = ExtProcSettings {
        tracer: Some(telemetry.tracer()),
        ..Default::default()
    };
    let mut waiting = StreamMachine::new(Arc::clone(&core), Arc::new(settings));
    waiting.handle(post_with(&[])).unwrap();
    let waiter = waiting.handle(body(CHAT, true)).unwrap().queue;
    (telemetry, running, waiting, finished, waiter)
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_has_its_wait_under_the_pick() {
    let (_telemetry, running, mut waiting, finished, waiter) = queued_behind_a_running_request();
    let waiter = waiter.expect("queued");
    drop(running); // frees the only slot: the waiting request is released
    let step = waiting.resume_after_queue(waiter.wait().await);
    let m = header_mutation(&step.responses[0]).clone();
    waiting.end_trace("closed");
    let pick = finished.named("kvpick.pick").unwrap();
    let queue = finished.named("kvpick.queue").unwrap();
    assert_eq!(queue.parent_span_id, pick.span_context.span_id());
    assert!(queue.attributes.iter().any(
        |kv| kv.key.as_str() == "kvpick.queue.outcome" && kv.value.to_string() == "dispatched"
    ));
    assert!(queue.end_time <= pick.end_time);
    assert!(set_value(&m, "traceparent")
        .unwrap()
        .contains(&pick.span_context.span_id().to_string()));
}

#[tokio::test(start_paused = true)]
async fn a_client_gone_while_queued_ends_its_spans_as_abandoned() {
    let (_telemetry, _running, mut waiting, finished, waiter) = queued_behind_a_running_request();
    assert!(waiter.is_some(), "queued");
    drop(waiter);
    waiting.end_trace("gone_while_queued");
    let attr = |span: &opentelemetry_sdk::trace::SpanData, key: &str| {
        span.attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.to_string())
    };
    let queue = finished.named("kvpick.queue").unwrap();
    assert_eq!(
        attr(&queue, "kvpick.queue.outcome").as_deref(),
        Some("abandoned")
    );
    let pick = finished.named("kvpick.pick").unwrap();
    assert_eq!(attr(&pick, "kvpick.abandoned").as_deref(), Some("true"));
    let stream = finished.named("kvpick.ext_proc").unwrap();
    assert_eq!(
        attr(&stream, "kvpick.stream.end").as_deref(),
        Some("gone_while_queued")
    );
}
