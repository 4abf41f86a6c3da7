//! SIGTERM on the real binary while an ext_proc stream is open: until the stream ends, both the
//! health port and the ext_proc port keep answering gRPC health, with readiness NOT_SERVING and
//! liveness SERVING, and new ext_proc streams are refused; then kvpick exits 0.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ext_proc::v3::{
    external_processor_client::ExternalProcessorClient, processing_request, HttpBody,
    ProcessingRequest,
};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

mod common;

use common::{start_static, wait_readiness};

fn headers(response: bool) -> ProcessingRequest {
    let pairs: &[(&str, &str)] = if response {
        &[(":status", "200"), ("content-type", "application/json")]
    } else {
        &[(":method", "POST"), ("content-type", "application/json")]
    };
    let h = common::http_headers(pairs);
    ProcessingRequest {
        request: Some(if response {
            processing_request::Request::ResponseHeaders(h)
        } else {
            processing_request::Request::RequestHeaders(h)
        }),
        ..Default::default()
    }
}

fn body(response: bool, bytes: &[u8]) -> ProcessingRequest {
    let b = HttpBody {
        body: bytes.to_vec(),
        end_of_stream: true,
        ..Default::default()
    };
    ProcessingRequest {
        request: Some(if response {
            processing_request::Request::ResponseBody(b)
        } else {
            processing_request::Request::RequestBody(b)
        }),
        ..Default::default()
    }
}

/// One health check on a fresh connection: the status, or the transport error as text.
async fn check(port: u16, service: &str) -> Result<ServingStatus, String> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{port}"))
        .unwrap()
        .connect()
        .await
        .map_err(|e| format!("connect: {e:?}"))?;
    let status = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: service.into(),
        })
        .await
        .map_err(|e| format!("check: {e:?}"))?
        .into_inner()
        .status;
    Ok(ServingStatus::try_from(status).unwrap())
}

#[tokio::test]
async fn draining_answers_not_serving_on_both_ports_until_exit() {
    let mut serve = start_static(
        "workers:\n  - {name: a, model: m, address: 127.0.0.1, ports: [8000]}\n",
        &["--shutdown-grace", "30"],
    );
    wait_readiness(serve.health, ServingStatus::Serving).await;
    let mut client = ExternalProcessorClient::connect(format!("http://127.0.0.1:{}", serve.grpc))
        .await
        .unwrap();

    // A routed request whose response has not ended: the stream (and its booking) is open.
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let mut inbound = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    tx.send(headers(false)).await.unwrap();
    tx.send(body(false, br#"{"model":"m","prompt":"hi"}"#))
        .await
        .unwrap();
    for _ in 0..2 {
        inbound.message().await.unwrap().expect("routing answer");
    }

    let pid = serve.child.id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .unwrap();
    assert!(killed.success());

    // Every readiness service turns NOT_SERVING on both ports while the stream is open (bounded
    // poll: the signal is handled by another process, and kvpick sets the services one after
    // the other, so the test waits for all of them instead of asserting the rest as soon as
    // `readiness` has turned).
    let deadline = Instant::now() + Duration::from_secs(10);
    let services = [
        "readiness",
        "inference-extension",
        "envoy.service.ext_proc.v3.ExternalProcessor",
        "",
    ];
    loop {
        let mut statuses = Vec::new();
        for port in [serve.health, serve.grpc] {
            for service in services {
                statuses.push((port, service, check(port, service).await));
            }
        }
        if statuses
            .iter()
            .all(|(_, _, s)| *s == Ok(ServingStatus::NotServing))
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "draining readiness (port, service, status): {statuses:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(
        check(serve.health, "liveness").await,
        Ok(ServingStatus::Serving)
    );
    assert_eq!(
        check(serve.grpc, "liveness").await,
        Ok(ServingStatus::Serving)
    );

    // New ext_proc streams are refused while draining.
    let (_tx2, rx2) = tokio::sync::mpsc::channel::<ProcessingRequest>(1);
    let refused = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx2))
        .await
        .expect_err("a new stream while draining");
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(
        serve.child.try_wait().unwrap().is_none(),
        "waits for the open stream"
    );

    // The open response ends: kvpick has nothing left to drain and exits 0.
    tx.send(headers(true)).await.unwrap();
    tx.send(body(true, b"{}")).await.unwrap();
    for _ in 0..2 {
        inbound.message().await.unwrap().expect("response answers");
    }
    drop(tx);
    let deadline = Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(status) = serve.child.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "kvpick did not exit after draining"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(status.success(), "{status:?}");
    let log = std::fs::read_to_string(serve.dir.join("kvpick.log")).unwrap();
    assert!(log.contains("drained"), "{log}");
}
