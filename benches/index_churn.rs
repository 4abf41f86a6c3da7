//! Inserts into a full KV index while the prompts' length changes, under the allocator `kvpick
//! serve` uses (mimalloc): the index fills with 2,300-block prompts (220 KB bodies of token ids),
//! takes 340- and 500-block ones (32 KB), then 3,400-block ones (220 KB of chat text without a
//! tokenizer). Eviction's tombstones then make the shards' tables grow once more while inserts
//! run, so this is where a table's growth shows in an insert's latency (docs/benchmarks.md,
//! "Index tables off huge pages"). Per phase: mean and worst insert, inserts over 5 ms, page
//! faults, the table's size. `cargo bench --bench index_churn`; writes
//! `target/bench-index-churn.json`. Without `--bench` (as under `cargo test`) a small smoke pass.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench harness: a panic is a failure report

use std::time::{Duration, Instant};

use kvpick_core::index::{PrefixIndex, Tier};
use kvpick_core::types::RankKey;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Minor page faults of this process so far (`/proc/self/stat`, field 10).
fn minor_faults() -> u64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let after_name = stat.rsplit(')').next().unwrap_or("");
    after_name
        .split_whitespace()
        .nth(7)
        .and_then(|f| f.parse().ok())
        .unwrap_or(0)
}

/// A uniform 64-bit key per (prompt, block), as chained block hashes are.
fn key(prompt: u64, block: u64) -> u64 {
    kvpick_core::hash::chain(prompt, block)
}

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let (capacity, scale) = if benching {
        (1usize << 20, 1)
    } else {
        (1 << 16, 16)
    };
    let phases: [(&str, u64, u64); 6] = [
        ("fill, 220 KB token ids", 2_300, 1_000),
        ("32 KB token ids", 340, 1_000),
        ("32 KB chat text", 500, 1_000),
        ("220 KB token ids", 2_300, 666),
        ("220 KB chat text", 3_400, 2_666),
        ("220 KB chat text, grown", 3_400, 1_000),
    ];
    let start = Instant::now();
    let mut index = PrefixIndex::new(capacity, start);
    let mut prompt = 0u64;
    let mut rows = Vec::new();
    println!("| phase | inserts | mean µs | worst ms | over 5 ms | page faults | table MB |");
    println!("|---|---|---|---|---|---|---|");
    for (phase, blocks, inserts) in phases {
        let (blocks, inserts) = (blocks / scale, (inserts / scale).max(4));
        let faults = minor_faults();
        let (mut total, mut worst, mut over_5ms) = (0.0f64, 0.0f64, 0u64);
        for _ in 0..inserts {
            prompt += 1;
            let hashes: Vec<u64> = (0..blocks).map(|b| key(prompt, b)).collect();
            let rank = RankKey {
                worker_id: 1 + prompt % 8,
                dp_rank: 0,
            };
            let t = Instant::now();
            index.insert(
                rank,
                &hashes,
                Tier::Gpu,
                Some(start + Duration::from_secs(3600)),
            );
            let ms = t.elapsed().as_secs_f64() * 1e3;
            total += ms;
            worst = worst.max(ms);
            over_5ms += u64::from(ms > 5.0);
        }
        assert!(index.len() <= capacity);
        let faults = minor_faults() - faults;
        let mean_us = total * 1e3 / inserts as f64;
        let table_mb = index.heap_bytes() as f64 / 1e6;
        println!(
            "| {phase} | {inserts} | {mean_us:.0} | {worst:.1} | {over_5ms} | {faults} | {table_mb:.0} |"
        );
        rows.push(serde_json::json!({
            "phase": phase, "blocks_per_insert": blocks, "inserts": inserts,
            "mean_us": mean_us, "worst_ms": worst, "over_5ms": over_5ms,
            "page_faults": faults, "table_mb": table_mb,
        }));
    }
    if benching {
        let out =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-index-churn.json");
        std::fs::write(&out, serde_json::to_string_pretty(&rows).unwrap()).unwrap();
        println!("written to {}", out.display());
    }
}
