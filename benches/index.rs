//! KV index benchmarks on blocks derived from the public Mooncake trace
//! (`data/mooncake/mooncake_trace_1000.jsonl`, each `hash_id` one block, chained as a prefix),
//! spread round-robin over 8 and 64 ranks:
//! - apply throughput: blocks/s through `SelectionCore::apply_kv_events` (decode excluded), and
//!   through msgpack decode + apply (decode included);
//! - `find_matches` latency (p50/p99) for 32-block prompts taken from the trace;
//! - memory per indexed (block, rank) pair, measured with a counting allocator;
//! - inserts into a full index (1M blocks, 2,300-block prompts that are all new, as 220 KB
//!   bodies of token ids are): p50/p90/p99, the maximum and the mean once eviction runs, which is what the
//!   eviction of least recently touched blocks costs a pick under the partition lock.
//!
//! Writes `target/bench-index.json` and prints a table. Without `--bench` (as under `cargo test`)
//! it runs a small smoke pass.

#![allow(clippy::unwrap_used, clippy::expect_used)]
// a test/bench harness: a panic is a failure report

// The counting allocator below is the one place kvpick allows unsafe code.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use kvpick::observability::metrics::Metrics;
use kvpick::selection::{CoreConfig, RankKey, SelectionCore};
use kvpick::sources::catalog::{RankLayout, WorkerSpec};
use kvpick::sources::events::decode::{decode_batch, KvEvent, Medium};
use kvpick_core::hash::{chain, local_hashes, BASE_SEED};
use kvpick_core::index::{PrefixIndex, Tier};

struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(
            new_size as isize - layout.size() as isize,
            Ordering::Relaxed,
        );
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

const BLOCK: usize = 16;

/// The Mooncake trace shipped in the repository (`data/mooncake`); the smoke pass under `cargo
/// test` takes its first 20 requests.
fn trace() -> Vec<Vec<u64>> {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("data/mooncake/mooncake_trace_1000.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["hash_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|h| h.as_u64().unwrap())
                .collect()
        })
        .collect()
}

/// 16 deterministic tokens standing for trace block `id`.
fn tokens_of(id: u64) -> Vec<u32> {
    (0..BLOCK as u32)
        .map(|t| (id as u32).wrapping_mul(2_654_435_761) ^ t)
        .collect()
}

/// Our chained hashes of a trace request (what requests and events both produce).
fn seq_hashes(ids: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(ids.len());
    let mut parent = None;
    for id in ids {
        let local = local_hashes(&tokens_of(*id), BLOCK, BASE_SEED)[0];
        let seq = parent.map_or(local, |p| chain(p, local));
        out.push(seq);
        parent = Some(seq);
    }
    out
}

fn store_events(ids: &[u64]) -> Vec<KvEvent> {
    // One event per request: all its blocks, engine hashes = trace ids (+1 so none is 0).
    vec![KvEvent::BlockStored {
        block_hashes: ids.iter().map(|i| i + 1).collect(),
        parent_block_hash: None,
        token_ids: ids.iter().flat_map(|i| tokens_of(*i)).collect(),
        block_size: BLOCK as u32,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
        media: Vec::new(),
    }]
}

/// The vLLM array layout of `[ts, [event], rank]` for one store, encoded with rmpv.
fn encode(ids: &[u64]) -> Vec<u8> {
    use rmpv::Value;
    let event = Value::Array(vec![
        Value::from("BlockStored"),
        Value::Array(ids.iter().map(|i| Value::from(i + 1)).collect()),
        Value::Nil,
        Value::Array(
            ids.iter()
                .flat_map(|i| tokens_of(*i))
                .map(Value::from)
                .collect(),
        ),
        Value::from(BLOCK as u64),
        Value::Nil,
        Value::from("GPU"),
    ]);
    let batch = Value::Array(vec![
        Value::from(0.0),
        Value::Array(vec![event]),
        Value::from(0),
    ]);
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).unwrap();
    out
}

fn core_with(ranks: usize) -> (Arc<SelectionCore>, Vec<RankKey>) {
    let core = SelectionCore::new(
        CoreConfig {
            index_max_blocks: 1 << 24,
            ..Default::default()
        },
        Metrics::new(),
    );
    core.apply_snapshot(vec![WorkerSpec {
        namespace: "bench".into(),
        address: "10.0.0.1".parse().unwrap(),
        block_size: Some(BLOCK as u32),
        ..WorkerSpec::for_test(
            "w",
            "m",
            RankLayout::PerPort((0..ranks as u16).map(|r| 8000 + r).collect()),
        )
    }])
    .unwrap();
    let id = core.list_workers(None)[0].record.id;
    let keys = (0..ranks as u32)
        .map(|r| RankKey {
            worker_id: id,
            dp_rank: r,
        })
        .collect();
    (core, keys)
}

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let mut requests = trace();
    if !benching {
        requests.truncate(20);
    }
    let total_blocks: usize = requests.iter().map(Vec::len).sum();
    let mut rows = Vec::new();
    println!("| ranks | apply Mblocks/s (no decode) | apply Mblocks/s (with decode) | lookup p50 µs | lookup p99 µs | bytes per (block, rank): index | with engine-hash maps |");
    println!("|---|---|---|---|---|---|---|");
    for ranks in [8usize, 64] {
        // Apply throughput, decode excluded.
        let events: Vec<Vec<KvEvent>> = requests.iter().map(|r| store_events(r)).collect();
        let (core, keys) = core_with(ranks);
        let live_before_apply = LIVE.load(Ordering::Relaxed);
        let t = Instant::now();
        for (i, ev) in events.iter().enumerate() {
            core.apply_kv_events(keys[i % ranks], ev);
        }
        let apply = total_blocks as f64 / t.elapsed().as_secs_f64();
        // Everything precise mode keeps: the index plus the per-rank engine-hash maps.
        let precise_bytes = (LIVE.load(Ordering::Relaxed) - live_before_apply) as f64;
        // Decode included.
        let payloads: Vec<Vec<u8>> = requests.iter().map(|r| encode(r)).collect();
        let (core2, keys2) = core_with(ranks);
        let t = Instant::now();
        for (i, p) in payloads.iter().enumerate() {
            let batch = decode_batch(p).unwrap();
            core2.apply_kv_events(keys2[i % ranks], &batch.events);
        }
        let apply_decode = total_blocks as f64 / t.elapsed().as_secs_f64();
        drop((core, core2, events, payloads));

        // Memory and lookups on a bare index.
        let chains: Vec<Vec<u64>> = requests.iter().map(|r| seq_hashes(r)).collect();
        let before = LIVE.load(Ordering::Relaxed);
        let mut index = PrefixIndex::new(1 << 24, std::time::Instant::now());
        let mut pairs = 0usize;
        for (i, c) in chains.iter().enumerate() {
            index.insert(keys2[i % ranks], c, Tier::Gpu, None);
            pairs += c.len();
        }
        let bytes = (LIVE.load(Ordering::Relaxed) - before) as f64;
        // Distinct (block, rank) pairs: a block re-stored on the same rank is one pair.
        let distinct_pairs: usize = {
            let mut set = std::collections::HashSet::new();
            for (i, c) in chains.iter().enumerate() {
                for h in c {
                    set.insert((*h, i % ranks));
                }
            }
            set.len()
        };
        let _ = pairs;
        let now = Instant::now();
        let mut samples: Vec<f64> = Vec::new();
        let rounds = if benching { 20 } else { 1 };
        for _ in 0..rounds {
            for c in &chains {
                let prompt = &c[..c.len().min(32)];
                let t = Instant::now();
                std::hint::black_box(index.find_matches(prompt, now));
                samples.push(t.elapsed().as_secs_f64() * 1e6);
            }
        }
        samples.sort_by(f64::total_cmp);
        let p50 = samples[samples.len() / 2];
        let p99 = samples[samples.len() * 99 / 100];
        let per_pair = bytes / distinct_pairs as f64;
        let precise_per_pair = precise_bytes / distinct_pairs as f64;
        println!(
            "| {ranks} | {:.2} | {:.2} | {p50:.2} | {p99:.2} | {per_pair:.0} | {precise_per_pair:.0} |",
            apply / 1e6,
            apply_decode / 1e6
        );
        rows.push(serde_json::json!({
            "ranks": ranks, "blocks": total_blocks, "apply_blocks_per_s": apply,
            "apply_with_decode_blocks_per_s": apply_decode, "lookup_p50_us": p50,
            "lookup_p99_us": p99, "bytes_per_block_rank_pair": per_pair,
            "bytes_per_block_rank_pair_with_engine_maps": precise_per_pair,
            "distinct_pairs": distinct_pairs,
        }));
    }
    rows.push(inserts_at_capacity(benching));
    if benching {
        let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-index.json");
        std::fs::write(&out, serde_json::to_string_pretty(&rows).unwrap()).unwrap();
        println!("written to {}", out.display());
    }
}

/// Inserts of all-new 2,300-block prompts into a 1M-block index, past its capacity: latency
/// quantiles over every insert and the mean over the second half (eviction running).
fn inserts_at_capacity(benching: bool) -> serde_json::Value {
    let (capacity, inserts) = if benching {
        (1usize << 20, 1_200u64)
    } else {
        (1 << 16, 80)
    };
    let mut index = PrefixIndex::new(capacity, Instant::now());
    let mut micros: Vec<f64> = Vec::new();
    for r in 0..inserts {
        // Chained xxh3 hashes, as a request's blocks are: uniform over all 64 bits. (Keys made
        // as `(r << 32 | b) * odd` shared their low 32 bits across prompts, and the table's
        // bucket index is the low bits: they measured collision chains, not inserts.)
        let ids: Vec<u64> = ((r << 12)..(r << 12) + 2_300).collect();
        let prompt = seq_hashes(&ids);
        let rank = RankKey {
            worker_id: 1 + r % 8,
            dp_rank: 0,
        };
        let t = Instant::now();
        index.insert(rank, &prompt, Tier::Gpu, None);
        micros.push(t.elapsed().as_secs_f64() * 1e6);
    }
    assert!(index.len() <= capacity);
    let half = micros.len() / 2;
    let steady_mean = micros[half..].iter().sum::<f64>() / (micros.len() - half) as f64;
    micros.sort_by(f64::total_cmp);
    let q = |p: usize| micros[micros.len() * p / 100];
    let (p50, p90, p99) = (q(50), q(90), q(99));
    let max = micros[micros.len() - 1];
    println!(
        "\ninserts of 2,300 new blocks into a full {capacity}-block index: p50 {p50:.0} µs, p90 {p90:.0}, \
         p99 {p99:.0}, max {max:.0}, mean once evicting {steady_mean:.0} µs"
    );
    serde_json::json!({
        "series": "insert_at_capacity", "capacity_blocks": capacity, "blocks_per_insert": 2_300,
        "insert_p50_us": p50, "insert_p90_us": p90, "insert_p99_us": p99, "insert_max_us": max,
        "insert_mean_evicting_us": steady_mean,
    })
}
