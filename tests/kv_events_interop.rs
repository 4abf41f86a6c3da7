//! Real peers: a Python publisher (pyzmq + msgspec, encoding events exactly as vLLM does, with
//! vLLM's ROUTER replay socket) feeds the real `kvpick serve` binary over ZeroMQ; the index is
//! checked through the gRPC `OverlapScores` call. Covers store, remove, a dropped range recovered
//! by replay, clear, and a publisher restart (seq back to 0) clearing stale blocks.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use kvpick::proto::SelectRequest;
use serde_json::{json, Value};

const BLOCK: usize = 16;

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

struct Publisher {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    endpoint: String,
    replay: String,
}

impl Publisher {
    fn start() -> Self {
        let python = repo().join(".venv/bin/python");
        assert!(
            python.exists(),
            "{} missing: run `bash e2e/setup.sh` (the test command does) to install pyzmq + msgspec",
            python.display()
        );
        let mut child = Command::new(python)
            .arg(repo().join("e2e/kv_events/publisher.py"))
            .args([
                "--endpoint",
                "tcp://127.0.0.1",
                "--replay-endpoint",
                "tcp://127.0.0.1",
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python publisher starts");
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        let ready: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(ready["ready"], true, "{line}");
        Publisher {
            endpoint: ready["endpoint"].as_str().unwrap().to_string(),
            replay: ready["replay_endpoint"].as_str().unwrap().to_string(),
            child,
            stdin,
            stdout,
        }
    }

    fn call(&mut self, request: Value) -> Value {
        writeln!(self.stdin, "{request}").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        let reply: Value = serde_json::from_str(&line).unwrap();
        assert_eq!(reply["ok"], true, "{request} -> {line}");
        reply
    }

    fn publish(&mut self, events: Value, send: bool) -> u64 {
        self.call(json!({"op": "publish", "events": events, "send": send}))["seq"]
            .as_u64()
            .unwrap()
    }
}

impl Drop for Publisher {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn store(hashes: &[u64], parent: Option<u64>, tokens: &[u32]) -> Value {
    json!({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
           "token_ids": tokens, "block_size": BLOCK, "medium": "GPU"})
}

fn prompt(seed: u32, blocks: usize) -> Vec<u32> {
    (0..(blocks * BLOCK) as u32)
        .map(|t| seed * 100_000 + t)
        .collect()
}

/// Engine hashes for a prompt: distinct per (seed, block).
fn engine_hashes(seed: u32, blocks: usize) -> Vec<u64> {
    (0..blocks as u64)
        .map(|b| seed as u64 * 1_000 + b + 1)
        .collect()
}

mod common;

/// kvpick with one worker whose KV events come from the publisher. Its HTTP port is `http`, a
/// listener the test holds: the engine answers connects, so a publisher restart is only a
/// restart (an engine whose port refused connections too would leave the picks meanwhile).
fn start_kvpick(events: &str, replay: &str, http: u16) -> common::Serve {
    common::start_static(
        &format!(
            "workers:\n  - {{name: w, model: m, address: 127.0.0.1, ports: [{http}], block_size: 16, kv_events: \"{events}\", kv_replay: \"{replay}\"}}\n"
        ),
        &[],
    )
}

/// The blocks of `tokens` the index holds, asked with one token more: an engine computes a
/// prompt's last token, so only then can all of `tokens`' blocks be credited.
async fn cached_blocks(api: &mut common::Api, tokens: &[u32]) -> u32 {
    let scores = api
        .overlap_scores(SelectRequest {
            model: "m".into(),
            token_ids: [tokens, &[u32::MAX]].concat(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    scores.scores[0].gpu_blocks
}

/// Polls the index until `check` holds, calling `nudge` between polls (e.g. to publish a probe
/// that makes kvpick notice a restart). Bounded: fails after 20 s.
async fn eventually<F, N>(api: &mut common::Api, what: &str, mut check: F, mut nudge: N)
where
    F: FnMut(&[u32]) -> bool,
    N: FnMut(),
{
    let deadline = Instant::now() + Duration::from_secs(20);
    let probes: Vec<(u32, Vec<u32>)> = (1..=6).map(|s| (s, prompt(s, 4))).collect();
    loop {
        let mut depths = Vec::new();
        for (_, tokens) in &probes {
            depths.push(cached_blocks(api, tokens).await);
        }
        if check(&depths) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {what}; depths {depths:?}"
        );
        nudge();
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn index_follows_a_real_vllm_style_publisher() {
    let mut publisher = Publisher::start();
    let http = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let kv = start_kvpick(
        &publisher.endpoint,
        &publisher.replay,
        http.local_addr().unwrap().port(),
    );
    let mut api = common::api(kv.grpc).await;

    // 1. Store prompt 1 (4 blocks) in two chained events. Whether kvpick subscribed before or
    //    after, it converges (live delivery or replay on subscribe).
    let (p1, h1) = (prompt(1, 4), engine_hashes(1, 4));
    publisher.publish(
        json!([
            store(&h1[..2], None, &p1[..32]),
            store(&h1[2..], Some(h1[1]), &p1[32..])
        ]),
        true,
    );
    eventually(&mut api, "prompt 1 stored", |d| d[0] == 4, || {}).await;

    // 2. Remove its last two blocks.
    publisher.publish(
        json!([{"type": "BlockRemoved", "block_hashes": &h1[2..], "medium": "GPU"}]),
        true,
    );
    eventually(&mut api, "prompt 1 trimmed", |d| d[0] == 2, || {}).await;

    // 3. A dropped range: prompt 2 is never sent live, prompt 3 is; the gap is replayed.
    let (p2, h2) = (prompt(2, 4), engine_hashes(2, 4));
    let (p3, h3) = (prompt(3, 4), engine_hashes(3, 4));
    publisher.publish(json!([store(&h2, None, &p2)]), false);
    publisher.publish(json!([store(&h3, None, &p3)]), true);
    eventually(
        &mut api,
        "dropped range recovered",
        |d| d[1] == 4 && d[2] == 4,
        || {},
    )
    .await;

    // 4. AllBlocksCleared.
    publisher.publish(json!([{"type": "AllBlocksCleared"}]), true);
    eventually(&mut api, "rank cleared", |d| d[..3] == [0, 0, 0], || {}).await;

    // 5. Prompt 4 stored, then the engine restarts (seq back to 0) and stores prompt 5: prompt 4
    //    is stale and must go. Probes keep the new run's sequence moving so a message lost while
    //    the subscriber reconnects is fetched by replay.
    let (p4, h4) = (prompt(4, 4), engine_hashes(4, 4));
    publisher.publish(json!([store(&h4, None, &p4)]), true);
    eventually(&mut api, "prompt 4 stored", |d| d[3] == 4, || {}).await;
    publisher.call(json!({"op": "restart"}));
    let (p5, h5) = (prompt(5, 4), engine_hashes(5, 4));
    assert_eq!(
        publisher.publish(json!([store(&h5, None, &p5)]), true),
        0,
        "seq restarts at 0"
    );
    let p6 = prompt(6, 1);
    let mut probe = 0u64;
    eventually(
        &mut api,
        "restart cleared stale blocks",
        |d| d[3] == 0 && d[4] == 4,
        || {
            probe += 1;
            let _ = &p6;
            writeln!(
                publisher.stdin,
                "{}",
                json!({"op": "publish", "events": [store(&[900_000 + probe], None, &p6)]})
            )
            .unwrap();
            publisher.stdin.flush().unwrap();
            let mut line = String::new();
            publisher.stdout.read_line(&mut line).unwrap();
        },
    )
    .await;
}
