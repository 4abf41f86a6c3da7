//! Remote indexing, the two designs of issue 48 measured on loopback (docs/replicas.md, "One
//! indexer"): a replica's per-pick cost of its KV view when the view lives
//!
//! - **A**: in another kvpick (the indexer, a real `kvpick serve` fed by vLLM-format KV events
//!   over ZeroMQ from [`FakeEngine`]s): one `OverlapScores` query with the prompt's block hashes,
//!   what `--kv-index-remote` sends;
//! - **B**: in Redis (a real `redis-server`, the store the replicas already share): block hash ->
//!   set of holder ranks (`SADD`), a pick = one pipeline of `SMEMBERS` over the prompt's block
//!   hashes and the longest consecutive prefix per rank computed by the replica.
//!
//! Same index in both (`--prompts` prompts of `--blocks` blocks, each held by two of 8 ranks),
//! the same picks (random prompts, sequential, A and B alternated so they share the machine's
//! noise). Reports pick p50/p99/mean, the index's memory (the indexer's RSS growth; Redis's
//! `used_memory` growth), and what a pick sees when the store dies and comes back.
//!
//! Run: `cargo test --bench remote_index` (a debug client; `KVPICK_BIN=target/release/kvpick`
//! for a release indexer; `-- --quick` for a smoke run). Needs `redis-server` on the PATH.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a benchmark: a panic is a failure report

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvpick::proto::selection_client::SelectionClient;
use kvpick::proto::SelectRequest;
use kvpick_core::event::{KvEvent, Medium};
use kvpick_core::hash;
use kvpick_testkit::engine::FakeEngine;
use kvpick_testkit::process::{rss_of, Kvpick};
use kvpick_testkit::prom;
use rand::{Rng, SeedableRng};

const BS: u32 = 16;
const RANKS: usize = 8;

struct Sizes {
    prompts: u32,
    blocks: u32,
    picks: usize,
}

fn sizes() -> Sizes {
    if std::env::args().any(|a| a == "--quick") {
        Sizes {
            prompts: 40,
            blocks: 64,
            picks: 200,
        }
    } else {
        Sizes {
            prompts: 1_600,
            blocks: 128,
            picks: 2_000,
        }
    }
}

fn tokens(p: u32, blocks: u32) -> Vec<u32> {
    (0..blocks * BS).map(|t| p * 1_000_000 + t).collect()
}

/// The two ranks holding prompt `p`.
fn holders(p: u32) -> [usize; 2] {
    [p as usize % RANKS, (p as usize + 3) % RANKS]
}

fn store(p: u32, blocks: u32) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: (0..u64::from(blocks))
            .map(|b| u64::from(p) << 20 | b)
            .collect(),
        parent_block_hash: None,
        token_ids: tokens(p, blocks),
        block_size: BS,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
        media: Vec::new(),
    }
}

/// The prompt's block hashes as a replica computes them (no adapter, no salt).
fn prompt_hashes(p: u32, blocks: u32) -> Vec<u64> {
    hash::prompt_hashes(
        &tokens(p, blocks),
        BS as usize,
        hash::block_seed(None, None),
    )
}

fn quantiles(mut xs: Vec<Duration>) -> (f64, f64, f64) {
    xs.sort();
    let at = |q: f64| xs[((xs.len() as f64 * q) as usize).min(xs.len() - 1)].as_secs_f64() * 1e6;
    let mean = xs.iter().map(Duration::as_secs_f64).sum::<f64>() / xs.len() as f64 * 1e6;
    (at(0.5), at(0.99), mean)
}

struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    fn start(port: u16) -> Redis {
        let child =
            Command::new(std::env::var("REDIS_SERVER_BIN").unwrap_or("redis-server".into()))
                .args(["--bind", "127.0.0.1", "--port", &port.to_string()])
                .args(["--save", "", "--appendonly", "no"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("redis-server on the PATH");
        Redis { child, port }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    async fn connect(&self) -> redis::aio::MultiplexedConnection {
        let client = redis::Client::open(self.url()).unwrap();
        let start = Instant::now();
        loop {
            if let Ok(c) = client.get_multiplexed_async_connection().await {
                return c;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "redis-server did not answer"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn used_memory(con: &mut redis::aio::MultiplexedConnection) -> u64 {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .query_async(con)
        .await
        .unwrap();
    info.lines()
        .find_map(|l| l.strip_prefix("used_memory:"))
        .and_then(|v| v.trim().parse().ok())
        .unwrap()
}

/// Option B's pick: one pipeline of `SMEMBERS`, then per rank the longest consecutive prefix.
async fn redis_pick(
    con: &mut redis::aio::MultiplexedConnection,
    hashes: &[u64],
) -> redis::RedisResult<[u32; RANKS]> {
    let mut pipe = redis::pipe();
    for h in hashes {
        pipe.cmd("SMEMBERS").arg(&h.to_le_bytes()[..]);
    }
    let sets: Vec<Vec<u32>> = pipe.query_async(con).await?;
    let mut depth = [0u32; RANKS];
    let mut alive = [true; RANKS];
    for (i, holders) in sets.iter().enumerate() {
        let mut here = [false; RANKS];
        for r in holders {
            if let Some(h) = here.get_mut(*r as usize) {
                *h = true;
            }
        }
        for r in 0..RANKS {
            if alive[r] && here[r] {
                depth[r] = i as u32 + 1;
            } else {
                alive[r] = false;
            }
        }
        if !alive.iter().any(|a| *a) {
            break;
        }
    }
    Ok(depth)
}

/// Option A's pick: the indexer's `OverlapScores` for the block hashes; the deepest GPU depth.
async fn remote_pick(
    client: &mut SelectionClient<tonic::transport::Channel>,
    hashes: &[u64],
    blocks: u32,
) -> Result<u32, tonic::Status> {
    let answer = client
        .overlap_scores(SelectRequest {
            model: "m".into(),
            block_hashes: hashes.to_vec(),
            prompt_tokens: u64::from(blocks * BS) + 1,
            ..Default::default()
        })
        .await?
        .into_inner();
    Ok(answer
        .scores
        .iter()
        .map(|s| s.gpu_blocks)
        .max()
        .unwrap_or(0))
}

fn catalog(engines: &[FakeEngine]) -> String {
    let mut text = String::from("workers:\n");
    for (i, e) in engines.iter().enumerate() {
        text += &format!(
            "  - {{name: w{i}, model: m, address: 127.0.0.1, ports: [{}], block_size: {BS}, kv_events: \"{}\"}}\n",
            e.ports.http,
            e.ports.events_endpoint()
        );
    }
    text
}

async fn applied(indexer: &Kvpick) -> f64 {
    let text = indexer.metrics_text().await.unwrap();
    prom::sum(
        &prom::parse(&text),
        "kvpick_kv_events_total",
        &[("result", "applied")],
    )
}

async fn start_indexer(binary: &Path, catalog: &Path) -> Kvpick {
    let args: Vec<String> = vec![
        "--secure-serving=false".into(),
        "--config".into(),
        catalog.display().to_string(),
    ];
    let indexer = Kvpick::start(binary, &args).await.unwrap();
    let mut health = indexer.health_client().await.unwrap();
    let start = Instant::now();
    while !kvpick_testkit::process::is_ready(&mut health).await {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "indexer not ready"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    indexer
}

fn replica_bin() -> PathBuf {
    PathBuf::from(
        std::env::var("REPLICA_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvpick").into()),
    )
}

/// A whole pick (`Select` with token ids) on a replica reading the indexer
/// (`--kv-index-remote`) against one reading its own index (`local`, subscribed like the
/// indexer), the same binary (`REPLICA_BIN`, default this build's `kvpick`), alternated.
async fn replica_picks(local: &Kvpick, catalog: &Path, indexer: &Kvpick, sizes: &Sizes) {
    let args: Vec<String> = vec![
        "--secure-serving=false".into(),
        "--config".into(),
        catalog.display().to_string(),
        "--kv-index-remote".into(),
        format!("http://127.0.0.1:{}", indexer.grpc),
    ];
    let replica = Kvpick::start(&replica_bin(), &args).await.unwrap();
    let mut health = replica.health_client().await.unwrap();
    let start = Instant::now();
    while !kvpick_testkit::process::is_ready(&mut health).await {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "replica not ready"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut to_local = SelectionClient::connect(format!("http://127.0.0.1:{}", local.grpc))
        .await
        .unwrap();
    let mut to_replica = SelectionClient::connect(format!("http://127.0.0.1:{}", replica.grpc))
        .await
        .unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (mut l, mut r) = (Vec::new(), Vec::new());
    let mut on_holder = 0;
    for _ in 0..sizes.picks {
        let p = rng.random_range(0..sizes.prompts);
        let mut ids = tokens(p, sizes.blocks);
        ids.push(1);
        let ask = SelectRequest {
            model: "m".into(),
            token_ids: ids,
            ..Default::default()
        };
        let t = Instant::now();
        to_local.select(ask.clone()).await.unwrap();
        l.push(t.elapsed());
        let t = Instant::now();
        let picked = to_replica.select(ask).await.unwrap().into_inner();
        r.push(t.elapsed());
        if picked.overlap_blocks == u64::from(sizes.blocks) {
            on_holder += 1;
        }
    }
    let (l50, l99, lmean) = quantiles(l);
    let (r50, r99, rmean) = quantiles(r);
    println!("| whole pick (`Select`, token ids) | p50 (µs) | p99 (µs) | mean (µs) |");
    println!("|---|---|---|---|");
    println!("| replica, local index (subscribed itself) | {l50:.0} | {l99:.0} | {lmean:.0} |");
    println!("| replica, `--kv-index-remote` (loopback) | {r50:.0} | {r99:.0} | {rmean:.0} |");
    println!(
        "replica on the remote: {on_holder} of {} picks found the prompt's whole prefix",
        sizes.picks
    );
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let sizes = sizes();
    let binary = PathBuf::from(
        std::env::var("KVPICK_BIN").unwrap_or_else(|_| env!("CARGO_BIN_EXE_kvpick").into()),
    );
    let mut engines = Vec::new();
    for _ in 0..RANKS {
        engines.push(FakeEngine::start(0).await.unwrap());
    }
    let dir = std::env::temp_dir().join(format!("kvpick-remote-bench-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let catalog_path = dir.join("catalog.yaml");
    std::fs::write(&catalog_path, catalog(&engines)).unwrap();

    // A: the indexer, fed by the engines' events.
    let indexer = start_indexer(&binary, &catalog_path).await;
    // A replica with its own index, to compare whole picks with (same index, same binary as
    // the remote-reading replica).
    let local = start_indexer(&replica_bin(), &catalog_path).await;
    for e in &engines {
        e.subscribed(2).await;
    }
    let rss_before = rss_of(indexer.pid()).unwrap();
    let mut sent = 0.0;
    for p in 0..sizes.prompts {
        for r in holders(p) {
            engines[r].publish(&[store(p, sizes.blocks)], true);
            sent += 1.0;
        }
    }
    let start = Instant::now();
    while applied(&indexer).await < sent || applied(&local).await < sent {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "events not applied"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rss_after = rss_of(indexer.pid()).unwrap();
    let mut client = SelectionClient::connect(format!("http://127.0.0.1:{}", indexer.grpc))
        .await
        .unwrap();

    // B: the same index in Redis.
    let redis = Redis::start(free_port());
    let mut con = redis.connect().await;
    let used_before = used_memory(&mut con).await;
    for p in 0..sizes.prompts {
        let mut pipe = redis::pipe();
        for h in prompt_hashes(p, sizes.blocks) {
            pipe.cmd("SADD")
                .arg(&h.to_le_bytes()[..])
                .arg(holders(p)[0])
                .arg(holders(p)[1])
                .ignore();
        }
        let () = pipe.query_async(&mut con).await.unwrap();
    }
    let used_after = used_memory(&mut con).await;

    // The picks, alternated.
    let mut rng = rand::rngs::StdRng::seed_from_u64(48);
    let (mut a, mut b) = (Vec::new(), Vec::new());
    for _ in 0..sizes.picks {
        let p = rng.random_range(0..sizes.prompts);
        let hashes = prompt_hashes(p, sizes.blocks);
        let t = Instant::now();
        let depth = remote_pick(&mut client, &hashes, sizes.blocks)
            .await
            .unwrap();
        a.push(t.elapsed());
        assert_eq!(depth, sizes.blocks, "the indexer holds prompt {p}");
        let t = Instant::now();
        let depths = redis_pick(&mut con, &hashes).await.unwrap();
        b.push(t.elapsed());
        assert_eq!(
            depths[holders(p)[0]],
            sizes.blocks,
            "redis holds prompt {p}"
        );
    }
    let blocks_total = u64::from(sizes.prompts) * u64::from(sizes.blocks);
    let (a50, a99, amean) = quantiles(a);
    let (b50, b99, bmean) = quantiles(b);
    println!(
        "index: {} prompts x {} blocks = {blocks_total} distinct blocks, 2 holders each, {RANKS} ranks; {} picks",
        sizes.prompts, sizes.blocks, sizes.picks
    );
    println!("| design | pick p50 (µs) | pick p99 (µs) | mean (µs) | index memory |");
    println!("|---|---|---|---|---|");
    println!(
        "| A: indexer `OverlapScores` | {a50:.0} | {a99:.0} | {amean:.0} | {:.1} MiB RSS growth ({:.0} B/block) |",
        (rss_after.saturating_sub(rss_before)) as f64 / 1048576.0,
        rss_after.saturating_sub(rss_before) as f64 / blocks_total as f64
    );
    println!(
        "| B: Redis pipelined `SMEMBERS` | {b50:.0} | {b99:.0} | {bmean:.0} | {:.1} MiB used_memory growth ({:.0} B/block) |",
        (used_after.saturating_sub(used_before)) as f64 / 1048576.0,
        used_after.saturating_sub(used_before) as f64 / blocks_total as f64
    );

    replica_picks(&local, &catalog_path, &indexer, &sizes).await;
    drop(local);

    // The store dies and comes back.
    let p = 0;
    let hashes = prompt_hashes(p, sizes.blocks);
    let port = redis.port;
    drop(redis);
    let t = Instant::now();
    let err = redis_pick(&mut con, &hashes).await.err();
    println!(
        "B, redis-server killed: the pick fails in {:.0} µs ({})",
        t.elapsed().as_secs_f64() * 1e6,
        err.map_or("no error".into(), |e| format!("{:?}", e.kind()))
    );
    let redis = Redis::start(port);
    let mut con = redis.connect().await;
    let depths = redis_pick(&mut con, &hashes).await.unwrap();
    println!(
        "B, redis-server restarted (no persistence): prompt {p}'s depth on its holder {} of {} blocks: every replica lost the whole index at once, until the engines store the blocks again",
        depths[holders(p)[0]],
        sizes.blocks
    );
    drop(indexer);
    let t = Instant::now();
    let err = remote_pick(&mut client, &hashes, sizes.blocks).await.err();
    println!(
        "A, indexer killed: the query fails in {:.0} µs ({:?}); a replica routes approximately (its own predictions)",
        t.elapsed().as_secs_f64() * 1e6,
        err.map(|e| e.code())
    );
    let t = Instant::now();
    let indexer = start_indexer(&binary, &catalog_path).await;
    for e in &engines {
        e.subscribed(3).await;
    }
    let mut client = SelectionClient::connect(format!("http://127.0.0.1:{}", indexer.grpc))
        .await
        .unwrap();
    let depth = remote_pick(&mut client, &hashes, sizes.blocks)
        .await
        .unwrap();
    println!(
        "A, indexer restarted: ready and subscribed in {:.2} s; prompt {p}'s depth {depth} of {} blocks (live events only: what it replays from the engines' buffers on a gap)",
        t.elapsed().as_secs_f64(),
        sizes.blocks
    );
    let _ = std::fs::remove_dir_all(dir);
}
