//! The monitoring shipped with kvpick (the Grafana dashboard, the alert rules and the KEDA
//! example) only names metrics kvpick exports: a real `kvpick serve` (every metric family on,
//! engine metrics from two fake engines, a shared state that is down) serves traffic through its
//! ext_proc port until every series those queries use exists, then its `/metrics` is scraped and
//! every metric name in every query is looked up there (a histogram's `_bucket`, `_sum` and
//! `_count` count as the histogram).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::{
    external_processor_client::ExternalProcessorClient, processing_request, processing_response,
    HttpBody, ProcessingRequest, ProcessingResponse,
};
use tokio::sync::mpsc;
use tonic_health::pb::health_check_response::ServingStatus;

mod common;

const PREFIXES: &[&str] = &[
    "kvpick_",
    "llm_d_epp_",
    "inference_objective_",
    "inference_pool_",
    "inference_extension_",
];

/// The metric names in a PromQL expression: identifiers with one of kvpick's prefixes, outside
/// string literals (label values).
fn metric_names(expr: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = expr.char_indices().peekable();
    while let Some((i, c)) = chars.next() {
        if c == '"' || c == '\'' {
            while let Some((_, d)) = chars.next() {
                if d == '\\' {
                    chars.next();
                } else if d == c {
                    break;
                }
            }
            continue;
        }
        if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let mut end = i + c.len_utf8();
            while let Some((j, d)) = chars.peek().copied() {
                if d.is_ascii_alphanumeric() || d == '_' || d == ':' {
                    end = j + 1;
                    chars.next();
                } else {
                    break;
                }
            }
            let word = &expr[i..end];
            if PREFIXES.iter().any(|p| word.starts_with(p)) {
                out.push(word.to_string());
            }
        }
    }
    out
}

#[test]
fn metric_names_skip_functions_labels_and_strings() {
    let names = metric_names(
        r#"histogram_quantile(0.9, sum by (le) (rate(kvpick_queue_wait_seconds_bucket{reason="kvpick_x"}[$__rate_interval]))) / llm_d_epp_request_total"#,
    );
    assert_eq!(
        names,
        [
            "kvpick_queue_wait_seconds_bucket",
            "llm_d_epp_request_total"
        ]
    );
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)).unwrap()
}

/// Every query of the dashboard, the alert rules and the KEDA example, by where it is.
fn queries() -> Vec<(String, String)> {
    let mut out = Vec::new();
    let dash: serde_json::Value =
        serde_json::from_str(&read("charts/kvpick/observability/dashboard.json")).unwrap();
    for panel in dash["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap();
            out.push((
                format!("dashboard panel {title:?}"),
                target["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    let alerts: serde_yaml::Value =
        serde_yaml::from_str(&read("charts/kvpick/observability/alerts.yaml")).unwrap();
    for group in alerts["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            out.push((
                format!("alert {}", rule["alert"].as_str().unwrap()),
                rule["expr"].as_str().unwrap().to_string(),
            ));
        }
    }
    let keda = read("manifests/observability/keda-scaledobject.yaml");
    let keda: serde_yaml::Value = serde_yaml::from_str(&keda).unwrap();
    for trigger in keda["spec"]["triggers"].as_sequence().unwrap() {
        out.push((
            "KEDA ScaledObject trigger".into(),
            trigger["metadata"]["query"].as_str().unwrap().to_string(),
        ));
    }
    out
}

/// A fake engine: answers every HTTP request with a vLLM metrics page.
fn fake_engine() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        let page = "vllm:num_requests_waiting 0\nvllm:num_requests_running 1\nvllm:kv_cache_usage_perc 0.25\n";
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let mut buf = [0u8; 4096];
            let mut seen = Vec::new();
            while !seen.windows(4).any(|w| w == b"\r\n\r\n") {
                match s.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => seen.extend_from_slice(&buf[..n]),
                }
            }
            let _ = write!(
                s,
                "HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{page}",
                page.len()
            );
        }
    });
    port
}

fn scrape(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text
}

/// Metric family name -> type, from the `# TYPE` lines.
fn exported(text: &str) -> BTreeMap<String, String> {
    text.lines()
        .filter_map(|l| {
            let mut parts = l.strip_prefix("# TYPE ")?.split_whitespace();
            Some((parts.next()?.to_string(), parts.next()?.to_string()))
        })
        .collect()
}

fn is_exported(families: &BTreeMap<String, String>, name: &str) -> bool {
    if families.contains_key(name) {
        return true;
    }
    ["_bucket", "_sum", "_count"].iter().any(|suffix| {
        name.strip_suffix(suffix)
            .is_some_and(|base| families.get(base).is_some_and(|t| t == "histogram"))
    })
}

type Client = ExternalProcessorClient<tonic::transport::Channel>;
type Stream = (
    mpsc::Sender<ProcessingRequest>,
    tonic::Streaming<ProcessingResponse>,
);

fn message(request: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..Default::default()
    }
}

/// Opens a stream and sends one completions request (headers `extra` added).
async fn request(client: &mut Client, extra: &[(&str, &str)]) -> Stream {
    let (tx, inbound) = common::open_stream(client).await;
    let mut pairs = vec![
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("content-type", "application/json"),
    ];
    pairs.extend_from_slice(extra);
    tx.send(message(processing_request::Request::RequestHeaders(
        common::http_headers(&pairs),
    )))
    .await
    .unwrap();
    tx.send(message(processing_request::Request::RequestBody(
        HttpBody {
            // Token ids: its response's cached tokens are held against the pick's prediction
            // (the cache-view series).
            body: br#"{"model":"m","prompt":[1,2,3]}"#.to_vec(),
            end_of_stream: true,
            ..Default::default()
        },
    )))
    .await
    .unwrap();
    (tx, inbound)
}

async fn next(stream: &mut Stream) -> processing_response::Response {
    stream
        .1
        .message()
        .await
        .unwrap()
        .expect("an answer")
        .response
        .unwrap()
}

/// Waits for the routing answer (and the echoed body).
async fn routed(stream: &mut Stream) {
    let answer = next(stream).await;
    assert!(
        matches!(answer, processing_response::Response::RequestHeaders(_)),
        "not routed: {answer:?}"
    );
    let echoed = next(stream).await;
    assert!(matches!(
        echoed,
        processing_response::Response::RequestBody(_)
    ));
}

/// The rank answers `status`; a 200 streams a body with usage.
async fn respond(stream: &mut Stream, status: &str) {
    let mut headers =
        common::http_headers(&[(":status", status), ("content-type", "application/json")]);
    headers.end_of_stream = status != "200";
    stream
        .0
        .send(message(processing_request::Request::ResponseHeaders(
            headers,
        )))
        .await
        .unwrap();
    next(stream).await;
    if status == "200" {
        let body = br#"{"choices":[{"text":"hi"}],"usage":{"prompt_tokens":3,"completion_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}"#;
        stream
            .0
            .send(message(processing_request::Request::ResponseBody(
                HttpBody {
                    body: body.to_vec(),
                    end_of_stream: true,
                    ..Default::default()
                },
            )))
            .await
            .unwrap();
        next(stream).await;
    }
}

/// Polls `/metrics` until `cond` holds (bounded: 15 s).
async fn wait_for(port: u16, what: &str, cond: impl Fn(&str) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while !cond(&scrape(port)) {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Requests through the ext_proc port until every series the queries use exists: routed ones
/// with SLOs and usage, a queue timeout, a request released from the queue, a rank's 5xx (and
/// its ejection).
async fn drive_every_series(serve: &common::Serve) {
    let mut client = Client::connect(format!("http://127.0.0.1:{}", serve.grpc))
        .await
        .unwrap();

    // Two requests hold both ranks (one request each saturates them) ...
    let slo = [
        ("x-llm-d-slo-ttft-ms", "60000"),
        ("x-llm-d-slo-tpot-ms", "60000"),
    ];
    let mut a1 = request(&mut client, &slo).await;
    routed(&mut a1).await;
    let mut a2 = request(&mut client, &[]).await;
    routed(&mut a2).await;
    // ... so the next waits in the queue and times out (503) ...
    let mut b = request(&mut client, &[]).await;
    match next(&mut b).await {
        processing_response::Response::ImmediateResponse(i) => {
            assert_eq!(i.status.unwrap().code, 503)
        }
        other => panic!("want the queue timeout's 503: {other:?}"),
    }
    // ... and one more waits until the first completes and frees its rank.
    let mut c = request(&mut client, &[]).await;
    wait_for(serve.metrics, "a queued request", |t| {
        t.lines().any(|l| l == "kvpick_queue_length 1")
    })
    .await;
    respond(&mut a1, "200").await;
    routed(&mut c).await;
    // Its rank fails it: ejected (one 5xx is enough here).
    respond(&mut c, "503").await;
    respond(&mut a2, "200").await;
    wait_for(serve.metrics, "an ejection", |t| {
        t.contains("kvpick_outlier_ejections_total{")
    })
    .await;
}

#[tokio::test]
async fn every_metric_the_dashboard_alerts_and_keda_example_use_is_exported() {
    let (e1, e2) = (fake_engine(), fake_engine());
    let catalog =
        format!("workers:\n  - {{name: a, model: m, address: 127.0.0.1, ports: [{e1}, {e2}]}}\n");
    let serve = common::start_static(
        &catalog,
        &[
            "--metrics-families",
            "kvpick,epp,igw",
            "--engine-metrics",
            "vllm",
            "--engine-metrics-interval-ms",
            "50",
            "--engine-metrics-stale-ms",
            "60000",
            "--saturation-max-requests",
            "1",
            "--saturation-wait",
            "inf",
            "--queue-timeout",
            "0.3",
            "--outlier-consecutive-5xx",
            "1",
            "--outlier-max-ejected-percent",
            "100",
            // Nothing listens on port 1: the shared state is down (kvpick routes on local state).
            "--shared-state",
            "redis://127.0.0.1:1",
            // Nor the remote KV index: its metrics are registered with the flag.
            "--kv-index-remote",
            "http://127.0.0.1:1",
        ],
    );
    common::wait_readiness(serve.health, ServingStatus::Serving).await;
    wait_for(serve.metrics, "fresh engine readings", |t| {
        t.contains("llm_d_epp_average_kv_cache_utilization{")
    })
    .await;
    drive_every_series(&serve).await;

    let text = scrape(serve.metrics);
    let families = exported(&text);
    let mut missing = Vec::new();
    let queries = queries();
    assert!(queries.len() >= 30, "only {} queries found", queries.len());
    for (place, expr) in &queries {
        let names = metric_names(expr);
        assert!(!names.is_empty(), "{place}: no kvpick metric in {expr:?}");
        for name in names {
            if !is_exported(&families, &name) {
                missing.push(format!("{place}: {name}"));
            }
        }
    }
    assert!(
        missing.is_empty(),
        "not exported by kvpick:\n{}\n--- /metrics ---\n{text}",
        missing.join("\n")
    );
}
