use super::*;
use crate::catalog::{RankLayout, WorkerSpec};
use crate::metrics::Metrics;
use crate::selection::CoreConfig;
use envoy_types::pb::envoy::config::core::v3::HeaderMap;
use envoy_types::pb::envoy::extensions::filters::http::ext_proc::v3::processing_mode::BodySendMode;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpTrailers, ProtocolConfiguration};
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
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: pairs
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: k.to_string(),
                        value: String::new(),
                        raw_value: v.as_bytes().to_vec(),
                    })
                    .collect(),
            }),
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
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

fn streamed(r: &ProcessingResponse) -> (&[u8], bool) {
    let common = match r.response.as_ref().unwrap() {
        R::RequestBody(b) | R::ResponseBody(b) => b.response.as_ref().unwrap(),
        other => panic!("not a body response: {other:?}"),
    };
    match common
        .body_mutation
        .as_ref()
        .unwrap()
        .mutation
        .as_ref()
        .unwrap()
    {
        body_mutation::Mutation::StreamedResponse(s) => (&s.body, s.end_of_stream),
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
    let (_core2, mut m2) = setup(default_pool(), ExtProcSettings::default());
    assert!(m2.handle(response_headers("application/json")).is_err());
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
            ("x-gateway-model-name-rewrite", "evil"),
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
    let usage = &core.metrics().usage_tokens;
    assert_eq!(usage.with_label_values(&["prompt"]).get(), 10);
    assert_eq!(usage.with_label_values(&["cached"]).get(), 4);
    assert_eq!(core.metrics().requests.with_label_values(&["200"]).get(), 1);
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
    let core = SelectionCore::new(
        CoreConfig {
            allow_pins: true,
            ..Default::default()
        },
        Metrics::new(),
    );
    core.apply_snapshot(default_pool()).unwrap();
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

fn tokenizer_settings() -> ExtProcSettings {
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
            .unwrap();
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
