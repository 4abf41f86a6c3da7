//! The stream machine's shared test fixtures (cores, pools, messages, readers of the answers)
//! and the tests of the machine as a whole: the protocol check, messages out of order, empty
//! and flow-control messages, Envoy's local replies. Each phase's own tests sit beside its
//! module (`stream/request_tests.rs`, `stream/parse_tests.rs`, ...) and use these fixtures.

use super::*;
use crate::observability::metrics::Metrics;
use crate::selection::CoreConfig;
use crate::sources::catalog::{RankLayout, WorkerSpec};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, HeaderMutation, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest,
    ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, Value};
use processing_response::Response as R;

pub(super) fn worker(name: &str, model: &str, layout: RankLayout) -> WorkerSpec {
    WorkerSpec::for_test(name, model, layout)
}

pub(super) fn setup(
    workers: Vec<WorkerSpec>,
    settings: ExtProcSettings,
) -> (Arc<SelectionCore>, StreamMachine) {
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(1),
            ..Default::default()
        },
        Metrics::new(),
    );
    core.apply_snapshot(workers).unwrap();
    let machine = StreamMachine::new(Arc::clone(&core), Arc::new(settings));
    (core, machine)
}

pub(super) fn default_pool() -> Vec<WorkerSpec> {
    vec![worker("a", "m", RankLayout::PerPort(vec![8000, 8001]))]
}

pub(super) fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> ProcessingRequest {
    let raw: Vec<(&str, &[u8])> = pairs.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
    let mut request = raw_headers(&raw);
    if let Some(processing_request::Request::RequestHeaders(h)) = &mut request.request {
        h.end_of_stream = end_of_stream;
    }
    request
}

pub(super) fn post_headers() -> ProcessingRequest {
    headers(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("x-request-id", "req-1"),
        ],
        false,
    )
}

pub(super) fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub(super) fn response_body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub(super) fn response_headers(content_type: &str) -> ProcessingRequest {
    let mut h = headers(&[(":status", "200"), ("content-type", content_type)], false);
    if let Some(processing_request::Request::RequestHeaders(inner)) = h.request.take() {
        h.request = Some(processing_request::Request::ResponseHeaders(inner));
    }
    h
}

pub(super) const CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

pub(super) fn header_mutation(r: &ProcessingResponse) -> &HeaderMutation {
    match r.response.as_ref().unwrap() {
        R::RequestHeaders(h) => h
            .response
            .as_ref()
            .unwrap()
            .header_mutation
            .as_ref()
            .unwrap(),
        other => panic!("not a request headers response: {other:?}"),
    }
}

pub(super) fn set_value(m: &HeaderMutation, key: &str) -> Option<String> {
    m.set_headers
        .iter()
        .map(|o| o.header.as_ref().unwrap())
        .find(|h| h.key == key)
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
}

pub(super) fn metadata_destination(r: &ProcessingResponse) -> String {
    let md = r.dynamic_metadata.as_ref().unwrap();
    let Some(Kind::StructValue(lb)) = &md.fields[LB_NAMESPACE].kind else {
        panic!("envoy.lb is not a struct")
    };
    match &lb.fields[DESTINATION_HEADER].kind {
        Some(Kind::StringValue(s)) => s.clone(),
        other => panic!("{other:?}"),
    }
}

/// A streamed body chunk: the message must be a body response, and its chunk is kept apart
/// by the codec's [`Outbound`].
pub(super) fn streamed(r: &Outbound) -> (&[u8], bool) {
    let common = match r.response.as_ref().unwrap() {
        R::RequestBody(b) | R::ResponseBody(b) => b.response.as_ref().unwrap(),
        other => panic!("not a body response: {other:?}"),
    };
    let mutation = common.body_mutation.as_ref().unwrap().mutation.as_ref();
    match mutation.unwrap() {
        body_mutation::Mutation::StreamedResponse(s) => {
            let (chunk, end_of_stream) = r.streamed_chunk().expect("the chunk");
            assert_eq!(s.end_of_stream, end_of_stream);
            assert!(
                s.body.is_empty(),
                "the chunk is not copied into the message"
            );
            (chunk, end_of_stream)
        }
        other => panic!("{other:?}"),
    }
}

pub(super) fn immediate_status(step: &Step) -> (u16, String) {
    assert!(step.finished);
    match step.responses[0].response.as_ref().unwrap() {
        R::ImmediateResponse(i) => (
            i.status.as_ref().unwrap().code as u16,
            String::from_utf8(i.body.clone()).unwrap(),
        ),
        other => panic!("not immediate: {other:?}"),
    }
}

#[test]
fn protocol_config_must_be_full_duplex() {
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    let mut msg = post_headers();
    msg.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::Buffered as i32,
        response_body_mode: BodySendMode::FullDuplexStreamed as i32,
        send_body_without_waiting_for_header_response: false,
    });
    let err = m.handle(msg).unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition);
    assert!(err.message().contains("BUFFERED"), "{}", err.message());

    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    let mut msg = post_headers();
    msg.protocol_config = Some(ProtocolConfiguration {
        request_body_mode: BodySendMode::FullDuplexStreamed as i32,
        response_body_mode: BodySendMode::FullDuplexStreamed as i32,
        send_body_without_waiting_for_header_response: false,
    });
    assert!(
        m.handle(msg).is_ok(),
        "send_body_without_waiting is not required"
    );
}

#[test]
fn out_of_order_messages_are_rejected() {
    let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
    assert_eq!(
        m.handle(body(CHAT, true)).unwrap_err().code(),
        tonic::Code::FailedPrecondition
    );
    m.handle(post_headers()).unwrap();
    assert_eq!(
        m.handle(post_headers()).unwrap_err().code(),
        tonic::Code::FailedPrecondition,
        "headers twice"
    );
    assert_eq!(core.live_bookings(), 0);
}

pub(super) fn str_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

pub(super) fn response_session_header(step: &Step) -> Option<String> {
    let R::ResponseHeaders(h) = step.responses[0].response.as_ref().unwrap() else {
        panic!("not response headers")
    };
    h.response
        .as_ref()
        .and_then(|c| c.header_mutation.as_ref())
        .and_then(|m| set_value(m, "x-dynamo-session-id"))
}

// ---------------------------------------------------------------------------------------------
// Bad input (issue #9): every case gets a clear answer, never a panic, and leaves no booking.

pub(super) fn raw_headers(pairs: &[(&str, &[u8])]) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: k.to_string(),
                        value: String::new(),
                        raw_value: v.to_vec(),
                    })
                    .collect(),
            }),
            ..Default::default()
        })),
        ..Default::default()
    }
}

pub(super) fn request_trailers() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestTrailers(
            HttpTrailers::default(),
        )),
        ..Default::default()
    }
}

pub(super) fn response_trailers() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseTrailers(
            HttpTrailers::default(),
        )),
        ..Default::default()
    }
}

/// Headers + one body message; the status of the answer (200 = routed) and the live bookings.
pub(super) fn outcome(
    core: &Arc<SelectionCore>,
    headers: ProcessingRequest,
    payload: &[u8],
) -> u16 {
    let mut m = StreamMachine::new(Arc::clone(core), Arc::new(ExtProcSettings::default()));
    assert!(m.handle(headers).unwrap().responses.is_empty());
    let step = m.handle(body(payload, true)).unwrap();
    let status = if step.finished {
        immediate_status(&step).0
    } else {
        assert!(set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER).is_some());
        assert_eq!(core.live_bookings(), 1);
        200
    };
    drop(m);
    assert_eq!(core.live_bookings(), 0, "no booking outlives its stream");
    status
}

pub(super) fn pool_core() -> Arc<SelectionCore> {
    setup(default_pool(), ExtProcSettings::default()).0
}

#[test]
fn out_of_order_sequences_are_errors_without_leaks() {
    type Seq = Vec<ProcessingRequest>;
    let routed = || vec![post_headers(), body(CHAT, true)];
    let cases: Vec<(&str, Seq, ProcessingRequest)> = vec![
        ("body before headers", vec![], body(CHAT, true)),
        ("trailers before headers", vec![], request_trailers()),
        ("headers twice", vec![post_headers()], post_headers()),
        ("headers again after routing", routed(), post_headers()),
        ("body again after routing", routed(), body(CHAT, true)),
    ];
    for (what, before, bad) in cases {
        let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
        for msg in before {
            m.handle(msg).unwrap();
        }
        let err = m.handle(bad).expect_err(what);
        assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{what}");
        assert!(!err.message().is_empty());
        // The gRPC stream ends with the error: the machine is dropped with it.
        drop(m);
        assert_eq!(core.live_bookings(), 0, "{what}");
    }
}

#[test]
fn empty_and_flow_control_messages_are_harmless() {
    let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
    assert!(m
        .handle(ProcessingRequest::default())
        .unwrap()
        .responses
        .is_empty());
    m.handle(post_headers()).unwrap();
    // A request trailers message ends the body like end_of_stream does.
    m.handle(body(CHAT, false)).unwrap();
    let step = m.handle(request_trailers()).unwrap();
    assert!(!step.finished);
    assert_eq!(core.live_bookings(), 1);
    m.handle(response_headers("text/event-stream")).unwrap();
    // Response bodies that are not SSE / JSON at all are echoed, never parsed into a panic.
    let mut deep = b"data: ".to_vec();
    deep.extend(std::iter::repeat_n(b'[', 100_000));
    deep.extend_from_slice(b"\n\ndata: \xff\xfe\n\n");
    let step = m.handle(response_body(&deep, false)).unwrap();
    assert_eq!(streamed(&step.responses[0]).0, &deep[..]);
    m.handle(response_trailers()).unwrap();
    assert_eq!(core.live_bookings(), 0, "trailers end the response");
}

pub(super) fn tokenizer_settings_with(limits: crate::tokenize::TokenizeLimits) -> ExtProcSettings {
    let dir = std::env::temp_dir().join(format!("kvpick-tok-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("tokenizer.json"),
        crate::tokenize::prefix_cache::testutil::tokenizer_json(),
    )
    .unwrap();
    let entries: Vec<crate::tokenize::ModelEntry> = serde_yaml::from_str(
        "- model: m\n  tokenizer_json: tokenizer.json\n  chat_template: \"{% for m in messages %}{{ m.role }}: {{ m.content }}\\n{% endfor %}\"\n",
    )
    .unwrap();
    let tokenizers =
        crate::tokenize::Tokenizers::from_entries(&entries, &dir, &prometheus::Registry::new())
            .unwrap()
            .with_limits(limits);
    std::fs::remove_dir_all(&dir).unwrap();
    ExtProcSettings {
        tokenizers: Some(Arc::new(tokenizers)),
        ..ExtProcSettings::default()
    }
}

pub(super) fn budget_settings(limit: usize) -> ExtProcSettings {
    ExtProcSettings {
        body_budget: crate::hosts::extproc::BodyBudget::unmetered(limit),
        ..ExtProcSettings::default()
    }
}

/// Envoy's local replies (431 for oversized headers, 400, ...) run the response path through
/// ext_proc before the request was routed, even before any request message: each message is
/// passed through unchanged, nothing is booked, and a request message after it is ignored.
#[test]
fn local_replies_before_routing_pass_through_unchanged() {
    let settings = Arc::new(budget_settings(1 << 20));
    let core = pool_core();
    type Seq = Vec<ProcessingRequest>;
    let cases: Vec<(&str, Seq)> = vec![
        ("before any request message", vec![]),
        ("after the request headers", vec![post_headers()]),
        ("mid-body", vec![post_headers(), body(&CHAT[..10], false)]),
    ];
    for (what, before) in cases {
        let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
        for msg in before {
            assert!(m.handle(msg).unwrap().responses.is_empty(), "{what}");
        }
        let step = m.handle(response_headers("text/plain")).expect(what);
        assert!(!step.finished);
        assert_eq!(step.responses.len(), 1, "{what}");
        match &*step.responses[0] {
            ProcessingResponse {
                response: Some(R::ResponseHeaders(HeadersResponse { response: None })),
                dynamic_metadata: None,
                ..
            } => {}
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!(
            settings.body_budget.in_use(),
            0,
            "{what}: the request body is dropped"
        );
        let reply = b"Request Header Fields Too Large";
        let step = m.handle(response_body(&reply[..7], false)).expect(what);
        assert_eq!(streamed(&step.responses[0]), (&reply[..7], false), "{what}");
        let step = m.handle(response_body(&reply[7..], true)).expect(what);
        assert_eq!(streamed(&step.responses[0]), (&reply[7..], true), "{what}");
        let step = m.handle(response_trailers()).expect(what);
        assert!(
            matches!(
                step.responses.iter().map(|r| &**r).collect::<Vec<_>>()[..],
                [ProcessingResponse {
                    response: Some(R::ResponseTrailers(_)),
                    ..
                }]
            ),
            "{what}"
        );
        // Request messages that still arrive are ignored, not errors.
        assert!(
            m.handle(body(CHAT, true)).unwrap().responses.is_empty(),
            "{what}"
        );
        assert_eq!(core.live_bookings(), 0, "{what}: nothing booked");
    }
    // A response body alone (no headers first) passes too.
    let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
    let step = m.handle(response_body(b"x", true)).unwrap();
    assert_eq!(streamed(&step.responses[0]), (&b"x"[..], true));
    assert_eq!(core.live_bookings(), 0);
}

pub(super) fn rewrite_settings(rules: &str) -> ExtProcSettings {
    let content = crate::sources::flow::static_file::parse_flow_config(rules).unwrap();
    let policy = crate::sources::flow::FlowPolicy::new(content.objectives, content.rules);
    let (tx, rx) = tokio::sync::watch::channel(Arc::new(policy));
    std::mem::forget(tx); // the policy stays as it is for the test
    ExtProcSettings {
        flow_policy: Some(rx),
        ..Default::default()
    }
}

pub(super) fn response_status(status: &str) -> ProcessingRequest {
    let mut h = headers(
        &[(":status", status), ("content-type", "application/json")],
        false,
    );
    if let Some(processing_request::Request::RequestHeaders(inner)) = h.request.take() {
        h.request = Some(processing_request::Request::ResponseHeaders(inner));
    }
    h
}

/// Flow control: a core whose one rank takes one request at a time.
pub(super) fn one_at_a_time(timeout: std::time::Duration) -> Arc<SelectionCore> {
    crate::selection::one_rank_core(CoreConfig {
        seed: Some(1),
        flow: kvpick_core::FlowConfig {
            queue_timeout: timeout,
            saturation: crate::selection::ONE_SLOT,
            ..kvpick_core::FlowConfig::default()
        },
        ..Default::default()
    })
}
