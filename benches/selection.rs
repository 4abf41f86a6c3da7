//! Decision latency of the selection core with warm state (ARCHITECTURE.md §4, issue "selection core"):
//! 8, 64, 1,024 and 8,192 ranks, an 8k-token prompt (512 blocks of 16), tokenization excluded
//! (the prompt arrives as precomputed block hashes; a second series includes hashing the tokens).
//!
//! Warm state: every rank holds its own 32-block history and a shared 8-block system prefix; every
//! 97th rank also holds a deeper part of this prompt. Criterion reports medians; a second pass
//! times single decisions to report p50/p99, printed and written to
//! `target/bench-selection.json`. Without `--bench` (as under `cargo test`) it runs one smoke
//! decision per size.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::sync::Arc;
use std::time::Instant;

mod common;

use common::{BLOCK, PROMPT_TOKENS};
use criterion::{BenchmarkId, Criterion};
use kvpick::observability::metrics::Metrics;
use kvpick::selection::{CoreConfig, PromptInput, SelectionCore, SelectionRequest};
use kvpick::sources::catalog::{RankLayout, WorkerSpec};

const SIZES: [usize; 4] = [8, 64, 1_024, 8_192];
const RANKS_PER_WORKER: usize = 8;

struct Fixture {
    core: Arc<SelectionCore>,
    hashes_request: SelectionRequest,
    tokens_request: SelectionRequest,
    /// The hashes request with a session already bound (hard affinity).
    session_request: SelectionRequest,
    /// A prompt sharing only the 8-block prefix every rank holds (then its own blocks): matches
    /// that do not grow with the ranks.
    shared_request: SelectionRequest,
}

fn fixture(ranks: usize) -> Fixture {
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(1),
            index_max_blocks: 4 << 20,
            ..CoreConfig::default()
        },
        Metrics::new(),
    );
    let workers = ranks.div_ceil(RANKS_PER_WORKER);
    let specs: Vec<WorkerSpec> = (0..workers)
        .map(|w| WorkerSpec {
            namespace: "bench".into(),
            address: format!("10.{}.{}.{}", w / 65536, (w / 256) % 256, w % 256)
                .parse()
                .unwrap(),
            block_size: Some(BLOCK as u32),
            ..WorkerSpec::for_test(
                &format!("w{w}"),
                "m",
                RankLayout::PerPort(
                    (0..RANKS_PER_WORKER.min(ranks - w * RANKS_PER_WORKER))
                        .map(|r| 8000 + r as u16)
                        .collect(),
                ),
            )
        })
        .collect();
    let prompt = common::warm(&core, specs);
    let shared_prefix: Vec<u64> = prompt[..8]
        .iter()
        .copied()
        .chain((0..504u64).map(|i| 0xdead_0000_0000 + i))
        .collect();
    let tokens = common::prompt_tokens();
    let base = SelectionRequest {
        request_id: "bench".into(),
        model: Some("m".into()),
        ..Default::default()
    };
    let hashes_request = SelectionRequest {
        prompt: PromptInput::BlockHashes {
            seq_hashes: prompt,
            prompt_tokens: PROMPT_TOKENS as u64,
        },
        ..base.clone()
    };
    let session_request = SelectionRequest {
        request_id: "bind".into(),
        session_id: Some("bench-session".into()),
        ..hashes_request.clone()
    };
    core.select_and_reserve(&session_request).unwrap().detach();
    let shared_request = SelectionRequest {
        request_id: "shared".into(),
        prompt: PromptInput::BlockHashes {
            seq_hashes: shared_prefix,
            prompt_tokens: PROMPT_TOKENS as u64,
        },
        ..base.clone()
    };
    Fixture {
        shared_request,
        hashes_request,
        session_request,
        tokens_request: SelectionRequest {
            prompt: PromptInput::Tokens(tokens),
            ..base
        },
        core,
    }
}

fn percentiles(f: &Fixture, request: &SelectionRequest, n: usize) -> (f64, f64) {
    let mut samples: Vec<f64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(f.core.select(request).unwrap());
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    (samples[n / 2], samples[n * 99 / 100])
}

/// p50/p99 µs of one booked pick and its free: through flow control's admission (the queue
/// empty, no rank saturated) and through the plain `select_and_reserve`, interleaved so both see
/// the same machine state. The difference is what the queue costs when it is empty.
fn admission_percentiles(f: &Fixture, n: usize) -> [(f64, f64); 2] {
    let mut admit = Vec::with_capacity(n);
    let mut plain = Vec::with_capacity(n);
    for _ in 0..n {
        let t = Instant::now();
        match f.core.admit(&f.hashes_request).unwrap() {
            kvpick::selection::admission::Admitted::Now(r) => drop(std::hint::black_box(r)),
            kvpick::selection::admission::Admitted::Queued(_) => panic!("nothing is saturated"),
        }
        admit.push(t.elapsed().as_secs_f64() * 1e6);
        let t = Instant::now();
        drop(std::hint::black_box(
            f.core.select_and_reserve(&f.hashes_request).unwrap(),
        ));
        plain.push(t.elapsed().as_secs_f64() * 1e6);
    }
    [admit, plain].map(|mut v| {
        v.sort_by(f64::total_cmp);
        (v[n / 2], v[n * 99 / 100])
    })
}

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let fixtures: Vec<(usize, Fixture)> = SIZES.iter().map(|&n| (n, fixture(n))).collect();
    if !benching {
        for (n, f) in &fixtures {
            let pick = f.core.select(&f.hashes_request).unwrap();
            assert!(pick.overlap_blocks >= 8, "{n} ranks: warm prefix found");
            let [admit, _] = admission_percentiles(f, 2);
            assert!(admit.0 > 0.0);
            let bound = f.core.select(&f.session_request).unwrap();
            assert_eq!(
                bound.session,
                Some(kvpick::selection::SessionOutcome::Reused)
            );
        }
        println!("selection bench smoke: ok (run `cargo bench --bench selection` to measure)");
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    {
        let mut group = c.benchmark_group("decision");
        for (n, f) in &fixtures {
            group.bench_with_input(BenchmarkId::new("block_hashes", n), f, |b, f| {
                b.iter(|| f.core.select(&f.hashes_request).unwrap())
            });
            group.bench_with_input(BenchmarkId::new("with_hashing", n), f, |b, f| {
                b.iter(|| f.core.select(&f.tokens_request).unwrap())
            });
            group.bench_with_input(BenchmarkId::new("bound_session", n), f, |b, f| {
                b.iter(|| f.core.select(&f.session_request).unwrap())
            });
            group.bench_with_input(BenchmarkId::new("shared_prefix_only", n), f, |b, f| {
                b.iter(|| f.core.select(&f.shared_request).unwrap())
            });
        }
        group.finish();
    }
    c.final_summary();

    let mut rows = Vec::new();
    println!("\n| ranks | p50 µs (hashes) | p99 µs (hashes) | p50 µs (with hashing) | p99 µs (with hashing) | p50 µs (bound session) | p99 µs (bound session) | p50 µs (shared prefix only) | p99 µs (shared prefix only) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for (n, f) in &fixtures {
        let iterations = if *n >= 1024 { 2_000 } else { 20_000 };
        let (p50, p99) = percentiles(f, &f.hashes_request, iterations);
        let (hp50, hp99) = percentiles(f, &f.tokens_request, iterations);
        let (sp50, sp99) = percentiles(f, &f.session_request, iterations);
        let (cp50, cp99) = percentiles(f, &f.shared_request, iterations);
        println!("| {n} | {p50:.1} | {p99:.1} | {hp50:.1} | {hp99:.1} | {sp50:.1} | {sp99:.1} | {cp50:.1} | {cp99:.1} |");
        rows.push(serde_json::json!({
            "ranks": n, "p50_us": p50, "p99_us": p99,
            "with_hashing_p50_us": hp50, "with_hashing_p99_us": hp99,
            "bound_session_p50_us": sp50, "bound_session_p99_us": sp99,
            "shared_prefix_only_p50_us": cp50, "shared_prefix_only_p99_us": cp99,
        }));
    }
    println!("\n| ranks | admit+free p50 µs | p99 | select_and_reserve+free p50 µs | p99 | empty-queue overhead p50 / p99 µs |");
    println!("|---|---|---|---|---|---|");
    let mut flow_rows = Vec::new();
    for (n, f) in &fixtures {
        let iterations = if *n >= 1024 { 2_000 } else { 20_000 };
        let [(ap50, ap99), (pp50, pp99)] = admission_percentiles(f, iterations);
        println!(
            "| {n} | {ap50:.1} | {ap99:.1} | {pp50:.1} | {pp99:.1} | {:.2} / {:.2} |",
            ap50 - pp50,
            ap99 - pp99
        );
        flow_rows.push(serde_json::json!({
            "ranks": n, "admit_p50_us": ap50, "admit_p99_us": ap99,
            "select_and_reserve_p50_us": pp50, "select_and_reserve_p99_us": pp99,
        }));
    }
    rows.push(serde_json::json!({ "flow_control_empty_queue": flow_rows }));
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-selection.json");
    std::fs::write(&out, serde_json::to_string_pretty(&rows).unwrap()).unwrap();
    println!("written to {}", out.display());
}
