//! Decision throughput of one partition at 1, 2 and 4 threads, and KV-event apply throughput
//! while picks run (issue 27 item 3). The warm state of the `selection` bench (1,024 ranks, an
//! 8k-token prompt, every rank holding the prompt's first 8 blocks), every rank already precise
//! (one KV event applied). Each run lasts `--seconds` (default 2); pick threads book and free
//! (`select_and_reserve` then drop), the event thread applies 16-block `BlockStored` batches
//! round robin over the ranks. Prints a table and writes `target/bench-concurrency.json`.
//! Without `--bench` (as under `cargo test`) it runs a short smoke of each mode.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench harness: a panic is a failure report

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::{BLOCK, PROMPT_TOKENS};
use kvpick::catalog::{RankLayout, WorkerSpec};
use kvpick::metrics::Metrics;
use kvpick::selection::{CoreConfig, PromptInput, RankKey, SelectionCore, SelectionRequest};
use kvpick_core::event::{KvEvent, Medium};

const RANKS: usize = 1_024;
const RANKS_PER_WORKER: usize = 8;
const EVENT_BLOCKS: usize = 16;

struct Fixture {
    core: Arc<SelectionCore>,
    request: SelectionRequest,
    ranks: Vec<RankKey>,
}

fn fixture() -> Fixture {
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(1),
            index_max_blocks: 4 << 20,
            ..CoreConfig::default()
        },
        Metrics::new(),
    );
    let workers = RANKS / RANKS_PER_WORKER;
    let specs: Vec<WorkerSpec> = (0..workers)
        .map(|w| WorkerSpec {
            namespace: "bench".into(),
            address: format!("10.0.{}.{}", w / 256, w % 256).parse().unwrap(),
            block_size: Some(BLOCK as u32),
            ..WorkerSpec::for_test(
                &format!("w{w}"),
                "m",
                RankLayout::PerPort((0..RANKS_PER_WORKER).map(|r| 8000 + r as u16).collect()),
            )
        })
        .collect();
    let prompt = common::warm(&core, specs);
    let ranks: Vec<RankKey> = core
        .list_workers(None)
        .iter()
        .flat_map(|v| {
            v.record.ranks.iter().map(|r| RankKey {
                worker_id: v.record.id,
                dp_rank: r.dp_rank,
            })
        })
        .collect();
    // One event per rank first: from then on its events take the KV-only path.
    for (i, rank) in ranks.iter().enumerate() {
        core.apply_kv_events(*rank, &[stored(i as u64, 0)]);
    }
    let request = SelectionRequest {
        request_id: "bench".into(),
        model: Some("m".into()),
        prompt: PromptInput::BlockHashes {
            seq_hashes: prompt,
            prompt_tokens: PROMPT_TOKENS as u64,
        },
        ..Default::default()
    };
    Fixture {
        core,
        request,
        ranks,
    }
}

/// A 16-block store, distinct per (rank, batch).
fn stored(rank: u64, batch: u64) -> KvEvent {
    let base = (rank << 40) ^ (batch << 8);
    KvEvent::BlockStored {
        block_hashes: (0..EVENT_BLOCKS as u64).map(|b| base + b + 1).collect(),
        parent_block_hash: None,
        token_ids: (0..(EVENT_BLOCKS * BLOCK) as u32)
            .map(|t| t ^ (base as u32))
            .collect(),
        block_size: BLOCK as u32,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
    }
}

/// Picks per second over `threads` pick threads and events per second from `event_threads`
/// event threads, all running for `run`.
fn measure(f: &Fixture, threads: usize, event_threads: usize, run: Duration) -> (f64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let picks = Arc::new(AtomicU64::new(0));
    let events = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (stop, picks) = (Arc::clone(&stop), Arc::clone(&picks));
            let mut request = f.request.clone();
            s.spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    request.request_id = format!("t{t}-{n}");
                    drop(std::hint::black_box(
                        f.core.select_and_reserve(&request).unwrap(),
                    ));
                    n += 1;
                }
                picks.fetch_add(n, Ordering::Relaxed);
            });
        }
        for e in 0..event_threads {
            let (stop, events) = (Arc::clone(&stop), Arc::clone(&events));
            s.spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let i = (n as usize * event_threads + e) % f.ranks.len();
                    let batch = 1 + n / f.ranks.len() as u64;
                    f.core
                        .apply_kv_events(f.ranks[i], &[stored(i as u64, batch)]);
                    n += 1;
                }
                events.fetch_add(n, Ordering::Relaxed);
            });
        }
        std::thread::sleep(run);
        stop.store(true, Ordering::Relaxed);
    });
    let secs = started.elapsed().as_secs_f64();
    (
        picks.load(Ordering::Relaxed) as f64 / secs,
        events.load(Ordering::Relaxed) as f64 / secs,
    )
}

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let seconds: f64 = std::env::args()
        .skip_while(|a| a != "--seconds")
        .nth(1)
        .map_or(2.0, |s| s.parse().expect("--seconds N"));
    let f = fixture();
    if !benching {
        let (p, _) = measure(&f, 2, 0, Duration::from_millis(50));
        let (_, e) = measure(&f, 1, 1, Duration::from_millis(50));
        assert!(p > 0.0 && e > 0.0);
        println!("concurrency bench smoke: ok (run `cargo bench --bench concurrency` to measure)");
        return;
    }
    let run = Duration::from_secs_f64(seconds);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("{RANKS} ranks, {cores} cores, {seconds} s per run\n");
    println!(
        "| pick threads | event threads | picks/s | x one thread | events/s (16 blocks each) |"
    );
    println!("|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut one = 0.0;
    for (threads, event_threads) in [(1, 0), (2, 0), (4, 0), (0, 1), (1, 1), (2, 1)] {
        let (p, e) = measure(&f, threads, event_threads, run);
        if threads == 1 && event_threads == 0 {
            one = p;
        }
        let ratio = if one > 0.0 { p / one } else { 0.0 };
        println!("| {threads} | {event_threads} | {p:.0} | {ratio:.2} | {e:.0} |");
        rows.push(serde_json::json!({
            "pick_threads": threads, "event_threads": event_threads,
            "picks_per_s": p, "events_per_s": e, "cores": cores,
        }));
    }
    let out =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-concurrency.json");
    std::fs::write(&out, serde_json::to_string_pretty(&rows).unwrap()).unwrap();
    println!("\nwrote {}", out.display());
}
