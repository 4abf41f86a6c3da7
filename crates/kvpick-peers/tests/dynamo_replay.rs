//! The `dynamo` replay policy drives Dynamo's own router: KV events reach its radix tree (a
//! repeated prefix goes to the rank that caches it), its load tracking follows the replay's
//! lifecycle, and a replay with it is complete and deterministic.
//! Run: `cargo test --manifest-path crates/kvpick-peers/Cargo.toml`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test harness: a panic is a failure report

use kvpick_core::event::{KvEvent, Medium};
use kvpick_peers::dynamo::DynamoRouter;
use kvpick_sim::replay::policy::{FleetView, PickRequest, Policy, PolicyOptions};
use kvpick_sim::replay::trace::TraceRecord;
use kvpick_sim::replay::{infinite_cache_hit_rate, prepare, run_policies_with, PolicyReport};
use kvpick_sim::sim::engine::EngineConfig;

const BLOCK: usize = 16;

fn engine() -> EngineConfig {
    EngineConfig {
        num_gpu_blocks: 4_000,
        ..EngineConfig::default()
    }
}

fn stored(tokens: &[u32], first_hash: u64) -> KvEvent {
    let blocks = tokens.len() / BLOCK;
    KvEvent::BlockStored {
        block_hashes: (0..blocks as u64).map(|i| first_hash + i).collect(),
        parent_block_hash: None,
        token_ids: tokens[..blocks * BLOCK].to_vec(),
        block_size: BLOCK as u32,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
        media: Vec::new(),
    }
}

fn tokens(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32).map(|i| seed * 100_000 + i).collect()
}

#[tokio::test(start_paused = true)]
async fn a_repeated_prefix_goes_to_the_rank_whose_events_announced_it() {
    let mut dynamo = DynamoRouter::new(4, &PolicyOptions::new(BLOCK, 1), &engine()).unwrap();
    let fleet = FleetView { metrics: &[] };
    let prefix = tokens(7, 40 * BLOCK);
    // Rank 2's engine cached the prefix and said so.
    dynamo.on_kv_events(2, &[stored(&prefix, 9_000)]);
    assert_eq!(dynamo.overlap_blocks(&prefix), vec![0, 0, 40, 0]);
    for id in 0..6u64 {
        let mut prompt = prefix.clone();
        prompt.extend(tokens(100 + id as u32, 3 * BLOCK));
        let rank = dynamo.pick(
            &PickRequest::new(id, &prompt),
            &fleet,
        );
        assert_eq!(rank, 2, "request {id} extends the prefix rank 2 caches");
        dynamo.on_first_token(id, rank);
        dynamo.on_complete(id, rank);
    }
    // Evicted: Dynamo forgets it, and a cold prompt no longer prefers rank 2.
    dynamo.on_kv_events(
        2,
        &[KvEvent::BlockRemoved {
            block_hashes: (9_000..9_040).collect(),
            medium: Medium::Gpu,
            group_idx: None,
        }],
    );
    assert_eq!(dynamo.overlap_blocks(&prefix), vec![0, 0, 0, 0]);
    assert_eq!(dynamo.errors(), (0, 0));
}

#[tokio::test(start_paused = true)]
async fn load_tracking_spreads_cold_requests_and_frees_them() {
    let mut dynamo = DynamoRouter::new(3, &PolicyOptions::new(BLOCK, 3), &engine()).unwrap();
    let fleet = FleetView { metrics: &[] };
    // Three cold, in-flight requests: Dynamo's active-sequence tracking books each one's prefill,
    // so the second and third avoid the ranks already prefilling.
    let picks: Vec<usize> = (0..3u64)
        .map(|id| {
            let prompt = tokens(id as u32 + 1, 64 * BLOCK);
            dynamo.pick(
                &PickRequest::new(id, &prompt),
                &fleet,
            )
        })
        .collect();
    let mut sorted = picks.clone();
    sorted.sort();
    assert_eq!(sorted, vec![0, 1, 2], "{picks:?}");
    for (id, rank) in picks.iter().enumerate() {
        dynamo.on_complete(id as u64, *rank);
    }
    assert_eq!(dynamo.errors(), (0, 0));
}

/// One prefix family, requests far apart (no queueing): after the first, every request should
/// find the family's blocks where the first one ran.
fn family_trace() -> Vec<TraceRecord> {
    (0..12u64)
        .map(|i| TraceRecord {
            timestamp: i * 5_000,
            input_length: 3 * 512 + 100,
            output_length: 8,
            hash_ids: vec![1, 2, 3, 1_000 + i],
            class: Default::default(),
            session: Default::default(),
        })
        .collect()
}

fn replay(seed: u64) -> PolicyReport {
    let requests = prepare(&family_trace(), 1.0);
    let config = engine();
    let peers = |name: &str, ranks: usize, options: &PolicyOptions| {
        kvpick_peers::build_peer(name, ranks, options, &config)
    };
    let mut reports = run_policies_with(
        &requests,
        &["dynamo".to_string()],
        4,
        &config,
        &PolicyOptions::new(config.block_size, seed),
        &peers,
    )
    .unwrap();
    reports.remove(0)
}

#[test]
fn a_replay_with_dynamo_completes_reuses_the_family_and_is_deterministic() {
    let report = replay(42);
    assert_eq!(report.policy, "dynamo");
    assert_eq!((report.completed, report.refused), (12, 0));
    let bound = infinite_cache_hit_rate(&prepare(&family_trace(), 1.0), BLOCK);
    assert!(
        report.kv_hit_rate > bound - 0.01,
        "hit rate {} vs bound {bound}",
        report.kv_hit_rate
    );
    assert_eq!(
        report.per_rank_requests.iter().max(),
        Some(&12),
        "{:?}",
        report.per_rank_requests
    );
    assert_eq!(report, replay(42));
}
