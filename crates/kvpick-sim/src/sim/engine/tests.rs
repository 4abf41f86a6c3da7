use super::*;
use std::collections::BTreeSet;

fn config() -> EngineConfig {
    EngineConfig {
        block_size: 16,
        num_gpu_blocks: 1000,
        max_num_seqs: 8,
        max_num_batched_tokens: 4096,
        prefill_overhead_ns: 1_000_000,
        prefill_ns_per_token: 100_000,
        itl_ns: 10_000_000,
        itl_ns_per_seq: 1_000_000,
        itl_ps_per_kv_token: 0,
    }
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32)
        .map(|i| seed.wrapping_mul(1_000_003) ^ i)
        .collect()
}

fn req(id: u64, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    EngineRequest {
        id,
        prompt,
        max_tokens,
    }
}

/// Steps until idle on a virtual clock starting at `now`; returns (first-token times by id,
/// finish times by id, all events, end time).
struct Run {
    first: HashMap<u64, u64>,
    done: HashMap<u64, u64>,
    cached: HashMap<u64, u32>,
    events: Vec<KvEvent>,
    now: u64,
}

fn run(engine: &mut Engine, mut now: u64) -> Run {
    let mut out = Run {
        first: HashMap::new(),
        done: HashMap::new(),
        cached: HashMap::new(),
        events: Vec::new(),
        now,
    };
    while let Some(step) = engine.step() {
        now += step.duration_ns;
        for o in step.outputs {
            if o.first {
                out.first.insert(o.id, now);
                out.cached.insert(o.id, o.cached_tokens);
            }
            if o.finished {
                out.done.insert(o.id, now);
            }
        }
        out.events.extend(step.events);
    }
    out.now = now;
    out
}

/// Replays events into a set of cached hashes, checking each stored chain's parent is known.
fn apply(set: &mut BTreeSet<u64>, events: &[KvEvent]) {
    for e in events {
        match e {
            KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                block_size,
                ..
            } => {
                assert_eq!(token_ids.len(), block_hashes.len() * *block_size as usize);
                if let Some(p) = parent_block_hash {
                    assert!(set.contains(p), "parent {p:x} announced before its child");
                }
                // The hashes are the router's own chained hashes of the token ids.
                let mut parent = *parent_block_hash;
                for (i, h) in block_hashes.iter().enumerate() {
                    let local = hash::block_hash(
                        &token_ids[i * 16..(i + 1) * 16],
                        hash::block_seed(None, None),
                    );
                    let expect = parent.map_or(local, |p| hash::chain(p, local));
                    assert_eq!(*h, expect);
                    parent = Some(*h);
                    assert!(set.insert(*h), "stored twice without removal");
                }
            }
            KvEvent::BlockRemoved { block_hashes, .. } => {
                for h in block_hashes {
                    assert!(set.remove(h), "removed a block never stored");
                }
            }
            KvEvent::AllBlocksCleared => set.clear(),
        }
    }
}

#[test]
fn a_lone_request_sees_overhead_plus_uncached_tokens() {
    let mut engine = Engine::new(config());
    engine.add_request(req(1, prompt(1, 160), 1)).unwrap();
    let r = run(&mut engine, 0);
    assert_eq!(r.first[&1], 1_000_000 + 160 * 100_000);
    assert_eq!(r.cached[&1], 0);
}

#[test]
fn a_cache_hit_reduces_ttft_by_exactly_cached_tokens_times_per_token() {
    let cfg = config();
    let mut engine = Engine::new(cfg.clone());
    engine.add_request(req(1, prompt(1, 200), 3)).unwrap();
    let cold = run(&mut engine, 0);
    let cold_ttft = cold.first[&1];
    // Same 160-token prefix, different tail.
    let mut p2 = prompt(1, 160);
    p2.extend(prompt(9, 40));
    engine.add_request(req(2, p2, 3)).unwrap();
    let start = cold.now;
    let warm = run(&mut engine, start);
    let warm_ttft = warm.first[&2] - start;
    assert_eq!(warm.cached[&2], 160);
    assert_eq!(cold_ttft - warm_ttft, 160 * cfg.prefill_ns_per_token);
    // A prompt that is entirely cached still computes its last token (at most len-1 cached).
    engine.add_request(req(3, prompt(1, 160), 1)).unwrap();
    let start = warm.now;
    let full = run(&mut engine, start);
    assert_eq!(full.cached[&3], 144);
    assert_eq!(full.first[&3] - start, 1_000_000 + 16 * 100_000);
    let stats = engine.stats();
    assert_eq!(stats.prefix_cache_queries, 200 + 200 + 160);
    assert_eq!(stats.prefix_cache_hits, 160 + 144);
}

#[test]
fn chunked_prefill_keeps_the_ttft_formula() {
    let mut cfg = config();
    cfg.max_num_batched_tokens = 48;
    let mut engine = Engine::new(cfg);
    engine.add_request(req(1, prompt(1, 160), 1)).unwrap();
    let r = run(&mut engine, 0);
    assert_eq!(r.first[&1], 1_000_000 + 160 * 100_000);
}

#[test]
fn decode_runs_at_itl_of_the_batch_and_seats_are_limited() {
    let mut cfg = config();
    cfg.max_num_seqs = 2;
    let mut engine = Engine::new(cfg.clone());
    for id in 1..=3 {
        engine
            .add_request(req(id, prompt(id as u32, 32), 3))
            .unwrap();
    }
    // Step 1: two requests prefill together (2 overheads + 64 tokens); the third waits.
    let s1 = engine.step().unwrap();
    assert_eq!(s1.duration_ns, 2 * 1_000_000 + 64 * 100_000);
    assert_eq!(engine.stats().waiting, 1);
    assert!(s1.outputs.iter().all(|o| o.first && o.new_tokens == 1));
    // Step 2: both decode: itl(2).
    let s2 = engine.step().unwrap();
    assert_eq!(s2.duration_ns, cfg.itl(2));
    assert_eq!(s2.decode_seqs, 2);
    // Step 3: both finish (3 tokens); the third is admitted only after seats free up.
    let s3 = engine.step().unwrap();
    assert!(s3.outputs.iter().all(|o| o.finished));
    let s4 = engine.step().unwrap();
    assert_eq!(s4.outputs[0].id, 3);
    assert!(s4.outputs[0].first);
}

#[test]
fn unreferenced_blocks_are_evicted_lru_tail_first_under_pressure() {
    let mut cfg = config();
    cfg.num_gpu_blocks = 24;
    let mut engine = Engine::new(cfg);
    let a = prompt(1, 160); // 10 blocks
    engine.add_request(req(1, a.clone(), 1)).unwrap();
    let r1 = run(&mut engine, 0);
    let a_hashes = hash::prompt_hashes(&a, 16, hash::block_seed(None, None));
    assert_eq!(engine.cached_block_hashes().len(), 10);
    // B needs 10 + 1 decode blocks... 20 in use after it; C then needs 10 more: A's tail goes.
    engine.add_request(req(2, prompt(2, 160), 1)).unwrap();
    engine.add_request(req(3, prompt(3, 160), 1)).unwrap();
    let r2 = run(&mut engine, r1.now);
    let removed: Vec<u64> = r2
        .events
        .iter()
        .flat_map(|e| match e {
            KvEvent::BlockRemoved { block_hashes, .. } => block_hashes.clone(),
            _ => vec![],
        })
        .collect();
    assert!(!removed.is_empty(), "no eviction under pressure");
    // Evicted from A's tail backwards; A's head survives.
    let expect: Vec<u64> = a_hashes.iter().rev().take(removed.len()).copied().collect();
    assert_eq!(removed, expect);
    assert!(engine.cached_block_hashes().len() <= 24);
    // A again: only its surviving head is a hit.
    engine.add_request(req(4, a, 1)).unwrap();
    let r3 = run(&mut engine, r2.now);
    assert_eq!(r3.cached[&4] as usize, (10 - removed.len()).min(9) * 16);
}

#[test]
fn referenced_blocks_are_never_evicted_and_preemption_recovers() {
    let mut cfg = config();
    cfg.num_gpu_blocks = 12;
    let mut engine = Engine::new(cfg);
    // Two requests of 4 blocks that each grow by 4 decode blocks: 16 > 12, one is preempted.
    engine.add_request(req(1, prompt(1, 64), 64)).unwrap();
    engine.add_request(req(2, prompt(2, 64), 64)).unwrap();
    let r = run(&mut engine, 0);
    assert!(r.done.contains_key(&1) && r.done.contains_key(&2));
    assert!(engine.stats().preemptions >= 1);
    assert!(!engine.has_work());
    assert_eq!(engine.stats().kv_usage, 0.0);
}

#[test]
fn events_always_equal_the_cache_contents() {
    let mut cfg = config();
    cfg.num_gpu_blocks = 60;
    cfg.max_num_batched_tokens = 100;
    let mut engine = Engine::new(cfg);
    let mut set = BTreeSet::new();
    let mut next_id = 0u64;
    // A workload of shared prefixes under memory pressure and chunking.
    for round in 0..40u32 {
        for k in 0..3u32 {
            next_id += 1;
            let mut p = prompt(round % 4, 64 + 16 * (k as usize));
            p.extend(prompt(1000 + round * 3 + k, 40));
            engine.add_request(req(next_id, p, 1 + k * 5)).unwrap();
        }
        for _ in 0..4 {
            if let Some(step) = engine.step() {
                apply(&mut set, &step.events);
                assert_eq!(
                    set.iter().copied().collect::<Vec<_>>(),
                    engine.cached_block_hashes()
                );
            }
        }
    }
    while let Some(step) = engine.step() {
        apply(&mut set, &step.events);
    }
    assert_eq!(
        set.into_iter().collect::<Vec<_>>(),
        engine.cached_block_hashes()
    );
}

#[test]
fn refuses_prompts_that_can_never_fit_and_duplicates() {
    let mut cfg = config();
    cfg.num_gpu_blocks = 4;
    let mut engine = Engine::new(cfg);
    assert!(matches!(
        engine.add_request(req(1, prompt(1, 100), 1)),
        Err(AddError::TooLong { .. })
    ));
    engine.add_request(req(2, prompt(1, 10), 1)).unwrap();
    assert_eq!(
        engine.add_request(req(2, prompt(1, 10), 1)),
        Err(AddError::Duplicate(2))
    );
    assert!(engine.abort(2));
    assert!(!engine.has_work());
}

#[test]
fn decode_cost_can_grow_with_the_kv_read() {
    let mut cfg = config();
    cfg.itl_ps_per_kv_token = 2_000; // 2 ns per KV token
    let mut engine = Engine::new(cfg.clone());
    engine.add_request(req(1, prompt(1, 100), 3)).unwrap();
    engine.step().unwrap(); // prefill + first token
    let s = engine.step().unwrap(); // decode with 101 tokens in KV
    assert_eq!(s.decode_ns, cfg.itl(1) + 101 * 2);
    assert_eq!(s.duration_ns, s.decode_ns);
}

/// A prompt whose KV was transferred from a prefill rank: no prefill time, the blocks enter the
/// cache (and the events) at admission, the first token comes from the first decode step, and a
/// later request with the same prefix hits them.
#[test]
fn a_transferred_prompt_is_cached_without_prefill_and_decodes_at_once() {
    let mut e = Engine::new(config());
    let p = prompt(3, 100);
    e.add_transferred(req(1, p.clone(), 3)).unwrap();
    let step = e.step().unwrap();
    assert_eq!(step.prefill_tokens, 0);
    assert_eq!(
        step.duration_ns,
        config().itl(1),
        "one decode step, no prefill"
    );
    assert!(step.outputs[0].first && step.outputs[0].new_tokens == 1);
    let stored: usize = step
        .events
        .iter()
        .map(|ev| match ev {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(stored, 100 / 16, "every complete prompt block is announced");
    let r = run(&mut e, 0);
    assert!(r.done.contains_key(&1));
    // The prompt is cached here now: a normal request with it prefills only its tail.
    e.add_request(req(2, p, 1)).unwrap();
    let r = run(&mut e, 0);
    assert_eq!(r.cached[&2], 96);
}

#[test]
fn external_kv_is_loaded_at_admission_instead_of_prefilled() {
    // 10 blocks + 1 token; the first 4 cached locally, the store holds the first 8.
    let p = prompt(7, 161);
    let mut e = Engine::new(config());
    e.add_request(req(1, p[..64].to_vec(), 1)).unwrap();
    run(&mut e, 0);
    let external = ExternalKv {
        blocks: 8,
        ns_per_block: 50_000,
    };
    e.add_with_external(req(2, p.clone(), 1), Some(external))
        .unwrap();
    let r = run(&mut e, 0);
    // 4 blocks loaded (8 - 4 cached), 161 - 128 = 33 tokens prefilled.
    assert_eq!(r.first[&2], 1_000_000 + 4 * 50_000 + 33 * 100_000);
    assert_eq!(r.cached[&2], 128, "loaded blocks are reported as cached");
    let stored: usize = r
        .events
        .iter()
        .map(|ev| match ev {
            KvEvent::BlockStored { block_hashes, .. } => block_hashes.len(),
            _ => 0,
        })
        .sum();
    assert_eq!(
        stored, 6,
        "4 loaded + 2 prefilled complete blocks enter the cache"
    );
    // A store holding no more than the rank caches loads nothing.
    let mut again = Engine::new(config());
    let none = ExternalKv {
        blocks: 0,
        ns_per_block: 50_000,
    };
    again.add_with_external(req(3, p, 1), Some(none)).unwrap();
    assert_eq!(run(&mut again, 0).first[&3], 1_000_000 + 161 * 100_000);
}
