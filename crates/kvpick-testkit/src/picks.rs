//! An open-loop pick client of kvpick's ext_proc port, doing what Envoy does per request: open a
//! stream, send the request headers and the body (a `/v1/completions` prompt of token ids),
//! read the routing answer and the echoed body, then the response headers and body, and close.
//! Picks start on a fixed schedule (rate × time) whatever the answers take, so a slow pick
//! queues the ones behind it instead of slowing the offered load.
//!
//! The latency of a pick is from the body's last byte sent to the routing answer received: what
//! Envoy waits for before it can connect upstream. Owns the client side only.

use std::sync::Arc;
use std::time::{Duration, Instant};

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::external_processor_client::ExternalProcessorClient;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    body_mutation, processing_request::Request, processing_response::Response, HttpBody,
    HttpHeaders, ProcessingRequest, ProcessingResponse,
};
use parking_lot::Mutex;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use crate::workload::Workload;

/// The header carrying the picked endpoint (GIE's).
pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";

/// A start later than its slot by more than this is late: tokio's timer wakes up to 1 ms after
/// the instant asked, so 2 ms means the client itself fell behind.
pub const LATE: Duration = Duration::from_millis(2);

/// What the client offers.
#[derive(Debug, Clone)]
pub struct PickConfig {
    pub rate: f64,
    /// HTTP/2 connections the picks are spread over (Envoy keeps a few per worker thread).
    pub connections: usize,
    pub model: String,
    pub workload: Workload,
    /// A pick not done within this is abandoned (its stream dropped, as Envoy's ext_proc
    /// message timeout does) and counts at this latency, a lower bound.
    pub timeout: Duration,
}

/// What the picks of one window met.
#[derive(Debug, Default)]
pub struct PickTally {
    /// Latencies of routed picks, in microseconds.
    pub latencies_us: Vec<u64>,
    /// Streams answered without a destination (an immediate response: 429, 503...).
    pub unrouted: u64,
    /// Streams that failed (transport or protocol error).
    pub failed: u64,
    /// Picks abandoned at the timeout.
    pub timed_out: u64,
    /// The first failure's message (what `failed` counts), for the report.
    pub first_error: Option<String>,
    /// Picks started later than their slot by more than [`LATE`] (the client fell behind).
    pub late_starts: u64,
}

/// Runs picks for `warmup + duration`; only those started after the warm-up are tallied.
/// Returns the tally and how many picks started in the measured part.
pub async fn run(
    endpoint: String,
    config: PickConfig,
    warmup: Duration,
    duration: Duration,
) -> anyhow::Result<(PickTally, u64)> {
    let mut clients = Vec::with_capacity(config.connections.max(1));
    for _ in 0..config.connections.max(1) {
        let channel = tonic::transport::Endpoint::from_shared(endpoint.clone())?
            .tcp_nodelay(true)
            .connect()
            .await?;
        clients.push(ExternalProcessorClient::new(channel));
    }
    let tally = Arc::new(Mutex::new(PickTally::default()));
    let start = Instant::now();
    let end = start + warmup + duration;
    let rate = config.rate.max(f64::MIN_POSITIVE);
    let mut started = 0u64;
    let mut measured = 0u64;
    let mut tasks = Vec::new();
    loop {
        let due = start + Duration::from_secs_f64(started as f64 / rate);
        if due >= end {
            break;
        }
        tokio::time::sleep_until(due.into()).await;
        let counted = due >= start + warmup;
        if counted && due.elapsed() > LATE {
            tally.lock().late_starts += 1;
        }
        let client = clients[started as usize % clients.len()].clone();
        let body = config.workload.completion_body(&config.model, started);
        let (tally, timeout) = (Arc::clone(&tally), config.timeout);
        tasks.push(tokio::spawn(async move {
            let outcome = tokio::time::timeout(timeout, one_pick(client, body)).await;
            if !counted {
                return;
            }
            let mut tally = tally.lock();
            match outcome {
                Ok(Ok(Some(latency))) => tally.latencies_us.push(latency.as_micros() as u64),
                Ok(Ok(None)) => tally.unrouted += 1,
                Ok(Err(err)) => {
                    tally.failed += 1;
                    tally.first_error.get_or_insert_with(|| format!("{err:#}"));
                }
                Err(_) => tally.timed_out += 1,
            }
        }));
        started += 1;
        measured += u64::from(counted);
    }
    for task in tasks {
        let _ = task.await;
    }
    let tally = std::mem::take(&mut *tally.lock());
    Ok((tally, measured))
}

fn headers(pairs: &[(&str, &str)]) -> HttpHeaders {
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
        ..Default::default()
    }
}

fn message(request: Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..Default::default()
    }
}

/// Whether a processing response names a destination.
fn routed(response: &ProcessingResponse) -> bool {
    let Some(Response::RequestHeaders(headers)) = &response.response else {
        return false;
    };
    headers
        .response
        .as_ref()
        .and_then(|c| c.header_mutation.as_ref())
        .is_some_and(|m| {
            m.set_headers.iter().any(|h| {
                h.header
                    .as_ref()
                    .is_some_and(|h| h.key == DESTINATION_HEADER)
            })
        })
}

/// One request's ext_proc stream. `Some(latency)` when routed, `None` when answered without a
/// destination.
async fn one_pick(
    mut client: ExternalProcessorClient<Channel>,
    body: Vec<u8>,
) -> anyhow::Result<Option<Duration>> {
    let (tx, rx) = mpsc::channel(4);
    let mut inbound = client
        .process(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await?
        .into_inner();
    let request_headers = headers(&[
        (":method", "POST"),
        (":path", "/v1/completions"),
        (":authority", "bench"),
        ("content-type", "application/json"),
    ]);
    tx.send(message(Request::RequestHeaders(request_headers)))
        .await?;
    let sent = Instant::now();
    tx.send(message(Request::RequestBody(HttpBody {
        body,
        end_of_stream: true,
        ..Default::default()
    })))
    .await?;
    let Some(answer) = inbound.message().await? else {
        anyhow::bail!("the stream ended before the routing answer");
    };
    let latency = sent.elapsed();
    if !routed(&answer) {
        return Ok(None);
    }
    // The echoed body, then the upstream's answer as Envoy relays it.
    until_body_end(&mut inbound, false).await?;
    let response_headers = headers(&[(":status", "200"), ("content-type", "application/json")]);
    tx.send(message(Request::ResponseHeaders(response_headers)))
        .await?;
    inbound.message().await?;
    tx.send(message(Request::ResponseBody(HttpBody {
        body: br#"{"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2}}"#.to_vec(),
        end_of_stream: true,
        ..Default::default()
    })))
    .await?;
    until_body_end(&mut inbound, true).await?;
    Ok(Some(latency))
}

/// Reads answers until the echo of the request body (or, with `response`, the response body)
/// has ended: a body answer that is not a streamed chunk, or the chunk marked end of stream.
async fn until_body_end(
    inbound: &mut tonic::Streaming<ProcessingResponse>,
    response: bool,
) -> anyhow::Result<()> {
    loop {
        let Some(answer) = inbound.message().await? else {
            anyhow::bail!("the stream ended inside the body echo");
        };
        let body = match (answer.response, response) {
            (Some(Response::RequestBody(b)), false) | (Some(Response::ResponseBody(b)), true) => b,
            (other, _) => anyhow::bail!("expected a body answer, got {other:?}"),
        };
        let streamed_end = body
            .response
            .and_then(|c| c.body_mutation)
            .and_then(|m| m.mutation)
            .map(|m| match m {
                body_mutation::Mutation::StreamedResponse(s) => s.end_of_stream,
                _ => true,
            });
        if streamed_end.unwrap_or(true) {
            return Ok(());
        }
    }
}
