//! The engine-metrics scraper's CPU cost: `cargo run --release --example scrape_cost -- RANKS
//! SECONDS [PAD_LINES]` starts a child process serving a vLLM-like `/metrics` page on RANKS
//! loopback ports (PAD_LINES extra histogram lines the scraper must skip, like a real vLLM page),
//! runs the real scraper (`kvpick::sources::engine_metrics::manage`, 50 ms interval) over a catalog of
//! RANKS workers for SECONDS, and prints the scraper process's CPU time (from /proc/self/stat),
//! scrapes per second and CPU per 100 ranks per second. The server's CPU is the child's, not
//! counted.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: a panic is a failure report

use std::io::{BufRead, BufReader};
use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvpick::observability::metrics::Metrics;
use kvpick::selection::{CoreConfig, SelectionCore};
use kvpick::sources::catalog::{RankLayout, WorkerSpec};
use kvpick::sources::engine_metrics::{manage, MetricNames, ScrapeConfig};

fn page(pad_lines: usize) -> String {
    let mut text = String::from(
        "# TYPE vllm:num_requests_waiting gauge\n\
         vllm:num_requests_waiting{engine=\"0\",model_name=\"m\"} 2.0\n\
         # TYPE vllm:num_requests_running gauge\n\
         vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 5.0\n\
         # TYPE vllm:kv_cache_usage_perc gauge\n\
         vllm:kv_cache_usage_perc{engine=\"0\",model_name=\"m\"} 0.42\n\
         vllm:lora_requests_info{max_lora=\"4\",running_lora_adapters=\"sql\",waiting_lora_adapters=\"\"} 1.7e9\n",
    );
    for i in 0..pad_lines {
        text.push_str(&format!(
            "vllm:e2e_request_latency_seconds_bucket{{engine=\"0\",le=\"{}.0\",model_name=\"m\"}} {i}.0\n",
            i
        ));
    }
    text
}

/// Child: serve the page on `ranks` ports, print them, run until stdin closes.
async fn serve(ranks: usize, pad_lines: usize) {
    let text = Arc::new(page(pad_lines));
    let mut ports = Vec::new();
    for _ in 0..ranks {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        ports.push(listener.local_addr().unwrap().port());
        let text = Arc::clone(&text);
        let app = axum::Router::new().route(
            "/metrics",
            axum::routing::get(move || {
                let text = Arc::clone(&text);
                async move { text.as_str().to_owned() }
            }),
        );
        tokio::spawn(async move { axum::serve(listener, app).await });
    }
    println!(
        "{}",
        ports
            .iter()
            .map(u16::to_string)
            .collect::<Vec<_>>()
            .join(",")
    );
    let mut line = String::new();
    let _ = tokio::task::spawn_blocking(move || std::io::stdin().read_line(&mut line)).await;
}

/// User + system CPU seconds of this process (clock ticks of 1/100 s, Linux's USER_HZ).
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap();
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Fields 14 and 15 of the whole line are utime and stime; after "pid (comm) " they are 11, 12.
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    ticks as f64 / 100.0
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        serve(args[2].parse().unwrap(), args[3].parse().unwrap()).await;
        return;
    }
    let ranks: usize = args.get(1).map_or(100, |a| a.parse().unwrap());
    let seconds: u64 = args.get(2).map_or(10, |a| a.parse().unwrap());
    let pad_lines: usize = args.get(3).map_or(0, |a| a.parse().unwrap());
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["serve", &ranks.to_string(), &pad_lines.to_string()])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut ports_line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut ports_line)
        .unwrap();
    let ports: Vec<u16> = ports_line
        .trim()
        .split(',')
        .map(|p| p.parse().unwrap())
        .collect();
    let metrics = Metrics::new();
    let core = SelectionCore::new(CoreConfig::default(), metrics.clone());
    core.apply_snapshot(
        ports
            .iter()
            .enumerate()
            .map(|(i, &port)| WorkerSpec {
                namespace: "bench".into(),
                name: format!("w{i}"),
                model: "m".into(),
                routing_group: String::new(),
                address: IpAddr::V4(Ipv4Addr::LOCALHOST),
                ranks: RankLayout::PerPort(vec![port]),
                block_size: Some(16),
                kv_events: None,
                kv_replay: None,
                lora_adapters: vec![],
                draining: false,
                incarnation: 0,
                roles: Vec::new(),
            })
            .collect(),
    )
    .unwrap();
    let config = ScrapeConfig {
        names: MetricNames::vllm(),
        path: "/metrics".into(),
        interval: Duration::from_millis(50),
        jitter: 0.2,
        timeout: Duration::from_millis(500),
        concurrency: 64,
        max_body_bytes: 8 << 20,
        stale_after: Duration::from_secs(1),
    };
    tokio::spawn(manage(Arc::clone(&core), config, core.catalog_changes()));
    // Warm-up (connections, first scrapes), then measure.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let ok = || metrics.engine.scrapes.with_label_values(&["ok"]).get();
    let (cpu0, ok0, t0) = (cpu_seconds(), ok(), Instant::now());
    tokio::time::sleep(Duration::from_secs(seconds)).await;
    let (cpu1, ok1, elapsed) = (cpu_seconds(), ok(), t0.elapsed().as_secs_f64());
    let failed: u64 = ["unreachable", "timeout", "http_error", "invalid"]
        .iter()
        .map(|o| metrics.engine.scrapes.with_label_values(&[o]).get())
        .sum();
    let cpu_per_s = (cpu1 - cpu0) / elapsed;
    println!(
        "ranks={ranks} page_bytes={} seconds={elapsed:.1} scrapes_ok_per_s={:.0} failed={failed} \
         cpu_s_per_s={cpu_per_s:.4} cpu_ms_per_100_ranks_per_s={:.1} cpu_us_per_scrape={:.1}",
        page(pad_lines).len(),
        (ok1 - ok0) as f64 / elapsed,
        cpu_per_s * 1000.0 * 100.0 / ranks as f64,
        (cpu1 - cpu0) * 1e6 / (ok1 - ok0).max(1) as f64,
    );
    drop(child.stdin.take());
    let _ = child.wait();
}
