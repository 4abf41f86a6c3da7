//! The EPP series driven by real ext_proc streams: they move when kvpick's own do.

use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, HttpBody, HttpHeaders, ProcessingRequest,
};

use crate::hosts::extproc::{ExtProcSettings, StreamMachine};
use crate::selection::{CoreConfig, SelectionCore};

fn core(config: CoreConfig) -> Arc<SelectionCore> {
    crate::selection::one_rank_core(config)
}

fn machine(core: &Arc<SelectionCore>) -> StreamMachine {
    StreamMachine::new(Arc::clone(core), Arc::new(ExtProcSettings::default()))
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
    HttpHeaders {
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
    }
}

fn msg(request: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..Default::default()
    }
}

fn request_headers(extra: &[(&str, &str)]) -> ProcessingRequest {
    let mut pairs = vec![
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("content-type", "application/json"),
    ];
    pairs.extend_from_slice(extra);
    msg(processing_request::Request::RequestHeaders(headers(
        &pairs, false,
    )))
}

fn body(bytes: &[u8]) -> ProcessingRequest {
    msg(processing_request::Request::RequestBody(HttpBody {
        body: bytes.to_vec(),
        end_of_stream: true,
        ..Default::default()
    }))
}

fn response_headers(status: &str) -> ProcessingRequest {
    msg(processing_request::Request::ResponseHeaders(headers(
        &[(":status", status), ("content-type", "application/json")],
        false,
    )))
}

fn response_body(bytes: &[u8]) -> ProcessingRequest {
    msg(processing_request::Request::ResponseBody(HttpBody {
        body: bytes.to_vec(),
        end_of_stream: true,
        ..Default::default()
    }))
}

const PROMPT: &[u8] = br#"{"model":"m","prompt":"hello"}"#;
const ANSWER: &[u8] =
    br#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}"#;

/// The value of the series `line_start` (name and labels, exactly as rendered).
fn value(text: &str, line_start: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(line_start)?.trim().parse().ok())
}

#[test]
fn a_request_through_the_stream_moves_the_epp_series_with_kvpick_s() {
    let core = core(CoreConfig::default());
    let mut m = machine(&core);
    m.handle(request_headers(&[("x-llm-d-fairness-id", "t1")]))
        .unwrap();
    m.handle(body(PROMPT)).unwrap();
    let text = core.metrics().render();
    let labels = r#"{fairness_id="t1",model_name="m",priority="0",target_model_name="m"}"#;
    assert_eq!(
        value(&text, r#"kvpick_requests_total{status="200"}"#),
        Some(1.0)
    );
    assert_eq!(
        value(&text, &format!("llm_d_epp_request_total{labels}")),
        Some(1.0),
        "{text}"
    );
    assert_eq!(
        value(&text, &format!("llm_d_epp_request_running{labels}")),
        Some(1.0)
    );
    assert_eq!(value(&text, "kvpick_inflight_total"), Some(1.0));
    assert_eq!(
        value(&text, r#"llm_d_epp_ready_endpoints{name="default"}"#),
        Some(1.0)
    );
    assert_eq!(
        value(&text, "llm_d_epp_scheduler_e2e_duration_seconds_count"),
        value(&text, "kvpick_pick_latency_seconds_count")
    );
    let pick = r#"llm_d_epp_plugin_duration_seconds_count{extension_point="Scheduling",plugin_name="kvpick",plugin_type="kv-cache-picker"}"#;
    assert_eq!(value(&text, pick), Some(1.0), "{text}");

    m.handle(response_headers("200")).unwrap();
    m.handle(response_body(ANSWER)).unwrap();
    let text = core.metrics().render();
    assert_eq!(
        value(&text, &format!("llm_d_epp_request_running{labels}")),
        Some(0.0)
    );
    assert_eq!(value(&text, "kvpick_inflight_total"), Some(0.0));
    assert_eq!(
        value(
            &text,
            &format!("llm_d_epp_request_duration_seconds_count{labels}")
        ),
        Some(1.0)
    );
    assert_eq!(
        value(
            &text,
            &format!("llm_d_epp_request_input_tokens_sum{labels}")
        ),
        value(&text, r#"kvpick_usage_tokens_total{kind="prompt"}"#)
    );
    assert_eq!(
        value(&text, &format!("llm_d_epp_response_size_bytes_sum{labels}")),
        Some(ANSWER.len() as f64)
    );
    assert_eq!(
        value(&text, &format!("llm_d_epp_request_size_bytes_sum{labels}")),
        Some(PROMPT.len() as f64)
    );
}

#[test]
fn a_refused_request_is_an_epp_error() {
    let core = core(CoreConfig::default());
    let mut m = machine(&core);
    m.handle(request_headers(&[])).unwrap();
    let step = m.handle(body(b"{not json")).unwrap();
    assert!(step.finished);
    let text = core.metrics().render();
    assert_eq!(
        value(&text, r#"kvpick_requests_total{status="400"}"#),
        Some(1.0)
    );
    let error = r#"llm_d_epp_request_error_total{error_code="BadRequest",fairness_id="default",model_name="",priority="0",target_model_name=""}"#;
    assert_eq!(value(&text, error), Some(1.0), "{text}");
}

#[test]
fn a_model_server_5xx_is_a_model_server_error() {
    let core = core(CoreConfig::default());
    let mut m = machine(&core);
    m.handle(request_headers(&[])).unwrap();
    m.handle(body(PROMPT)).unwrap();
    m.handle(response_headers("503")).unwrap();
    let text = core.metrics().render();
    let error = r#"llm_d_epp_request_error_total{error_code="ModelServerError",fairness_id="default",model_name="m",priority="0",target_model_name="m"}"#;
    assert_eq!(value(&text, error), Some(1.0), "{text}");
}

#[test]
fn a_queued_request_is_in_the_queue_gauges_until_its_stream_goes() {
    let mut config = CoreConfig::default();
    config.flow.saturation = crate::selection::ONE_SLOT;
    let core = core(config);
    let mut first = machine(&core);
    first.handle(request_headers(&[])).unwrap();
    first.handle(body(PROMPT)).unwrap();
    let mut second = machine(&core);
    second.handle(request_headers(&[])).unwrap();
    let mut step = second.handle(body(PROMPT)).unwrap();
    let waiter = step.queue.take().expect("the rank is saturated: queued");
    let text = core.metrics().render();
    let queued = r#"llm_d_epp_flow_control_queue_size{fairness_id="default",inference_pool="default",model_name="m",priority="0",target_model_name="m"}"#;
    assert_eq!(value(&text, queued), Some(1.0), "{text}");
    assert_eq!(value(&text, "kvpick_queue_length"), Some(1.0));
    assert_eq!(
        value(&text, r#"kvpick_queue_depth{priority="0"}"#),
        Some(1.0)
    );
    assert!(value(&text, "kvpick_queue_oldest_age_seconds").is_some());
    assert_eq!(value(&text, "kvpick_pool_saturated_ranks_ratio"), Some(1.0));
    // The client goes away while queued.
    drop(waiter);
    drop(second);
    let text = core.metrics().render();
    assert_eq!(value(&text, queued), Some(0.0));
    assert_eq!(value(&text, "kvpick_queue_length"), Some(0.0));
    assert_eq!(value(&text, "kvpick_queue_oldest_age_seconds"), Some(0.0));
}

/// Issue 46's measurement: three requests naming their tenant in llm-d-router's current header
/// are counted under that tenant, not under the default key.
#[test]
fn three_requests_with_llm_d_s_fairness_header_count_under_their_tenant() {
    let core = core(CoreConfig::default());
    let mut machines: Vec<StreamMachine> = (0..3).map(|_| machine(&core)).collect();
    for m in &mut machines {
        m.handle(request_headers(&[(
            "x-llm-d-inference-fairness-id",
            "tenant-zz7",
        )]))
        .unwrap();
        m.handle(body(PROMPT)).unwrap();
    }
    let text = core.metrics().render();
    let tenant = r#"{fairness_id="tenant-zz7",model_name="m",priority="0",target_model_name="m"}"#;
    assert_eq!(
        value(&text, &format!("llm_d_epp_request_total{tenant}")),
        Some(3.0),
        "{text}"
    );
    assert!(
        !text.contains(r#"fairness_id="default""#),
        "nothing under the default key: {text}"
    );
}

/// `x-llm-d-model-name-rewrite` (and its deprecated alias) sends the request to the model it
/// names: the body is rewritten before the pick, so the pick is in the target's partition and the
/// metrics name both models.
#[test]
fn the_model_rewrite_header_routes_to_the_model_it_names() {
    for name in crate::sources::flow::MODEL_REWRITE_HEADERS {
        let core = core(CoreConfig::default());
        let mut m = machine(&core);
        m.handle(request_headers(&[(name, "m")])).unwrap();
        let step = m
            .handle(body(br#"{"model":"asked","prompt":"hello"}"#))
            .unwrap();
        assert!(!step.finished, "{name}: routed, not refused");
        let text = core.metrics().render();
        let labels =
            r#"{fairness_id="default",model_name="asked",priority="0",target_model_name="m"}"#;
        assert_eq!(
            value(&text, &format!("llm_d_epp_request_total{labels}")),
            Some(1.0),
            "{name}: {text}"
        );
    }
}
