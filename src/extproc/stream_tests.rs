use super::*;
use crate::catalog::{RankLayout, WorkerSpec};
use crate::metrics::Metrics;
use crate::request::Prompt;
use crate::selection::{CoreConfig, PromptInput, SelectionRequest};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue, Metadata};
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, HeaderMutation, HttpBody, HttpHeaders, HttpTrailers, ProcessingRequest,
    ProtocolConfiguration,
};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use processing_response::Response as R;

fn worker(name: &str, model: &str, layout: RankLayout) -> WorkerSpec {
    WorkerSpec::for_test(name, model, layout)
}

fn setup(
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

fn default_pool() -> Vec<WorkerSpec> {
    vec![worker("a", "m", RankLayout::PerPort(vec![8000, 8001]))]
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> ProcessingRequest {
    let raw: Vec<(&str, &[u8])> = pairs.iter().map(|(k, v)| (*k, v.as_bytes())).collect();
    let mut request = raw_headers(&raw);
    if let Some(processing_request::Request::RequestHeaders(h)) = &mut request.request {
        h.end_of_stream = end_of_stream;
    }
    request
}

/// A core that honours pins, over the default pool.
fn pin_core() -> Arc<SelectionCore> {
    let core = SelectionCore::new(
        CoreConfig {
            allow_pins: true,
            ..Default::default()
        },
        Metrics::new(),
    );
    core.apply_snapshot(default_pool()).unwrap();
    core
}

fn post_headers() -> ProcessingRequest {
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

fn body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_body(bytes: &[u8], end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseBody(HttpBody {
            body: bytes.to_vec(),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn response_headers(content_type: &str) -> ProcessingRequest {
    let mut h = headers(&[(":status", "200"), ("content-type", content_type)], false);
    if let Some(processing_request::Request::RequestHeaders(inner)) = h.request.take() {
        h.request = Some(processing_request::Request::ResponseHeaders(inner));
    }
    h
}

const CHAT: &[u8] = br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#;

fn header_mutation(r: &ProcessingResponse) -> &HeaderMutation {
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

fn set_value(m: &HeaderMutation, key: &str) -> Option<String> {
    m.set_headers
        .iter()
        .map(|o| o.header.as_ref().unwrap())
        .find(|h| h.key == key)
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
}

fn metadata_destination(r: &ProcessingResponse) -> String {
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
fn streamed(r: &Outbound) -> (&[u8], bool) {
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

fn immediate_status(step: &Step) -> (u16, String) {
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
fn headers_are_withheld_until_body_end_then_ordered() {
    let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
    assert!(m.handle(post_headers()).unwrap().responses.is_empty());
    assert!(m
        .handle(body(&CHAT[..10], false))
        .unwrap()
        .responses
        .is_empty());
    let step = m.handle(body(&CHAT[10..], true)).unwrap();
    assert_eq!(
        step.responses.len(),
        2,
        "headers response then one body chunk"
    );
    let mutation = header_mutation(&step.responses[0]);
    let dest = set_value(mutation, DESTINATION_HEADER).unwrap();
    assert_eq!(dest, metadata_destination(&step.responses[0]));
    assert!(dest == "127.0.0.1:8000" || dest == "127.0.0.1:8001");
    let R::RequestHeaders(h) = step.responses[0].response.as_ref().unwrap() else {
        unreachable!()
    };
    assert!(h.response.as_ref().unwrap().clear_route_cache);
    assert_eq!(
        set_value(mutation, "x-dynamo-dp-rank").unwrap(),
        if dest.ends_with("8000") { "0" } else { "1" }
    );
    assert!(set_value(mutation, "x-data-parallel-rank").is_none());
    let (echo, eos) = streamed(&step.responses[1]);
    assert_eq!(echo, CHAT);
    assert!(eos);
    assert_eq!(core.live_bookings(), 1);
    assert_eq!(m.booking_id(), Some("req-1"));
}

#[test]
fn large_body_is_echoed_in_bounded_chunks() {
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    let mut big = br#"{"model":"m","prompt":""#.to_vec();
    big.extend(std::iter::repeat_n(b'x', 200_000));
    big.extend_from_slice(br#""}"#);
    m.handle(post_headers()).unwrap();
    let step = m.handle(body(&big, true)).unwrap();
    let chunks: Vec<(&[u8], bool)> = step.responses[1..].iter().map(streamed).collect();
    assert_eq!(chunks.len(), big.len().div_ceil(MAX_BODY_CHUNK));
    assert!(chunks
        .iter()
        .all(|(c, _)| c.len() <= MAX_BODY_CHUNK && !c.is_empty()));
    assert!(chunks[..chunks.len() - 1].iter().all(|(_, eos)| !eos));
    assert!(chunks.last().unwrap().1);
    let joined: Vec<u8> = chunks.iter().flat_map(|(c, _)| c.to_vec()).collect();
    assert_eq!(joined, big);
}

#[test]
fn header_only_request_is_routed_at_once() {
    let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
    let step = m
        .handle(headers(
            &[(":method", "GET"), (":path", "/v1/models")],
            true,
        ))
        .unwrap();
    assert_eq!(step.responses.len(), 1);
    let mutation = header_mutation(&step.responses[0]);
    assert!(set_value(mutation, DESTINATION_HEADER).is_some());
    assert!(
        set_value(mutation, "x-request-id").is_some(),
        "minted request id"
    );
    assert_eq!(core.live_bookings(), 1);
    drop(m);
    assert_eq!(core.live_bookings(), 0, "dropped stream frees its booking");
}

#[test]
fn trailers_after_body_and_trailers_ending_the_body() {
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(post_headers()).unwrap();
    m.handle(body(CHAT, true)).unwrap();
    let trailers = ProcessingRequest {
        request: Some(processing_request::Request::RequestTrailers(
            HttpTrailers::default(),
        )),
        ..Default::default()
    };
    let step = m.handle(trailers.clone()).unwrap();
    assert!(matches!(
        step.responses[0].response,
        Some(R::RequestTrailers(_))
    ));

    // Body without end_of_stream, ended by trailers: route, echo (no eos), then trailers.
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(post_headers()).unwrap();
    m.handle(body(CHAT, false)).unwrap();
    let step = m.handle(trailers).unwrap();
    assert_eq!(step.responses.len(), 3);
    assert!(matches!(
        step.responses[0].response,
        Some(R::RequestHeaders(_))
    ));
    assert_eq!(streamed(&step.responses[1]), (CHAT, false));
    assert!(matches!(
        step.responses[2].response,
        Some(R::RequestTrailers(_))
    ));
}

#[test]
fn client_errors_are_immediate_responses() {
    let cases: [(&[u8], u16, &str); 3] = [
        (b"{not json", 400, "malformed JSON"),
        (br#"{"messages":[]}"#, 400, "missing `model`"),
        (
            br#"{"model":"unknown"}"#,
            503,
            "no ready worker serves model unknown",
        ),
    ];
    for (payload, status, text) in cases {
        let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
        m.handle(post_headers()).unwrap();
        let (code, msg) = immediate_status(&m.handle(body(payload, true)).unwrap());
        assert_eq!(code, status);
        assert!(msg.starts_with(&format!("kvpick: {status}: ")), "{msg}");
        assert!(msg.contains(text), "{msg}");
        assert_eq!(core.live_bookings(), 0);
        // Anything after an immediate response is ignored.
        assert!(m.handle(body(b"", true)).unwrap().responses.is_empty());
    }
}

#[test]
fn body_over_limit_is_413_as_soon_as_it_is_exceeded() {
    let (_core, mut m) = setup(
        default_pool(),
        ExtProcSettings {
            max_body_bytes: 100,
            ..Default::default()
        },
    );
    m.handle(post_headers()).unwrap();
    assert!(m
        .handle(body(&[b' '; 60], false))
        .unwrap()
        .responses
        .is_empty());
    let (code, _) = immediate_status(&m.handle(body(&[b' '; 60], false)).unwrap());
    assert_eq!(code, 413);
}

/// A body whose `content-length` is over the limit is refused at the headers, before a byte
/// of it is buffered; one declared at the limit goes on.
#[test]
fn a_declared_length_over_the_limit_is_413_at_the_headers() {
    let settings = || ExtProcSettings {
        max_body_bytes: 100,
        ..Default::default()
    };
    let post = |len: &str| {
        headers(
            &[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("content-type", "application/json"),
                ("content-length", len),
            ],
            false,
        )
    };
    let (_core, mut m) = setup(default_pool(), settings());
    let (code, _) = immediate_status(&m.handle(post("101")).unwrap());
    assert_eq!(code, 413);
    let (_core, mut m) = setup(default_pool(), settings());
    assert!(m.handle(post("100")).unwrap().responses.is_empty());
}

#[test]
fn empty_catalog_is_503() {
    let (_core, mut m) = setup(vec![], ExtProcSettings::default());
    m.handle(post_headers()).unwrap();
    let (code, msg) = immediate_status(&m.handle(body(CHAT, true)).unwrap());
    assert_eq!(code, 503);
    assert!(msg.contains("no ready worker"), "{msg}");
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

fn with_subset(mut msg: ProcessingRequest, value: Value) -> ProcessingRequest {
    let hint = Struct {
        fields: [(SUBSET_KEY.to_string(), value)].into(),
    };
    msg.metadata_context = Some(Metadata {
        filter_metadata: [(SUBSET_NAMESPACE.to_string(), hint)].into(),
        ..Default::default()
    });
    msg
}

fn str_value(s: &str) -> Value {
    Value {
        kind: Some(Kind::StringValue(s.into())),
    }
}

#[test]
fn subset_hint_as_list_or_comma_string() {
    let pool = vec![
        worker("a", "m", RankLayout::PerPort(vec![8000, 8001])),
        worker("b", "m", RankLayout::PerPort(vec![9000])),
    ];
    let hints = [
        Value {
            kind: Some(Kind::ListValue(ListValue {
                values: vec![str_value("127.0.0.1:8001"), str_value("10.9.9.9")],
            })),
        },
        str_value("10.9.9.9, 127.0.0.1:8001"),
    ];
    for hint in hints {
        for _ in 0..10 {
            let (_core, mut m) = setup(pool.clone(), ExtProcSettings::default());
            m.handle(with_subset(post_headers(), hint.clone())).unwrap();
            let step = m.handle(body(CHAT, true)).unwrap();
            let dest = set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER);
            assert_eq!(dest.as_deref(), Some("127.0.0.1:8001"));
        }
    }
    let (_core, mut m) = setup(pool, ExtProcSettings::default());
    m.handle(with_subset(post_headers(), str_value("garbage,,")))
        .unwrap();
    let (code, msg) = immediate_status(&m.handle(body(CHAT, true)).unwrap());
    assert_eq!(code, 503);
    assert!(msg.contains("subset"), "{msg}");
}

#[test]
fn spoofed_headers_are_removed_and_fallbacks_listed() {
    let pool = vec![
        worker("a", "m", RankLayout::PerPort(vec![8000])),
        worker("b", "m", RankLayout::PerPort(vec![9000])),
    ];
    let (_core, mut m) = setup(
        pool,
        ExtProcSettings {
            fallbacks: 1,
            ..Default::default()
        },
    );
    m.handle(headers(
        &[
            (":method", "POST"),
            ("x-gateway-destination-endpoint", "6.6.6.6:1"),
            ("x-gateway-destination-endpoint-subset", "6.6.6.6"),
            ("X-Gateway-Inference-Objective", "x"),
            // Read (a target model, as llm-d-router reads it), then kept from the upstream.
            ("x-gateway-model-name-rewrite", "m"),
            ("x-data-parallel-rank", "7"),
        ],
        false,
    ))
    .unwrap();
    let step = m.handle(body(CHAT, true)).unwrap();
    let mutation = header_mutation(&step.responses[0]);
    let dest = set_value(mutation, DESTINATION_HEADER).unwrap();
    let parts: Vec<&str> = dest.split(',').collect();
    assert_eq!(parts.len(), 2);
    assert_ne!(parts[0], parts[1]);
    assert_eq!(metadata_destination(&step.responses[0]), dest);
    let mut removed = mutation.remove_headers.clone();
    removed.sort();
    assert_eq!(
        removed,
        vec![
            "x-data-parallel-rank",
            "x-gateway-destination-endpoint-subset",
            "x-gateway-inference-objective",
            "x-gateway-model-name-rewrite",
        ]
    );
}

#[test]
fn multiplexed_rank_header() {
    let pool = vec![worker(
        "a",
        "m",
        RankLayout::Multiplexed {
            port: 8000,
            size: 2,
        },
    )];
    let mut seen = std::collections::BTreeSet::new();
    let (core, _) = setup(pool, ExtProcSettings::default());
    let settings = Arc::new(ExtProcSettings::default());
    for _ in 0..40 {
        let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
        m.handle(post_headers()).unwrap();
        let step = m.handle(body(CHAT, true)).unwrap();
        let mutation = header_mutation(&step.responses[0]);
        assert_eq!(
            set_value(mutation, DESTINATION_HEADER).unwrap(),
            "127.0.0.1:8000"
        );
        let rank = set_value(mutation, "x-data-parallel-rank").unwrap();
        assert_eq!(set_value(mutation, "x-dynamo-dp-rank").unwrap(), rank);
        seen.insert(rank);
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec!["0", "1"]);
}

#[test]
fn response_is_echoed_chunk_by_chunk_and_frees_the_booking() {
    let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(post_headers()).unwrap();
    m.handle(body(CHAT, true)).unwrap();
    let step = m.handle(response_headers("text/event-stream")).unwrap();
    assert!(matches!(
        step.responses[0].response,
        Some(R::ResponseHeaders(_))
    ));
    let sse = b"data: {\"choices\":[]}\n\ndata: {\"usage\":{\"prompt_tokens\":10,\"completion_tokens\":3,\"prompt_tokens_details\":{\"cached_tokens\":4}}}\n\ndata: [DONE]\n\n";
    let (first, rest) = sse.split_at(50);
    let step = m.handle(response_body(first, false)).unwrap();
    assert_eq!(streamed(&step.responses[0]), (first, false));
    assert_eq!(core.live_bookings(), 1);
    let step = m.handle(response_body(rest, true)).unwrap();
    assert_eq!(streamed(&step.responses[0]), (rest, true));
    assert_eq!(core.live_bookings(), 0);
    let usage = &core.metrics().extproc.usage_tokens;
    assert_eq!(usage.with_label_values(&["prompt"]).get(), 10);
    assert_eq!(usage.with_label_values(&["cached"]).get(), 4);
    assert_eq!(
        core.metrics()
            .extproc
            .requests
            .with_label_values(&["200"])
            .get(),
        1
    );
}

#[test]
fn served_endpoint_metadata_moves_booking_and_conformance_echo() {
    let pool = vec![
        worker("a", "m", RankLayout::PerPort(vec![8000])),
        worker("b", "m", RankLayout::PerPort(vec![9000])),
    ];
    let (core, mut m) = setup(
        pool,
        ExtProcSettings {
            conformance_test_mode: true,
            ..Default::default()
        },
    );
    let mut h = post_headers();
    if let Some(processing_request::Request::RequestHeaders(inner)) = &mut h.request {
        inner.headers.as_mut().unwrap().headers.push(HeaderValue {
            key: CONFORMANCE_SELECTION_HEADER.into(),
            value: "127.0.0.1:8000".into(),
            raw_value: vec![],
        });
    }
    m.handle(h).unwrap();
    let step = m.handle(body(CHAT, true)).unwrap();
    assert_eq!(
        set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:8000")
    );
    let mut rh = response_headers("application/json");
    rh.metadata_context = Some(Metadata {
        filter_metadata: [(
            LB_NAMESPACE.to_string(),
            Struct {
                fields: [(
                    SERVED_KEY.to_string(),
                    str_value("127.0.0.1:8000,127.0.0.1:9000"),
                )]
                .into(),
            },
        )]
        .into(),
        ..Default::default()
    });
    let step = m.handle(rh).unwrap();
    let R::ResponseHeaders(h) = step.responses[0].response.as_ref().unwrap() else {
        unreachable!()
    };
    let served = set_value(
        h.response
            .as_ref()
            .unwrap()
            .header_mutation
            .as_ref()
            .unwrap(),
        CONFORMANCE_SERVED_HEADER,
    );
    assert_eq!(served.as_deref(), Some("127.0.0.1:9000"));
    let loads: Vec<u64> = core
        .list_workers(None)
        .iter()
        .map(|w| w.loads[0].active_requests)
        .collect();
    assert_eq!(loads, vec![0, 1], "booking moved to the served endpoint");
}

fn response_session_header(step: &Step) -> Option<String> {
    let R::ResponseHeaders(h) = step.responses[0].response.as_ref().unwrap() else {
        panic!("not response headers")
    };
    h.response
        .as_ref()
        .and_then(|c| c.header_mutation.as_ref())
        .and_then(|m| set_value(m, "x-dynamo-session-id"))
}

fn session_turn(core: &Arc<SelectionCore>, extra: &[(&str, &str)]) -> (String, Option<String>) {
    let mut pairs = vec![(":method", "POST"), ("content-type", "application/json")];
    pairs.extend_from_slice(extra);
    let mut m = StreamMachine::new(Arc::clone(core), Arc::new(ExtProcSettings::default()));
    m.handle(headers(&pairs, false)).unwrap();
    let step = m.handle(body(CHAT, true)).unwrap();
    let dest = set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER).unwrap();
    let echoed = response_session_header(&m.handle(response_headers("application/json")).unwrap());
    (dest, echoed)
}

#[test]
fn session_headers_bind_echo_and_prefer_dynamo() {
    let pool = vec![
        worker("a", "m", RankLayout::PerPort(vec![8000, 8001])),
        worker("b", "m", RankLayout::PerPort(vec![9000, 9001])),
    ];
    let (core, _) = setup(pool, ExtProcSettings::default());
    let (home, echoed) = session_turn(&core, &[("x-session-id", "s1")]);
    assert_eq!(echoed.as_deref(), Some("s1"));
    for _ in 0..10 {
        assert_eq!(session_turn(&core, &[("x-session-id", "s1")]).0, home);
        // x-dynamo-session-id outranks the fallbacks.
        let (dest, echoed) = session_turn(
            &core,
            &[
                ("x-claude-code-session-id", "other"),
                ("x-dynamo-session-id", "s1"),
            ],
        );
        assert_eq!(dest, home);
        assert_eq!(echoed.as_deref(), Some("s1"));
    }
    // No session: no echo.
    assert_eq!(session_turn(&core, &[]).1, None);
}

#[test]
fn overlong_session_id_is_400() {
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    let long = "s".repeat(257);
    m.handle(headers(
        &[(":method", "POST"), ("x-claude-code-session-id", &long)],
        false,
    ))
    .unwrap();
    let (code, msg) = immediate_status(&m.handle(body(CHAT, true)).unwrap());
    assert_eq!(code, 400);
    assert!(msg.contains("longer than 256 bytes"), "{msg}");
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(headers(
        &[
            (":method", "POST"),
            ("x-dynamo-session-id", &"s".repeat(256)),
        ],
        false,
    ))
    .unwrap();
    assert!(!m.handle(body(CHAT, true)).unwrap().finished);
}

#[test]
fn bad_pins_and_priorities_are_400() {
    let core = pin_core();
    for (pairs, text) in [
        (
            vec![("x-dynamo-dp-rank", "1")],
            "needs x-dynamo-worker-instance-id",
        ),
        (
            vec![("x-dynamo-worker-instance-id", "abc")],
            "decimal worker id",
        ),
        (
            vec![("x-dynamo-request-priority", "high")],
            "must be an integer",
        ),
    ] {
        let mut m = StreamMachine::new(Arc::clone(&core), Arc::new(ExtProcSettings::default()));
        m.handle(headers(&pairs, false)).unwrap();
        let (code, msg) = immediate_status(&m.handle(body(CHAT, true)).unwrap());
        assert_eq!(code, 400, "{pairs:?}");
        assert!(msg.contains(text), "{msg}");
    }
}

// ---------------------------------------------------------------------------------------------
// Bad input (issue #9): every case gets a clear answer, never a panic, and leaves no booking.

fn raw_headers(pairs: &[(&str, &[u8])]) -> ProcessingRequest {
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

fn request_trailers() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestTrailers(
            HttpTrailers::default(),
        )),
        ..Default::default()
    }
}

fn response_trailers() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::ResponseTrailers(
            HttpTrailers::default(),
        )),
        ..Default::default()
    }
}

/// Headers + one body message; the status of the answer (200 = routed) and the live bookings.
fn outcome(core: &Arc<SelectionCore>, headers: ProcessingRequest, payload: &[u8]) -> u16 {
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

fn pool_core() -> Arc<SelectionCore> {
    setup(default_pool(), ExtProcSettings::default()).0
}

#[test]
fn malformed_bodies_are_400() {
    let core = pool_core();
    let nested_open = {
        let mut b = br#"{"model":"m","messages":"#.to_vec();
        b.extend(std::iter::repeat_n(b'[', 100_000));
        b
    };
    let top_level_nested = vec![b'['; 100_000];
    let nested_objects = {
        let mut b = br#"{"model":"m","x":"#.to_vec();
        for _ in 0..50_000 {
            b.extend_from_slice(br#"{"a":"#);
        }
        b
    };
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        (
            "invalid UTF-8 in a string",
            b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}"
                .to_vec(),
            400,
        ),
        (
            "invalid UTF-8 in the model",
            b"{\"model\":\"m\xc3\x28\"}".to_vec(),
            400,
        ),
        ("binary garbage", vec![0x00, 0xff, 0x13, 0x37, 0x80], 400),
        ("NUL bytes", b"{\"model\":\"m\"}\0\0".to_vec(), 400),
        ("truncated", br#"{"model":"m","messages":[{"#.to_vec(), 400),
        ("100k unclosed [", nested_open, 400),
        ("100k [ at top level", top_level_nested, 400),
        ("50k nested objects", nested_objects, 400),
        (
            "huge exponent model",
            br#"{"model":1e999999}"#.to_vec(),
            400,
        ),
        ("model as an object", br#"{"model":{"a":1}}"#.to_vec(), 400),
        ("a JSON string", br#""model""#.to_vec(), 400),
        ("null", b"null".to_vec(), 400),
        (
            "duplicate model keys",
            br#"{"model":"m","model":"m"}"#.to_vec(),
            400,
        ),
    ];
    for (what, payload, want) in cases {
        assert_eq!(outcome(&core, post_headers(), &payload), want, "{what}");
    }
}

#[test]
fn odd_but_valid_bodies_route() {
    let core = pool_core();
    let huge_ids = br#"{"model":"m","prompt":[99999999999999999999999999,1e999,-1]}"#;
    let long_string = format!(
        r#"{{"model":"m","prompt":"{}"}}"#,
        "x".repeat(4 * 1024 * 1024)
    );
    // Well-formed but 100k deep: the prompt-bearing fields are kept as raw JSON, which serde_json
    // skips over without recursion, so this is routed (the engine judges the content).
    let nested_closed = {
        let mut b = br#"{"model":"m","messages":"#.to_vec();
        b.extend(std::iter::repeat_n(b'[', 100_000));
        b.extend(std::iter::repeat_n(b']', 100_000));
        b.extend_from_slice(br#","unknown":"#);
        b.extend(std::iter::repeat_n(b'[', 100_000));
        b.extend(std::iter::repeat_n(b']', 100_000));
        b.push(b'}');
        b
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "100k closed [ in messages and an unknown field",
            nested_closed,
        ),
        ("token ids out of u32 range", huge_ids.to_vec()),
        (
            "huge numbers elsewhere",
            br#"{"model":"m","max_tokens":1e308,"n":123456789012345678901234567890}"#.to_vec(),
        ),
        (
            "escaped NUL and lone surrogate text",
            br#"{"model":"m","prompt":"a\u0000b\ud800"}"#.to_vec(),
        ),
        ("4 MiB prompt", long_string.into_bytes()),
        (
            "stream not a bool",
            br#"{"model":"m","stream":"yes"}"#.to_vec(),
        ),
        (
            "cache_salt not a string",
            br#"{"model":"m","cache_salt":[1,2]}"#.to_vec(),
        ),
    ];
    for (what, payload) in cases {
        assert_eq!(outcome(&core, post_headers(), &payload), 200, "{what}");
    }
    // A body that is not JSON by its content type is routed on load alone, unparsed.
    let binary = raw_headers(&[
        (":method", b"POST"),
        ("content-type", b"application/octet-stream"),
    ]);
    assert_eq!(outcome(&core, binary, &[0xff, 0x00, 0xfe]), 200);
}

#[test]
fn session_ids_that_differ_only_in_invalid_bytes_stay_distinct() {
    let core = pin_core();
    let with_session = |sid: &[u8]| {
        raw_headers(&[
            (":method", b"POST"),
            (":path", b"/v1/chat/completions"),
            ("content-type", b"application/json"),
            ("x-dynamo-session-id", sid),
        ])
    };
    assert_eq!(outcome(&core, with_session(&[0xff; 8]), CHAT), 200);
    assert_eq!(outcome(&core, with_session(&[0xfe; 8]), CHAT), 200);
    assert_eq!(outcome(&core, with_session(b"plain"), CHAT), 200);
    assert_eq!(
        core.metrics().selection.sessions_live.get(),
        3,
        "a lossy conversion would have made the first two one session"
    );
}

#[test]
fn invalid_utf8_and_binary_header_values() {
    let core = pin_core();
    let h = |extra: &[(&str, &[u8])]| {
        let mut pairs: Vec<(&str, &[u8])> = vec![
            (":method", b"POST"),
            (":path", b"/v1/chat/completions"),
            ("content-type", b"application/json"),
        ];
        pairs.extend_from_slice(extra);
        raw_headers(&pairs)
    };
    // Values that carry no routing meaning are accepted as they are.
    for extra in [
        &[("x-request-id", &b"\xff\xfe\x00id"[..])][..],
        &[("x-session-id", &b"\xc3\x28\x00\x01"[..])][..],
        &[("x-anything", &[0u8, 1, 2, 255][..])][..],
        &[("x-request-id", &[b'r'; 65_536][..])][..],
    ] {
        assert_eq!(outcome(&core, h(extra), CHAT), 200, "{extra:?}");
    }
    // A session id of 200 invalid bytes is 200 bytes, under the 256-byte limit (it used to be
    // measured after the lossy UTF-8 conversion, which makes it 600).
    assert_eq!(
        outcome(&core, h(&[("x-dynamo-session-id", &[0xff; 200])]), CHAT),
        200
    );
    assert_eq!(
        outcome(&core, h(&[("x-dynamo-session-id", &[0xff; 257])]), CHAT),
        400
    );
    assert_eq!(
        outcome(&core, h(&[("x-dynamo-session-id", &[b's'; 1 << 20])]), CHAT),
        400
    );
    // Values that must be numbers are 400 when they are bytes.
    for extra in [
        &[("x-dynamo-request-priority", &b"\xff"[..])][..],
        &[("x-dynamo-request-priority", &b"1\x00"[..])][..],
        &[("x-dynamo-request-priority", &b"99999999999999999999"[..])][..],
        &[("x-dynamo-worker-instance-id", &b"\x00\x01"[..])][..],
        &[("x-dynamo-worker-instance-id", &b"18446744073709551616"[..])][..],
        &[
            ("x-dynamo-worker-instance-id", &b"1"[..]),
            ("x-dynamo-dp-rank", &b"\xff"[..]),
        ][..],
    ] {
        assert_eq!(outcome(&core, h(extra), CHAT), 400, "{extra:?}");
    }
    // A content type that is bytes is not JSON: the body is routed unparsed.
    assert_eq!(
        outcome(&core, h(&[("content-type", b"\xff\xfe")]), b"\xff"),
        200
    );
}

#[test]
fn the_request_id_is_bounded() {
    let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(headers(&[("x-request-id", &"é".repeat(100_000))], false))
        .unwrap();
    m.handle(body(CHAT, true)).unwrap();
    assert_eq!(m.booking_id().unwrap().chars().count(), 256);
    drop(m);
    assert_eq!(core.live_bookings(), 0);
}

fn list(values: Vec<Value>) -> Value {
    Value {
        kind: Some(Kind::ListValue(ListValue { values })),
    }
}

#[test]
fn garbage_subset_hints_are_503_and_book_nothing() {
    use envoy_types::pb::google::protobuf::NullValue;
    let core = pool_core();
    let num = |n: f64| Value {
        kind: Some(Kind::NumberValue(n)),
    };
    let garbage = vec![
        ("number", num(8001.0)),
        (
            "bool",
            Value {
                kind: Some(Kind::BoolValue(true)),
            },
        ),
        (
            "null",
            Value {
                kind: Some(Kind::NullValue(NullValue::NullValue as i32)),
            },
        ),
        ("no kind", Value { kind: None }),
        (
            "struct",
            Value {
                kind: Some(Kind::StructValue(Struct {
                    fields: [("127.0.0.1:8001".to_string(), str_value("x"))].into(),
                })),
            },
        ),
        ("empty string", str_value("")),
        ("commas and spaces", str_value(" , ,, ")),
        ("empty list", list(vec![])),
        (
            "list of empty strings",
            list(vec![str_value(""), str_value(" ")]),
        ),
        ("list of numbers", list(vec![num(1.0), num(f64::NAN)])),
        ("non-IP text", str_value("localhost:8001,model-server")),
        ("port out of range", str_value("127.0.0.1:99999")),
        ("negative port", str_value("127.0.0.1:-1")),
        ("bad IPv6", str_value("[::1:8001")),
        ("control bytes", str_value("127.0.0.1\0:8001\n")),
        ("1 MiB of text", str_value(&"9".repeat(1 << 20))),
        (
            "100k entries",
            str_value(&vec!["10.0.0.1:1"; 100_000].join(",")),
        ),
    ];
    for (what, hint) in garbage {
        let status = outcome(&core, with_subset(post_headers(), hint), CHAT);
        assert_eq!(status, 503, "{what}");
    }
    // Nested lists are flattened: the strings inside still count; non-strings are skipped.
    let nested = list(vec![
        num(3.0),
        list(vec![list(vec![str_value("127.0.0.1:8001")])]),
    ]);
    for _ in 0..5 {
        let mut m = StreamMachine::new(Arc::clone(&core), Arc::new(ExtProcSettings::default()));
        m.handle(with_subset(post_headers(), nested.clone()))
            .unwrap();
        let step = m.handle(body(CHAT, true)).unwrap();
        let dest = set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER);
        assert_eq!(dest.as_deref(), Some("127.0.0.1:8001"));
    }
    assert_eq!(core.live_bookings(), 0);
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

#[test]
fn deeply_nested_json_response_is_echoed_and_frees_the_booking() {
    let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(post_headers()).unwrap();
    m.handle(body(CHAT, true)).unwrap();
    m.handle(response_headers("application/json")).unwrap();
    let mut deep = br#"{"usage":"#.to_vec();
    deep.extend(std::iter::repeat_n(b'[', 100_000));
    let step = m.handle(response_body(&deep, true)).unwrap();
    assert_eq!(streamed(&step.responses[0]), (&deep[..], true));
    assert_eq!(core.live_bookings(), 0);
}

fn tokenizer_settings() -> ExtProcSettings {
    tokenizer_settings_with(crate::tokenize::TokenizeLimits::default())
}

fn tokenizer_settings_with(limits: crate::tokenize::TokenizeLimits) -> ExtProcSettings {
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

#[test]
fn text_prompt_of_a_tokenized_model_waits_for_ids_then_routes_and_echoes_the_body() {
    for outcome in [
        crate::tokenize::TokenizeOutcome::Tokens {
            ids: (0..64).collect(),
            source: crate::tokenize::Source::Local,
            media: Vec::new(),
        },
        crate::tokenize::TokenizeOutcome::Fallback {
            reason: "test".into(),
        },
    ] {
        let (_core, mut m) = setup(default_pool(), tokenizer_settings());
        assert!(m.handle(post_headers()).unwrap().responses.is_empty());
        let step = m.handle(body(CHAT, true)).unwrap();
        assert!(step.responses.is_empty());
        let job = step.tokenize.expect("a tokenization job");
        assert_eq!(job.model, "m");
        assert_eq!(&job.body[..], CHAT);
        let step = m.resume(outcome);
        assert!(!step.finished);
        assert_eq!(step.responses.len(), 2);
        let dest = set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER).unwrap();
        assert!(dest.starts_with("10.") || dest.contains(':'), "{dest}");
        assert_eq!(streamed(&step.responses[1]), (CHAT, true));
    }
}

fn post_to(path: &str) -> ProcessingRequest {
    headers(
        &[
            (":method", "POST"),
            (":path", path),
            ("content-type", "application/json"),
        ],
        false,
    )
}

#[test]
fn anthropic_messages_and_sglang_generate_are_tokenized_with_their_path() {
    // /v1/messages: a text prompt of the named model, tokenized as an Anthropic body.
    let (_core, mut m) = setup(default_pool(), tokenizer_settings());
    m.handle(post_to("/v1/messages")).unwrap();
    let anthropic =
        br#"{"model":"m","max_tokens":8,"system":"S","messages":[{"role":"user","content":"hi"}]}"#;
    let job = m
        .handle(body(anthropic, true))
        .unwrap()
        .tokenize
        .expect("a job");
    assert_eq!(
        (job.model.as_str(), job.path.as_str()),
        ("m", "/v1/messages")
    );
    // /generate names no model: the only configured tokenizer is used, any partition routes.
    let (_core, mut m) = setup(default_pool(), tokenizer_settings());
    m.handle(post_to("/generate")).unwrap();
    let job = m
        .handle(body(br#"{"text":"hello","rid":"r1"}"#, true))
        .unwrap()
        .tokenize
        .expect("a job");
    assert_eq!((job.model.as_str(), job.path.as_str()), ("m", "/generate"));
    let step = m.resume(crate::tokenize::TokenizeOutcome::Tokens {
        ids: (0..64).collect(),
        source: crate::tokenize::Source::Local,
        media: Vec::new(),
    });
    assert!(set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER).is_some());
    // /generate with `input_ids`: routed at once on the ids, no model, no tokenizer.
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(post_to("/generate")).unwrap();
    let step = m
        .handle(body(br#"{"input_ids":[1,2,3],"stream":true}"#, true))
        .unwrap();
    assert!(step.tokenize.is_none());
    assert!(set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER).is_some());
    // Elsewhere a body without a model is still a 400.
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(post_to("/v1/messages")).unwrap();
    let step = m.handle(body(br#"{"messages":[]}"#, true)).unwrap();
    assert!(step.finished);
}

#[test]
fn tokenization_with_trailers_answers_trailers_after_routing() {
    let (_core, mut m) = setup(default_pool(), tokenizer_settings());
    m.handle(post_headers()).unwrap();
    assert!(m.handle(body(CHAT, false)).unwrap().responses.is_empty());
    let trailers = ProcessingRequest {
        request: Some(processing_request::Request::RequestTrailers(
            HttpTrailers::default(),
        )),
        ..Default::default()
    };
    let step = m.handle(trailers).unwrap();
    assert!(step.tokenize.is_some());
    let step = m.resume(crate::tokenize::TokenizeOutcome::NotApplicable);
    assert_eq!(step.responses.len(), 3);
    assert!(matches!(
        step.responses[2].response,
        Some(R::RequestTrailers(_))
    ));
}

#[test]
fn models_without_a_tokenizer_and_token_id_prompts_route_at_once() {
    let (_core, mut m) = setup(
        vec![worker("b", "other", RankLayout::PerPort(vec![8000]))],
        tokenizer_settings(),
    );
    m.handle(post_headers()).unwrap();
    let step = m
        .handle(body(br#"{"model":"other","prompt":"hi"}"#, true))
        .unwrap();
    assert!(step.tokenize.is_none());
    assert_eq!(step.responses.len(), 2);
    let (_core, mut m) = setup(default_pool(), tokenizer_settings());
    m.handle(post_headers()).unwrap();
    let step = m
        .handle(body(br#"{"model":"m","prompt":[1,2,3]}"#, true))
        .unwrap();
    assert!(step.tokenize.is_none());
    assert_eq!(step.responses.len(), 2);
}

fn budget_settings(limit: usize) -> ExtProcSettings {
    ExtProcSettings {
        body_budget: crate::extproc::BodyBudget::unmetered(limit),
        ..ExtProcSettings::default()
    }
}

#[test]
fn body_budget_is_shared_by_streams_and_returned_at_every_exit() {
    let settings = Arc::new(budget_settings(100));
    let budget = Arc::clone(&settings.body_budget);
    let core = pool_core();
    let machine = || StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));

    // A stream mid-body holds its bytes.
    let mut a = machine();
    a.handle(post_headers()).unwrap();
    a.handle(body(&CHAT[..50], false)).unwrap();
    assert_eq!(budget.in_use(), 50);

    // Another stream whose body would go over the shared budget: 503, holding nothing.
    let mut b = machine();
    b.handle(post_headers()).unwrap();
    b.handle(body(&CHAT[..30], false)).unwrap();
    let step = b.handle(body(&CHAT[30..], true)).unwrap();
    assert_eq!(
        immediate_status(&step),
        (
            503,
            "kvpick: 503: request body budget exhausted, retry later\n".into()
        )
    );
    assert_eq!(core.metrics().extproc.body_budget_rejected.get(), 1);
    assert_eq!(core.live_bookings(), 0, "a rejected stream books nothing");
    assert_eq!(budget.in_use(), 50);

    // The client goes away mid-body: dropping the stream returns its bytes.
    drop(a);
    assert_eq!(budget.in_use(), 0);

    // Routed: the echoed body keeps its bytes until the host has sent the step.
    let mut c = machine();
    c.handle(post_headers()).unwrap();
    let step = c.handle(body(CHAT, true)).unwrap();
    assert!(!step.finished);
    assert_eq!(budget.in_use(), CHAT.len());
    drop(step);
    assert_eq!(budget.in_use(), 0);
    assert_eq!(core.live_bookings(), 1);

    // Rejected after buffering (400, 413): returned at once.
    let mut d = machine();
    d.handle(post_headers()).unwrap();
    d.handle(body(b"{not json", false)).unwrap();
    assert_eq!(budget.in_use(), 9);
    let step = d.handle(body(b"", true)).unwrap();
    assert_eq!(immediate_status(&step).0, 400);
    assert_eq!(budget.in_use(), 0);
    let small = Arc::new(ExtProcSettings {
        max_body_bytes: 40,
        ..budget_settings(100)
    });
    let mut e = StreamMachine::new(Arc::clone(&core), Arc::clone(&small));
    e.handle(post_headers()).unwrap();
    e.handle(body(&CHAT[..30], false)).unwrap();
    assert_eq!(small.body_budget.in_use(), 30);
    assert_eq!(
        immediate_status(&e.handle(body(&CHAT[30..], true)).unwrap()).0,
        413
    );
    assert_eq!(small.body_budget.in_use(), 0);
}

#[test]
fn body_budget_covers_the_tokenizer_copy_until_the_body_is_echoed() {
    let base = tokenizer_settings();
    let settings = Arc::new(ExtProcSettings {
        body_budget: crate::extproc::BodyBudget::unmetered(2 * CHAT.len()),
        ..base
    });
    let budget = Arc::clone(&settings.body_budget);
    let core = pool_core();
    let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
    m.handle(post_headers()).unwrap();
    m.handle(body(&CHAT[..20], false)).unwrap();
    let step = m.handle(body(&CHAT[20..], true)).unwrap();
    let job = step.tokenize.expect("tokenization job");
    assert_eq!(&job.body[..], CHAT);
    assert_eq!(budget.in_use(), 2 * CHAT.len(), "chunks and the job's copy");
    drop(job);
    let step = m.resume(crate::tokenize::TokenizeOutcome::NotApplicable);
    // Tiny chunks are coalesced: headers, then one body chunk.
    assert_eq!(step.responses.len(), 2);
    assert_eq!(streamed(&step.responses[1]), (CHAT, true));
    drop(step);
    assert_eq!(budget.in_use(), 0);

    // Disconnected while tokenizing.
    let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
    m.handle(post_headers()).unwrap();
    assert!(m.handle(body(CHAT, true)).unwrap().tokenize.is_some());
    assert_eq!(budget.in_use(), 2 * CHAT.len());
    drop(m);
    assert_eq!(budget.in_use(), 0);

    // No room for the copy: 503 like any body over the budget.
    let tight = Arc::new(ExtProcSettings {
        body_budget: crate::extproc::BodyBudget::unmetered(CHAT.len() + 10),
        ..tokenizer_settings()
    });
    let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&tight));
    m.handle(post_headers()).unwrap();
    assert_eq!(
        immediate_status(&m.handle(body(CHAT, true)).unwrap()).0,
        503
    );
    assert_eq!(tight.body_budget.in_use(), 0);
}

#[test]
fn echoed_body_chunks_are_the_received_buffers_not_copies() {
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(post_headers()).unwrap();
    let mut first = br#"{"model":"m","prompt":""#.to_vec();
    first.extend(std::iter::repeat_n(b'x', 40_000));
    let second = [vec![b'y'; 50_000], br#""}"#.to_vec()].concat();
    let addresses = [first.as_ptr(), second.as_ptr()];
    let expected = [first.clone(), second.clone()].concat();
    assert!(m
        .handle(body_owned(first, false))
        .unwrap()
        .responses
        .is_empty());
    let step = m.handle(body_owned(second, true)).unwrap();
    let echoed: Vec<(&[u8], bool)> = step.responses[1..].iter().map(streamed).collect();
    assert_eq!(echoed.len(), 2);
    assert_eq!(
        echoed[0].0.as_ptr(),
        addresses[0],
        "first chunk moved, not copied"
    );
    assert_eq!(
        echoed[1].0.as_ptr(),
        addresses[1],
        "second chunk moved, not copied"
    );
    assert_eq!(
        echoed.iter().map(|(_, eos)| *eos).collect::<Vec<_>>(),
        [false, true]
    );
    assert_eq!([echoed[0].0, echoed[1].0].concat(), expected);
}

fn body_owned(bytes: Vec<u8>, end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: bytes,
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

#[test]
fn a_body_over_the_tokenize_cap_routes_at_once_on_load_alone() {
    let settings = tokenizer_settings_with(crate::tokenize::TokenizeLimits {
        max_body_bytes: CHAT.len() - 1,
        ..Default::default()
    });
    let tokenizers = Arc::clone(settings.tokenizers.as_ref().unwrap());
    let (_core, mut m) = setup(default_pool(), settings);
    m.handle(post_headers()).unwrap();
    let step = m.handle(body(CHAT, true)).unwrap();
    assert!(step.tokenize.is_none(), "no tokenization job");
    assert_eq!(step.responses.len(), 2, "routed and echoed at once");
    assert_eq!(streamed(&step.responses[1]), (CHAT, true));
    assert_eq!(
        tokenizers
            .metrics()
            .skipped
            .with_label_values(&["m", crate::tokenize::SKIP_BODY_TOO_LARGE])
            .get(),
        1
    );
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

/// `--shared-state`: a session this replica has no binding for waits for one lookup before its
/// pick (body and trailers are answered after routing); with Redis unreachable the lookup fails,
/// the request routes on local state, and the next one does not even try while Redis is down.
#[tokio::test]
async fn a_session_unknown_here_is_looked_up_before_its_pick_and_redis_down_never_fails_it() {
    let (core, _) = setup(default_pool(), ExtProcSettings::default());
    let config = crate::shared::SharedConfig::new(
        "unix:///nonexistent/kvpick-test-redis.sock",
        None,
        None,
        "t",
        50,
        50,
        std::time::Duration::from_secs(60),
    )
    .unwrap();
    let metrics = Metrics::new();
    let shared = crate::shared::SharedState::new(config, &metrics.registry).unwrap();
    core.attach_shared(Arc::clone(&shared));
    let settings = Arc::new(ExtProcSettings::default());
    let session_headers = || {
        headers(
            &[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("content-type", "application/json"),
                ("x-session-id", "s-1"),
            ],
            false,
        )
    };
    let trailers = || ProcessingRequest {
        request: Some(processing_request::Request::RequestTrailers(
            HttpTrailers::default(),
        )),
        ..Default::default()
    };

    let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
    m.handle(session_headers()).unwrap();
    assert!(m.handle(body(CHAT, false)).unwrap().responses.is_empty());
    let step = m.handle(trailers()).unwrap();
    assert!(
        step.responses.is_empty(),
        "nothing is answered before the pick"
    );
    let job = step
        .session_lookup
        .expect("no local binding: a lookup first");
    core.prefetch_session(job).await;
    assert!(!shared.is_up(), "the failed lookup opened an outage");
    let step = m.resume_after_lookup();
    assert_eq!(
        step.responses.len(),
        3,
        "headers, the body echo, then the trailers"
    );
    assert!(matches!(
        step.responses[0].response,
        Some(R::RequestHeaders(_))
    ));
    assert!(matches!(
        step.responses[2].response,
        Some(R::RequestTrailers(_))
    ));

    // The binding made on local state serves the next request; another session routes at
    // once too: no lookup is tried while Redis is down.
    for sid in ["s-1", "s-2"] {
        let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
        let mut h = session_headers();
        if let Some(processing_request::Request::RequestHeaders(hh)) = &mut h.request {
            for header in hh.headers.iter_mut().flat_map(|m| m.headers.iter_mut()) {
                if header.key == "x-session-id" {
                    header.raw_value = sid.as_bytes().to_vec();
                }
            }
        }
        m.handle(h).unwrap();
        let step = m.handle(body(CHAT, true)).unwrap();
        assert!(step.session_lookup.is_none(), "{sid}: no lookup");
        assert_eq!(step.responses.len(), 2, "{sid}: routed at once");
    }
    assert_eq!(
        shared
            .metrics()
            .local_fallbacks
            .with_label_values(&["down"])
            .get(),
        1,
        "s-2 was routed on local state because Redis is down"
    );
}

/// Flow control through the state machine: one rank that takes one request at a time.
mod queue {
    use super::*;
    use kvpick_core::FlowConfig;
    use std::time::Duration;

    pub(super) fn one_at_a_time(timeout: Duration) -> Arc<SelectionCore> {
        crate::selection::one_rank_core(CoreConfig {
            seed: Some(1),
            flow: FlowConfig {
                queue_timeout: timeout,
                saturation: crate::selection::ONE_SLOT,
                ..FlowConfig::default()
            },
            ..Default::default()
        })
    }

    /// Client priorities are clamped to the policy's bands: these tests queue in 9, 0 and -1.
    fn machine(core: &Arc<SelectionCore>) -> StreamMachine {
        let settings = rewrite_settings("objectives:\n  - {name: high, priority: 9}\n");
        StreamMachine::new(Arc::clone(core), Arc::new(settings))
    }

    fn request(id: &str, priority: &str) -> ProcessingRequest {
        headers(
            &[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("content-type", "application/json"),
                ("x-request-id", id),
                ("x-dynamo-request-priority", priority),
            ],
            false,
        )
    }

    /// Sends a request through; returns the step after its body.
    fn send(m: &mut StreamMachine, id: &str, priority: &str) -> Step {
        assert!(m
            .handle(request(id, priority))
            .unwrap()
            .responses
            .is_empty());
        m.handle(body(CHAT, true)).unwrap()
    }

    fn status(step: &Step) -> Option<u32> {
        step.responses
            .iter()
            .find_map(|r| match r.response.as_ref()? {
                R::ImmediateResponse(i) => Some(i.status.as_ref()?.code as u32),
                _ => None,
            })
    }

    #[tokio::test(start_paused = true)]
    async fn a_queued_stream_is_routed_when_capacity_frees_and_its_body_follows() {
        let core = one_at_a_time(Duration::from_secs(30));
        let mut first = machine(&core);
        let step = send(&mut first, "r1", "0");
        assert!(step.queue.is_none());
        assert_eq!(step.responses.len(), 2, "headers + body");
        let mut second = machine(&core);
        let mut step = send(&mut second, "r2", "0");
        assert!(step.responses.is_empty(), "nothing answered while queued");
        let waiter = step.queue.take().expect("queued");
        assert_eq!(core.waiting_requests(), 1);
        drop(first); // the first stream ends: its booking frees and releases the second
        let outcome = waiter.wait().await;
        let step = second.resume_after_queue(outcome);
        let m = header_mutation(&step.responses[0]);
        assert_eq!(
            set_value(m, DESTINATION_HEADER).as_deref(),
            Some("127.0.0.1:8000")
        );
        assert!(
            matches!(step.responses[1].response, Some(R::RequestBody(_))),
            "the held body is echoed after the headers"
        );
        assert_eq!(second.booking_id(), Some("r2"));
        assert_eq!(core.live_bookings(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn higher_priority_streams_are_released_first() {
        let core = one_at_a_time(Duration::from_secs(30));
        let mut running = machine(&core);
        send(&mut running, "busy", "0");
        let mut low = machine(&core);
        let low_waiter = send(&mut low, "low", "-1").queue.unwrap();
        let mut high = machine(&core);
        let high_waiter = send(&mut high, "high", "9").queue.unwrap();
        drop(running);
        let outcome = high_waiter.wait().await;
        assert_eq!(outcome.as_ref().unwrap().booking_id(), "high");
        let high_step = high.resume_after_queue(outcome);
        assert_eq!(status(&high_step), None);
        assert_eq!(core.waiting_requests(), 1, "the sheddable one still waits");
        drop(high);
        let outcome = low_waiter.wait().await;
        assert_eq!(outcome.unwrap().booking_id(), "low");
    }

    #[tokio::test(start_paused = true)]
    async fn the_queue_timeout_answers_503_and_429_for_sheddable() {
        let core = one_at_a_time(Duration::from_secs(2));
        let mut running = machine(&core);
        send(&mut running, "busy", "0");
        for (priority, expected) in [("0", 503), ("-1", 429)] {
            let mut m = machine(&core);
            let waiter = send(&mut m, "w", priority).queue.unwrap();
            let started = tokio::time::Instant::now();
            let outcome = waiter.wait().await;
            assert_eq!(started.elapsed(), Duration::from_secs(2));
            let step = m.resume_after_queue(outcome);
            assert_eq!(status(&step), Some(expected));
            assert!(step.finished);
        }
        assert_eq!(core.waiting_requests(), 0);
        let text = core.metrics().render();
        assert!(
            text.contains(r#"kvpick_queue_rejected_total{priority="0",reason="timeout"} 1"#),
            "{text}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_client_gone_while_queued_leaves_the_queue_and_books_nothing() {
        let core = one_at_a_time(Duration::from_secs(30));
        let mut running = machine(&core);
        send(&mut running, "busy", "0");
        let mut gone = machine(&core);
        let waiter = send(&mut gone, "gone", "0").queue.unwrap();
        assert_eq!(core.waiting_requests(), 1);
        drop(waiter);
        drop(gone);
        assert_eq!(core.waiting_requests(), 0);
        drop(running);
        assert_eq!(
            core.live_bookings(),
            0,
            "nothing was released to the gone client"
        );
        let text = core.metrics().render();
        assert!(text.contains(r#"reason="cancelled"} 1"#), "{text}");
        assert!(
            text.contains(r#"kvpick_queue_depth{priority="0"} 0"#),
            "{text}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_waiter_dropped_after_its_release_frees_the_booking() {
        let core = one_at_a_time(Duration::from_secs(30));
        let mut running = machine(&core);
        send(&mut running, "busy", "0");
        let mut late = machine(&core);
        let waiter = send(&mut late, "late", "0").queue.unwrap();
        drop(running); // released: booked for "late"...
        assert_eq!(core.live_bookings(), 1);
        drop(waiter); // ...whose client went away before it read the outcome
        assert_eq!(core.live_bookings(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn bad_flow_headers_are_400() {
        let core = one_at_a_time(Duration::from_secs(30));
        let mut m = machine(&core);
        let h = headers(
            &[
                (":method", "POST"),
                (":path", "/v1/chat/completions"),
                ("x-llm-d-slo-ttft-ms", "soon"),
            ],
            false,
        );
        m.handle(h).unwrap();
        let step = m.handle(body(CHAT, true)).unwrap();
        assert_eq!(status(&step), Some(400));
    }
}
fn rewrite_settings(rules: &str) -> ExtProcSettings {
    let content = crate::flow::static_file::parse_flow_config(rules).unwrap();
    let policy = crate::flow::FlowPolicy::new(content.objectives, content.rules);
    let (tx, rx) = tokio::sync::watch::channel(Arc::new(policy));
    std::mem::forget(tx); // the policy stays as it is for the test
    ExtProcSettings {
        flow_policy: Some(rx),
        ..Default::default()
    }
}

#[test]
fn model_rewrite_routes_to_the_target_and_echoes_the_rewritten_body() {
    let (_core, mut m) = setup(
        vec![worker("a", "m-v2", RankLayout::PerPort(vec![8000]))],
        rewrite_settings("rewrites: [{matches: [m], targets: [{model: m-v2}]}]"),
    );
    m.handle(post_headers()).unwrap();
    let sent =
        br#"{"messages": [{"role": "user", "content": "hi"}], "model": "m", "stream": true}"#;
    m.handle(body(&sent[..20], false)).unwrap();
    let step = m.handle(body(&sent[20..], true)).unwrap();
    let dest = set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER);
    assert_eq!(dest.as_deref(), Some("127.0.0.1:8000"), "routed as m-v2");
    let echoed: Vec<u8> = step.responses[1..]
        .iter()
        .flat_map(|r| streamed(r).0.to_vec())
        .collect();
    assert_eq!(
        echoed,
        br#"{"messages": [{"role": "user", "content": "hi"}], "model": "m-v2", "stream": true}"#
    );
    assert!(streamed(step.responses.last().unwrap()).1);

    // No rule for the model: the body is echoed as sent.
    let (_core, mut m) = setup(
        default_pool(),
        rewrite_settings("rewrites: [{matches: [other], targets: [{model: m-v2}]}]"),
    );
    m.handle(post_headers()).unwrap();
    let step = m.handle(body(CHAT, true)).unwrap();
    assert_eq!(streamed(&step.responses[1]).0, CHAT);
}

#[test]
fn weighted_model_rewrite_is_sticky_per_session_and_splits_across_sessions() {
    let settings = Arc::new(rewrite_settings(
        "rewrites: [{matches: [m], targets: [{model: m-v1}, {model: m-v2}]}]",
    ));
    let core = SelectionCore::new(CoreConfig::default(), Metrics::new());
    core.apply_snapshot(vec![
        worker("a", "m-v1", RankLayout::PerPort(vec![8000])),
        worker("b", "m-v2", RankLayout::PerPort(vec![9000])),
    ])
    .unwrap();
    let route = |session: &str, request: &str| {
        let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
        m.handle(headers(
            &[
                (":method", "POST"),
                ("content-type", "application/json"),
                ("x-session-id", session),
                ("x-request-id", request),
            ],
            false,
        ))
        .unwrap();
        let step = m.handle(body(CHAT, true)).unwrap();
        let echoed = streamed(&step.responses[1]).0.to_vec();
        let dest = set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER).unwrap();
        let model = if dest.ends_with(":8000") {
            "m-v1"
        } else {
            "m-v2"
        };
        assert!(
            String::from_utf8(echoed)
                .unwrap()
                .contains(&format!("\"model\":\"{model}\"")),
            "the body names the model of the rank it went to"
        );
        dest
    };
    let first = route("s-1", "r-0");
    for i in 1..8 {
        assert_eq!(
            route("s-1", &format!("r-{i}")),
            first,
            "one session, one target"
        );
    }
    let targets: std::collections::BTreeSet<String> =
        (0..64).map(|i| route(&format!("s-{i}"), "r")).collect();
    assert_eq!(targets.len(), 2, "sessions spread over both targets");
}

/// A prefill rank and a decode rank; splitting ties with prefilling locally on idle ranks.
fn pd_setup(protocol: super::super::PdProtocol) -> (Arc<SelectionCore>, StreamMachine) {
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(1),
            pd: kvpick_core::PdConfig {
                transfer_block_cost: 0.0,
                ..Default::default()
            },
            ..Default::default()
        },
        Metrics::new(),
    );
    let role = |name: &str, port: u16, role: kvpick_core::Role| WorkerSpec {
        roles: vec![role],
        ..worker(name, "m", RankLayout::PerPort(vec![port]))
    };
    core.apply_snapshot(vec![
        role("p", 8000, kvpick_core::Role::Prefill),
        role("d", 9000, kvpick_core::Role::Decode),
    ])
    .unwrap();
    let settings = ExtProcSettings {
        pd_protocol: protocol,
        ..Default::default()
    };
    let machine = StreamMachine::new(Arc::clone(&core), Arc::new(settings));
    (core, machine)
}

/// 8 KiB of prompt text: 2048 pseudo tokens, over the split threshold.
fn long_completion() -> Vec<u8> {
    format!(r#"{{"model":"m","prompt":"{}"}}"#, "word".repeat(2048)).into_bytes()
}

fn requests_by_worker(core: &SelectionCore) -> Vec<(String, u64)> {
    let mut loads: Vec<(String, u64)> = core
        .list_workers(None)
        .iter()
        .map(|w| (w.record.spec.name.clone(), w.loads[0].active_requests))
        .collect();
    loads.sort();
    loads
}

#[test]
fn a_split_pick_names_the_prefill_rank_in_llm_d_headers_and_frees_each_side_once() {
    let (core, mut m) = pd_setup(super::super::PdProtocol::LlmD);
    m.handle(headers(
        &[
            (":method", "POST"),
            ("x-prefiller-host-port", "6.6.6.6:1"),
            ("x-dynamo-routing-mode", "aggregated"),
        ],
        false,
    ))
    .unwrap();
    let step = m.handle(body(&long_completion(), true)).unwrap();
    let mutation = header_mutation(&step.responses[0]);
    assert_eq!(
        set_value(mutation, DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:9000"),
        "the destination is the decode rank"
    );
    assert_eq!(
        set_value(mutation, "x-prefiller-host-port").as_deref(),
        Some("127.0.0.1:8000")
    );
    assert_eq!(set_value(mutation, "x-dynamo-prefill-instance-id"), None);
    assert_eq!(
        mutation.remove_headers,
        vec!["x-dynamo-routing-mode".to_string()],
        "a client-sent pair header never reaches the sidecar (the set one replaces its own)"
    );
    assert_eq!(
        requests_by_worker(&core),
        vec![("d".into(), 1), ("p".into(), 1)]
    );
    m.handle(response_headers("text/event-stream")).unwrap();
    m.handle(response_body(b"data: {}\n\n", false)).unwrap();
    assert_eq!(
        requests_by_worker(&core),
        vec![("d".into(), 1), ("p".into(), 0)],
        "the first token frees the prefill rank"
    );
    m.handle(response_body(b"data: [DONE]\n\n", true)).unwrap();
    assert_eq!(
        requests_by_worker(&core),
        vec![("d".into(), 0), ("p".into(), 0)]
    );
    drop(m);
    assert_eq!(
        requests_by_worker(&core),
        vec![("d".into(), 0), ("p".into(), 0)],
        "nothing is freed twice"
    );
}

#[test]
fn a_split_pick_speaks_dynamo_and_a_dropped_stream_frees_both_ranks() {
    let (core, mut m) = pd_setup(super::super::PdProtocol::Dynamo);
    m.handle(headers(&[(":method", "POST")], false)).unwrap();
    let step = m.handle(body(&long_completion(), true)).unwrap();
    let mutation = header_mutation(&step.responses[0]);
    let prefill_id = kvpick_core::catalog::worker_id("static", "p").to_string();
    assert_eq!(
        set_value(mutation, "x-dynamo-prefill-instance-id"),
        Some(prefill_id)
    );
    assert_eq!(
        set_value(mutation, "x-dynamo-prefill-dp-rank").as_deref(),
        Some("0")
    );
    assert_eq!(
        set_value(mutation, "x-dynamo-routing-mode").as_deref(),
        Some("disaggregated")
    );
    assert_eq!(set_value(mutation, "x-prefiller-host-port"), None);
    assert_eq!(
        requests_by_worker(&core),
        vec![("d".into(), 1), ("p".into(), 1)]
    );
    drop(m);
    assert_eq!(
        requests_by_worker(&core),
        vec![("d".into(), 0), ("p".into(), 0)]
    );
    // A short prompt is served by the decode rank alone: Dynamo hears `aggregated`.
    let mut m = StreamMachine::new(
        Arc::clone(&core),
        Arc::new(ExtProcSettings {
            pd_protocol: super::super::PdProtocol::Dynamo,
            ..Default::default()
        }),
    );
    m.handle(headers(&[(":method", "POST")], false)).unwrap();
    let step = m.handle(body(CHAT, true)).unwrap();
    let mutation = header_mutation(&step.responses[0]);
    assert_eq!(
        set_value(mutation, "x-dynamo-routing-mode").as_deref(),
        Some("aggregated")
    );
    assert_eq!(set_value(mutation, "x-dynamo-prefill-instance-id"), None);
}

#[test]
fn a_tpot_slo_is_settled_from_the_response_usage() {
    let (core, mut m) = setup(default_pool(), ExtProcSettings::default());
    let h = headers(
        &[
            (":method", "POST"),
            (":path", "/v1/chat/completions"),
            ("content-type", "application/json"),
            ("x-llm-d-slo-tpot-ms", "60000"),
        ],
        false,
    );
    m.handle(h).unwrap();
    m.handle(body(CHAT, true)).unwrap();
    m.handle(response_headers("application/json")).unwrap();
    let json = br#"{"choices":[],"usage":{"prompt_tokens":10,"completion_tokens":3}}"#;
    m.handle(response_body(json, true)).unwrap();
    assert_eq!(core.live_bookings(), 0);
    let text = core.metrics().render();
    assert!(
        text.contains(r#"kvpick_slo_tpot_total{outcome="met",priority="0"} 1"#),
        "{text}"
    );
}

fn response_status(status: &str) -> ProcessingRequest {
    let mut h = headers(
        &[(":status", status), ("content-type", "application/json")],
        false,
    );
    if let Some(processing_request::Request::RequestHeaders(inner)) = h.request.take() {
        h.request = Some(processing_request::Request::ResponseHeaders(inner));
    }
    h
}

/// The response `:status` is read: a 503's first byte is no first token (no TTFT sample), the
/// answer is counted per worker and class, and five 503s in a row eject the rank; a stream
/// that ends before any response is a `reset`.
#[test]
fn response_status_feeds_outlier_detection_not_the_estimator() {
    let (core, _) = setup(
        vec![worker("a", "m", RankLayout::PerPort(vec![8000]))],
        ExtProcSettings::default(),
    );
    let settings = Arc::new(ExtProcSettings::default());
    let observed = || {
        core.metrics()
            .selection
            .ttft_prediction_ratio
            .get_sample_count()
    };
    let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
    m.handle(post_headers()).unwrap();
    m.handle(body(CHAT, true)).unwrap();
    m.handle(response_status("503")).unwrap();
    m.handle(response_body(b"{\"error\":\"down\"}", true))
        .unwrap();
    let responses = &core.metrics().outlier.responses;
    assert_eq!(observed(), 0, "a 503 is no TTFT sample");
    assert_eq!(responses.with_label_values(&["a", "0", "5xx"]).get(), 1);
    let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
    m.handle(post_headers()).unwrap();
    m.handle(body(CHAT, true)).unwrap();
    m.handle(response_status("200")).unwrap();
    m.handle(response_body(b"{}", true)).unwrap();
    assert_eq!(observed(), 1, "a 200 is");
    assert_eq!(responses.with_label_values(&["a", "0", "2xx"]).get(), 1);
    // Routed, then gone before any response.
    let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
    m.handle(post_headers()).unwrap();
    m.handle(body(CHAT, true)).unwrap();
    drop(m);
    assert_eq!(responses.with_label_values(&["a", "0", "reset"]).get(), 1);
    assert_eq!(core.live_bookings(), 0);
    // One rank alone is never ejected (the 50% cap rounds down): it keeps serving.
    for _ in 0..6 {
        let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
        m.handle(post_headers()).unwrap();
        m.handle(body(CHAT, true)).unwrap();
        m.handle(response_status("502")).unwrap();
        m.handle(response_body(b"", true)).unwrap();
    }
    assert_eq!(core.metrics().outlier.ejected_ranks.get(), 0);
}

/// The response's answer and a stream's reset, per booking ([`super::super::StreamMachine`]).
#[path = "stream_reset_tests.rs"]
mod reset;

#[path = "stream_trace_tests.rs"]
mod trace;

#[path = "stream_scan_tests.rs"]
mod scan;

#[path = "stream_session_tests.rs"]
mod sessions;
