//! The stream bounds over a real gRPC connection: `--max-ext-proc-streams` streams are served
//! and the one past them is refused RESOURCE_EXHAUSTED at once (a freed place is reused); a
//! stream silent for `--ext-proc-idle-timeout` before routing ends DEADLINE_EXCEEDED and gives its
//! body back, one whose next message comes a millisecond before it carries on, and a routed
//! stream is not bound by it; at the cap a new stream takes the place of the stream idle longest
//! before routing, once past `--ext-proc-evict-idle-after`, and never of one within it, routed
//! or waiting in the queue (paused time: the timeouts fire only when the test moves the clock).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::time::Duration;

use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    external_processor_client::ExternalProcessorClient, processing_request, HttpBody, HttpHeaders,
    ProcessingRequest, ProcessingResponse,
};
use tokio::sync::mpsc;
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::Code;

use std::sync::Arc;

use super::{StreamBounds, StreamCap};
use crate::hosts::extproc::{BodyBudget, ExtProcService, ExtProcSettings, DEFAULT_BUDGET_BYTES};
use crate::selection::{CoreConfig, SelectionCore};

const IDLE: Duration = Duration::from_secs(60);
/// `--ext-proc-evict-idle-after`.
const GRACE: Duration = Duration::from_secs(1);
const BODY: &[u8] = br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]}"#;

struct Fixture {
    service: ExtProcService,
    core: Arc<SelectionCore>,
    cap: Arc<StreamCap>,
    budget: Arc<BodyBudget>,
}

/// `cap` places and the idle timeout [`IDLE`].
fn fixture(cap: usize) -> Fixture {
    fixture_on(
        crate::selection::one_rank_core(CoreConfig::default()),
        cap,
        Some(IDLE),
    )
}

/// `cap` places and no idle timeout, for the eviction tests: with paused time the clock jumps to
/// the next timer whenever the runtime waits on the loopback sockets, so an idle timeout would
/// end the waiting streams those tests need to stay.
fn eviction_fixture(cap: usize) -> Fixture {
    fixture_on(
        crate::selection::one_rank_core(CoreConfig::default()),
        cap,
        None,
    )
}

fn fixture_on(core: Arc<SelectionCore>, cap: usize, idle_timeout: Option<Duration>) -> Fixture {
    let cap = StreamCap::unmetered(cap, Some(GRACE));
    let budget = BodyBudget::unmetered(DEFAULT_BUDGET_BYTES);
    let settings = ExtProcSettings {
        streams: StreamBounds {
            cap: Arc::clone(&cap),
            idle_timeout,
        },
        body_budget: Arc::clone(&budget),
        ..ExtProcSettings::default()
    };
    Fixture {
        service: ExtProcService::new(Arc::clone(&core), settings),
        core,
        cap,
        budget,
    }
}

type Client = ExternalProcessorClient<tonic::transport::Channel>;

async fn connect(service: ExtProcService) -> Client {
    connect_twice(service).await.0
}

/// Two clients, each on its own connection to one server.
async fn connect_twice(service: ExtProcService) -> (Client, Client) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(service.into_server())
            .serve_with_incoming(TcpListenerStream::new(listener)),
    );
    let one = ExternalProcessorClient::connect(url.clone()).await.unwrap();
    (one, ExternalProcessorClient::connect(url).await.unwrap())
}

fn message(r: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(r),
        ..Default::default()
    }
}

fn headers() -> ProcessingRequest {
    let header = |k: &str, v: &str| HeaderValue {
        key: k.into(),
        value: String::new(),
        raw_value: v.as_bytes().to_vec(),
    };
    message(processing_request::Request::RequestHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![
                header(":method", "POST"),
                header(":path", "/v1/completions"),
                header("content-type", "application/json"),
            ],
        }),
        ..Default::default()
    }))
}

fn body(chunk: &[u8], end: bool) -> ProcessingRequest {
    message(processing_request::Request::RequestBody(HttpBody {
        body: chunk.to_vec(),
        end_of_stream: end,
        ..Default::default()
    }))
}

struct Stream {
    tx: mpsc::Sender<ProcessingRequest>,
    answers: Result<tonic::Streaming<ProcessingResponse>, tonic::Status>,
}

impl Stream {
    async fn open(
        client: &mut ExternalProcessorClient<tonic::transport::Channel>,
        first: Vec<ProcessingRequest>,
    ) -> Stream {
        let (tx, rx) = mpsc::channel(8);
        for m in first {
            tx.send(m).await.unwrap();
        }
        let answers = client
            .process(ReceiverStream::new(rx))
            .await
            .map(|r| r.into_inner());
        Stream { tx, answers }
    }

    /// The next answer, or the status the stream ended with.
    async fn next(&mut self) -> Result<Option<ProcessingResponse>, tonic::Status> {
        match &mut self.answers {
            Ok(answers) => answers.message().await,
            Err(status) => Err(status.clone()),
        }
    }
}

fn ends(core: &SelectionCore, end: &str) -> u64 {
    core.metrics()
        .extproc
        .streams
        .with_label_values(&[end])
        .get()
}

/// Waits (yielding, never sleeping) until `done` holds; fails the test if it does not within
/// 10 s of real time (a bound on failure, not a synchronisation: paused tokio time does not move).
async fn until(done: impl Fn() -> bool) {
    let started = std::time::Instant::now();
    while !done() {
        assert!(
            started.elapsed() < Duration::from_secs(10),
            "the awaited condition never held"
        );
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn streams_up_to_the_cap_are_served_and_the_one_past_it_is_refused_at_once() {
    let Fixture {
        service, core, cap, ..
    } = fixture(2);
    let live = service.live_streams();
    let mut client = connect(service).await;
    // Two streams at the cap, waiting for their bodies.
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(Stream::open(&mut client, vec![headers()]).await);
    }
    until(|| cap.open() == 2).await;
    let mut over = Stream::open(&mut client, vec![headers()]).await;
    let status = over.next().await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(ends(&core, "over_stream_cap"), 1);
    assert_eq!(live.count(), 2, "the refused stream was never served");

    // One held stream completes its request: its place serves the next stream.
    let mut first = held.remove(0);
    first.tx.send(body(BODY, true)).await.unwrap();
    assert!(first.next().await.unwrap().unwrap().response.is_some());
    drop(first);
    until(|| cap.open() == 1).await;
    let mut again = Stream::open(&mut client, vec![headers(), body(BODY, true)]).await;
    assert!(again.next().await.unwrap().is_some(), "served again");
    assert_eq!(ends(&core, "over_stream_cap"), 1);
}

#[tokio::test(start_paused = true)]
async fn a_stream_silent_before_routing_is_ended_at_the_idle_timeout_and_gives_its_body_back() {
    let Fixture {
        service,
        core,
        cap,
        budget,
    } = fixture(16);
    let live = service.live_streams();
    let mut client = connect(service).await;
    let (head, tail) = BODY.split_at(10);

    // A message a millisecond before the timeout keeps the stream going, twice over.
    let mut patient = Stream::open(&mut client, vec![headers()]).await;
    until(|| cap.open() == 1).await;
    tokio::time::advance(IDLE - Duration::from_millis(1)).await;
    patient.tx.send(body(head, false)).await.unwrap();
    until(|| budget.in_use() == 10).await;
    tokio::time::advance(IDLE - Duration::from_millis(1)).await;
    patient.tx.send(body(tail, true)).await.unwrap();
    let routed = patient.next().await.unwrap().unwrap();
    assert!(routed.response.is_some(), "routed");
    assert_eq!(core.live_bookings(), 1);

    // A stream that stops after part of its body: ended at the timeout, its body given back.
    let mut silent = Stream::open(&mut client, vec![headers(), body(head, false)]).await;
    // The routed stream's echo stays charged until its next message (what tonic and h2 may still
    // buffer of it), beside the silent stream's 10 bytes.
    until(|| budget.in_use() == BODY.len() + 10 && cap.open() == 2).await;
    tokio::time::advance(IDLE).await;
    let status = silent.next().await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
    assert!(status.message().contains("--ext-proc-idle-timeout"));
    until(|| cap.open() == 1).await;
    assert_eq!(ends(&core, "idle_timeout"), 1);
    assert_eq!(
        budget.in_use(),
        BODY.len(),
        "the silent stream's body was given back"
    );

    // The routed stream is not bound by the idle timeout: silent far past it, it still answers.
    let echo = patient.next().await.unwrap().unwrap();
    assert!(echo.response.is_some(), "the body's echo");
    tokio::time::advance(IDLE * 10).await;
    patient.tx.send(response_headers()).await.unwrap();
    assert!(patient.next().await.unwrap().is_some(), "still served");
    assert_eq!(budget.in_use(), 0, "its next message released the echo");
    assert_eq!(live.count(), 1);
    assert_eq!(core.live_bookings(), 1);
    drop(patient);
    live.idle().await;
    assert_eq!(core.live_bookings(), 0);
    assert_eq!(ends(&core, "idle_timeout"), 1);
}

fn response_headers() -> ProcessingRequest {
    message(processing_request::Request::ResponseHeaders(HttpHeaders {
        headers: Some(HeaderMap {
            headers: vec![HeaderValue {
                key: ":status".into(),
                value: String::new(),
                raw_value: b"200".to_vec(),
            }],
        }),
        ..Default::default()
    }))
}

#[tokio::test(start_paused = true)]
async fn at_the_cap_a_new_stream_takes_the_place_of_the_stream_idle_longest_before_routing() {
    let Fixture {
        service,
        core,
        cap,
        budget,
    } = eviction_fixture(4);
    let live = service.live_streams();
    let (mut client, mut envoy) = connect_twice(service).await;
    let (head, _) = BODY.split_at(10);
    // The oldest holds part of a body; three more wait for theirs, opened 10 ms later.
    let mut oldest = Stream::open(&mut client, vec![headers(), body(head, false)]).await;
    until(|| budget.in_use() == 10).await;
    tokio::time::advance(Duration::from_millis(10)).await;
    let mut idle = Vec::new();
    for _ in 0..3 {
        idle.push(Stream::open(&mut client, vec![headers()]).await);
    }
    until(|| cap.open() == 4).await;
    tokio::time::advance(GRACE).await;

    // All four are past the grace: the new stream, on a connection holding no waiting stream
    // (as Envoy's), is served in the oldest's place.
    let mut new = Stream::open(&mut envoy, vec![headers(), body(BODY, true)]).await;
    let routed = new.next().await.unwrap().unwrap();
    assert!(routed.response.is_some(), "the new stream is served");
    let status = oldest.next().await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(status.message(), "kvpick: stream evicted at the stream cap");
    until(|| live.count() == 4).await;
    assert_eq!(ends(&core, "evicted"), 1);
    assert_eq!(ends(&core, "over_stream_cap"), 0);
    assert_eq!(
        cap.open(),
        4,
        "the new stream holds the evicted one's place"
    );
    // The evicted stream's part body was given back; the new stream's echo stays charged until
    // its next message.
    assert!(new.next().await.unwrap().unwrap().response.is_some());
    until(|| budget.in_use() == BODY.len()).await;

    // The next new stream takes the next idle one (not the routed new stream).
    let mut second = Stream::open(&mut envoy, vec![headers(), body(BODY, true)]).await;
    assert!(second.next().await.unwrap().unwrap().response.is_some());
    let nexts = idle.iter_mut().map(|s| Box::pin(s.next()));
    let (first, ..) = futures::future::select_all(nexts).await;
    let status = first.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    until(|| ends(&core, "evicted") == 2 && live.count() == 4).await;
    assert_eq!(core.live_bookings(), 2);
    assert_eq!(cap.open(), 4);
}

#[tokio::test(start_paused = true)]
async fn streams_within_the_grace_and_routed_streams_are_never_evicted() {
    let Fixture {
        service,
        core,
        cap,
        budget,
    } = eviction_fixture(3);
    // Two streams waiting on one connection (a hoard the newcomers' connection does not match).
    let (mut client, mut envoy) = connect_twice(service).await;
    let (head, tail) = BODY.split_at(10);
    let mut waiting = Vec::new();
    for _ in 0..2 {
        waiting.push(Stream::open(&mut client, vec![headers()]).await);
    }
    let mut routed = Stream::open(&mut client, vec![headers(), body(BODY, true)]).await;
    assert!(routed.next().await.unwrap().unwrap().response.is_some());
    assert!(
        routed.next().await.unwrap().unwrap().response.is_some(),
        "echo"
    );
    until(|| cap.open() == 3).await;

    // A millisecond short of the grace: the one just over the cap is refused.
    tokio::time::advance(GRACE - Duration::from_millis(1)).await;
    let mut over = Stream::open(&mut envoy, vec![headers()]).await;
    assert_eq!(
        over.next().await.unwrap_err().code(),
        Code::ResourceExhausted
    );
    assert_eq!(ends(&core, "over_stream_cap"), 1);
    // A message starts the grace again; the routed stream, long past it, never qualifies.
    for w in &waiting {
        w.tx.send(body(head, false)).await.unwrap();
    }
    // (The routed stream's echo stays charged until its next message.)
    until(|| budget.in_use() == BODY.len() + 20).await;
    tokio::time::advance(GRACE - Duration::from_millis(1)).await;
    for w in &waiting {
        w.tx.send(body(tail, false)).await.unwrap();
    }
    until(|| budget.in_use() == 3 * BODY.len()).await;
    tokio::time::advance(GRACE - Duration::from_millis(1)).await;
    let mut over = Stream::open(&mut envoy, vec![headers()]).await;
    assert_eq!(
        over.next().await.unwrap_err().code(),
        Code::ResourceExhausted
    );
    assert_eq!(ends(&core, "over_stream_cap"), 2);
    assert_eq!(ends(&core, "evicted"), 0);

    // Past the grace a waiting stream gives way; the routed one carries on.
    tokio::time::advance(Duration::from_millis(1)).await;
    let mut new = Stream::open(&mut envoy, vec![headers()]).await;
    let nexts = waiting.iter_mut().map(|s| Box::pin(s.next()));
    let (status, ..) = futures::future::select_all(nexts).await;
    let status = status.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert_eq!(ends(&core, "evicted"), 1);
    new.tx.send(body(BODY, true)).await.unwrap();
    assert!(
        new.next().await.unwrap().unwrap().response.is_some(),
        "served"
    );
    routed.tx.send(response_headers()).await.unwrap();
    assert!(
        routed.next().await.unwrap().is_some(),
        "the routed stream is still served"
    );
    assert_eq!(core.live_bookings(), 2);
}

#[tokio::test(start_paused = true)]
async fn at_the_cap_a_connection_evicts_only_from_one_holding_more_waiting_streams() {
    let Fixture {
        service, core, cap, ..
    } = eviction_fixture(4);
    let live = service.live_streams();
    let (mut a, mut b) = connect_twice(service).await;
    // Two waiting streams on each connection, all past the grace.
    let mut streams = Vec::new();
    for client in [&mut a, &mut b] {
        for _ in 0..2 {
            streams.push(Stream::open(client, vec![headers()]).await);
        }
    }
    until(|| cap.open() == 4).await;
    tokio::time::advance(GRACE * 2).await;
    // Equal hoards: a newcomer on either is refused, however long the others waited.
    for client in [&mut a, &mut b] {
        let mut over = Stream::open(client, vec![headers()]).await;
        let status = over.next().await.unwrap_err();
        assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    }
    assert_eq!(ends(&core, "over_stream_cap"), 2);
    assert_eq!(ends(&core, "evicted"), 0);
    // b's streams are routed: b holds none waiting, a two, more than b would with a newcomer.
    for s in &streams[2..] {
        s.tx.send(body(BODY, true)).await.unwrap();
    }
    for s in &mut streams[2..] {
        assert!(s.next().await.unwrap().unwrap().response.is_some());
    }
    let mut new = Stream::open(&mut b, vec![headers(), body(BODY, true)]).await;
    assert!(
        new.next().await.unwrap().unwrap().response.is_some(),
        "b (none waiting) takes a's place"
    );
    // The evicted stream counts its end when its driver wakes.
    until(|| ends(&core, "evicted") == 1).await;
    // a (one waiting left) against b's newcomer (one): refused.
    let mut over = Stream::open(&mut b, vec![headers()]).await;
    assert_eq!(
        over.next().await.unwrap_err().code(),
        Code::ResourceExhausted
    );
    assert_eq!(ends(&core, "evicted"), 1);
    drop((streams, new, over));
    live.idle().await;
    until(|| cap.open() == 0).await;
    assert_eq!(
        cap.waiting_on(None),
        (0, 0),
        "every connection's count went back"
    );
}

#[tokio::test(start_paused = true)]
async fn a_stream_waiting_in_the_queue_past_the_grace_is_not_evicted() {
    // One rank taking one request at a time: the second waits in the queue.
    let core = crate::selection::one_rank_core(CoreConfig {
        seed: Some(1),
        flow: kvpick_core::FlowConfig {
            queue_timeout: Duration::from_secs(300),
            saturation: crate::selection::ONE_SLOT,
            ..kvpick_core::FlowConfig::default()
        },
        ..Default::default()
    });
    let Fixture {
        service, core, cap, ..
    } = fixture_on(core, 2, None);
    let mut client = connect(service).await;
    let mut routed = Stream::open(&mut client, vec![headers(), body(BODY, true)]).await;
    assert!(routed.next().await.unwrap().unwrap().response.is_some());
    let mut queued = Stream::open(&mut client, vec![headers(), body(BODY, true)]).await;
    until(|| core.waiting_requests() == 1).await;
    tokio::time::advance(GRACE * 10).await;
    let mut over = Stream::open(&mut client, vec![headers()]).await;
    assert_eq!(
        over.next().await.unwrap_err().code(),
        Code::ResourceExhausted
    );
    assert_eq!(ends(&core, "over_stream_cap"), 1);
    assert_eq!(ends(&core, "evicted"), 0);
    // The routed stream ends: the queued one is routed in its turn.
    drop(routed);
    assert!(queued.next().await.unwrap().unwrap().response.is_some());
    assert_eq!(core.waiting_requests(), 0);
    assert_eq!(cap.open(), 1);
}
