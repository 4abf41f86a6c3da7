//! Held bookings on the real binary over loopback (issue 45): ext_proc streams that send a
//! complete request (headers and a 100 KB body, so kvpick routes and books them) and then never
//! send the response phase. They saturate every rank, so a good request queues; once their
//! prefill decays (max(predicted TTFT × --booking-prefill-margin, floor)) the good requests are
//! routed onto those same ranks while the held streams stay open.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::collections::BTreeSet;

use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, processing_response, HttpBody, ProcessingRequest, ProcessingResponse,
};
use tonic_health::pb::health_check_response::ServingStatus;

mod common;

use common::{
    metric, open_stream as open, start_static, wait_metric, wait_readiness, ExtProcClient as Client,
};

const CATALOG: &str =
    "workers:\n  - {name: a, model: m, address: 127.0.0.1, ports: [8000, 8001, 8002, 8003]}\n";

fn message(request: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..Default::default()
    }
}

fn request_headers() -> ProcessingRequest {
    message(processing_request::Request::RequestHeaders(
        common::http_headers(&[(":method", "POST"), ("content-type", "application/json")]),
    ))
}

/// A completions body whose prompt is `tokens` token ids from `first` on.
fn body(first: u32, tokens: u32) -> ProcessingRequest {
    let ids: Vec<String> = (first..first + tokens).map(|t| t.to_string()).collect();
    let body = format!(r#"{{"model":"m","prompt":[{}]}}"#, ids.join(","));
    message(processing_request::Request::RequestBody(HttpBody {
        body: body.into_bytes(),
        end_of_stream: true,
        ..Default::default()
    }))
}

fn response(end: bool) -> ProcessingRequest {
    if end {
        message(processing_request::Request::ResponseBody(HttpBody {
            body: b"{}".to_vec(),
            end_of_stream: true,
            ..Default::default()
        }))
    } else {
        message(processing_request::Request::ResponseHeaders(
            common::http_headers(&[(":status", "200"), ("content-type", "application/json")]),
        ))
    }
}

/// The destination a request-headers answer routes to.
fn destination(answer: &ProcessingResponse) -> String {
    let Some(processing_response::Response::RequestHeaders(h)) = &answer.response else {
        panic!("not a routing answer: {answer:?}");
    };
    let mutation = h
        .response
        .as_ref()
        .unwrap()
        .header_mutation
        .as_ref()
        .unwrap();
    mutation
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == "x-gateway-destination-endpoint")
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
        .expect("a destination header")
}

type Stream = (
    tokio::sync::mpsc::Sender<ProcessingRequest>,
    tonic::Streaming<ProcessingResponse>,
);

/// Sends a request (headers, body) and reads its routing answer and the echoed body; returns
/// the destination and the open stream.
async fn route(client: &mut Client, first: u32, tokens: u32) -> (String, Stream) {
    let (tx, mut inbound) = open(client).await;
    tx.send(request_headers()).await.unwrap();
    tx.send(body(first, tokens)).await.unwrap();
    let answer = inbound.message().await.unwrap().expect("a routing answer");
    let to = destination(&answer);
    // The body comes back in chunks; the last one ends the request phase.
    loop {
        let echoed = inbound.message().await.unwrap().expect("the echoed body");
        let Some(processing_response::Response::RequestBody(b)) = &echoed.response else {
            panic!("not an echoed body: {echoed:?}");
        };
        let Some(mutation) = b.response.as_ref().and_then(|c| c.body_mutation.as_ref()) else {
            break;
        };
        if matches!(
            &mutation.mutation,
            Some(envoy_types::pb::envoy::service::ext_proc::v3::body_mutation::Mutation::StreamedResponse(s)) if s.end_of_stream
        ) {
            break;
        }
    }
    (to, (tx, inbound))
}

/// The response phase of a routed request, to its end (its booking is freed).
async fn finish((tx, mut inbound): Stream) {
    tx.send(response(false)).await.unwrap();
    inbound
        .message()
        .await
        .unwrap()
        .expect("response headers answer");
    tx.send(response(true)).await.unwrap();
    inbound
        .message()
        .await
        .unwrap()
        .expect("response body answer");
}

#[tokio::test]
async fn held_streams_stop_saturating_their_ranks_once_their_prefill_decays() {
    // 20,000 tokens predict ~1.02 s at the prior line (over the 0.5 s of --saturation-wait):
    // with margin 1 the held prefills stop counting ~1 s after their picks.
    let serve = start_static(
        CATALOG,
        &[
            "--booking-prefill-margin",
            "1",
            "--booking-prefill-floor-ms",
            "200",
            "--queue-timeout",
            "20",
        ],
    );
    wait_readiness(serve.health, ServingStatus::Serving).await;
    let mut client = Client::connect(format!("http://127.0.0.1:{}", serve.grpc))
        .await
        .unwrap();

    // Four held requests (~100 KB bodies), one per rank; they never send a response phase.
    let mut held = Vec::new();
    let mut ranks = BTreeSet::new();
    for i in 0..4 {
        let (to, stream) = route(&mut client, 100_000 * (i + 1), 20_000).await;
        ranks.insert(to);
        held.push(stream);
    }
    assert_eq!(ranks.len(), 4, "one held request per rank: {ranks:?}");

    // Every rank is saturated: a good request waits in the queue...
    let (tx, mut inbound) = open(&mut client).await;
    tx.send(request_headers()).await.unwrap();
    tx.send(body(1, 64)).await.unwrap();
    wait_metric(serve.metrics, "kvpick_queue_length", 1.0).await;
    // ... and is routed, onto one of the held ranks, once their prefill decays.
    let answer = inbound.message().await.unwrap().expect("a routing answer");
    assert!(ranks.contains(&destination(&answer)));
    drop((tx, inbound));
    wait_metric(serve.metrics, "kvpick_bookings_decayed_total", 4.0).await;

    // Good requests keep being routed to every held rank, none waiting, while the held streams
    // stay open with their request slots.
    let mut served = BTreeSet::new();
    for i in 0..12 {
        let (to, stream) = route(&mut client, 10_000 + 100 * i, 64).await;
        assert!(ranks.contains(&to));
        served.insert(to);
        finish(stream).await;
    }
    assert_eq!(served, ranks, "every held rank serves good requests");
    assert_eq!(metric(serve.metrics, "kvpick_queue_length"), 0.0);
    assert_eq!(metric(serve.metrics, "kvpick_inflight_total"), 4.0);

    // The held streams end: their bookings are freed once, the ranks are idle.
    drop(held);
    wait_metric(serve.metrics, "kvpick_inflight_total", 0.0).await;
}
