//! Engine metrics end to end in one process: loopback HTTP servers serve vLLM `/metrics` pages
//! the test controls, the real scraper (`kvpick::sources::engine_metrics::manage`) reads them into the
//! selection core, and the picks follow: off a rank whose queue is deep, back to bookings alone
//! when a rank stops answering (its reading goes stale, and is counted), and towards the rank
//! that has the requested LoRA adapter loaded rather than one at `max_lora` without it. A rank
//! without KV events whose engine refuses connections leaves the picks and comes back cleared.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

mod common;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::http::StatusCode;
use axum::routing::get;
use kvpick::observability::metrics::Metrics;
use kvpick::selection::{CoreConfig, SelectionCore, SelectionRequest};
use kvpick::sources::catalog::{RankLayout, WorkerSpec};
use kvpick::sources::engine_metrics::{manage, MetricNames, ScrapeConfig};
use parking_lot::Mutex;

/// A loopback `/metrics` page: `Some(text)` is served with 200, `None` answers 503.
#[derive(Clone)]
struct Page(Arc<Mutex<Option<String>>>);

impl Page {
    fn set(&self, text: Option<String>) {
        *self.0.lock() = text;
    }
}

async fn serve_page() -> (u16, Page) {
    let page = Page(Arc::new(Mutex::new(None)));
    let shared = page.clone();
    let app = axum::Router::new().route(
        "/metrics",
        get(move || {
            let page = shared.0.lock().clone();
            async move {
                match page {
                    Some(text) => (StatusCode::OK, text),
                    None => (StatusCode::SERVICE_UNAVAILABLE, String::new()),
                }
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (port, page)
}

fn vllm_page(waiting: u64, kv_usage: f64, lora: Option<(&str, u32)>) -> String {
    let mut text = format!(
        "# TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{{engine=\"0\",model_name=\"base\"}} {waiting}.0\n\
         vllm:num_requests_running{{engine=\"0\",model_name=\"base\"}} 1.0\n\
         vllm:kv_cache_usage_perc{{engine=\"0\",model_name=\"base\"}} {kv_usage}\n"
    );
    if let Some((running, max)) = lora {
        text.push_str(&format!(
            "vllm:lora_requests_info{{max_lora=\"{max}\",running_lora_adapters=\"{running}\",waiting_lora_adapters=\"\"}} 1.7e9\n"
        ));
    }
    text
}

fn worker(name: &str, port: u16, adapters: &[&str]) -> WorkerSpec {
    WorkerSpec {
        namespace: "test".into(),
        name: name.into(),
        model: "base".into(),
        routing_group: String::new(),
        address: IpAddr::V4(Ipv4Addr::LOCALHOST),
        ranks: RankLayout::PerPort(vec![port]),
        block_size: Some(16),
        kv_events: None,
        kv_replay: None,
        lora_adapters: adapters.iter().map(|a| a.to_string()).collect(),
        draining: false,
        incarnation: 0,
        roles: Vec::new(),
    }
}

const STALE: Duration = Duration::from_millis(300);

struct Fleet {
    core: Arc<SelectionCore>,
    metrics: Metrics,
    ports: Vec<u16>,
    pages: Vec<Page>,
}

async fn fleet(adapters: &[&str]) -> Fleet {
    let mut ports = Vec::new();
    let mut pages = Vec::new();
    for _ in 0..2 {
        let (port, page) = serve_page().await;
        ports.push(port);
        pages.push(page);
    }
    let metrics = Metrics::new();
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(7),
            engine_metrics_max_age: STALE,
            ..CoreConfig::default()
        },
        metrics.clone(),
    );
    core.apply_snapshot(vec![
        worker("a", ports[0], adapters),
        worker("b", ports[1], adapters),
    ])
    .unwrap();
    let config = ScrapeConfig {
        names: MetricNames::vllm(),
        path: "/metrics".into(),
        interval: Duration::from_millis(10),
        jitter: 0.2,
        timeout: Duration::from_millis(500),
        concurrency: 8,
        max_body_bytes: 1 << 20,
        stale_after: STALE,
    };
    tokio::spawn(manage(Arc::clone(&core), config, core.catalog_changes()));
    Fleet {
        core,
        metrics,
        ports,
        pages,
    }
}

impl Fleet {
    /// Ports picked by `n` dry-run selections of `model`, with counts.
    fn picks(&self, model: &str, n: usize) -> HashMap<u16, usize> {
        let mut out = HashMap::new();
        for i in 0..n {
            let selection = self
                .core
                .select(&SelectionRequest {
                    request_id: format!("r{i}"),
                    model: Some(model.into()),
                    ..Default::default()
                })
                .unwrap();
            *out.entry(selection.primary.endpoint.port()).or_default() += 1;
        }
        out
    }

    /// Both loops have a good reading (each counts its ranks stale until its first one).
    fn both_read(&self) -> bool {
        self.metrics.engine.stale_ranks.get() == 0 && self.scrapes("ok") >= 4
    }

    fn scrapes(&self, outcome: &str) -> u64 {
        self.metrics
            .engine
            .scrapes
            .with_label_values(&[outcome])
            .get()
    }

    /// Polls `cond` (every 5 ms, at most 10 s): the scraper runs on its own schedule. A
    /// condition on picks asks for 20 in a row, which a random tie-break gives once in 10^6.
    async fn until(&self, what: &str, mut cond: impl FnMut(&Fleet) -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond(self) {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_pick_moves_off_a_rank_whose_scraped_queue_is_deep() {
    let f = fleet(&[]).await;
    let (a, b) = (f.ports[0], f.ports[1]);
    f.pages[0].set(Some(vllm_page(20, 0.9, None)));
    f.pages[1].set(Some(vllm_page(0, 0.1, None)));
    f.until("both ranks read", |f| {
        f.both_read() && f.picks("base", 20) == HashMap::from([(b, 20)])
    })
    .await;
    assert_eq!(f.picks("base", 30), HashMap::from([(b, 30)]));
    // The queues swap: the picks follow within a few scrapes.
    f.pages[0].set(Some(vllm_page(0, 0.1, None)));
    f.pages[1].set(Some(vllm_page(20, 0.9, None)));
    f.until("picks move to a", |f| {
        f.picks("base", 20) == HashMap::from([(a, 20)])
    })
    .await;
    assert_eq!(f.picks("base", 30), HashMap::from([(a, 30)]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_that_stops_answering_goes_stale_and_its_old_reading_is_not_used() {
    let f = fleet(&[]).await;
    let (a, b) = (f.ports[0], f.ports[1]);
    f.pages[0].set(Some(vllm_page(0, 0.0, None)));
    f.pages[1].set(Some(vllm_page(30, 1.0, None)));
    f.until("both ranks read", |f| {
        f.both_read() && f.picks("base", 20) == HashMap::from([(a, 20)])
    })
    .await;
    assert_eq!(f.picks("base", 30), HashMap::from([(a, 30)]));
    // b's engine stops answering: its deep reading must not keep steering picks away for good.
    f.pages[1].set(None);
    f.until("b counted stale", |f| {
        f.metrics.engine.stale_ranks.get() == 1 && f.scrapes("http_error") > 0
    })
    .await;
    // Costed on bookings alone (none), a and b tie: random tie-breaks use both.
    let picks = f.picks("base", 60);
    assert!(
        picks.get(&a).copied().unwrap_or(0) > 0 && picks.get(&b).copied().unwrap_or(0) > 0,
        "{picks:?}"
    );
    // It answers again: no longer stale, and its reading counts again.
    f.pages[1].set(Some(vllm_page(30, 1.0, None)));
    f.until("b fresh again", |f| f.metrics.engine.stale_ranks.get() == 0)
        .await;
    assert_eq!(f.picks("base", 30), HashMap::from([(a, 30)]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_request_prefers_the_rank_with_its_adapter_loaded_and_avoids_a_full_one() {
    let f = fleet(&["sql", "chat"]).await;
    let (a, b) = (f.ports[0], f.ports[1]);
    // a runs sql; b is at max_lora=1 with chat.
    f.pages[0].set(Some(vllm_page(0, 0.2, Some(("sql", 1)))));
    f.pages[1].set(Some(vllm_page(0, 0.2, Some(("chat", 1)))));
    f.until("both ranks read", |f| {
        f.both_read()
            && f.picks("sql", 20) == HashMap::from([(a, 20)])
            && f.picks("chat", 20) == HashMap::from([(b, 20)])
    })
    .await;
    assert_eq!(f.picks("sql", 30), HashMap::from([(a, 30)]));
    assert_eq!(f.picks("chat", 30), HashMap::from([(b, 30)]));
    // a evicts sql for chat, b now runs sql: the affinity follows the engines.
    f.pages[0].set(Some(vllm_page(0, 0.2, Some(("chat", 1)))));
    f.pages[1].set(Some(vllm_page(0, 0.2, Some(("sql", 1)))));
    f.until("sql moves to b", |f| {
        f.picks("sql", 20) == HashMap::from([(b, 20)])
    })
    .await;
    assert_eq!(f.picks("sql", 30), HashMap::from([(b, 30)]));
}

/// One line of kvpick's own `/metrics`: the value of the series that starts with `series`.
fn kvpick_metric(port: u16, series: &str) -> Option<f64> {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    text.lines().find_map(|l| {
        l.strip_prefix(series)?
            .strip_prefix(' ')?
            .trim()
            .parse()
            .ok()
    })
}

/// The real binary: `--engine-metrics vllm` scrapes the catalog's ranks, exports its own scrape
/// metrics, and the selection API's pick avoids the rank whose engine queue is deep.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_engine_metrics_scrapes_and_steers_the_pick() {
    let (deep, deep_page) = serve_page().await;
    let (idle, idle_page) = serve_page().await;
    deep_page.set(Some(vllm_page(50, 0.95, None)));
    idle_page.set(Some(vllm_page(0, 0.05, None)));
    let catalog = format!(
        "workers:\n  - {{name: deep, model: m, address: 127.0.0.1, port: {deep}}}\n  - {{name: idle, model: m, address: 127.0.0.1, port: {idle}}}\n"
    );
    let serve = common::start_static(
        &catalog,
        &[
            "--engine-metrics",
            "vllm",
            "--engine-metrics-interval-ms",
            "10",
        ],
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while kvpick_metric(serve.metrics, "kvpick_engine_scrapes_total{outcome=\"ok\"}").unwrap_or(0.0)
        < 4.0
        || kvpick_metric(serve.metrics, "kvpick_engine_stale_ranks") != Some(0.0)
    {
        assert!(Instant::now() < deadline, "kvpick never scraped both ranks");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut api = common::api(serve.grpc).await;
    for i in 0..20 {
        let pick = api
            .select(kvpick::proto::SelectRequest {
                request_id: format!("q{i}"),
                model: "m".into(),
                token_ids: vec![i; 16],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            pick.primary.unwrap().address,
            format!("127.0.0.1:{idle}"),
            "pick {i} went to the deep queue"
        );
    }
    // The deep engine stops answering: counted, and stale after the default 1 s.
    deep_page.set(None);
    let deadline = Instant::now() + Duration::from_secs(20);
    while kvpick_metric(serve.metrics, "kvpick_engine_stale_ranks") != Some(1.0) {
        assert!(
            Instant::now() < deadline,
            "the failing rank never counted stale"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        kvpick_metric(
            serve.metrics,
            "kvpick_engine_scrapes_total{outcome=\"http_error\"}"
        )
        .unwrap_or(0.0)
            > 0.0
    );
}

/// A `/metrics` page served by hand, one request per connection, on a port that can be closed
/// (a dead engine: connects are refused) and opened again.
struct Stoppable {
    port: u16,
    task: tokio::task::JoinHandle<()>,
}

impl Stoppable {
    async fn start(port: u16, text: String) -> Stoppable {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", port))
            .await
            .unwrap();
        let port = listener.local_addr().unwrap().port();
        let task = tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                let text = text.clone();
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf).await {
                            Ok(n) if n > 0 => request.extend_from_slice(&buf[..n]),
                            _ => return,
                        }
                    }
                    let head = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        text.len()
                    );
                    let _ = stream.write_all(head.as_bytes()).await;
                    let _ = stream.write_all(text.as_bytes()).await;
                });
            }
        });
        Stoppable { port, task }
    }

    /// Closes the port; returns once it refuses connections.
    async fn stop(self) -> u16 {
        self.task.abort();
        let _ = self.task.await;
        self.port
    }
}

/// A rank without KV events is judged by its scrapes: one that cannot connect takes it out of
/// the picks, the next good one brings it back with its index entries cleared (a process that
/// refused connections and answers again is a new one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rank_without_kv_events_whose_engine_refuses_leaves_the_picks_and_returns_cleared() {
    use kvpick::selection::PromptInput;
    let page = vllm_page(0, 0.1, None);
    let a = Stoppable::start(0, page.clone()).await;
    let b = Stoppable::start(0, page.clone()).await;
    let (a_port, b_port) = (a.port, b.port);
    let metrics = Metrics::new();
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(7),
            ..CoreConfig::default()
        },
        metrics.clone(),
    );
    core.apply_snapshot(vec![worker("a", a_port, &[]), worker("b", b_port, &[])])
        .unwrap();
    let config = ScrapeConfig {
        names: MetricNames::vllm(),
        path: "/metrics".into(),
        interval: Duration::from_millis(10),
        jitter: 0.2,
        timeout: Duration::from_millis(500),
        concurrency: 8,
        max_body_bytes: 1 << 20,
        stale_after: STALE,
    };
    let scraper = tokio::spawn(manage(Arc::clone(&core), config, core.catalog_changes()));
    let a_rank = core
        .list_workers(None)
        .into_iter()
        .find(|w| w.record.spec.name == "a")
        .map(|w| kvpick::selection::RankKey {
            worker_id: w.record.id,
            dp_rank: 0,
        })
        .unwrap();
    // a holds the prompt's four blocks (as kvpick's own picks would have predicted).
    let tokens: Vec<u32> = (0..64).collect();
    let hashes = kvpick_core::hash::prompt_hashes(&tokens, 16, kvpick_core::hash::BASE_SEED);
    core.inner().insert_blocks(
        &kvpick::selection::PartitionKey {
            model: "base".into(),
            routing_group: String::new(),
        },
        a_rank,
        &hashes,
        kvpick_core::index::Tier::Gpu,
        None,
        tokio::time::Instant::now().into_std(),
    );
    let pick = |id: &str| {
        core.select(&SelectionRequest {
            request_id: id.into(),
            model: Some("base".into()),
            prompt: PromptInput::Tokens(tokens.clone()),
            ..Default::default()
        })
        .map(|s| s.primary.endpoint.port())
    };
    let reachable = || {
        core.list_workers(None)
            .iter()
            .all(|w| w.status[0].reachable)
    };
    let until = |what: &'static str, cond: &dyn Fn() -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    };
    until("both scraped", &|| metrics.engine.stale_ranks.get() == 0);
    assert_eq!(pick("warm").unwrap(), a_port);

    let a_port = a.stop().await;
    until("a unreachable", &|| !reachable());
    for i in 0..20 {
        assert_eq!(pick(&format!("dead{i}")).unwrap(), b_port);
    }
    let _a = Stoppable::start(a_port, page.clone()).await;
    until("a back", &reachable);
    let overlap = core
        .overlap_scores(&SelectionRequest {
            model: Some("base".into()),
            prompt: PromptInput::Tokens(tokens.clone()),
            ..Default::default()
        })
        .unwrap()
        .1;
    assert!(
        overlap.iter().all(|(_, d)| d.gpu == 0),
        "cleared: {overlap:?}"
    );
    scraper.abort();
    drop(b);
}
