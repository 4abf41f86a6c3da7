use super::*;

fn tokens(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| seed * 100_000 + i).collect()
}

fn idle(n: usize) -> Vec<EngineStats> {
    vec![EngineStats::default(); n]
}

fn pick(p: &mut dyn Policy, id: u64, t: &[u32], m: &[EngineStats]) -> usize {
    p.pick(&PickRequest::new(id, t), &FleetView { metrics: m })
}

#[test]
fn round_robin_cycles() {
    let mut p = build("round-robin", 3, &PolicyOptions::new(16, 0)).unwrap();
    let t = tokens(1, 32);
    let picks: Vec<usize> = (0..7).map(|i| pick(p.as_mut(), i, &t, &idle(3))).collect();
    assert_eq!(picks, vec![0, 1, 2, 0, 1, 2, 0]);
}

#[test]
fn random_is_seeded_and_covers_the_fleet() {
    let t = tokens(1, 32);
    let run = |seed| {
        let mut p = build("random", 4, &PolicyOptions::new(16, seed)).unwrap();
        (0..200)
            .map(|i| pick(p.as_mut(), i, &t, &idle(4)))
            .collect::<Vec<_>>()
    };
    assert_eq!(run(9), run(9));
    assert_ne!(run(9), run(10));
    let picks = run(9);
    assert!((0..4).all(|r| picks.contains(&r)));
}

#[test]
fn least_loaded_picks_fewest_in_flight() {
    let mut p = build("least-loaded", 3, &PolicyOptions::new(16, 0)).unwrap();
    let t = tokens(1, 32);
    assert_eq!(pick(p.as_mut(), 1, &t, &idle(3)), 0);
    assert_eq!(pick(p.as_mut(), 2, &t, &idle(3)), 1);
    assert_eq!(pick(p.as_mut(), 3, &t, &idle(3)), 2);
    p.on_complete(2, 1);
    assert_eq!(pick(p.as_mut(), 4, &t, &idle(3)), 1);
}

#[test]
fn gie_weights_prefix_3_queue_2_kv_2() {
    let mut p = GieDefault::new(3, 1);
    let shared = tokens(1, 320);
    // Route once: rank chosen among equal scores; remember where it went.
    let first = pick(&mut p, 1, &shared, &idle(3));
    // Same prompt, idle fleet: full prefix match wins (3 + 2 + 2 vs 0 + 2 + 2).
    let s = p.scores(&shared, &FleetView { metrics: &idle(3) });
    assert_eq!(s[first], 7.0);
    assert!(s.iter().enumerate().all(|(i, &v)| i == first || v == 4.0));
    // A long queue (score 0) and a full KV cache (score 0) cost 4 points: the prefix owner (3)
    // now loses to an idle empty rank (4).
    let mut m = idle(3);
    m[first].waiting = 10;
    m[first].kv_usage = 1.0;
    let s = p.scores(&shared, &FleetView { metrics: &m });
    assert_eq!(s[first], 3.0);
    assert_ne!(pick(&mut p, 2, &shared, &m), first);
    // Only the first 256 chunks (4096 tokens) are considered.
    let long = tokens(2, 16 * 300);
    let mut p = GieDefault::new(2, 1);
    let r = pick(&mut p, 3, &long[..16 * 256], &idle(2));
    let s = p.scores(&long, &FleetView { metrics: &idle(2) });
    assert_eq!(s[r], 7.0);
}

#[test]
fn sglang_owner_above_threshold_else_smallest_tree_and_least_loaded_when_imbalanced() {
    let n = 3;
    let prefix = tokens(1, 640);
    let mut p = SglangCacheAware::new(n);
    // Rank 2 owns a 640-token prefix; rank 0 has a bigger tree; rank 1 the smallest.
    p.seed_state(2, &prefix, 0);
    p.seed_state(0, &tokens(9, 2000), 0);
    p.seed_state(1, &tokens(8, 320), 0);
    // Match rate 640/1000 > 0.3 -> owner.
    let mut q = prefix.clone();
    q.extend(tokens(3, 360));
    assert_eq!(pick(&mut p, 1, &q, &idle(n)), 2);
    // Match rate 0 -> the smallest tree (rank 1), even though rank 0 is as idle.
    assert_eq!(pick(&mut p, 2, &tokens(4, 1000), &idle(n)), 1);
    // Imbalanced (max-min = 100 > 64 and 100 > 1.5×0): least loaded wins over the owner.
    let mut p = SglangCacheAware::new(n);
    p.seed_state(2, &prefix, 100);
    p.seed_state(0, &[], 50);
    assert_eq!(pick(&mut p, 3, &q, &idle(n)), 1);
    // Balanced by the relative rule (max 100 < 1.5 × 80): cache owner again.
    let mut p = SglangCacheAware::new(n);
    p.seed_state(2, &prefix, 100);
    p.seed_state(0, &[], 80);
    p.seed_state(1, &[], 80);
    assert_eq!(pick(&mut p, 4, &q, &idle(n)), 2);
}

#[test]
fn kvpick_uses_announced_blocks_and_its_own_bookings() {
    let mut p = Kvpick::new(3, &PolicyOptions::new(16, 7));
    let prompt = tokens(1, 160);
    let hashes = hash::prompt_hashes(&prompt, 16, hash::BASE_SEED);
    // Rank 1 announces the first 8 blocks.
    p.on_kv_events(
        1,
        &[KvEvent::BlockStored {
            block_hashes: hashes[..8].to_vec(),
            parent_block_hash: None,
            token_ids: prompt[..128].to_vec(),
            block_size: 16,
            lora_id: None,
            medium: kvpick_core::event::Medium::Gpu,
            lora_name: None,
            cache_salt: None,
            group_idx: None,
            media: Vec::new(),
        }],
    );
    assert_eq!(p.events_dropped, 0);
    assert_eq!(pick(&mut p, 1, &prompt, &idle(3)), 1);
    // Bookings count: a flood of unrelated prompts booked on rank 1 pushes the next cache-hit
    // request elsewhere once the queued prefill outweighs the 8 cached blocks.
    let mut others = 0;
    for i in 0..6 {
        let r = pick(&mut p, 10 + i, &tokens(50 + i as u32, 160), &idle(3));
        others += (r != 1) as u32;
    }
    assert!(others > 0, "unrelated load spreads");
    // After the engine evicts the blocks, the preference is gone and bookings decide.
    p.on_kv_events(
        1,
        &[KvEvent::BlockRemoved {
            block_hashes: hashes[..8].to_vec(),
            medium: kvpick_core::event::Medium::Gpu,
            group_idx: None,
        }],
    );
    for id in [1, 10, 11, 12, 13, 14, 15] {
        p.on_complete(id, 0);
    }
    assert_eq!(p.core().live_bookings(), 0);
}

#[test]
fn unknown_policy_is_refused() {
    assert!(build("fastest", 2, &PolicyOptions::new(16, 0)).is_err());
}

#[test]
fn a_peer_policy_without_the_peers_crate_says_where_it_lives() {
    let err = build("dynamo", 2, &PolicyOptions::new(16, 1))
        .err()
        .expect("dynamo is not linked into kvpick")
        .to_string();
    assert!(
        err.contains("crates/kvpick-peers") && err.contains("replay --policy dynamo"),
        "{err}"
    );
    let unknown = build("nope", 2, &PolicyOptions::new(16, 1))
        .err()
        .expect("unknown")
        .to_string();
    assert!(unknown.contains("dynamo"), "{unknown}");
}

/// The trace's session columns reach kvpick's core as the request's session and parent.
#[test]
fn session_columns_become_the_requests_session_and_parent() {
    let t = tokens(1, 32);
    let req = PickRequest {
        session_id: Some("a1.2"),
        parent_session_id: Some("a1"),
        ..PickRequest::new(7, &t)
    };
    let r = selection_request(&req);
    assert_eq!(
        (r.session_id.as_deref(), r.parent_session_id.as_deref()),
        (Some("a1.2"), Some("a1"))
    );
    let plain = selection_request(&PickRequest::new(8, &t));
    assert_eq!((plain.session_id, plain.parent_session_id), (None, None));
}
