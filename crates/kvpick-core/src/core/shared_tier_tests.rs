//! The shared KV tier through the core (`--shared-cache-multiplier`): `EXTERNAL` stores are
//! indexed per model, not per rank, and count for every rank beyond its own overlap at the
//! multiplier's weight; an `EXTERNAL` removal takes them back; without a multiplier they stay
//! the storing rank's disk tier.

use std::time::Instant;

use super::fixtures::{evented_worker as spec, rank_of, BS};
use super::*;
use crate::event::{KvEvent, Medium};

/// Eight blocks of `tag`'s own, one token more so all eight are reusable.
fn prompt(tag: u32) -> Vec<u32> {
    fixtures::whole_blocks(tag * 10_000, 8)
}

fn request(id: &str, tokens: Vec<u32>) -> SelectionRequest {
    fixtures::token_request(id, tokens)
}

/// A store of `tokens`' blocks `from..to` in `medium`, engine hashes `base + i`.
fn store(tokens: &[u32], from: usize, to: usize, medium: Medium, base: u64) -> KvEvent {
    let bs = BS as usize;
    KvEvent::BlockStored {
        block_hashes: (from as u64..to as u64).map(|i| base + i).collect(),
        parent_block_hash: (from > 0).then(|| base + from as u64 - 1),
        token_ids: tokens[from * bs..to * bs].to_vec(),
        block_size: BS,
        lora_id: None,
        medium,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
        media: Vec::new(),
    }
}

fn external() -> Medium {
    Medium::parse("EXTERNAL")
}

/// Two precise workers `a` and `b`.
fn two_workers(multiplier: f64) -> (Core, RankKey, RankKey, Instant) {
    let mut config = CoreConfig {
        kv_events: true,
        allow_pins: true,
        seed: Some(1),
        ..CoreConfig::default()
    };
    config.shared_cache.multiplier = multiplier;
    let core = Core::new(config);
    let (a, b) = (spec("a", 1), spec("b", 2));
    let t0 = Instant::now();
    core.apply_source_snapshot("catalog", vec![a.clone(), b.clone()], t0)
        .unwrap();
    for r in [rank_of(&a), rank_of(&b)] {
        core.apply_kv_events(r, &[KvEvent::AllBlocksCleared], None, t0);
    }
    (core, rank_of(&a), rank_of(&b), t0)
}

fn shared_pick(facts: &Facts) -> Option<bool> {
    facts.iter().find_map(|f| match f {
        Fact::SharedTierPick { changed } => Some(*changed),
        _ => None,
    })
}

fn shared_size(facts: &Facts) -> Option<usize> {
    facts.iter().find_map(|f| match f {
        Fact::SharedTierSize { blocks, .. } => Some(*blocks),
        _ => None,
    })
}

/// `a` holds the prompt on its GPU but has a prefill queued; `b` is idle. Without a shared tier
/// the holder wins; with one `b` loads the prefix from the store and starts at once.
fn busy_holder_idle_peer(multiplier: f64) -> (Core, RankKey, RankKey, Instant) {
    let (core, a, b, t0) = two_workers(multiplier);
    core.apply_kv_events(a, &[store(&prompt(1), 0, 8, Medium::Gpu, 100)], None, t0);
    let (_, facts) = core.apply_kv_events(a, &[store(&prompt(1), 0, 8, external(), 100)], None, t0);
    if multiplier > 0.0 {
        assert_eq!(
            shared_size(&facts),
            Some(8),
            "eight blocks in the shared tier"
        );
    } else {
        assert_eq!(
            shared_size(&facts),
            None,
            "no shared tier without a multiplier"
        );
    }
    // Three blocks of another prompt queued on `a` (booked, no first byte yet).
    let mut other = request("queued", (900_000..900_000 + 3 * BS).collect());
    other.pin = Some(crate::request::Pin {
        worker_id: a.worker_id,
        dp_rank: Some(0),
    });
    let (s, _) = core.select_and_reserve(&other, t0).unwrap();
    assert_eq!(s.primary.key, a);
    (core, a, b, t0)
}

#[test]
fn without_a_multiplier_the_busy_holder_keeps_the_prefix() {
    let (core, a, _, t0) = busy_holder_idle_peer(0.0);
    let (s, facts) = core
        .select_and_reserve(&request("r", prompt(1)), t0)
        .unwrap();
    assert_eq!(s.primary.key, a);
    assert_eq!(s.shared_blocks, 0);
    assert_eq!(shared_pick(&facts), None);
}

#[test]
fn the_shared_tier_moves_the_pick_to_an_idle_rank_that_loads_the_prefix() {
    let (core, _, b, t0) = busy_holder_idle_peer(0.9);
    let (s, facts) = core
        .select_and_reserve(&request("r", prompt(1)), t0)
        .unwrap();
    assert_eq!(
        s.primary.key, b,
        "b loads 8 blocks at 0.9 instead of waiting on a"
    );
    assert_eq!(s.shared_blocks, 8);
    assert_eq!(s.overlap_blocks, 0, "nothing of it on b's own GPU");
    assert_eq!(shared_pick(&facts), Some(true), "the pick changed");
}

#[test]
fn a_query_only_selection_reports_no_shared_pick_fact() {
    let (core, _, b, t0) = busy_holder_idle_peer(0.9);
    let (s, facts) = core.select(&request("q", prompt(1)), t0).unwrap();
    assert_eq!((s.primary.key, s.shared_blocks), (b, 8));
    assert_eq!(shared_pick(&facts), None, "only booked picks are counted");
}

#[test]
fn an_external_removal_takes_the_blocks_back() {
    let (core, a, _, t0) = busy_holder_idle_peer(0.9);
    let removed = KvEvent::BlockRemoved {
        block_hashes: (100..108).collect(),
        medium: external(),
        group_idx: None,
    };
    let (stats, facts) = core.apply_kv_events(a, &[removed], None, t0);
    assert_eq!((stats.applied, shared_size(&facts)), (1, Some(0)));
    let (s, _) = core
        .select_and_reserve(&request("r", prompt(1)), t0)
        .unwrap();
    assert_eq!(
        (s.primary.key, s.shared_blocks),
        (a, 0),
        "back to the holder"
    );
}

#[test]
fn shared_blocks_count_from_the_ranks_own_depth_on() {
    let (core, a, b, t0) = two_workers(0.5);
    // `a` holds blocks 0..3 on its GPU; the store holds 3..8 (stored after them by `a`, the
    // parent named by `a`'s engine), so it continues `a`'s prefix and no one else's.
    core.apply_kv_events(a, &[store(&prompt(2), 0, 3, Medium::Gpu, 200)], None, t0);
    core.apply_kv_events(a, &[store(&prompt(2), 3, 8, external(), 200)], None, t0);
    let (s, _) = core.select(&request("q", prompt(2)), t0).unwrap();
    assert_eq!(
        (s.primary.key, s.overlap_blocks, s.shared_blocks),
        (a, 3, 5)
    );
    // `b` cannot start from block 3: its own prefix ends at 0, where the store holds nothing.
    let mut only_b = request("q", prompt(2));
    only_b.pin = Some(crate::request::Pin {
        worker_id: b.worker_id,
        dp_rank: Some(0),
    });
    let (s, _) = core.select(&only_b, t0).unwrap();
    assert_eq!((s.primary.key, s.shared_blocks), (b, 0));
}

#[test]
fn without_a_shared_tier_an_external_store_is_the_ranks_disk_tier() {
    let (core, a, _, t0) = two_workers(0.0);
    core.apply_kv_events(a, &[store(&prompt(3), 0, 8, external(), 300)], None, t0);
    let (_, ranks) = core.overlap_scores(&request("q", prompt(3)), t0).unwrap();
    let depths = ranks.iter().find(|(k, _)| k.key == a).map(|(_, d)| *d);
    assert_eq!(depths.map(|d| (d.gpu, d.disk)), Some((0, 8)));
}

#[test]
fn models_not_attached_have_no_shared_tier() {
    let mut config = CoreConfig {
        kv_events: true,
        ..CoreConfig::default()
    };
    config.shared_cache.multiplier = 0.5;
    config.shared_cache.models = vec!["other".into()];
    let core = Core::new(config);
    let a = spec("a", 1);
    let t0 = Instant::now();
    core.apply_source_snapshot("catalog", vec![a.clone()], t0)
        .unwrap();
    let (_, facts) = core.apply_kv_events(
        rank_of(&a),
        &[store(&prompt(4), 0, 8, external(), 1)],
        None,
        t0,
    );
    assert_eq!(shared_size(&facts), None);
}
