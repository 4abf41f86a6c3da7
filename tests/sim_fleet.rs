//! `kvpick sim` over loopback: the OpenAI endpoints and metrics of a simulated worker, the
//! data-parallel header, and kvpick's own KV-event ingestion indexing exactly what the simulated
//! engines announced (both payload encodings, with replay at subscribe time).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

mod common;

use std::net::{IpAddr, Ipv4Addr};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use kvpick::observability::metrics::Metrics;
use kvpick::selection::{CoreConfig, PromptInput, SelectionCore, SelectionRequest};
use kvpick::sources::catalog::{RankLayout, WorkerSpec};
use kvpick_sim::sim::server::{start, SimArgs};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[derive(Parser)]
struct Wrap {
    #[command(flatten)]
    args: SimArgs,
}

fn sim_args(extra: &[&str]) -> SimArgs {
    let mut argv = vec![
        "sim",
        "--base-port",
        "0",
        "--kv-events-port",
        "0",
        "--kv-replay-port",
        "0",
        "--speedup",
        "50",
    ];
    argv.extend_from_slice(extra);
    if !extra.contains(&"--workers") {
        argv.extend_from_slice(&["--workers", "2"]);
    }
    Wrap::parse_from(argv).args
}

/// One HTTP/1.1 request with `Connection: close`; returns (status, headers, body).
async fn http(
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> (u16, String, String) {
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\ncontent-length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).await.unwrap();
    let text = String::from_utf8_lossy(&out).to_string();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    let status = head[9..12].parse().unwrap();
    (status, head.to_ascii_lowercase(), body.to_string())
}

/// De-chunks a `transfer-encoding: chunked` body (good enough for tests).
fn dechunk(body: &str) -> String {
    let mut out = String::new();
    let mut rest = body;
    while let Some((len, tail)) = rest.split_once("\r\n") {
        let n = usize::from_str_radix(len.trim(), 16).unwrap_or(0);
        if n == 0 {
            break;
        }
        out.push_str(&tail[..n]);
        rest = &tail[n + 2..];
    }
    out
}

fn prompt(len: u32) -> Vec<u32> {
    (0..len).map(|i| 1000 + i * 7).collect()
}

fn completion(tokens: &[u32], max_tokens: u32, stream: bool) -> String {
    serde_json::json!({"model": "kvpick-sim", "prompt": tokens, "max_tokens": max_tokens,
        "stream": stream, "stream_options": {"include_usage": true}})
    .to_string()
}

#[tokio::test]
async fn openai_endpoints_usage_and_metrics() {
    let fleet = start(&sim_args(&[])).await.unwrap();
    let port = fleet.workers[0].http;
    let body = completion(&prompt(100), 4, false);
    let (status, _, cold) = http(port, "POST", "/v1/completions", &[], &body).await;
    assert_eq!(status, 200, "{cold}");
    let cold: serde_json::Value = serde_json::from_str(&cold).unwrap();
    assert_eq!(cold["usage"]["prompt_tokens"], 100);
    assert_eq!(cold["usage"]["completion_tokens"], 4);
    assert_eq!(cold["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // The same prompt again, streamed: 96 tokens (6 complete blocks) come from the cache.
    let (status, head, sse) = http(
        port,
        "POST",
        "/v1/completions",
        &[],
        &completion(&prompt(100), 4, true),
    )
    .await;
    assert_eq!(status, 200);
    assert!(head.contains("text/event-stream"));
    let sse = dechunk(&sse);
    let events: Vec<&str> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .collect();
    assert_eq!(*events.last().unwrap(), "[DONE]");
    let usage: serde_json::Value = serde_json::from_str(events[events.len() - 2]).unwrap();
    assert_eq!(usage["usage"]["prompt_tokens_details"]["cached_tokens"], 96);
    assert_eq!(events.len(), 4 + 2, "4 token chunks, usage, [DONE]");
    // Chat with a text prompt.
    let chat = serde_json::json!({"model": "kvpick-sim", "max_tokens": 2,
        "messages": [{"role": "user", "content": "hello"}]})
    .to_string();
    let (status, _, body) = http(port, "POST", "/v1/chat/completions", &[], &chat).await;
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    // Errors, models, health, metrics.
    let (status, _, _) = http(
        port,
        "POST",
        "/v1/completions",
        &[],
        "{\"model\":\"other\",\"prompt\":\"x\"}",
    )
    .await;
    assert_eq!(status, 404);
    let (status, _, body) = http(port, "GET", "/v1/models", &[], "").await;
    assert_eq!(status, 200);
    assert!(body.contains("kvpick-sim"));
    assert_eq!(http(port, "GET", "/health", &[], "").await.0, 200);
    // What sglang-router reads to register a worker (new and `get_` names).
    for path in [
        "/server_info",
        "/get_server_info",
        "/model_info",
        "/get_model_info",
    ] {
        let (status, _, body) = http(port, "GET", path, &[], "").await;
        assert_eq!(status, 200, "{path}");
        let info: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(info["served_model_name"], "kvpick-sim", "{path}: {body}");
        assert!(
            info.get("model_path").is_none(),
            "{path}: no tokenizer to load"
        );
    }
    let (_, _, metrics) = http(port, "GET", "/metrics", &[], "").await;
    for name in [
        "vllm:num_requests_running{",
        "vllm:num_requests_waiting{",
        "vllm:kv_cache_usage_perc{",
        "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"kvpick-sim\"} 96\n",
        "vllm:prefix_cache_queries_total{engine=\"0\",model_name=\"kvpick-sim\"} 208\n",
        "vllm:cache_config_info{block_size=\"16\"",
    ] {
        assert!(metrics.contains(name), "{name} missing from\n{metrics}");
    }
}

#[tokio::test]
async fn data_parallel_rank_header_is_honoured() {
    let fleet = start(&sim_args(&["--dp-size", "3", "--workers", "1"]))
        .await
        .unwrap();
    let port = fleet.workers[0].http;
    assert_eq!(fleet.workers[0].ranks.len(), 3);
    let body = completion(&prompt(40), 1, false);
    for rank in ["2", "0", "2"] {
        let (status, head, _) = http(
            port,
            "POST",
            "/v1/completions",
            &[("X-data-parallel-rank", rank)],
            &body,
        )
        .await;
        assert_eq!(status, 200);
        assert!(head.contains(&format!("x-sim-rank: {rank}")), "{head}");
    }
    let (_, _, metrics) = http(port, "GET", "/metrics", &[], "").await;
    // Rank 2 saw the prompt twice (the second time 32 tokens hit), rank 1 never.
    assert!(
        metrics.contains("vllm:prefix_cache_hits_total{engine=\"2\",model_name=\"kvpick-sim\"} 32"),
        "{metrics}"
    );
    assert!(metrics
        .contains("vllm:prefix_cache_queries_total{engine=\"1\",model_name=\"kvpick-sim\"} 0"));
    let (status, _, _) = http(
        port,
        "POST",
        "/v1/completions",
        &[("X-data-parallel-rank", "3")],
        &body,
    )
    .await;
    assert_eq!(status, 400);
}

async fn ingest_indexes_what_the_sim_announced(encoding: &str) {
    // Requests go to the sim first, before kvpick subscribes: the blocks reach the index through
    // the replay socket at subscribe time, later ones live.
    let fleet = start(&sim_args(&["--kv-encoding", encoding]))
        .await
        .unwrap();
    let early = prompt(64);
    let (status, _, _) = http(
        fleet.workers[1].http,
        "POST",
        "/v1/completions",
        &[],
        &completion(&early, 1, false),
    )
    .await;
    assert_eq!(status, 200);

    let core = SelectionCore::new(
        CoreConfig {
            kv_events: true,
            seed: Some(1),
            ..CoreConfig::default()
        },
        Metrics::new(),
    );
    let specs: Vec<WorkerSpec> = fleet
        .workers
        .iter()
        .enumerate()
        .map(|(i, w)| WorkerSpec {
            namespace: "sim".into(),
            name: format!("sim-{i}"),
            model: "kvpick-sim".into(),
            routing_group: String::new(),
            address: IpAddr::V4(Ipv4Addr::LOCALHOST),
            ranks: RankLayout::PerPort(vec![w.http]),
            block_size: Some(16),
            kv_events: Some(format!("tcp://127.0.0.1:{}", w.ranks[0].events.unwrap())),
            kv_replay: Some(format!("tcp://127.0.0.1:{}", w.ranks[0].replay.unwrap())),
            lora_adapters: vec![],
            draining: false,
            incarnation: 0,
            roles: Vec::new(),
        })
        .collect();
    core.apply_snapshot(specs).unwrap();
    let ingest = tokio::spawn(kvpick::sources::events::ingest::manage(
        Arc::clone(&core),
        core.catalog_changes(),
    ));

    // Asked with one token more: an engine computes a prompt's last token, so only then can
    // every block of `tokens` be credited.
    let depth_on = |tokens: &[u32], worker: usize| {
        let req = SelectionRequest {
            request_id: "q".into(),
            model: Some("kvpick-sim".into()),
            prompt: PromptInput::Tokens([tokens, &[u32::MAX]].concat()),
            ..Default::default()
        };
        let (_, ranks) = core.overlap_scores(&req).unwrap();
        ranks
            .iter()
            .find(|(r, _)| r.worker_name == format!("sim-{worker}"))
            .map_or(0, |(_, d)| d.gpu)
    };
    let wait_for = |tokens: Vec<u32>, worker: usize, want: u32| {
        let deadline = Instant::now() + Duration::from_secs(20);
        async move {
            loop {
                let got = depth_on(&tokens, worker);
                if got == want {
                    return;
                }
                assert!(
                    Instant::now() < deadline,
                    "worker {worker}: depth {got}, want {want}"
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // All 4 complete blocks of the early prompt, on worker 1 only.
    wait_for(early.clone(), 1, 4).await;
    assert_eq!(depth_on(&early, 0), 0);
    // A live one on worker 0: 150 tokens = 9 complete blocks.
    let live: Vec<u32> = (0..150).map(|i| 50_000 + i).collect();
    let (status, _, _) = http(
        fleet.workers[0].http,
        "POST",
        "/v1/completions",
        &[],
        &completion(&live, 2, true),
    )
    .await;
    assert_eq!(status, 200);
    wait_for(live, 0, 9).await;
    ingest.abort();
}

#[tokio::test]
async fn ingest_indexes_what_the_sim_announced_array() {
    ingest_indexes_what_the_sim_announced("array").await;
}

#[tokio::test]
async fn ingest_indexes_what_the_sim_announced_map() {
    ingest_indexes_what_the_sim_announced("map").await;
}

#[test]
fn the_binary_writes_its_port_file_and_serves() {
    let dir = common::temp_dir("kvpick-sim");
    let port_file = dir.join("ports.json");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kvpick"))
        .args([
            "sim",
            "--workers",
            "2",
            "--base-port",
            "0",
            "--kv-events-port",
            "0",
        ])
        .args(["--kv-replay-port", "0", "--speedup", "100", "--port-file"])
        .arg(&port_file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let text = loop {
        if let Ok(t) = std::fs::read_to_string(&port_file) {
            break t;
        }
        assert!(
            child.try_wait().unwrap().is_none(),
            "kvpick sim exited early"
        );
        assert!(Instant::now() < deadline, "no port file");
        std::thread::sleep(Duration::from_millis(20));
    };
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    let workers = v["workers"].as_array().unwrap();
    assert_eq!(workers.len(), 2);
    let port = workers[1]["http"].as_u64().unwrap() as u16;
    assert!(workers[1]["ranks"][0]["events"].as_u64().is_some());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let (status, _, body) = rt.block_on(http(
        port,
        "POST",
        "/v1/completions",
        &[],
        &completion(&prompt(20), 3, false),
    ));
    assert_eq!(status, 200, "{body}");
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn stream_interval_coalesces_tokens_but_sends_the_first_at_once() {
    let fleet = start(&sim_args(&["--stream-interval", "4", "--workers", "1"]))
        .await
        .unwrap();
    let (status, _, sse) = http(
        fleet.workers[0].http,
        "POST",
        "/v1/completions",
        &[],
        &completion(&prompt(30), 9, true),
    )
    .await;
    assert_eq!(status, 200);
    let sse = dechunk(&sse);
    let texts: Vec<String> = sse
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|d| *d != "[DONE]")
        .filter_map(|d| serde_json::from_str::<serde_json::Value>(d).ok())
        .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
        .collect();
    // Token 1 alone, then tokens 2-4, 5-8, and the last one.
    let words: Vec<usize> = texts.iter().map(|t| t.split_whitespace().count()).collect();
    assert_eq!(texts.len(), 4, "{texts:?}");
    assert_eq!(words[0], 1);
    assert_eq!(texts.concat(), " the cache is warm and tokens flow. the");
}

/// `--lora`: an adapter request is served, and while it runs its rank's
/// `vllm:lora_requests_info` lists it (with `max_lora`), in the form kvpick's scraper reads;
/// once it ends the list is empty again.
#[tokio::test]
async fn lora_requests_info_lists_running_adapters() {
    let fleet = start(&sim_args(&[
        "--workers",
        "1",
        "--lora",
        "sql,chat",
        "--max-loras",
        "2",
    ]))
    .await
    .unwrap();
    let port = fleet.workers[0].http;
    let names = kvpick::sources::engine_metrics::MetricNames::vllm();
    let loaded = || async {
        let (status, _, page) = http(port, "GET", "/metrics", &[], "").await;
        assert_eq!(status, 200);
        let r =
            kvpick::sources::engine_metrics::readings(&page, &names, &[0], Instant::now()).unwrap();
        let r = r[0].clone().unwrap();
        (r.adapters.to_vec(), r.max_adapters)
    };
    assert_eq!(loaded().await, (vec![], Some(2)));
    // A long streamed adapter request: read its first chunk, then look at the metrics.
    let mut s = tokio::net::TcpStream::connect(("127.0.0.1", port))
        .await
        .unwrap();
    let body = serde_json::json!({"model": "sql", "prompt": prompt(16), "max_tokens": 100000,
        "stream": true})
    .to_string();
    let req = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.unwrap();
    let mut first = [0u8; 64];
    let n = s.read(&mut first).await.unwrap();
    assert!(String::from_utf8_lossy(&first[..n]).starts_with("HTTP/1.1 200"));
    assert_eq!(loaded().await, (vec!["sql".to_string()], Some(2)));
    // The client leaves: the request is aborted and the adapter no longer listed.
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(10);
    while !loaded().await.0.is_empty() {
        assert!(
            Instant::now() < deadline,
            "adapter still listed after the request ended"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // An unknown adapter is still a 404.
    let bad = serde_json::json!({"model": "nope", "prompt": prompt(4)}).to_string();
    let (status, _, _) = http(port, "POST", "/v1/completions", &[], &bad).await;
    assert_eq!(status, 404);
}

/// Prefill/decode: a decode worker told (llm-d's header) which prefill worker to use has it run
/// the prefill, pulls the blocks, decodes; the prompt is then cached on both; a bad header is a
/// 400, an unreachable prefill rank a 502.
#[tokio::test]
async fn a_decode_worker_pulls_the_prompt_from_the_named_prefill_worker() {
    let prefill = start(&sim_args(&["--workers", "1", "--role", "prefill"]))
        .await
        .unwrap();
    let decode = start(&sim_args(&["--workers", "1", "--role", "decode"]))
        .await
        .unwrap();
    let (p, d) = (prefill.workers[0].http, decode.workers[0].http);
    let target = format!("127.0.0.1:{p}");
    let body = completion(&prompt(200), 4, false);
    let (status, head, out) = http(
        d,
        "POST",
        "/v1/completions",
        &[("x-prefiller-host-port", &target)],
        &body,
    )
    .await;
    assert_eq!(status, 200, "{out}");
    assert!(head.contains("x-sim-role: decode"), "{head}");
    assert!(head.contains("x-sim-prefill-worker: 0"), "{head}");
    assert!(
        head.contains(&format!("x-sim-prefill-host-port: {target}")),
        "{head}"
    );
    assert!(
        head.contains("x-sim-transferred-blocks: 12"),
        "200 tokens = 12 complete blocks, none cached here: {head}"
    );
    let out: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        out["usage"]["completion_tokens"], 4,
        "the decode rank generates"
    );
    // Both ranks cache the prompt now.
    for port in [p, d] {
        let (_, _, again) = http(port, "POST", "/v1/completions", &[], &body).await;
        let again: serde_json::Value = serde_json::from_str(&again).unwrap();
        assert_eq!(
            again["usage"]["prompt_tokens_details"]["cached_tokens"],
            192
        );
    }
    let (status, _, _) = http(
        d,
        "POST",
        "/v1/completions",
        &[("x-prefiller-host-port", "nowhere")],
        &body,
    )
    .await;
    assert_eq!(status, 400);
    drop(prefill);
    let (status, _, _) = http(
        d,
        "POST",
        "/v1/completions",
        &[("x-prefiller-host-port", "127.0.0.1:1")],
        &body,
    )
    .await;
    assert_eq!(status, 502);
}
