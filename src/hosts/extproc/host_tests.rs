//! The host over a real gRPC connection: how a stream's end is counted, and that a client gone
//! while its request waits in the queue leaves the queue (the answer stream is dropped by
//! hyper, and with it the stream's driver).

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    external_processor_client::ExternalProcessorClient, processing_request, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};

use super::*;
use crate::selection::CoreConfig;
use kvpick_core::FlowConfig;

/// One rank that takes one request at a time; the rest wait in the queue.
fn one_at_a_time() -> Arc<SelectionCore> {
    crate::selection::one_rank_core(CoreConfig {
        seed: Some(1),
        flow: FlowConfig {
            queue_timeout: Duration::from_secs(300),
            saturation: crate::selection::ONE_SLOT,
            ..FlowConfig::default()
        },
        ..Default::default()
    })
}

async fn serve(service: ExtProcService) -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    url
}

fn request(id: &str) -> [ProcessingRequest; 2] {
    let header = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        value: String::new(),
        raw_value: v.as_bytes().to_vec(),
    };
    let headers = HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![
                header(":method", "POST"),
                header(":path", "/v1/completions"),
                header("content-type", "application/json"),
                header("x-request-id", id),
            ],
        }),
        ..Default::default()
    };
    let body = HttpBody {
        body: br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#.to_vec(),
        end_of_stream: true,
        ..Default::default()
    };
    [
        processing_request::Request::RequestHeaders(headers),
        processing_request::Request::RequestBody(body),
    ]
    .map(|r| ProcessingRequest {
        request: Some(r),
        ..Default::default()
    })
}

struct Client {
    tx: mpsc::Sender<ProcessingRequest>,
    answers: tonic::Streaming<ProcessingResponse>,
}

async fn open(client: &mut ExternalProcessorClient<tonic::transport::Channel>, id: &str) -> Client {
    let (tx, rx) = mpsc::channel(4);
    for message in request(id) {
        tx.send(message).await.unwrap();
    }
    let answers = client
        .process(ReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    Client { tx, answers }
}

fn ends(core: &SelectionCore, end: &str) -> u64 {
    core.metrics()
        .extproc
        .streams
        .with_label_values(&[end])
        .get()
}

#[tokio::test]
async fn a_client_gone_while_queued_leaves_the_queue_and_each_end_is_counted() {
    let core = one_at_a_time();
    let service = ExtProcService::new(Arc::clone(&core), ExtProcSettings::default());
    let live = service.live_streams();
    let mut client = ExternalProcessorClient::connect(serve(service).await)
        .await
        .unwrap();

    let mut busy = open(&mut client, "busy").await;
    let routed = busy.answers.message().await.unwrap().unwrap();
    assert!(routed.response.is_some(), "the first request is routed");
    assert_eq!(core.live_bookings(), 1);

    let waiting = open(&mut client, "waiting").await;
    let mut seen = live.0.subscribe();
    seen.wait_for(|n| *n == 2).await.unwrap();
    // Its body is read once the stream is polled; the queue takes it then.
    while core.waiting_requests() == 0 {
        tokio::task::yield_now().await;
    }
    drop(waiting);
    seen.wait_for(|n| *n == 1).await.unwrap();
    assert_eq!(core.waiting_requests(), 0, "the gone client left the queue");
    assert_eq!(ends(&core, "gone_while_queued"), 1);

    // Envoy closes its side: the stream ends cleanly and its booking is freed.
    drop(busy.tx);
    let mut after = 0;
    while busy.answers.message().await.unwrap().is_some() {
        after += 1;
    }
    assert_eq!(after, 1, "the body's echo, then the end");
    live.idle().await;
    assert_eq!(ends(&core, "closed"), 1);
    assert_eq!(
        core.live_bookings(),
        0,
        "nothing was released to the gone client"
    );

    // A routed stream whose client goes away (reset) frees its booking too.
    let mut routed = open(&mut client, "routed").await;
    routed.answers.message().await.unwrap().unwrap();
    assert_eq!(core.live_bookings(), 1);
    drop(routed);
    live.idle().await;
    assert_eq!(core.live_bookings(), 0);
    assert_eq!(ends(&core, "envoy_gone") + ends(&core, "reset"), 1);
}

/// The response messages of an exchange: 200 headers, then a body that ends the response.
fn response(body: &[u8]) -> [ProcessingRequest; 2] {
    let headers = HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![HeaderValue {
                key: ":status".into(),
                value: String::new(),
                raw_value: b"200".to_vec(),
            }],
        }),
        ..Default::default()
    };
    let body = HttpBody {
        body: body.to_vec(),
        end_of_stream: true,
        ..Default::default()
    };
    [
        processing_request::Request::ResponseHeaders(headers),
        processing_request::Request::ResponseBody(body),
    ]
    .map(|r| ProcessingRequest {
        request: Some(r),
        ..Default::default()
    })
}

/// Envoy ends a finished exchange's stream in any of three ways; each is a normal end
/// (`completed`), never `envoy_gone` or `reset`.
#[tokio::test]
async fn a_stream_that_ends_after_its_response_completed_is_counted_completed() {
    let core = crate::selection::one_rank_core(CoreConfig::default());
    let service = ExtProcService::new(Arc::clone(&core), ExtProcSettings::default());
    let live = service.live_streams();
    let mut client = ExternalProcessorClient::connect(serve(service).await)
        .await
        .unwrap();
    for (i, how) in ["half-close", "drop", "unfinished"].into_iter().enumerate() {
        let mut s = open(&mut client, &format!("r{i}")).await;
        // The routing answer and the body's echo.
        for _ in 0..2 {
            s.answers.message().await.unwrap().unwrap();
        }
        if how != "unfinished" {
            for message in response(b"{}") {
                s.tx.send(message).await.unwrap();
                s.answers.message().await.unwrap().unwrap();
            }
        }
        match how {
            "half-close" => {
                drop(s.tx);
                assert!(s.answers.message().await.unwrap().is_none());
            }
            _ => drop(s),
        }
        live.idle().await;
    }
    assert_eq!(ends(&core, "completed"), 2);
    // A stream gone before its response ended is still Envoy gone (or a reset).
    assert_eq!(ends(&core, "envoy_gone") + ends(&core, "reset"), 1);
    assert_eq!(ends(&core, "closed"), 0);
    assert_eq!(core.live_bookings(), 0);
}

/// The request headers message of `request(id)` padded with an `x-pad` header to exactly `len`
/// bytes on the wire (without gRPC's prefix), then its body.
fn request_of_size(id: &str, len: usize) -> [ProcessingRequest; 2] {
    use prost::Message;
    let [mut headers, body] = request(id);
    let Some(processing_request::Request::RequestHeaders(h)) = headers.request.as_mut() else {
        unreachable!()
    };
    let map = h.headers.as_mut().unwrap();
    map.headers.push(HeaderValue {
        key: "x-pad".into(),
        value: String::new(),
        raw_value: Vec::new(),
    });
    let base = headers.encoded_len();
    let mut pad = len - base;
    loop {
        let Some(processing_request::Request::RequestHeaders(h)) = headers.request.as_mut() else {
            unreachable!()
        };
        h.headers
            .as_mut()
            .unwrap()
            .headers
            .last_mut()
            .unwrap()
            .raw_value = vec![b'p'; pad];
        match headers.encoded_len().cmp(&len) {
            std::cmp::Ordering::Equal => return [headers, body],
            std::cmp::Ordering::Greater => pad -= 1,
            std::cmp::Ordering::Less => pad += 1,
        }
    }
}

/// `--max-ext-proc-message-bytes`: a message of exactly the limit is served, one byte over it
/// ends the stream with OUT_OF_RANGE (tonic's check on the 5-byte prefix, before it reserves).
#[tokio::test]
async fn a_message_over_the_limit_ends_its_stream_with_out_of_range() {
    const LIMIT: usize = 64 * 1024;
    let core = crate::selection::one_rank_core(CoreConfig {
        seed: Some(1),
        ..Default::default()
    });
    let settings = ExtProcSettings {
        max_message_bytes: LIMIT,
        ..Default::default()
    };
    let service = ExtProcService::new(Arc::clone(&core), settings);
    let client = ExternalProcessorClient::connect(serve(service).await)
        .await
        .unwrap();
    let send = |messages: [ProcessingRequest; 2]| {
        let mut client = client.clone();
        async move {
            let (tx, rx) = mpsc::channel(4);
            for m in messages {
                tx.send(m).await.unwrap();
            }
            let mut answers = client.process(ReceiverStream::new(rx)).await?.into_inner();
            let first = answers.message().await;
            drop(tx);
            first
        }
    };
    let at = send(request_of_size("at", LIMIT)).await.unwrap();
    assert!(
        at.is_some_and(|a| a.response.is_some()),
        "at the limit: served"
    );
    let over = send(request_of_size("over", LIMIT + 1)).await.unwrap_err();
    assert_eq!(over.code(), tonic::Code::OutOfRange, "{over}");
    assert!(over.message().contains("the limit is: 65536"), "{over}");
    assert_eq!(
        crate::hosts::extproc::max_message_bytes(32 << 20),
        (32 << 20) + crate::hosts::extproc::MESSAGE_HEADROOM_BYTES,
        "the default: --max-body-bytes plus the headroom"
    );
}
