//! The load generator and instant upstreams of the overhead benchmark and the soak test
//! (`e2e/bench_overhead.py`, `e2e/soak.py`). Not part of kvpick: it only speaks HTTP/1.1.
//!
//! ```text
//! loadgen upstream --count N [--events K --event-ms MS]
//!     N instant model servers on 127.0.0.1:0; prints `PORTS p1,p2,...`. A JSON request answers at
//!     once with an OpenAI-shaped body and `usage`; a request whose body has `"stream":true` gets
//!     K SSE events, MS apart, then `[DONE]`.
//! loadgen run --url URL --body FILE --concurrency C (--requests N | --seconds S)
//!             [--rate R] [--abort-fraction F] [--warmup W] [--first N]
//!     C closed-loop clients, each on its own keep-alive connection, POST the body (every `{n}`
//!     replaced by a unique request number, counting from N: give runs against the same kvpick
//!     disjoint ranges, or a later run's prompts are an earlier run's, already indexed).
//!     `--rate` caps the total request rate; a fraction F of requests is abandoned after the
//!     response head (the connection is dropped mid-stream).
//!     Prints one JSON object: counts, statuses, requests/s and latency percentiles (ms, until
//!     the whole response body has arrived).
//! ```

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, TcpStream};

type BoxBody = http_body_util::combinators::BoxBody<Bytes, std::convert::Infallible>;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn num<T: std::str::FromStr>(args: &[String], name: &str, default: T) -> T {
    arg(args, name)
        .map(|v| {
            v.parse()
                .unwrap_or_else(|_| panic!("{name}: not a number: {v}"))
        })
        .unwrap_or(default)
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("upstream") => upstream(&args).await,
        Some("run") => run(&args).await,
        _ => {
            eprintln!("usage: loadgen upstream --count N | loadgen run --url URL --body FILE ...");
            std::process::exit(2);
        }
    }
}

// ------------------------------------------------------------------------------------------
// instant upstreams

async fn upstream(args: &[String]) {
    let count: usize = num(args, "--count", 1);
    let events: usize = num(args, "--events", 4);
    let event_ms: u64 = num(args, "--event-ms", 50);
    let mut ports = Vec::new();
    for _ in 0..count {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        ports.push(listener.local_addr().unwrap().port());
        tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        answer(req, events, Duration::from_millis(event_ms))
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
    }
    let list: Vec<String> = ports.iter().map(u16::to_string).collect();
    println!("PORTS {}", list.join(","));
    std::future::pending::<()>().await;
}

async fn answer(
    req: Request<Incoming>,
    events: usize,
    gap: Duration,
) -> Result<Response<BoxBody>, hyper::Error> {
    let body = req.into_body().collect().await?.to_bytes();
    let prompt_bytes = body.len();
    let stream = memchr_stream(&body);
    if !stream {
        let json = format!(
            "{{\"id\":\"x\",\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\"ok\",\"finish_reason\":\"stop\"}}],\"usage\":{{\"prompt_tokens\":{},\"completion_tokens\":1,\"total_tokens\":{}}}}}",
            prompt_bytes / 4,
            prompt_bytes / 4 + 1
        );
        return Ok(Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(json)).boxed())
            .unwrap());
    }
    let (tx, rx) = tokio::sync::mpsc::channel::<Result<Frame<Bytes>, std::convert::Infallible>>(4);
    tokio::spawn(async move {
        for i in 0..events {
            if i > 0 {
                tokio::time::sleep(gap).await;
            }
            let event = format!("data: {{\"choices\":[{{\"index\":0,\"text\":\"t{i}\"}}]}}\n\n");
            if tx.send(Ok(Frame::data(Bytes::from(event)))).await.is_err() {
                return;
            }
        }
        let _ = tx
            .send(Ok(Frame::data(Bytes::from_static(b"data: [DONE]\n\n"))))
            .await;
    });
    let body = StreamBody::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    Ok(Response::builder()
        .header("content-type", "text/event-stream")
        .body(BodyExt::boxed(body))
        .unwrap())
}

fn memchr_stream(body: &[u8]) -> bool {
    body.windows(13).any(|w| w == b"\"stream\":true")
}

// ------------------------------------------------------------------------------------------
// load

struct Shared {
    url: hyper::Uri,
    authority: String,
    template: Vec<Vec<u8>>,
    next: AtomicU64,
    /// The run's first request number: request `base + i` is due at `start + i * interval`.
    base: u64,
    limit: Option<u64>,
    deadline: Option<Instant>,
    interval: Option<Duration>,
    start: Instant,
    abort_every: Option<u64>,
}

#[derive(Default)]
struct Tally {
    latencies_ms: Vec<f64>,
    statuses: BTreeMap<String, u64>,
    errors: u64,
    aborted: u64,
}

async fn run(args: &[String]) {
    let url: hyper::Uri = arg(args, "--url")
        .expect("--url")
        .parse()
        .expect("--url: a URL");
    let body = std::fs::read(arg(args, "--body").expect("--body")).expect("read --body");
    let concurrency: usize = num(args, "--concurrency", 1);
    let requests: Option<u64> = arg(args, "--requests").map(|v| v.parse().expect("--requests"));
    let seconds: Option<f64> = arg(args, "--seconds").map(|v| v.parse().expect("--seconds"));
    let rate: Option<f64> = arg(args, "--rate").map(|v| v.parse().expect("--rate"));
    let abort_fraction: f64 = num(args, "--abort-fraction", 0.0);
    let warmup: u64 = num(args, "--warmup", 0);
    let first: u64 = num(args, "--first", 0);
    let template = split_template(&body);
    let authority = url.authority().expect("--url: host:port").to_string();

    if warmup > 0 {
        let shared = Arc::new(Shared {
            url: url.clone(),
            authority: authority.clone(),
            template: template.clone(),
            next: AtomicU64::new(first),
            base: first,
            limit: Some(first + warmup),
            deadline: None,
            interval: None,
            start: Instant::now(),
            abort_every: None,
        });
        drive(shared, concurrency.min(warmup as usize).max(1)).await;
    }
    let start = Instant::now();
    let shared = Arc::new(Shared {
        url,
        authority,
        template,
        next: AtomicU64::new(first + warmup),
        base: first + warmup,
        limit: requests.map(|n| first + n + warmup),
        deadline: seconds.map(|s| start + Duration::from_secs_f64(s)),
        interval: rate.map(|r| Duration::from_secs_f64(1.0 / r)),
        start,
        abort_every: (abort_fraction > 0.0).then(|| (1.0 / abort_fraction).round().max(1.0) as u64),
    });
    let tally = drive(shared, concurrency).await;
    let elapsed = start.elapsed().as_secs_f64();
    let mut lat = tally.latencies_ms;
    lat.sort_by(f64::total_cmp);
    let pct = |q: f64| {
        if lat.is_empty() {
            0.0
        } else {
            lat[((lat.len() - 1) as f64 * q).round() as usize]
        }
    };
    let ok = tally.statuses.get("200").copied().unwrap_or(0);
    let out = serde_json::json!({
        "completed": lat.len(),
        "ok": ok,
        "errors": tally.errors,
        "aborted": tally.aborted,
        "statuses": tally.statuses,
        "elapsed_s": elapsed,
        "rps": lat.len() as f64 / elapsed,
        "latency_ms": {
            "p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "max": pct(1.0),
            "mean": if lat.is_empty() { 0.0 } else { lat.iter().sum::<f64>() / lat.len() as f64 },
        },
    });
    println!("{out}");
}

fn split_template(body: &[u8]) -> Vec<Vec<u8>> {
    let mut parts = Vec::new();
    let mut rest = body;
    while let Some(at) = rest.windows(3).position(|w| w == b"{n}") {
        parts.push(rest[..at].to_vec());
        rest = &rest[at + 3..];
    }
    parts.push(rest.to_vec());
    parts
}

fn render(template: &[Vec<u8>], n: u64) -> Bytes {
    let mut out = Vec::with_capacity(template.iter().map(Vec::len).sum::<usize>() + 16);
    for (i, part) in template.iter().enumerate() {
        if i > 0 {
            out.extend_from_slice(n.to_string().as_bytes());
        }
        out.extend_from_slice(part);
    }
    Bytes::from(out)
}

async fn drive(shared: Arc<Shared>, concurrency: usize) -> Tally {
    let mut tasks = Vec::new();
    for _ in 0..concurrency {
        let shared = Arc::clone(&shared);
        tasks.push(tokio::spawn(client(shared)));
    }
    let mut total = Tally::default();
    for t in tasks {
        let tally = t.await.expect("client task");
        total.latencies_ms.extend(tally.latencies_ms);
        total.errors += tally.errors;
        total.aborted += tally.aborted;
        for (k, v) in tally.statuses {
            *total.statuses.entry(k).or_default() += v;
        }
    }
    total
}

type Sender = hyper::client::conn::http1::SendRequest<Full<Bytes>>;

async fn connect(authority: &str) -> Option<Sender> {
    let stream = TcpStream::connect(authority).await.ok()?;
    let _ = stream.set_nodelay(true);
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .ok()?;
    tokio::spawn(conn);
    Some(sender)
}

async fn client(shared: Arc<Shared>) -> Tally {
    let mut tally = Tally::default();
    let mut sender: Option<Sender> = None;
    loop {
        let n = shared.next.fetch_add(1, Ordering::Relaxed);
        if shared.limit.is_some_and(|l| n >= l)
            || shared.deadline.is_some_and(|d| Instant::now() >= d)
        {
            break;
        }
        if let Some(interval) = shared.interval {
            // Open-loop pacing across all clients.
            let due = shared.start + interval.mul_f64((n - shared.base) as f64);
            // A request due after the deadline is not sent: with more clients than requests
            // per second, a client would otherwise wait past the end for a far-off slot.
            if shared.deadline.is_some_and(|d| due >= d) {
                break;
            }
            tokio::time::sleep_until(due.into()).await;
        }
        if sender.as_ref().is_none_or(|s| s.is_closed()) {
            sender = connect(&shared.authority).await;
        }
        let Some(s) = sender.as_mut() else {
            tally.errors += 1;
            continue;
        };
        if s.ready().await.is_err() {
            sender = None;
            tally.errors += 1;
            continue;
        }
        let request = Request::post(shared.url.clone())
            .header("host", &shared.authority)
            .header("content-type", "application/json")
            .header("x-request-id", format!("lg-{n}"))
            .body(Full::new(render(&shared.template, n)))
            .unwrap();
        let started = Instant::now();
        let abort = shared
            .abort_every
            .is_some_and(|every| n % every == every - 1);
        match s.send_request(request).await {
            Ok(response) => {
                let status = response.status().as_u16().to_string();
                if abort {
                    // Drop the connection after the head: a client gone mid-stream.
                    drop(response);
                    sender = None;
                    tally.aborted += 1;
                    continue;
                }
                match response.into_body().collect().await {
                    Ok(_) => {
                        tally
                            .latencies_ms
                            .push(started.elapsed().as_secs_f64() * 1e3);
                        *tally.statuses.entry(status).or_default() += 1;
                    }
                    Err(_) => {
                        tally.errors += 1;
                        sender = None;
                    }
                }
            }
            Err(_) => {
                tally.errors += 1;
                sender = None;
            }
        }
    }
    tally
}
