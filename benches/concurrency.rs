//! Decision throughput of one partition at 1, 2 and 4 threads, and KV-event apply throughput
//! while picks run (issue 27 item 3). The warm state of the `selection` bench (1,024 ranks, an
//! 8k-token prompt, every rank holding the prompt's first 8 blocks), every rank already precise
//! (one KV event applied). Each run lasts `--seconds` (default 2); pick threads book and free
//! (`select_and_reserve` then drop), the event thread applies 16-block `BlockStored` batches
//! round robin over the ranks. Two prompt mixes: *shared* (every pick sends the same 8k-token
//! prompt, so every pick rewrites the same 512 predicted index entries: true sharing between
//! the cores) and *distinct* (64 conversations that share only the 8 blocks every rank holds, as
//! different clients do, split between the pick threads: each thread cycles through its own
//! share, so the working set is the same at every thread count). Prints a table and writes
//! `target/bench-concurrency.json`.
//! `--only shared:2:0` runs one row (prompts, pick threads, event threads), for profiling.
//! Without `--bench` (as under `cargo test`) it runs a short smoke of each mode.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench harness: a panic is a failure report

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod common;

use common::{BLOCK, PROMPT_TOKENS};
use kvpick::observability::metrics::Metrics;
use kvpick::selection::{CoreConfig, PromptInput, RankKey, SelectionCore, SelectionRequest};
use kvpick::sources::catalog::{RankLayout, WorkerSpec};
use kvpick_core::event::{KvEvent, Medium};

const RANKS: usize = 1_024;
const RANKS_PER_WORKER: usize = 8;
const EVENT_BLOCKS: usize = 16;

struct Fixture {
    core: Arc<SelectionCore>,
    request: SelectionRequest,
    /// The warm prompt's block hashes (its first 8 are held by every rank).
    prompt: Vec<u64>,
    ranks: Vec<RankKey>,
}

/// Conversations of the distinct mix, split between the pick threads: a fixed total, so more
/// threads do not also mean more index to keep in cache (with 64 per thread, one thread given
/// 128 ran at 56% of its 64-conversation rate).
const CONVERSATIONS: u64 = 64;

#[derive(Clone, Copy, PartialEq)]
enum Prompts {
    Shared,
    Distinct,
}

impl Prompts {
    fn name(self) -> &'static str {
        match self {
            Prompts::Shared => "shared",
            Prompts::Distinct => "distinct",
        }
    }
}

/// The block hashes of conversation `c` of pick thread `t`: the 8 shared blocks, then its own.
fn conversation(prompt: &[u64], t: usize, c: u64) -> Vec<u64> {
    let salt = ((t as u64 + 1) << 48) ^ ((c + 1) << 32);
    prompt[..8]
        .iter()
        .copied()
        .chain(prompt[8..].iter().map(|h| h ^ salt))
        .collect()
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
            seq_hashes: prompt.clone(),
            prompt_tokens: PROMPT_TOKENS as u64,
        },
        ..Default::default()
    };
    Fixture {
        core,
        request,
        prompt,
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
        media: Vec::new(),
    }
}

/// Picks per second over `threads` pick threads and events per second from `event_threads`
/// event threads, all running for `run`.
fn measure(
    f: &Fixture,
    prompts: Prompts,
    threads: usize,
    event_threads: usize,
    run: Duration,
) -> (f64, f64) {
    let stop = Arc::new(AtomicBool::new(false));
    let picks = Arc::new(AtomicU64::new(0));
    let events = Arc::new(AtomicU64::new(0));
    let started = Instant::now();
    std::thread::scope(|s| {
        for t in 0..threads {
            let (stop, picks) = (Arc::clone(&stop), Arc::clone(&picks));
            let mut requests: Vec<SelectionRequest> = match prompts {
                Prompts::Shared => vec![f.request.clone()],
                Prompts::Distinct => (0..(CONVERSATIONS / threads as u64).max(1))
                    .map(|c| SelectionRequest {
                        prompt: PromptInput::BlockHashes {
                            seq_hashes: conversation(&f.prompt, t, c),
                            prompt_tokens: PROMPT_TOKENS as u64,
                        },
                        ..f.request.clone()
                    })
                    .collect(),
            };
            s.spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let k = requests.len();
                    let request = &mut requests[n as usize % k];
                    request.request_id = format!("t{t}-{n}");
                    drop(std::hint::black_box(
                        f.core.select_and_reserve(request).unwrap(),
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
        let (p, _) = measure(&f, Prompts::Shared, 2, 0, Duration::from_millis(50));
        let (d, e) = measure(&f, Prompts::Distinct, 1, 1, Duration::from_millis(50));
        assert!(p > 0.0 && d > 0.0 && e > 0.0);
        println!("concurrency bench smoke: ok (run `cargo bench --bench concurrency` to measure)");
        return;
    }
    // `--only distinct:2:0`: one row (prompts, pick threads, event threads), for profiling.
    let only: Option<String> = std::env::args().skip_while(|a| a != "--only").nth(1);
    let run = Duration::from_secs_f64(seconds);
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!("{RANKS} ranks, {cores} cores, {seconds} s per run\n");
    println!(
        "| prompts | pick threads | event threads | picks/s | x one thread | events/s (16 blocks each) |"
    );
    println!("|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    for prompts in [Prompts::Shared, Prompts::Distinct] {
        let mut one = 0.0;
        for (threads, event_threads) in [(1, 0), (2, 0), (4, 0), (0, 1), (1, 1), (2, 1)] {
            if prompts == Prompts::Distinct && threads == 0 {
                continue; // events alone do not depend on the prompts
            }
            let row = format!("{}:{threads}:{event_threads}", prompts.name());
            if only.as_ref().is_some_and(|o| *o != row) {
                continue;
            }
            let (p, e) = measure(&f, prompts, threads, event_threads, run);
            if threads == 1 && event_threads == 0 {
                one = p;
            }
            let ratio = if one > 0.0 { p / one } else { 0.0 };
            let name = prompts.name();
            println!("| {name} | {threads} | {event_threads} | {p:.0} | {ratio:.2} | {e:.0} |");
            rows.push(serde_json::json!({
                "prompts": name, "pick_threads": threads, "event_threads": event_threads,
                "picks_per_s": p, "events_per_s": e, "cores": cores,
            }));
        }
    }
    let out =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-concurrency.json");
    std::fs::write(&out, serde_json::to_string_pretty(&rows).unwrap()).unwrap();
    println!("\nwrote {}", out.display());
}
