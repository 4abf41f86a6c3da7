//! Resource limits of the real ext_proc server over loopback: the global request-body budget
//! (503 past it, bytes returned when a client disconnects mid-body) and the HTTP/2
//! concurrent-stream limit it advertises.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, processing_response, HttpBody, ProcessingRequest,
};
use tonic_health::pb::health_check_response::ServingStatus;

mod common;

use common::{metric, start_static, wait_metric, wait_readiness};

const CATALOG: &str = "workers:\n  - {name: a, model: m, address: 127.0.0.1, ports: [8000]}\n";

fn headers() -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(
            common::http_headers(&[(":method", "POST"), ("content-type", "application/json")]),
        )),
        ..Default::default()
    }
}

/// A completions body of exactly `len` bytes.
fn body_of(len: usize, end_of_stream: bool) -> ProcessingRequest {
    let head = br#"{"model":"m","prompt":""#;
    let mut body = head.to_vec();
    body.resize(len - 2, b'x');
    body.extend_from_slice(br#""}"#);
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body,
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

use common::{open_stream as open, ExtProcClient as Client};

#[tokio::test]
async fn body_budget_503_and_bytes_come_back_when_the_client_disconnects() {
    let serve = start_static(CATALOG, &["--max-buffered-body-bytes", "1000"]);
    wait_readiness(serve.health, ServingStatus::Serving).await;
    let mut client = Client::connect(format!("http://127.0.0.1:{}", serve.grpc))
        .await
        .unwrap();

    // A stream holding 600 bytes mid-body.
    let (held_tx, held_rx) = open(&mut client).await;
    held_tx.send(headers()).await.unwrap();
    held_tx.send(body_of(600, false)).await.unwrap();
    wait_metric(serve.metrics, "kvpick_body_bytes_buffered", 600.0).await;

    // A second 600-byte body does not fit next to it: 503 with the budget message.
    let (tx, mut inbound) = open(&mut client).await;
    tx.send(headers()).await.unwrap();
    tx.send(body_of(600, true)).await.unwrap();
    let answer = inbound
        .message()
        .await
        .unwrap()
        .expect("an immediate response");
    let Some(processing_response::Response::ImmediateResponse(i)) = answer.response else {
        panic!("not an immediate response: {answer:?}");
    };
    assert_eq!(i.status.unwrap().code, 503);
    assert_eq!(
        String::from_utf8(i.body).unwrap(),
        "kvpick: 503: request body budget exhausted, retry later\n"
    );
    assert_eq!(
        metric(serve.metrics, "kvpick_body_budget_rejected_total"),
        1.0
    );

    // The first client goes away mid-body: its 600 bytes come back, and the same body fits.
    drop((held_tx, held_rx));
    wait_metric(serve.metrics, "kvpick_body_bytes_buffered", 0.0).await;
    let (tx, mut inbound) = open(&mut client).await;
    tx.send(headers()).await.unwrap();
    tx.send(body_of(600, true)).await.unwrap();
    let answer = inbound.message().await.unwrap().expect("a routing answer");
    assert!(
        matches!(
            answer.response,
            Some(processing_response::Response::RequestHeaders(_))
        ),
        "{answer:?}"
    );
    let echoed = inbound.message().await.unwrap().expect("the echoed body");
    assert!(matches!(
        echoed.response,
        Some(processing_response::Response::RequestBody(_))
    ));
    // The echo stays charged (what tonic and h2 may still buffer of it) until Envoy's next
    // message shows it was read, or the stream ends.
    assert_eq!(metric(serve.metrics, "kvpick_body_bytes_buffered"), 600.0);
    drop((tx, inbound));
    wait_metric(serve.metrics, "kvpick_body_bytes_buffered", 0.0).await;
}

#[tokio::test]
async fn ext_proc_port_advertises_its_concurrent_stream_limit() {
    let serve = start_static(CATALOG, &["--max-concurrent-streams", "3"]);
    let tcp = tokio::net::TcpStream::connect(("127.0.0.1", serve.grpc))
        .await
        .unwrap();
    let (send, connection) = h2::client::handshake(tcp).await.unwrap();
    tokio::spawn(connection);
    let mut send = send.ready().await.unwrap();
    // One round trip: by its answer the server's SETTINGS have been applied.
    let request = http::Request::post(format!(
        "http://127.0.0.1:{}/grpc.health.v1.Health/Check",
        serve.grpc
    ))
    .header("content-type", "application/grpc")
    .header("te", "trailers")
    .body(())
    .unwrap();
    let (response, mut stream) = send.send_request(request, false).unwrap();
    // An empty HealthCheckRequest: 5-byte gRPC frame header, no payload.
    stream
        .send_data(bytes::Bytes::from_static(&[0, 0, 0, 0, 0]), true)
        .unwrap();
    let response = response.await.unwrap();
    assert_eq!(response.status(), 200);
    assert_eq!(send.current_max_send_streams(), 3);
}
