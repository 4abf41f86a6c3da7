//! The response phase: the echo chunk by chunk, the served endpoint, the response status, usage
//! (TPOT), the booking freed.

use super::super::tests::*;
use super::super::*;
use crate::sources::catalog::RankLayout;
use envoy_types::pb::envoy::config::core::v3::{HeaderValue, Metadata};
use envoy_types::pb::google::protobuf::Struct;
use processing_response::Response as R;

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

#[path = "response_reset_tests.rs"]
mod reset;

#[path = "response_cache_view_tests.rs"]
mod cache_view;
