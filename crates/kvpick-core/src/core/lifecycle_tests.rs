use super::*;
use crate::catalog::RankLayout;
use crate::event::{KvEvent, Medium};
use crate::request::PromptInput;
use crate::types::Lifecycle;

const BS: usize = 16;

fn worker(name: &str, port: u16) -> WorkerSpec {
    WorkerSpec {
        block_size: Some(BS as u32),
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

fn tokens() -> Vec<u32> {
    (0..(4 * BS) as u32).collect()
}

/// The engine announces the prompt's four blocks.
fn announce(core: &Core, spec: &WorkerSpec) {
    let event = KvEvent::BlockStored {
        block_hashes: vec![11, 12, 13, 14],
        parent_block_hash: None,
        token_ids: tokens(),
        block_size: BS as u32,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
        media: Vec::new(),
    };
    let (stats, _) = core.apply_kv_events(rank(spec), &[event], None, Instant::now());
    assert_eq!(stats.applied, 1);
}

/// `tokens` and one more: an engine computes a prompt's last token, so only a prompt longer
/// than its complete blocks can reuse all of them.
fn and_one(mut tokens: Vec<u32>) -> Vec<u32> {
    tokens.push(u32::MAX);
    tokens
}

fn overlap_on(core: &Core, name: &str) -> u32 {
    let request = SelectionRequest {
        model: Some("m".into()),
        prompt: PromptInput::Tokens(and_one(tokens())),
        ..Default::default()
    };
    let (_, ranks) = core.overlap_scores(&request, Instant::now()).unwrap();
    ranks
        .iter()
        .find(|(r, _)| r.worker_name == name)
        .map_or(0, |(_, d)| d.gpu)
}

fn apply(core: &Core, specs: Vec<WorkerSpec>) -> ApplyReport {
    core.apply_source_snapshot("catalog", specs, Instant::now())
        .unwrap()
        .0
}

#[test]
fn a_worker_that_leaves_and_returns_with_a_fresh_engine_has_no_phantom_cache() {
    let core = Core::new(CoreConfig::default());
    let (a, b) = (worker("a", 1), worker("b", 2));
    apply(&core, vec![a.clone(), b.clone()]);
    announce(&core, &a);
    assert_eq!(overlap_on(&core, "a"), 4);
    apply(&core, vec![b.clone()]);
    apply(&core, vec![a.clone(), b]);
    assert_eq!(
        overlap_on(&core, "a"),
        0,
        "the old engine's blocks left with it"
    );
}

#[test]
fn a_new_incarnation_forgets_the_cache_and_a_metadata_change_does_not() {
    let core = Core::new(CoreConfig::default());
    let a = worker("a", 1);
    apply(&core, vec![a.clone()]);
    announce(&core, &a);
    let relabelled = WorkerSpec {
        lora_adapters: vec!["x".into()],
        ..a.clone()
    };
    apply(&core, vec![relabelled.clone()]);
    assert_eq!(overlap_on(&core, "a"), 4, "same engine, new metadata");
    let restarted = WorkerSpec {
        incarnation: 7,
        ..relabelled
    };
    apply(&core, vec![restarted]);
    assert_eq!(overlap_on(&core, "a"), 0, "the engine restarted");
}

#[test]
fn a_restarted_data_parallel_worker_forgets_every_rank_and_only_its_own() {
    let core = Core::new(CoreConfig::default());
    let dp = WorkerSpec {
        ranks: RankLayout::Multiplexed { port: 1, size: 4 },
        ..worker("dp", 1)
    };
    let b = worker("b", 2);
    apply(&core, vec![dp.clone(), b.clone()]);
    for dp_rank in 0..4 {
        let event = KvEvent::BlockStored {
            block_hashes: vec![11, 12, 13, 14],
            parent_block_hash: None,
            token_ids: tokens(),
            block_size: BS as u32,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            cache_salt: None,
            group_idx: None,
            media: Vec::new(),
        };
        let key = RankKey {
            dp_rank,
            ..rank(&dp)
        };
        assert_eq!(
            core.apply_kv_events(key, &[event], None, Instant::now())
                .0
                .applied,
            1
        );
    }
    announce(&core, &b);
    let cached = |core: &Core| -> Vec<(String, u32)> {
        let request = SelectionRequest {
            model: Some("m".into()),
            prompt: PromptInput::Tokens(tokens()),
            ..Default::default()
        };
        let (_, ranks) = core.overlap_scores(&request, Instant::now()).unwrap();
        let mut out: Vec<(String, u32)> = ranks
            .iter()
            .filter(|(_, d)| d.gpu > 0)
            .map(|(r, _)| (r.worker_name.clone(), r.key.dp_rank))
            .collect();
        out.sort();
        out
    };
    let mut all: Vec<(String, u32)> = (0..4)
        .map(|r| ("dp".to_string(), r))
        .chain([("b".to_string(), 0)])
        .collect();
    all.sort();
    assert_eq!(cached(&core), all);
    let restarted = WorkerSpec {
        incarnation: 3,
        ..dp.clone()
    };
    apply(&core, vec![restarted.clone(), b.clone()]);
    assert_eq!(
        cached(&core),
        [("b".to_string(), 0)],
        "all four ranks restarted"
    );
    apply(&core, vec![b]);
    assert_eq!(
        cached(&core),
        [("b".to_string(), 0)],
        "deleting dp keeps b's blocks"
    );
}

#[test]
fn a_draining_worker_keeps_its_load_until_it_is_ready_again_or_deleted() {
    let core = Core::new(CoreConfig::default());
    let (a, b) = (worker("a", 1), worker("b", 2));
    apply(&core, vec![a.clone(), b.clone()]);
    let request = |id: &str| SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        subset: Some(crate::request::EndpointFilter::parse(["127.0.0.1:1"])),
        ..Default::default()
    };
    let now = Instant::now();
    let (booked, _) = core.select_and_reserve(&request("r"), now).unwrap();
    assert_eq!(booked.primary.worker_name, "a");
    let load_of_a = |core: &Core| {
        core.list_workers(None)
            .into_iter()
            .find(|w| w.record.spec.name == "a")
            .map(|w| (w.record.lifecycle, w.loads[0].active_requests))
    };
    let draining = WorkerSpec {
        draining: true,
        ..a.clone()
    };
    let report = apply(&core, vec![draining, b.clone()]);
    assert!(report.ready, "b is still schedulable");
    assert_eq!(load_of_a(&core), Some((Lifecycle::Draining, 1)));
    assert_eq!(core.live_bookings(), 1);
    let err = core.select(&request("x"), now).unwrap_err();
    assert_eq!(err.label(), "unavailable", "a draining rank is not picked");
    apply(&core, vec![a.clone(), b.clone()]);
    assert_eq!(
        load_of_a(&core),
        Some((Lifecycle::Schedulable, 1)),
        "back from a readiness flap with its in-flight load"
    );
    apply(&core, vec![b]);
    assert_eq!(load_of_a(&core), None);
    assert_eq!(core.live_bookings(), 0, "deleted: its bookings go");
}

fn overlap_at(core: &Core, name: &str, tokens: Vec<u32>, now: Instant) -> u32 {
    let request = SelectionRequest {
        model: Some("m".into()),
        prompt: PromptInput::Tokens(and_one(tokens)),
        ..Default::default()
    };
    let (_, ranks) = core.overlap_scores(&request, now).unwrap();
    ranks
        .iter()
        .find(|(r, _)| r.worker_name == name)
        .map_or(0, |(_, d)| d.gpu)
}

/// A worker that declares a KV-event endpoint but whose engine publishes nothing is routed in
/// approximate mode (picks remembered for `approx_ttl`), not with predictions that end with
/// their request.
#[test]
fn a_rank_is_precise_only_once_its_events_arrive() {
    let config = CoreConfig {
        kv_events: true,
        ..CoreConfig::default()
    };
    let core = Core::new(config);
    let a = worker("a", 1);
    apply(&core, vec![a.clone()]);
    let t0 = Instant::now();
    let pick = |id: &str, tokens: Vec<u32>| {
        let request = SelectionRequest {
            request_id: id.into(),
            model: Some("m".into()),
            prompt: PromptInput::Tokens(tokens),
            ..Default::default()
        };
        let (s, facts) = core.select_and_reserve(&request, t0).unwrap();
        core.free(&s.booking_id, Claim::Any, t0);
        facts
    };
    let silent: Vec<u32> = (1_000..1_000 + 4 * BS as u32).collect();
    pick("r1", silent.clone());
    let later = t0 + std::time::Duration::from_secs(10);
    assert_eq!(
        overlap_at(&core, "a", silent.clone(), later),
        4,
        "no events yet: the pick is remembered past the 2 s prediction"
    );
    announce(&core, &a);
    let (_, facts) = core.apply_kv_events(rank(&a), &[], None, t0);
    assert!(facts.iter().all(|f| !matches!(f, Fact::RankPrecise { .. })));
    let fresh: Vec<u32> = (5_000..5_000 + 4 * BS as u32).collect();
    pick("r2", fresh.clone());
    assert_eq!(
        overlap_at(&core, "a", fresh, later),
        0,
        "precise: an unconfirmed prediction ends with its request"
    );
}

#[test]
fn the_block_size_is_learned_from_events_and_mismatches_are_counted() {
    let core = Core::new(CoreConfig::default());
    let a = WorkerSpec {
        block_size: None,
        ..worker("a", 1)
    };
    apply(&core, vec![a.clone()]);
    let key = PartitionKey {
        model: "m".into(),
        routing_group: String::new(),
    };
    assert_eq!(core.block_size(&key), DEFAULT_BLOCK_SIZE);
    let tokens: Vec<u32> = (0..128).collect();
    let store = |hashes: Vec<u64>, tokens: Vec<u32>, size: u32| KvEvent::BlockStored {
        block_hashes: hashes,
        parent_block_hash: None,
        token_ids: tokens,
        block_size: size,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
        media: Vec::new(),
    };
    let now = Instant::now();
    let (stats, _) = core.apply_kv_events(
        rank(&a),
        &[store(vec![1, 2], tokens.clone(), 64)],
        None,
        now,
    );
    assert_eq!((stats.applied, stats.block_size_mismatches), (1, 0));
    assert_eq!(core.block_size(&key), 64, "learned from the engine");
    assert_eq!(overlap_at(&core, "a", tokens.clone(), now), 2);
    let (stats, facts) = core.apply_kv_events(
        rank(&a),
        &[store(vec![3], (0..16).collect(), 16)],
        None,
        now,
    );
    assert_eq!((stats.dropped, stats.block_size_mismatches), (1, 1));
    assert!(facts.iter().any(|f| matches!(
        f,
        Fact::KvEvents {
            block_size_mismatches: 1,
            ..
        }
    )));
}

/// vLLM mixes `cache_salt` into the first block: salted requests match only blocks stored
/// under the same salt, and unsalted requests never match salted blocks.
#[test]
fn salted_blocks_match_only_requests_with_the_same_salt() {
    let core = Core::new(CoreConfig::default());
    let (a, b) = (worker("a", 1), worker("b", 2));
    apply(&core, vec![a.clone(), b.clone()]);
    let store = |salt: Option<&str>| KvEvent::BlockStored {
        block_hashes: vec![1, 2, 3, 4],
        parent_block_hash: None,
        token_ids: tokens(),
        block_size: BS as u32,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: salt.map(str::to_owned),
        group_idx: None,
        media: Vec::new(),
    };
    let now = Instant::now();
    core.apply_kv_events(rank(&a), &[store(Some("tenant-1"))], None, now);
    core.apply_kv_events(rank(&b), &[store(None)], None, now);
    let overlaps = |salt: Option<&str>| {
        let request = SelectionRequest {
            model: Some("m".into()),
            prompt: PromptInput::Tokens(and_one(tokens())),
            cache_salt: salt.map(str::to_owned),
            ..Default::default()
        };
        let (_, ranks) = core.overlap_scores(&request, now).unwrap();
        let mut out: Vec<(String, u32)> = ranks
            .into_iter()
            .map(|(r, d)| (r.worker_name, d.gpu))
            .collect();
        out.sort();
        out
    };
    assert_eq!(
        overlaps(Some("tenant-1")),
        [("a".into(), 4), ("b".into(), 0)]
    );
    assert_eq!(overlaps(None), [("a".into(), 0), ("b".into(), 4)]);
    assert_eq!(
        overlaps(Some("tenant-2")),
        [("a".into(), 0), ("b".into(), 0)]
    );
}

/// vLLM computes a prompt's last token whatever it has cached: a block-aligned prompt whose
/// every block is cached is credited one block less (what the engine reports as cached), while
/// a pick still predicts every block (the engine stores them all), so a longer prompt sharing
/// them finds all of them.
#[test]
fn a_block_aligned_prompt_is_credited_what_the_engine_reuses_and_predicts_every_block() {
    let core = Core::new(CoreConfig::default());
    let a = worker("a", 1);
    apply(&core, vec![a.clone()]);
    announce(&core, &a);
    let now = Instant::now();
    let aligned = |tokens: Vec<u32>| SelectionRequest {
        model: Some("m".into()),
        prompt: PromptInput::Tokens(tokens),
        ..Default::default()
    };
    let (blocks, ranks) = core.overlap_scores(&aligned(tokens()), now).unwrap();
    assert_eq!((blocks, ranks[0].1.gpu), (4, 3));
    let (s, _) = core.select(&aligned(tokens()), now).unwrap();
    assert_eq!((s.prompt_blocks, s.overlap_blocks), (4, 3));
    assert_eq!(overlap_on(&core, "a"), 4, "one token more: every block");
    let fresh: Vec<u32> = (7_000..7_000 + 4 * BS as u32).collect();
    let (s, _) = core
        .select_and_reserve(
            &SelectionRequest {
                request_id: "fresh".into(),
                ..aligned(fresh.clone())
            },
            now,
        )
        .unwrap();
    assert_eq!(s.overlap_blocks, 0);
    assert_eq!(overlap_at(&core, "a", fresh, now), 4, "all four predicted");
}
