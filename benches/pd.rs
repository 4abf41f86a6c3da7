//! Pair-decision latency (prefill/decode disaggregation, issue 19) against the aggregated
//! decision on the same ranks and warm state: 8, 64 and 1,024 ranks, an 8k-token prompt given as
//! block hashes (512 blocks of 16). In the P/D fleet the first half of the workers are `prefill`
//! and the rest `decode`; the transfer is free, so the idle fleet splits (the whole pair decision
//! runs: decode ranking, split test, prefill ranking). Criterion reports medians; a second pass
//! times single decisions for p50/p99 and the P/D / aggregated ratio, printed and written to
//! `target/bench-pd.json`. Without `--bench` (as under `cargo test`) it checks one pick per size.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::sync::Arc;
use std::time::Instant;

mod common;

use common::{BLOCK, PROMPT_TOKENS};
use criterion::{BenchmarkId, Criterion};
use kvpick::observability::metrics::Metrics;
use kvpick::selection::{CoreConfig, PromptInput, SelectionCore, SelectionRequest};
use kvpick::sources::catalog::{RankLayout, WorkerSpec};
use kvpick_core::{PdConfig, Role};

const SIZES: [usize; 3] = [8, 64, 1_024];
const RANKS_PER_WORKER: usize = 8;

fn fixture(ranks: usize, split: bool) -> (Arc<SelectionCore>, SelectionRequest) {
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(1),
            index_max_blocks: 4 << 20,
            pd: PdConfig {
                transfer_block_cost: 0.0,
                ..PdConfig::default()
            },
            ..CoreConfig::default()
        },
        Metrics::new(),
    );
    let workers = ranks.div_ceil(RANKS_PER_WORKER);
    let specs: Vec<WorkerSpec> = (0..workers)
        .map(|w| {
            let n = RANKS_PER_WORKER.min(ranks - w * RANKS_PER_WORKER);
            // 8 ranks = one worker: its ranks split half and half (per-rank roles).
            let roles = match (split, workers) {
                (false, _) => vec![],
                (true, 1) => (0..n)
                    .map(|r| {
                        if r < n / 2 {
                            Role::Prefill
                        } else {
                            Role::Decode
                        }
                    })
                    .collect(),
                (true, _) if w < workers / 2 => vec![Role::Prefill],
                (true, _) => vec![Role::Decode],
            };
            WorkerSpec {
                block_size: Some(BLOCK as u32),
                address: format!("10.{}.{}.{}", w / 65536, (w / 256) % 256, w % 256)
                    .parse()
                    .unwrap(),
                roles,
                ..WorkerSpec::for_test(
                    &format!("w{w}"),
                    "m",
                    RankLayout::PerPort((0..n).map(|r| 8000 + r as u16).collect()),
                )
            }
        })
        .collect();
    let prompt = common::warm(&core, specs);
    let request = SelectionRequest {
        request_id: "bench".into(),
        model: Some("m".into()),
        prompt: PromptInput::BlockHashes {
            seq_hashes: prompt,
            prompt_tokens: PROMPT_TOKENS as u64,
        },
        ..Default::default()
    };
    (core, request)
}

fn percentiles(core: &SelectionCore, request: &SelectionRequest, n: usize) -> (f64, f64) {
    let mut samples: Vec<f64> = (0..n)
        .map(|_| {
            let t = Instant::now();
            std::hint::black_box(core.select(request).unwrap());
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    (samples[n / 2], samples[n * 99 / 100])
}

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let fixtures: Vec<_> = SIZES
        .iter()
        .map(|&n| (n, fixture(n, false), fixture(n, true)))
        .collect();
    for (n, (agg, agg_req), (pd, pd_req)) in &fixtures {
        assert!(
            agg.select(agg_req).unwrap().prefill.is_none(),
            "{n}: aggregated"
        );
        assert!(
            pd.select(pd_req).unwrap().prefill.is_some(),
            "{n}: the P/D fleet splits"
        );
    }
    if !benching {
        println!("pd bench smoke: ok (run `cargo bench --bench pd` to measure)");
        return;
    }
    let mut c = Criterion::default().configure_from_args();
    {
        let mut group = c.benchmark_group("pair_decision");
        for (n, (agg, agg_req), (pd, pd_req)) in &fixtures {
            group.bench_with_input(BenchmarkId::new("aggregated", n), n, |b, _| {
                b.iter(|| agg.select(agg_req).unwrap())
            });
            group.bench_with_input(BenchmarkId::new("pair", n), n, |b, _| {
                b.iter(|| pd.select(pd_req).unwrap())
            });
        }
        group.finish();
    }
    c.final_summary();
    let mut rows = Vec::new();
    println!(
        "\n| ranks | aggregated p50 µs | p99 µs | pair p50 µs | p99 µs | pair / aggregated (p50) |"
    );
    println!("|---|---|---|---|---|---|");
    for (n, (agg, agg_req), (pd, pd_req)) in &fixtures {
        let iterations = if *n >= 1024 { 2_000 } else { 20_000 };
        let (a50, a99) = percentiles(agg, agg_req, iterations);
        let (p50, p99) = percentiles(pd, pd_req, iterations);
        println!(
            "| {n} | {a50:.1} | {a99:.1} | {p50:.1} | {p99:.1} | {:.2} |",
            p50 / a50
        );
        rows.push(serde_json::json!({
            "ranks": n, "aggregated_p50_us": a50, "aggregated_p99_us": a99,
            "pair_p50_us": p50, "pair_p99_us": p99, "ratio_p50": p50 / a50,
        }));
    }
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-pd.json");
    std::fs::write(&out, serde_json::to_string_pretty(&rows).unwrap()).unwrap();
    println!("written to {}", out.display());
}
