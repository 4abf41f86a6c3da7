//! `kvpick::server::run` in-process: the test binds the three listeners on 127.0.0.1 port 0
//! itself, runs the whole server on them (a static catalog of one worker), routes one ext_proc
//! request, reads health and `/metrics`, then resolves the shutdown future: `run` drains, closes
//! the listeners and returns `Ok`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::io::{Read, Write};
use std::time::Duration;

use clap::Parser;
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, processing_response, HttpBody, ProcessingRequest, ProcessingResponse,
};
use tokio::net::TcpListener;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

mod common;

/// `kvpick serve`'s flags, parsed as the binary parses them.
#[derive(Parser)]
struct Serve {
    #[command(flatten)]
    args: kvpick::server::ServeArgs,
}

async fn liveness(port: u16) -> ServingStatus {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut client = HealthClient::new(channel);
    let status = client
        .check(HealthCheckRequest {
            service: "liveness".into(),
        })
        .await
        .unwrap()
        .into_inner()
        .status;
    ServingStatus::try_from(status).unwrap()
}

/// The destination a request-headers answer routes to.
fn destination(answer: &ProcessingResponse) -> String {
    let Some(processing_response::Response::RequestHeaders(h)) = &answer.response else {
        panic!("not a routing answer: {answer:?}");
    };
    let mutation = h.response.as_ref().unwrap().header_mutation.as_ref();
    mutation
        .unwrap()
        .set_headers
        .iter()
        .filter_map(|o| o.header.as_ref())
        .find(|h| h.key == "x-gateway-destination-endpoint")
        .map(|h| String::from_utf8(h.raw_value.clone()).unwrap())
        .expect("a destination header")
}

/// One pick through the ext_proc port: the destination kvpick answers.
async fn pick(port: u16) -> String {
    let mut client = ExternalProcessorClient::connect(format!("http://127.0.0.1:{port}"))
        .await
        .unwrap();
    let (tx, mut inbound) = common::open_stream(&mut client).await;
    let headers = common::http_headers(&[
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("content-type", "application/json"),
    ]);
    let message = |request| ProcessingRequest {
        request: Some(request),
        ..Default::default()
    };
    tx.send(message(processing_request::Request::RequestHeaders(
        headers,
    )))
    .await
    .unwrap();
    let body = HttpBody {
        body: br#"{"model":"m","prompt":"hello"}"#.to_vec(),
        end_of_stream: true,
        ..Default::default()
    };
    tx.send(message(processing_request::Request::RequestBody(body)))
        .await
        .unwrap();
    let answer = inbound.message().await.unwrap().expect("a routing answer");
    destination(&answer)
}

fn metrics_status_line(port: u16) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines().next().unwrap_or_default().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_serves_bound_listeners_until_the_shutdown_future_resolves() {
    let dir = common::temp_dir("kvpick-run");
    let catalog = dir.join("catalog.yaml");
    std::fs::write(
        &catalog,
        "workers:\n  - {name: a, model: m, address: 127.0.0.1, ports: [8000]}\n",
    )
    .unwrap();
    let serve = Serve::try_parse_from([
        "kvpick".as_ref(),
        "--secure-serving=false".as_ref(),
        "--shutdown-grace".as_ref(),
        "5".as_ref(),
        "--config".as_ref(),
        catalog.as_os_str(),
    ])
    .unwrap();

    let listeners = kvpick::server::Listeners {
        grpc: TcpListener::bind("127.0.0.1:0").await.unwrap(),
        health: TcpListener::bind("127.0.0.1:0").await.unwrap(),
        metrics: TcpListener::bind("127.0.0.1:0").await.unwrap(),
    };
    let (grpc, health, metrics) = listeners.ports().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(kvpick::server::run(serve.args, listeners, async move {
        let _ = stopped.await;
    }));

    // The listeners were bound before `run`: connections wait in their backlogs until it serves.
    assert_eq!(liveness(health).await, ServingStatus::Serving);
    assert_eq!(pick(grpc).await, "127.0.0.1:8000");
    assert_eq!(
        tokio::task::spawn_blocking(move || metrics_status_line(metrics))
            .await
            .unwrap(),
        "HTTP/1.0 200 OK"
    );

    stop.send(()).unwrap();
    let exit = tokio::time::timeout(Duration::from_secs(30), server)
        .await
        .expect("run returns after the shutdown future resolves");
    exit.unwrap().unwrap();
    // The listeners are closed: nothing answers on their ports any more.
    for port in [grpc, health, metrics] {
        assert!(
            std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
            "port {port} still open after run returned"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
}
