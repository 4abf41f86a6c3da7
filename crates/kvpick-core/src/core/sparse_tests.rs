//! The bounded search ([`crate::partition`]'s `sparse`) against the full path: over random
//! partitions (sizes, loads booked and freed, remote loads, calibrated speeds, engine readings,
//! ejected ranks, busy thresholds, shared and deeper cached prefixes) and random requests
//! (sessions hard and soft, fallbacks, subsets, sheddable and API requests), both paths give
//! the same ranking with the same costs, the same affinity outcome, or the same refusal.

use std::collections::HashMap;
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::catalog::RankLayout;
use crate::engine::EngineMetrics;
use crate::facts::ResponseClass;
use crate::index::Tier;
use crate::request::{EndpointFilter, PromptInput};
use crate::session::AffinityMode;

const BLOCK: u64 = 16;

fn random_config(rng: &mut StdRng) -> CoreConfig {
    let mut config = CoreConfig {
        seed: Some(rng.random()),
        ..CoreConfig::default()
    };
    config.sessions.mode = if rng.random_bool(0.5) {
        AffinityMode::Hard
    } else {
        AffinityMode::Soft
    };
    config.sessions.soft_margin_blocks = rng.random_range(0.0..50.0);
    if rng.random_bool(0.3) {
        config.busy.active_prefill_tokens = Some(rng.random_range(200..3000));
    }
    if rng.random_bool(0.3) {
        config.busy.active_decode_blocks = Some(rng.random_range(20..300));
    }
    config.max_api_bookings_per_rank = rng.random_range(1..4);
    // Calibrate after a few first tokens, so ranks' speed factors differ.
    config.estimator.min_observations = [1.0, 3.0, 16.0][rng.random_range(0..3)];
    config.outlier.consecutive_failures = 2;
    config.flow.enabled = false;
    // Some ranks saturate, so flow control's gate has picks to move or hold.
    config.flow.saturation.max_wait_seconds = Some(rng.random_range(0.005..0.2));
    if rng.random_bool(0.5) {
        config.flow.saturation.max_active_requests = Some(rng.random_range(1..8));
    }
    let cost = &mut config.cost;
    cost.ttft_slack = [1.0, 1.5, 3.0, f64::INFINITY][rng.random_range(0..4)];
    cost.stall_weight = [0.0, 0.5, 1.0, 2.0][rng.random_range(0..4)];
    cost.decode_block_weight = [0.0, 0.0, 0.01, 1.0][rng.random_range(0..4)];
    cost.decode_active_request_weight = [0.0, 0.0, 0.5][rng.random_range(0..3)];
    cost.prefill_load_scale = [0.5, 1.0][rng.random_range(0..2)];
    // Half the worlds have a shared KV store (the shared tier).
    if rng.random_bool(0.5) {
        config.shared_cache.multiplier = [0.25, 0.5, 0.9][rng.random_range(0..3)];
    }
    config
}

fn hashes(tag: u64, n: usize) -> Vec<u64> {
    (0..n as u64).map(|i| (tag << 32) ^ (i + 1)).collect()
}

/// A request whose prompt is `cached` (hashes some ranks hold) then `tail` blocks of its own,
/// plus a partial block of `extra` tokens.
fn request(id: &str, cached: &[u64], tail: usize, extra: u64) -> SelectionRequest {
    let tag = id
        .bytes()
        .fold(11u64, |h, b| h.wrapping_mul(131).wrapping_add(u64::from(b)));
    let mut seq_hashes = cached.to_vec();
    seq_hashes.extend(hashes(tag | 1 << 40, tail));
    let prompt_tokens = seq_hashes.len() as u64 * BLOCK + extra % BLOCK;
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::BlockHashes {
            seq_hashes,
            prompt_tokens,
        },
        ..Default::default()
    }
}

/// A partition of random size with a random mix of everything a decision reads.
fn random_world(rng: &mut StdRng, t0: Instant) -> (Core, Vec<RankKey>, Vec<u64>) {
    let core = Core::new(random_config(rng));
    let workers = rng.random_range(1..24usize);
    let specs: Vec<WorkerSpec> = (0..workers)
        .map(|w| {
            let ranks = rng.random_range(1..4u16);
            let ports = (0..ranks).map(|r| 8000 + (w as u16) * 8 + r).collect();
            WorkerSpec::for_test(&format!("w{w}"), "m", RankLayout::PerPort(ports))
        })
        .collect();
    core.apply_source_snapshot("catalog", specs, t0).unwrap();
    let key = PartitionKey {
        model: "m".into(),
        routing_group: String::new(),
    };
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
    let shared = hashes(1, 64);
    let common = if rng.random_bool(0.6) {
        rng.random_range(1..12)
    } else {
        0
    };
    for rank in &ranks {
        // Most worlds give every rank the shared prefix (the index's base); some miss a rank.
        if common > 0 && !rng.random_bool(0.05) {
            core.insert_blocks(&key, *rank, &shared[..common], Tier::Gpu, None, t0);
        }
        if rng.random_bool(0.3) {
            let depth = rng.random_range(1..64);
            let tier = [Tier::Gpu, Tier::Host, Tier::Disk][rng.random_range(0..3)];
            core.insert_blocks(&key, *rank, &shared[..depth], tier, None, t0);
        }
        if rng.random_bool(0.5) {
            core.insert_blocks(
                &key,
                *rank,
                &hashes(rank.worker_id ^ 7, 8),
                Tier::Gpu,
                None,
                t0,
            );
        }
    }
    // The shared store holds a run of the shared prefix (from its start or past it).
    if rng.random_bool(0.7) {
        let from = [0, common, rng.random_range(0..32)][rng.random_range(0..3)];
        let to = rng.random_range(from..64).max(from);
        core.insert_shared_blocks(&key, &shared[from..to], t0);
    }
    (core, ranks, shared)
}

/// Books, answers and frees random requests, so loads, calibration and health differ.
trait TokensHint {
    fn prompt_tokens_hint(&self) -> u64;
}

impl TokensHint for SelectionRequest {
    fn prompt_tokens_hint(&self) -> u64 {
        match &self.prompt {
            PromptInput::BlockHashes { prompt_tokens, .. } => *prompt_tokens,
            _ => 0,
        }
    }
}

fn random_traffic(rng: &mut StdRng, core: &Core, ranks: &[RankKey], shared: &[u64], t0: Instant) {
    let mut now = t0;
    let mut live = Vec::new();
    let free_share = rng.random_range(0.2..0.9);
    let complete_share = rng.random_range(0.2..0.9);
    for i in 0..rng.random_range(0..300) {
        let depth = rng.random_range(0..shared.len());
        let mut r = request(
            &format!("t{i}"),
            &shared[..depth],
            rng.random_range(0..250),
            rng.random(),
        );
        let tokens = r.prompt_tokens_hint();
        if rng.random_bool(0.2) {
            r.session_id = Some(format!("s{}", rng.random_range(0..6)));
        }
        now += Duration::from_millis(rng.random_range(0..30));
        let (s, _) = match core.select_and_reserve(&r, now) {
            Ok(s) => s,
            Err(_) => continue,
        };
        let claim = Claim::Generation(s.generation);
        if rng.random_bool(0.1) {
            core.record_response(&r.request_id, claim, ResponseClass::ServerError, now);
        }
        if rng.random_bool(complete_share) {
            let slow = 1 + s.primary.key.worker_id % 3;
            now += Duration::from_millis(tokens * slow / 40);
            core.mark_prefill_complete(&r.request_id, claim, now);
        }
        if rng.random_bool(free_share) {
            core.free(&r.request_id, claim, now);
        } else {
            live.push(r.request_id);
        }
    }
    for rank in ranks {
        if rng.random_bool(0.3) {
            core.record_engine_metrics(
                *rank,
                EngineMetrics {
                    waiting: rng.random_range(0..5),
                    running: rng.random_range(0..20),
                    kv_usage: rng.random_range(0.0..1.0),
                    adapters: Vec::new().into(),
                    max_adapters: None,
                    at: now,
                },
            );
        }
    }
    if rng.random_bool(0.3) {
        let mut remote: HashMap<RankKey, crate::types::RankLoad> = HashMap::new();
        for k in ranks {
            if rng.random_bool(0.3) {
                let load = crate::types::RankLoad {
                    active_prefill_tokens: rng.random_range(0..2000),
                    active_decode_blocks: rng.random_range(0..100),
                    active_requests: rng.random_range(0..6),
                };
                remote.insert(*k, load);
            }
        }
        core.set_remote_loads(&remote);
    }
}

fn random_request(rng: &mut StdRng, i: usize, shared: &[u64]) -> SelectionRequest {
    let depth = rng.random_range(0..shared.len());
    let mut r = request(
        &format!("q{i}"),
        &shared[..depth],
        rng.random_range(0..350),
        rng.random(),
    );
    if rng.random_bool(0.4) {
        r.session_id = Some(format!("s{}", rng.random_range(0..6)));
    }
    r.fallbacks = rng.random_range(0..3);
    if rng.random_bool(0.2) {
        r.priority = -1;
    }
    if rng.random_bool(0.2) {
        r.holder = Holder::Api;
    }
    if rng.random_bool(0.15) {
        let ports: Vec<String> = (0..rng.random_range(1..10))
            .map(|_| format!("127.0.0.1:{}", 8000 + rng.random_range(0..200)))
            .collect();
        r.subset = Some(EndpointFilter::parse(ports.iter().map(String::as_str)));
    }
    r
}

#[test]
fn the_bounded_search_decides_as_costing_every_rank() {
    let mut rng = StdRng::seed_from_u64(2027);
    let t0 = Instant::now();
    let mut compared = 0usize;
    let mut decided = 0usize;
    for world in 0..250 {
        let (core, ranks, shared) = random_world(&mut rng, t0);
        random_traffic(&mut rng, &core, &ranks, &shared, t0);
        let now = t0 + Duration::from_secs(rng.random_range(1..30));
        for i in 0..8 {
            let r = random_request(&mut rng, i, &shared);
            let flow = rng.random_bool(0.5);
            let [sparse, full] = core.decision_paths(&r, now, flow);
            assert_eq!(
                sparse, full,
                "world {world} request {i} (flow {flow}): {r:?}"
            );
            compared += 1;
            decided += usize::from(full.is_ok());
        }
    }
    assert_eq!(compared, 2000);
    let (asked, answered) = crate::partition::sparse::SEARCHES.with(|c| c.get());
    assert!(
        answered * 5 > asked * 3,
        "the search answered most decisions itself: {answered} of {asked}"
    );
    assert!(decided > 1000, "most requests decide: {decided}");
}

/// The shared prefix every rank holds comes back once, as the base, and the search still finds
/// the one rank caching deeper among many idle ones.
#[test]
fn a_deeper_match_among_a_shared_prefix_wins_without_costing_every_rank() {
    let core = Core::new(CoreConfig {
        seed: Some(1),
        ..CoreConfig::default()
    });
    let t0 = Instant::now();
    let specs: Vec<WorkerSpec> = (0..64u16)
        .map(|w| WorkerSpec::for_test(&format!("w{w}"), "m", RankLayout::PerPort(vec![9000 + w])))
        .collect();
    core.apply_source_snapshot("catalog", specs, t0).unwrap();
    let key = PartitionKey {
        model: "m".into(),
        routing_group: String::new(),
    };
    let shared = hashes(3, 40);
    let ranks: Vec<RankKey> = core
        .list_workers(None)
        .iter()
        .map(|v| RankKey {
            worker_id: v.record.id,
            dp_rank: 0,
        })
        .collect();
    for rank in &ranks {
        core.insert_blocks(&key, *rank, &shared[..8], Tier::Gpu, None, t0);
    }
    let deep = ranks[17];
    core.insert_blocks(&key, deep, &shared[..30], Tier::Gpu, None, t0);
    let r = request("deep", &shared, 0, 0);
    let (s, _) = core.select(&r, t0).unwrap();
    assert_eq!(s.primary.key, deep);
    assert_eq!(s.overlap_blocks, 30);
    assert!(
        s.candidates < 8,
        "the deeper rank and a few idle ones are costed, not 64: {}",
        s.candidates
    );
    let [sparse, full] = core.decision_paths(&r, t0, false);
    assert_eq!(sparse, full);
}

/// Two workers `u` and `v` (one rank each) with pins allowed, to set their loads by hand.
fn two_ranks(config: CoreConfig) -> (Core, RankKey, RankKey, Instant) {
    let core = Core::new(CoreConfig {
        allow_pins: true,
        seed: Some(5),
        ..config
    });
    let t0 = Instant::now();
    let specs = vec![
        WorkerSpec::for_test("u", "m", RankLayout::PerPort(vec![8101])),
        WorkerSpec::for_test("v", "m", RankLayout::PerPort(vec![8102])),
    ];
    core.apply_source_snapshot("catalog", specs, t0).unwrap();
    let id = |name: &str| RankKey {
        worker_id: crate::catalog::worker_id("static", name),
        dp_rank: 0,
    };
    (core, id("u"), id("v"), t0)
}

fn book_on(core: &Core, id: &str, rank: RankKey, tail: usize, prefilled: bool, now: Instant) {
    let mut r = request(id, &[], tail, 0);
    r.pin = Some(crate::request::Pin {
        worker_id: rank.worker_id,
        dp_rank: Some(rank.dp_rank),
    });
    let (s, _) = core.select_and_reserve(&r, now).unwrap();
    assert_eq!(s.primary.key, rank);
    if prefilled {
        core.mark_prefill_complete(id, Claim::Generation(s.generation), now);
    }
}

/// The fastest rank may be the costliest (its decodes stall a new prefill), yet it sets the
/// TTFT bound that pushes a slow rank back: the search must find it before ranking by cost.
#[test]
fn the_ttft_bound_comes_from_the_fastest_rank_even_when_it_costs_most() {
    let (core, u, v, t0) = two_ranks(CoreConfig::default());
    for i in 0..10 {
        book_on(&core, &format!("u{i}"), u, 4, true, t0);
    }
    book_on(&core, "v0", v, 125, false, t0);
    // 20 blocks, no cache. u: TTFT 25 fixed + 20, cost + 10 x 20 stalled = 245.
    // v: TTFT 25 + 125 queued + 20 = 170 > 1.5 x 45 + 1, cost 170 + 20 = 190.
    let r = request("q", &[], 20, 0);
    let [sparse, full] = core.decision_paths(&r, t0, false);
    assert_eq!(sparse, full);
    let (s, _) = core.select(&r, t0).unwrap();
    assert_eq!(
        s.primary.key, u,
        "v is beyond the bound: u's first token comes far sooner"
    );
}

/// Equal costs in different request-count buckets and queued-prefill runs: the rank picked
/// least recently wins even when it is busier, so the search must not stop at the first rank
/// of the cutoff's cost.
#[test]
fn a_tie_across_loads_goes_to_the_rank_picked_least_recently() {
    let mut config = CoreConfig::default();
    config.cost.stall_weight = 0.0;
    config.cost.decode_block_weight = 0.0;
    // Three times the credit: a cached prompt waits for nothing on either rank, queued prefill
    // (four blocks) or not.
    config.cost.overlap_score_credit = 3.0;
    let (core, u, v, t0) = two_ranks(config);
    let key = PartitionKey {
        model: "m".into(),
        routing_group: String::new(),
    };
    let cached = hashes(9, 4);
    for rank in [u, v] {
        core.insert_blocks(&key, rank, &cached, Tier::Gpu, None, t0);
    }
    // u is picked first (rank order breaks the first tie) and keeps a queued prefill; v is
    // picked next (u's queue makes it dearer) and freed.
    let (a, _) = core
        .select_and_reserve(&request("a", &[], 4, 0), t0)
        .unwrap();
    assert_eq!(a.primary.key, u);
    let (b, _) = core
        .select_and_reserve(&request("b", &[], 4, 0), t0)
        .unwrap();
    assert_eq!(b.primary.key, v);
    core.free("b", Claim::Generation(b.generation), t0);
    // One token past the cached blocks, so all four are reusable (the engine computes the last).
    let q = request("q", &cached, 0, 1);
    let [sparse, full] = core.decision_paths(&q, t0, false);
    assert_eq!(sparse, full);
    let (s, _) = core.select(&q, t0).unwrap();
    assert_eq!(
        s.primary.key, u,
        "equal costs: u, picked before v, wins the tie"
    );
}
