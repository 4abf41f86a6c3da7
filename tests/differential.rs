//! One core, two hosts: the same seeded request stream through the ext_proc host (a real tonic
//! ExternalProcessor client, as Envoy speaks it) and through the gRPC selection API must produce
//! byte-identical decision traces.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use envoy_types::pb::envoy::service::ext_proc::v3::{
    external_processor_client::ExternalProcessorClient, processing_request, processing_response,
    HttpBody, HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use kvpick::hosts::api::SelectionApi;
use kvpick::hosts::extproc::{ExtProcService, ExtProcSettings};
use kvpick::observability::metrics::Metrics;
use kvpick::proto::selection_client::SelectionClient;
use kvpick::proto::{BookingRef, SelectRequest};
use kvpick::selection::{CoreConfig, SelectionCore};
use kvpick::sources::catalog::{RankLayout, WorkerSpec};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::Streaming;

fn catalog() -> Vec<WorkerSpec> {
    let worker = |name: &str, layout: RankLayout| WorkerSpec {
        block_size: Some(16),
        ..WorkerSpec::for_test(name, "m", layout)
    };
    vec![
        worker("a", RankLayout::PerPort(vec![8000, 8001])),
        worker(
            "b",
            RankLayout::Multiplexed {
                port: 8100,
                size: 2,
            },
        ),
        worker("c", RankLayout::PerPort(vec![8200])),
    ]
}

fn new_core() -> Arc<SelectionCore> {
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(2024),
            trace_decisions: 10_000,
            // Observed first-token times are wall-clock input that differs between the two runs;
            // the hosts must agree on everything else (calibration has its own tests in the core).
            estimator: kvpick_core::EstimatorConfig {
                calibrate: false,
                ..Default::default()
            },
            ..CoreConfig::default()
        },
        Metrics::new(),
    );
    core.apply_snapshot(catalog()).unwrap();
    core
}

async fn serve(router: tonic::transport::server::Router) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(router.serve_with_incoming(TcpListenerStream::new(listener)));
    format!("http://{addr}")
}

/// One request's ext_proc stream, kept open until the response ends.
struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    rx: Streaming<ProcessingResponse>,
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
    HttpHeaders {
        end_of_stream,
        ..common::http_headers(pairs)
    }
}

fn message(request: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..Default::default()
    }
}

impl Stream {
    async fn open(client: &mut ExternalProcessorClient<tonic::transport::Channel>) -> Self {
        let (tx, rx) = mpsc::channel(8);
        let rx = client
            .process(ReceiverStream::new(rx))
            .await
            .unwrap()
            .into_inner();
        Stream { tx, rx }
    }

    async fn send(&mut self, request: processing_request::Request) {
        self.tx.send(message(request)).await.unwrap();
    }

    async fn next(&mut self) -> processing_response::Response {
        self.rx.message().await.unwrap().unwrap().response.unwrap()
    }
}

enum Op {
    Select { id: String, tokens: Vec<u32> },
    Prefill(String),
    Free(String),
}

/// A seeded stream of selections over shared prefixes, with bookings held, prefilled and freed
/// out of order.
fn operations() -> Vec<Op> {
    let mut rng = StdRng::seed_from_u64(99);
    let prefixes: Vec<Vec<u32>> = (0..5)
        .map(|p| {
            (0..rng.random_range(16..200))
                .map(|t| p * 10_000 + t)
                .collect()
        })
        .collect();
    let mut ops = Vec::new();
    let mut open: Vec<String> = Vec::new();
    let mut prefilled: Vec<String> = Vec::new();
    for i in 0..150 {
        let mut tokens = prefixes[rng.random_range(0..prefixes.len())].clone();
        tokens.extend((0..rng.random_range(0..100)).map(|t| 1_000_000 + i * 1000 + t));
        let id = format!("req-{i}");
        ops.push(Op::Select {
            id: id.clone(),
            tokens,
        });
        open.push(id);
        if rng.random_bool(0.6) && !open.is_empty() {
            let id = open.remove(rng.random_range(0..open.len()));
            ops.push(Op::Prefill(id.clone()));
            prefilled.push(id);
        }
        if rng.random_bool(0.5) && !prefilled.is_empty() {
            ops.push(Op::Free(
                prefilled.remove(rng.random_range(0..prefilled.len())),
            ));
        }
    }
    ops
}

#[tokio::test]
async fn ext_proc_and_grpc_api_make_identical_decisions() {
    let via_extproc = new_core();
    let via_api = new_core();
    let extproc_url = serve(tonic::transport::Server::builder().add_service(
        ExtProcService::new(Arc::clone(&via_extproc), ExtProcSettings::default()).into_server(),
    ))
    .await;
    let api_url = serve(
        tonic::transport::Server::builder()
            .add_service(SelectionApi::new(Arc::clone(&via_api)).into_server()),
    )
    .await;
    let mut extproc = ExternalProcessorClient::connect(extproc_url).await.unwrap();
    let mut api = SelectionClient::connect(api_url).await.unwrap();

    let mut streams: HashMap<String, Stream> = HashMap::new();
    let ops = operations();
    for op in &ops {
        match op {
            Op::Select { id, tokens } => {
                let mut s = Stream::open(&mut extproc).await;
                s.send(processing_request::Request::RequestHeaders(headers(
                    &[
                        (":method", "POST"),
                        (":path", "/v1/completions"),
                        ("x-request-id", id),
                    ],
                    false,
                )))
                .await;
                let body = serde_json::json!({"model": "m", "prompt": tokens}).to_string();
                s.send(processing_request::Request::RequestBody(HttpBody {
                    body: body.into_bytes(),
                    end_of_stream: true,
                    ..Default::default()
                }))
                .await;
                assert!(matches!(
                    s.next().await,
                    processing_response::Response::RequestHeaders(_)
                ));
                assert!(matches!(
                    s.next().await,
                    processing_response::Response::RequestBody(_)
                ));
                streams.insert(id.clone(), s);

                api.select_and_reserve(SelectRequest {
                    request_id: id.clone(),
                    model: "m".into(),
                    token_ids: tokens.clone(),
                    ..Default::default()
                })
                .await
                .unwrap();
            }
            Op::Prefill(id) => {
                let s = streams.get_mut(id).unwrap();
                s.send(processing_request::Request::ResponseHeaders(headers(
                    &[(":status", "200")],
                    false,
                )))
                .await;
                assert!(matches!(
                    s.next().await,
                    processing_response::Response::ResponseHeaders(_)
                ));
                s.send(processing_request::Request::ResponseBody(HttpBody {
                    body: b"data: {}\n\n".to_vec(),
                    end_of_stream: false,
                    ..Default::default()
                }))
                .await;
                assert!(matches!(
                    s.next().await,
                    processing_response::Response::ResponseBody(_)
                ));
                api.prefill_complete(BookingRef {
                    request_id: id.clone(),
                })
                .await
                .unwrap();
            }
            Op::Free(id) => {
                let mut s = streams.remove(id).unwrap();
                s.send(processing_request::Request::ResponseBody(HttpBody {
                    body: Vec::new(),
                    end_of_stream: true,
                    ..Default::default()
                }))
                .await;
                assert!(matches!(
                    s.next().await,
                    processing_response::Response::ResponseBody(_)
                ));
                assert!(
                    api.free(BookingRef {
                        request_id: id.clone()
                    })
                    .await
                    .unwrap()
                    .into_inner()
                    .found
                );
            }
        }
    }
    let a = via_extproc.decision_trace();
    let b = via_api.decision_trace();
    assert_eq!(a.len(), 150);
    assert_eq!(a, b, "decision traces differ between hosts");
    // The traces are not trivial: prefixes were found and several ranks were used.
    assert!(
        a.iter().any(|l| !l.contains(" overlap=0 ")),
        "some picks reused cached prefixes"
    );
    let picks: std::collections::HashSet<&str> = a
        .iter()
        .map(|l| l.split(' ').find(|w| w.starts_with("pick=")).unwrap())
        .collect();
    assert!(picks.len() >= 3, "{picks:?}");
    assert_eq!(via_extproc.live_bookings(), via_api.live_bookings());
}
