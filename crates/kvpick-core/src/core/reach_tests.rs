//! The engine's standing through the core: a rank reported unreachable takes no picks however
//! well its cache matches, keeps its index entries, and comes back when reported reachable; a
//! rank whose KV events carry another block size is reported once per size, and again when it
//! matches; listings show both and the partition's block size once known.

use super::*;
use crate::catalog::RankLayout;
use crate::event::{KvEvent, Medium};
use crate::request::PromptInput;

const BS: u32 = 16;

fn worker(name: &str, port: u16, block_size: Option<u32>) -> WorkerSpec {
    WorkerSpec {
        block_size,
        kv_events: Some(format!("tcp://127.0.0.1:{}", 5557 + port)),
        ..WorkerSpec::for_test(name, "m", RankLayout::PerPort(vec![port]))
    }
}

fn rank(spec: &WorkerSpec) -> RankKey {
    RankKey {
        worker_id: spec.worker_id(),
        dp_rank: 0,
    }
}

fn core_with(specs: Vec<WorkerSpec>) -> Core {
    let core = Core::new(CoreConfig {
        seed: Some(5),
        ..CoreConfig::default()
    });
    core.apply_source_snapshot("catalog", specs, Instant::now())
        .unwrap();
    core
}

fn tokens(size: u32) -> Vec<u32> {
    (0..4 * size).collect()
}

fn store(size: u32) -> KvEvent {
    KvEvent::BlockStored {
        block_hashes: vec![11, 12, 13, 14],
        parent_block_hash: None,
        token_ids: tokens(size),
        block_size: size,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
        media: Vec::new(),
    }
}

fn pick(core: &Core, id: &str) -> Result<String, SelectError> {
    let request = SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::Tokens(tokens(BS)),
        ..Default::default()
    };
    core.select(&request, Instant::now())
        .map(|(s, _)| s.primary.worker_name.to_string())
}

fn reachability(facts: &Facts) -> Vec<(String, bool)> {
    facts
        .iter()
        .filter_map(|f| match f {
            Fact::RankReachable {
                worker, reachable, ..
            } => Some((worker.to_string(), *reachable)),
            _ => None,
        })
        .collect()
}

#[test]
fn an_unreachable_rank_takes_no_pick_keeps_its_cache_and_comes_back() {
    let (a, b) = (worker("a", 1, Some(BS)), worker("b", 2, Some(BS)));
    let core = core_with(vec![a.clone(), b.clone()]);
    core.apply_kv_events(rank(&a), &[store(BS)], None, Instant::now());
    assert_eq!(pick(&core, "1").unwrap(), "a", "the cache pulls the pick");

    let facts = core.set_rank_reachable(rank(&a), false, Instant::now());
    assert_eq!(reachability(&facts), [("a".to_string(), false)]);
    for i in 0..20 {
        assert_eq!(pick(&core, &format!("r{i}")).unwrap(), "b");
    }
    let again = core.set_rank_reachable(rank(&a), false, Instant::now());
    assert!(reachability(&again).is_empty(), "a fact per change only");
    let view = core.list_workers(None);
    assert!(!view[0].status[0].reachable && view[1].status[0].reachable);

    // A catalog re-apply (a file reload, a pod update) does not make it reachable.
    core.apply_source_snapshot("catalog", vec![a.clone(), b.clone()], Instant::now())
        .unwrap();
    assert_eq!(pick(&core, "2").unwrap(), "b");

    let facts = core.set_rank_reachable(rank(&a), true, Instant::now());
    assert_eq!(reachability(&facts), [("a".to_string(), true)]);
    assert_eq!(
        pick(&core, "3").unwrap(),
        "a",
        "its index entries were kept"
    );
}

#[test]
fn a_partition_whose_every_rank_is_unreachable_is_unavailable() {
    let a = worker("a", 1, Some(BS));
    let core = core_with(vec![a.clone()]);
    core.set_rank_reachable(rank(&a), false, Instant::now());
    assert!(matches!(pick(&core, "1"), Err(SelectError::Unavailable(_))));
    core.set_rank_reachable(rank(&a), true, Instant::now());
    assert_eq!(pick(&core, "2").unwrap(), "a");
    let unknown = RankKey {
        worker_id: 999,
        dp_rank: 0,
    };
    assert!(core
        .set_rank_reachable(unknown, false, Instant::now())
        .0
        .is_empty());
}

fn size_facts(facts: &Facts) -> Vec<(u32, Option<u32>)> {
    facts
        .iter()
        .filter_map(|f| match f {
            Fact::BlockSizeMismatch {
                partition, engine, ..
            } => Some((*partition, *engine)),
            _ => None,
        })
        .collect()
}

#[test]
fn a_block_size_mismatch_is_reported_once_per_size_and_when_it_ends() {
    let a = worker("a", 1, Some(BS));
    let core = core_with(vec![a.clone()]);
    let now = Instant::now();
    let (stats, facts) = core.apply_kv_events(rank(&a), &[store(32)], None, now);
    assert_eq!(stats.block_size_mismatches, 1);
    assert_eq!(size_facts(&facts), [(16, Some(32))]);
    let listed = |core: &Core| core.list_workers(None)[0].clone();
    assert_eq!(listed(&core).status[0].mismatched_block_size, Some(32));
    assert_eq!(listed(&core).block_size, Some(16));
    // The same size again: counted, not reported again (also once the rank is precise).
    core.apply_kv_events(rank(&a), &[KvEvent::AllBlocksCleared], None, now);
    for _ in 0..3 {
        let (stats, facts) = core.apply_kv_events(rank(&a), &[store(32)], None, now);
        assert_eq!(stats.block_size_mismatches, 1);
        assert!(size_facts(&facts).is_empty());
    }
    let (_, facts) = core.apply_kv_events(rank(&a), &[store(64)], None, now);
    assert_eq!(size_facts(&facts), [(16, Some(64))], "another size");
    // The catalog is fixed: the stores match, the mismatch ends once.
    let fixed = worker("a", 1, Some(64));
    core.apply_source_snapshot("catalog", vec![fixed], now)
        .unwrap();
    let (stats, facts) = core.apply_kv_events(rank(&a), &[store(64)], None, now);
    assert_eq!((stats.applied, stats.block_size_mismatches), (1, 0));
    assert_eq!(size_facts(&facts), [(64, None)]);
    let (_, facts) = core.apply_kv_events(rank(&a), &[store(64)], None, now);
    assert!(size_facts(&facts).is_empty());
    assert_eq!(listed(&core).status[0], crate::RankStatus::default());
}

#[test]
fn a_listing_shows_the_block_size_learned_from_events() {
    let a = worker("a", 1, None);
    let core = core_with(vec![a.clone()]);
    assert_eq!(core.list_workers(None)[0].block_size, None, "not known yet");
    let (_, facts) = core.apply_kv_events(rank(&a), &[store(32)], None, Instant::now());
    assert!(size_facts(&facts).is_empty(), "learned, not a mismatch");
    assert_eq!(core.list_workers(None)[0].block_size, Some(32));
}
