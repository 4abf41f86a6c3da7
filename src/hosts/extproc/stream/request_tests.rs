//! The request phase as it arrives: headers (ordering, pins, session ids, bad bytes, the request
//! id), subset hints, trailers, the body limit.

use super::super::tests::*;
use super::super::*;
use crate::observability::metrics::Metrics;
use crate::selection::CoreConfig;
use crate::sources::catalog::RankLayout;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpTrailers, ProcessingRequest};
use envoy_types::pb::google::protobuf::{value::Kind, ListValue, Struct, Value};
use processing_response::Response as R;

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

#[path = "request_scan_tests.rs"]
mod scan;

#[path = "request_session_tests.rs"]
mod sessions;
