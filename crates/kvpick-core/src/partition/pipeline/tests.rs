//! One test (or more) per pipeline stage: each fails when its rule is broken.

use std::sync::Arc;

use super::*;
use crate::decide::Decision;

fn key(worker_id: u64, dp_rank: u32) -> RankKey {
    RankKey { worker_id, dp_rank }
}

fn slot(port: u16) -> Slot {
    Slot::for_test(port)
}

/// Three workers, one rank each (ports 8001..8003), plus worker 4 with two ranks (8004, 8005).
fn slots() -> Vec<(RankKey, Slot)> {
    vec![
        (key(1, 0), slot(8001)),
        (key(2, 0), slot(8002)),
        (key(3, 0), slot(8003)),
        (key(4, 0), slot(8004)),
        (key(4, 1), slot(8005)),
    ]
}

const OPEN: Allowed<'static> = Allowed {
    subset: None,
    adapter: None,
};

#[test]
fn prompt_blocks_hash_complete_blocks_only() {
    let tokens: Vec<u32> = (0..40).collect();
    let blocks = prompt_blocks(&PromptInput::Tokens(tokens.clone()), 16, 7, None, 1000);
    assert_eq!(blocks.tokens, 40);
    assert_eq!(blocks.seq_hashes, hash::prompt_hashes(&tokens, 16, 7));
    assert_eq!(blocks.seq_hashes.len(), 2, "the 8-token tail is not hashed");
    let text = prompt_blocks(&PromptInput::Text(vec![1; 66]), 16, 7, None, 1000);
    assert_eq!(text.tokens, 17, "4-byte pseudo tokens, the tail padded");
    assert_eq!(text.seq_hashes.len(), 1);
    let none = prompt_blocks(&PromptInput::None, 16, 7, None, 1000);
    assert_eq!((none.tokens, none.seq_hashes.len()), (0, 0));
}

/// vLLM computes a prompt's last token whatever it has cached: a block-aligned prompt of N
/// blocks reuses N - 1 (all N are hashed: the engine stores them after the prefill).
#[test]
fn a_match_reads_only_the_blocks_an_engine_can_reuse() {
    for (tokens, hashed, reusable) in [
        (0u32, 0, 0),
        (1, 0, 0),
        (15, 0, 0),
        (16, 1, 0),
        (17, 1, 1),
        (31, 1, 1),
        (32, 2, 1),
        (33, 2, 2),
    ] {
        let input = PromptInput::Tokens((0..tokens).collect());
        let blocks = prompt_blocks(&input, 16, 7, None, 1000);
        assert_eq!(blocks.seq_hashes.len(), hashed, "{tokens} tokens");
        assert_eq!(blocks.reusable, reusable, "{tokens} tokens");
        assert_eq!(blocks.match_hashes(), &blocks.seq_hashes[..reusable]);
    }
    // Capped by the hashed blocks (`--max-prompt-blocks`), and the same for block hashes given
    // with their token count.
    let long = prompt_blocks(&PromptInput::Tokens((0..1600).collect()), 16, 7, None, 10);
    assert_eq!((long.seq_hashes.len(), long.reusable), (10, 10));
    for (prompt_tokens, reusable) in [(64, 3), (65, 4), (79, 4)] {
        let hashes = PromptInput::BlockHashes {
            seq_hashes: (0..4).collect(),
            prompt_tokens,
        };
        let blocks = prompt_blocks(&hashes, 16, 7, None, 100);
        assert_eq!(blocks.reusable, reusable, "{prompt_tokens} tokens");
    }
}

#[test]
fn a_cache_salt_changes_the_first_block_and_so_the_whole_chain() {
    let tokens: Vec<u32> = (0..48).collect();
    let plain = prompt_blocks(&PromptInput::Tokens(tokens.clone()), 16, 7, None, 100);
    let salted = prompt_blocks(&PromptInput::Tokens(tokens.clone()), 16, 7, Some("s"), 100);
    let other = prompt_blocks(&PromptInput::Tokens(tokens.clone()), 16, 7, Some("t"), 100);
    assert_eq!(salted.seq_hashes.len(), 3);
    for i in 0..3 {
        assert_ne!(plain.seq_hashes[i], salted.seq_hashes[i], "block {i}");
        assert_ne!(salted.seq_hashes[i], other.seq_hashes[i], "block {i}");
    }
    // Only the first block's own hash is salted; later blocks differ through the chain.
    let local = hash::local_hashes(&tokens, 16, 7);
    assert_eq!(
        salted.seq_hashes[1],
        hash::chain(salted.seq_hashes[0], local[1])
    );
}

#[test]
fn a_huge_prompt_hashes_only_its_leading_blocks_but_counts_every_token() {
    let tokens: Vec<u32> = (0..16 * 100).collect();
    let capped = prompt_blocks(&PromptInput::Tokens(tokens.clone()), 16, 7, None, 10);
    assert_eq!(capped.tokens, 1600, "the load is the whole prompt");
    assert_eq!(capped.seq_hashes.len(), 10);
    assert_eq!(
        capped.seq_hashes,
        hash::prompt_hashes(&tokens, 16, 7)[..10].to_vec(),
        "the leading blocks hash as they would uncapped"
    );
    let text = prompt_blocks(&PromptInput::Text(vec![3; 4 * 16 * 100]), 16, 7, None, 10);
    assert_eq!((text.tokens, text.seq_hashes.len()), (1600, 10));
    let hashes = PromptInput::BlockHashes {
        seq_hashes: (0..100).collect(),
        prompt_tokens: 1600,
    };
    assert_eq!(prompt_blocks(&hashes, 16, 7, None, 10).seq_hashes.len(), 10);
}

#[test]
fn a_binding_is_valid_only_on_a_schedulable_allowed_rank_with_the_adapter() {
    let mut s = slot(8001);
    assert_eq!(check_binding(Some(&s), &OPEN), Ok(()));
    assert_eq!(check_binding(None, &OPEN), Err(Invalidation::Gone));
    let other = EndpointFilter::parse(["10.0.0.9"]);
    let outside = Allowed {
        subset: Some(&other),
        adapter: None,
    };
    assert_eq!(
        check_binding(Some(&s), &outside),
        Err(Invalidation::OutsideSubset)
    );
    let lora = Allowed {
        subset: None,
        adapter: Some("lora-a"),
    };
    assert_eq!(check_binding(Some(&s), &lora), Err(Invalidation::Adapter));
    s.lora_adapters = Arc::from(vec!["lora-a".to_string()]);
    assert_eq!(check_binding(Some(&s), &lora), Ok(()));
    s.schedulable = false;
    assert_eq!(
        check_binding(Some(&s), &OPEN),
        Err(Invalidation::Unschedulable)
    );
}

#[test]
fn allowed_ranks_are_schedulable_and_inside_the_subset() {
    let mut table = slots();
    table[1].1.schedulable = false;
    assert_eq!(allowed_ranks(&table, &OPEN, "m"), Ok(vec![0, 2, 3, 4]));
    let filter = EndpointFilter::parse(["10.0.0.1:8002", "10.0.0.1:8003"]);
    let subset = Allowed {
        subset: Some(&filter),
        adapter: None,
    };
    assert_eq!(allowed_ranks(&table, &subset, "m"), Ok(vec![2]));
    let none = EndpointFilter::parse(["10.9.9.9:1"]);
    let empty = Allowed {
        subset: Some(&none),
        adapter: None,
    };
    assert_eq!(
        allowed_ranks(&table, &empty, "m"),
        Err(SelectError::Unavailable(
            "subset hint matches no eligible endpoint".into()
        ))
    );
    for s in &mut table {
        s.1.schedulable = false;
    }
    assert_eq!(
        allowed_ranks(&table, &OPEN, "m"),
        Err(SelectError::Unavailable(
            "no ready worker serves model m".into()
        ))
    );
}

#[test]
fn a_pin_narrows_to_its_worker_and_rank_and_must_agree_with_a_hard_binding() {
    let table = slots();
    let all = || vec![0, 1, 2, 3, 4];
    let mut eligible = all();
    let mut bound = None;
    let pin = Pin {
        worker_id: 4,
        dp_rank: None,
    };
    apply_pin(&table, &mut eligible, pin, &mut bound, AffinityMode::Hard).unwrap();
    assert_eq!(eligible, vec![3, 4], "both ranks of worker 4");
    let mut eligible = all();
    let rank1 = Pin {
        worker_id: 4,
        dp_rank: Some(1),
    };
    apply_pin(&table, &mut eligible, rank1, &mut bound, AffinityMode::Hard).unwrap();
    assert_eq!(eligible, vec![4]);
    let bad_rank = Pin {
        worker_id: 4,
        dp_rank: Some(7),
    };
    let err = apply_pin(&table, &mut all(), bad_rank, &mut None, AffinityMode::Hard);
    assert!(matches!(err, Err(SelectError::BadRequest(_))), "{err:?}");
    let gone = Pin {
        worker_id: 99,
        dp_rank: None,
    };
    let err = apply_pin(&table, &mut all(), gone, &mut None, AffinityMode::Hard);
    assert!(matches!(err, Err(SelectError::Unavailable(_))), "{err:?}");
    // Worker 4 is schedulable but outside what the earlier stages allowed.
    let err = apply_pin(&table, &mut vec![0, 1], pin, &mut None, AffinityMode::Hard);
    assert!(matches!(err, Err(SelectError::Unavailable(_))), "{err:?}");
    // A binding to worker 1 contradicts a pin to worker 4: refused when hard, dropped when soft.
    let mut bound = Some(key(1, 0));
    let err = apply_pin(&table, &mut all(), pin, &mut bound, AffinityMode::Hard);
    assert!(matches!(err, Err(SelectError::BadRequest(_))), "{err:?}");
    apply_pin(&table, &mut all(), pin, &mut bound, AffinityMode::Soft).unwrap();
    assert_eq!(bound, None);
    let mut agreeing = Some(key(4, 1));
    apply_pin(&table, &mut all(), pin, &mut agreeing, AffinityMode::Hard).unwrap();
    assert_eq!(agreeing, Some(key(4, 1)), "a binding the pin allows stays");
}

#[test]
fn adapter_requests_go_where_the_adapter_is_loaded() {
    let mut table = slots();
    table[2].1.lora_adapters = Arc::from(vec!["lora-a".to_string()]);
    let mut eligible = vec![0, 1, 2, 3, 4];
    narrow_adapter(&table, &mut eligible, &OPEN).unwrap();
    assert_eq!(eligible.len(), 5, "a base-model request is not narrowed");
    let lora = Allowed {
        subset: None,
        adapter: Some("lora-a"),
    };
    narrow_adapter(&table, &mut eligible, &lora).unwrap();
    assert_eq!(eligible, vec![2]);
    let missing = Allowed {
        subset: None,
        adapter: Some("lora-b"),
    };
    let err = narrow_adapter(&table, &mut vec![0, 1], &missing);
    assert!(matches!(err, Err(SelectError::Unavailable(_))), "{err:?}");
}

#[test]
fn busy_ranks_are_dropped_sheddable_first_and_a_busy_hard_binding_is_refused() {
    let mut table = slots();
    table[0].1.load.active_prefill_tokens = 100;
    table[1].1.load.active_prefill_tokens = 85;
    let busy = BusyThresholds {
        active_decode_blocks: None,
        active_prefill_tokens: Some(100),
        sheddable_fraction: 0.8,
    };
    let mut eligible = vec![0, 1, 2];
    drop_busy(&table, &mut eligible, &busy, 0, None, false).unwrap();
    assert_eq!(eligible, vec![1, 2], "at the threshold is busy");
    let mut eligible = vec![0, 1, 2];
    drop_busy(&table, &mut eligible, &busy, -1, None, false).unwrap();
    assert_eq!(eligible, vec![2], "sheddable requests see 80% of it");
    let err = drop_busy(&table, &mut vec![0, 1], &busy, 0, Some(key(1, 0)), false);
    assert_eq!(
        err,
        Err(SelectError::Overloaded(
            "the session's worker is over its busy threshold".into()
        )),
        "a busy hard-bound rank is neither replaced nor overloaded"
    );
    let err = drop_busy(&table, &mut vec![1, 2], &busy, -1, Some(key(2, 0)), false);
    assert!(
        matches!(&err, Err(SelectError::Overloaded(m)) if m.contains("shed")),
        "a sheddable request to a rank near its threshold is shed: {err:?}"
    );
    let mut eligible = vec![1, 2];
    drop_busy(&table, &mut eligible, &busy, 0, Some(key(2, 0)), false).unwrap();
    assert_eq!(
        eligible,
        vec![1, 2],
        "under its threshold the bound rank serves"
    );
    let err = drop_busy(&table, &mut vec![0], &busy, 0, None, true);
    assert_eq!(
        err,
        Err(SelectError::Overloaded(
            "pinned worker is over its busy threshold".into()
        ))
    );
    let err = drop_busy(&table, &mut vec![0, 1], &busy, -1, None, false);
    assert!(
        matches!(&err, Err(SelectError::Overloaded(m)) if m.contains("sheddable")),
        "{err:?}"
    );
}

#[test]
fn candidates_join_eligible_ranks_with_their_matches() {
    let mut table = slots();
    table[2].1.load.active_requests = 3;
    let depth = |gpu| TierDepths {
        gpu,
        host: gpu,
        disk: gpu,
    };
    // Matches on ranks 1, 3 and 4/1; rank 3 and 4/1 are eligible.
    let matches = vec![
        (key(1, 0), depth(5)),
        (key(3, 0), depth(2)),
        (key(4, 1), depth(9)),
    ];
    let view = EngineView {
        now: std::time::Instant::now(),
        max_age: std::time::Duration::from_secs(1),
        adapter: None,
        shared: Default::default(),
    };
    let estimator = crate::estimate::TtftEstimator::default();
    let got = candidates(&table, &[1, 2, 4], &matches, &estimator, 16, &view);
    let summary: Vec<(RankKey, u32, u64, u64)> = got
        .iter()
        .map(|c| (c.key, c.overlap.gpu, c.active_requests, c.stalled_requests))
        .collect();
    assert_eq!(
        summary,
        vec![
            (key(2, 0), 0, 0, 0),
            (key(3, 0), 2, 3, 3),
            (key(4, 1), 9, 0, 0)
        ]
    );
    // The prior line: 20 ms fixed at 50 µs/token is 25 blocks of 16 tokens; no rank has a
    // scale of its own yet.
    assert!(got.iter().all(|c| c.scale == 1.0));
    assert!((got[0].fixed_blocks - 25.0).abs() < 1e-9);
}

/// Other replicas' bookings (`remote_load`) add to this process's own, for the cost function and
/// for the busy thresholds alike.
#[test]
fn remote_load_adds_to_local_load_for_candidates_and_busy_thresholds() {
    let mut table = slots();
    table[0].1.load.active_requests = 1;
    table[0].1.load.active_decode_blocks = 4;
    table[0].1.remote_load.active_requests = 2;
    table[0].1.remote_load.active_decode_blocks = 6;
    table[1].1.remote_load.active_prefill_tokens = 100;
    let got = candidates(
        &table,
        &[0, 1],
        &[],
        &crate::estimate::TtftEstimator::default(),
        16,
        &EngineView {
            now: std::time::Instant::now(),
            max_age: std::time::Duration::from_secs(1),
            adapter: None,
            shared: Default::default(),
        },
    );
    let summary: Vec<(u64, u64, u64)> = got
        .iter()
        .map(|c| {
            (
                c.active_requests,
                c.active_decode_blocks,
                c.active_prefill_tokens,
            )
        })
        .collect();
    assert_eq!(summary, vec![(3, 10, 0), (0, 0, 100)]);
    let busy = BusyThresholds {
        active_decode_blocks: Some(10),
        active_prefill_tokens: Some(100),
        sheddable_fraction: 1.0,
    };
    let mut eligible = vec![0, 1, 2];
    drop_busy(&table, &mut eligible, &busy, 0, None, false).unwrap();
    assert_eq!(
        eligible,
        vec![2],
        "busy through the other replicas' bookings"
    );
}

fn decision(costs: Vec<f64>) -> Decision {
    let mut ranking: Vec<usize> = (0..costs.len()).collect();
    ranking.sort_by(|a, b| costs[*a].total_cmp(&costs[*b]));
    Decision { ranking, costs }
}

fn cands(keys: &[RankKey]) -> Vec<Candidate> {
    keys.iter()
        .map(|&key| Candidate::new(key, RankLoad::default(), TierDepths::default()))
        .collect()
}

#[test]
fn candidates_carry_only_fresh_engine_readings_and_the_adapter_fit() {
    use crate::engine::{AdapterFit, EngineMetrics};
    use std::time::{Duration, Instant};
    let now = Instant::now();
    let max_age = Duration::from_millis(500);
    let reading = |waiting: u64, at: Instant, adapters: &[&str]| EngineMetrics {
        waiting,
        running: 1,
        kv_usage: 0.25,
        adapters: adapters.iter().map(|a| a.to_string()).collect(),
        max_adapters: Some(1),
        at,
    };
    let mut table = slots();
    table[0].1.engine = Some(reading(7, now, &["sql"]));
    table[1].1.engine = Some(reading(9, now - Duration::from_secs(2), &["sql"]));
    table[2].1.engine = Some(reading(0, now, &["chat"]));
    let view = EngineView {
        now,
        max_age,
        adapter: Some("sql"),
        shared: Default::default(),
    };
    let estimator = crate::estimate::TtftEstimator::default();
    let got = candidates(&table, &[0, 1, 2, 3], &[], &estimator, 16, &view);
    let summary: Vec<(Option<u64>, AdapterFit)> = got
        .iter()
        .map(|c| (c.engine.map(|e| e.waiting), c.adapter))
        .collect();
    assert_eq!(
        summary,
        vec![
            (Some(7), AdapterFit::Loaded),
            // Stale: neither its queue nor its adapters count.
            (None, AdapterFit::Unknown),
            // At max_lora = 1 with another adapter.
            (Some(0), AdapterFit::Full),
            // Never scraped.
            (None, AdapterFit::Unknown),
        ]
    );
}

#[test]
fn affinity_keeps_the_bound_rank_hard_always_soft_within_the_margin() {
    let c = cands(&[key(1, 0), key(2, 0), key(3, 0)]);
    let hard = SessionConfig::default();
    let soft = SessionConfig {
        mode: AffinityMode::Soft,
        soft_margin_blocks: 10.0,
        ..SessionConfig::default()
    };
    let mut d = decision(vec![5.0, 100.0, 1.0]);
    assert_eq!(apply_affinity(&mut d, &c, None, &hard), Affinity::Unbound);
    assert_eq!(d.ranking, vec![2, 0, 1], "no binding: the ranking stands");
    assert_eq!(
        apply_affinity(&mut d, &c, Some(key(2, 0)), &hard),
        Affinity::Kept
    );
    assert_eq!(
        d.ranking[0], 1,
        "hard: the bound rank first, whatever it costs"
    );
    let mut d = decision(vec![5.0, 100.0, 1.0]);
    assert_eq!(
        apply_affinity(&mut d, &c, Some(key(1, 0)), &soft),
        Affinity::Kept,
        "soft: 5 is within 10 of the best 1"
    );
    assert_eq!(d.ranking[0], 0);
    let mut d = decision(vec![5.0, 100.0, 1.0]);
    assert_eq!(
        apply_affinity(&mut d, &c, Some(key(2, 0)), &soft),
        Affinity::Overridden
    );
    assert_eq!(d.ranking[0], 2, "overridden: the cheapest stays first");
    let mut d = decision(vec![5.0, 100.0, 1.0]);
    assert_eq!(
        apply_affinity(&mut d, &c, Some(key(9, 0)), &hard),
        Affinity::Overridden,
        "a bound rank that is not a candidate cannot be kept"
    );
}

#[test]
fn fallbacks_are_distinct_endpoints_in_ranking_order() {
    let mut table = slots();
    // Worker 4's two ranks are multiplexed behind one port.
    table[4].1.endpoint = table[3].1.endpoint;
    let eligible = vec![0, 1, 2, 3, 4];
    let (primary, fallbacks) = picked_ranks(&table, &eligible, &[3, 4, 1, 0, 2], 2).unwrap();
    assert_eq!(primary.key, key(4, 0));
    let keys: Vec<RankKey> = fallbacks.iter().map(|f| f.key).collect();
    assert_eq!(
        keys,
        vec![key(2, 0), key(1, 0)],
        "4/1 shares the primary's endpoint"
    );
    let (_, none) = picked_ranks(&table, &eligible, &[0, 1], 0).unwrap();
    assert!(none.is_empty());
    assert!(picked_ranks(&table, &eligible, &[], 1).is_none());
}
