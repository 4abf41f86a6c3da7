//! A pick's predicted index entries through the core: on a rank whose KV events flow they live
//! while the request does (a slow prefill keeps them for its siblings), turn permanent when the
//! engine announces the blocks, and the unconfirmed ones go when the request ends; on a rank in
//! approximate mode they stay for `approx_ttl`; `predicted_ttl` bounds a booking that never ends.

use std::time::{Duration, Instant};

use super::fixtures::{evented_worker as spec, rank_of, BS};
use super::*;
use crate::event::KvEvent;

/// A prompt of four blocks of its own (`tag`), one token more so all four are reusable.
fn prompt(tag: u32) -> Vec<u32> {
    fixtures::whole_blocks(tag * 1_000, 4)
}

fn request(id: &str, tokens: Vec<u32>) -> SelectionRequest {
    fixtures::token_request(id, tokens)
}

/// The engine announces `tokens`' complete blocks (as vLLM does after the prefill).
fn store(tokens: &[u32]) -> KvEvent {
    fixtures::gpu_store(tokens, BS, 900)
}

/// One worker `a` whose KV events flow (precise), with `config` and KV events on.
fn precise_core(config: CoreConfig) -> (Core, WorkerSpec, Instant) {
    let core = Core::new(CoreConfig {
        kv_events: true,
        seed: Some(1),
        ..config
    });
    let a = spec("a", 1);
    let t0 = Instant::now();
    core.apply_source_snapshot("catalog", vec![a.clone()], t0)
        .unwrap();
    let (stats, _) = core.apply_kv_events(rank_of(&a), &[KvEvent::AllBlocksCleared], None, t0);
    assert_eq!(stats.applied, 1, "the rank is precise");
    (core, a, t0)
}

fn cached(core: &Core, tokens: Vec<u32>, at: Instant) -> u32 {
    let (_, ranks) = core.overlap_scores(&request("q", tokens), at).unwrap();
    ranks.first().map_or(0, |(_, d)| d.gpu)
}

#[test]
fn a_prediction_outlives_a_slow_prefill_and_ends_with_its_request() {
    let (core, _, t0) = precise_core(CoreConfig::default());
    let (s, _) = core
        .select_and_reserve(&request("long", prompt(1)), t0)
        .unwrap();
    // The real vLLM case: a 7,000-token prefill took 4.15 s; a sibling at 4.2 s must see it
    // (a fixed 2 s prediction had expired).
    let sibling = t0 + Duration::from_millis(4_200);
    assert_eq!(cached(&core, prompt(1), sibling), 4);
    let claim = Claim::Generation(s.generation);
    core.mark_prefill_complete("long", claim, sibling);
    let later = t0 + Duration::from_secs(60);
    assert_eq!(cached(&core, prompt(1), later), 4, "decoding: still held");
    // The engine never announced the blocks: once the request is over they are believed only
    // while its events may still be on their way (the end grace), not a moment longer.
    core.free("long", claim, later);
    let grace = crate::partition::END_GRACE;
    assert_eq!(
        cached(&core, prompt(1), later + grace - Duration::from_millis(1)),
        4,
        "a sibling right after the end still finds them (the store event may be in flight)"
    );
    assert_eq!(
        cached(&core, prompt(1), later + grace + Duration::from_millis(1)),
        0
    );
}

#[test]
fn blocks_the_engine_announced_outlive_their_request() {
    let (core, a, t0) = precise_core(CoreConfig::default());
    let (s, _) = core
        .select_and_reserve(&request("r", prompt(2)), t0)
        .unwrap();
    core.apply_kv_events(rank_of(&a), &[store(&prompt(2))], None, t0);
    core.free("r", Claim::Generation(s.generation), t0);
    assert_eq!(cached(&core, prompt(2), t0 + Duration::from_secs(60)), 4);
}

/// An approximate rank's entries are all kvpick knows of its cache: the request's end keeps
/// them for `approx_ttl`.
#[test]
fn an_approximate_ranks_prediction_outlives_its_request() {
    let core = Core::new(CoreConfig {
        kv_events: true,
        ..CoreConfig::default()
    });
    let a = spec("a", 1);
    let t0 = Instant::now();
    core.apply_source_snapshot("catalog", vec![a], t0).unwrap();
    let (s, _) = core
        .select_and_reserve(&request("r", prompt(3)), t0)
        .unwrap();
    core.free("r", Claim::Generation(s.generation), t0);
    let approx = CoreConfig::default().approx_ttl;
    let just_before = t0 + approx - Duration::from_millis(10);
    assert_eq!(cached(&core, prompt(3), just_before), 4);
    assert_eq!(
        cached(&core, prompt(3), t0 + approx + Duration::from_millis(10)),
        0
    );
}

/// `predicted_ttl` bounds a prediction whose request never ends (a leaked booking).
#[test]
fn the_bound_ends_a_prediction_whose_request_never_ends() {
    let bound = Duration::from_secs(10);
    let (core, _, t0) = precise_core(CoreConfig {
        predicted_ttl: bound,
        ..CoreConfig::default()
    });
    core.select_and_reserve(&request("leak", prompt(4)), t0)
        .unwrap();
    let margin = Duration::from_millis(10);
    assert_eq!(cached(&core, prompt(4), t0 + bound - margin), 4);
    assert_eq!(cached(&core, prompt(4), t0 + bound + margin), 0);
}

/// Envoy served the request from another rank: the picked rank never computed the prompt.
#[test]
fn a_moved_booking_takes_its_prediction_off_the_rank_that_did_not_serve_it() {
    let core = Core::new(CoreConfig {
        kv_events: true,
        seed: Some(1),
        ..CoreConfig::default()
    });
    let (a, b) = (spec("a", 1), spec("b", 2));
    let t0 = Instant::now();
    core.apply_source_snapshot("catalog", vec![a.clone(), b.clone()], t0)
        .unwrap();
    for s in [&a, &b] {
        core.apply_kv_events(rank_of(s), &[KvEvent::AllBlocksCleared], None, t0);
    }
    let (s, _) = core
        .select_and_reserve(&request("r", prompt(5)), t0)
        .unwrap();
    let picked = s.primary.worker_name.clone();
    let on = |worker: &str| {
        let (_, ranks) = core.overlap_scores(&request("q", prompt(5)), t0).unwrap();
        ranks
            .iter()
            .find(|(r, _)| r.worker_name == worker)
            .map_or(0, |(_, d)| d.gpu)
    };
    assert_eq!(on(&picked), 4);
    let other = core
        .records()
        .into_iter()
        .find(|r| r.spec.name != picked)
        .unwrap();
    let served = other.ranks[0].endpoint;
    let (moved, _) = core.move_booking("r", Claim::Generation(s.generation), served);
    assert!(moved);
    assert_eq!(on(&picked), 0);
}

/// Applies an empty live batch of `a` that arrived `lag` late; returns the grace it reported.
fn lagged_batch(core: &Core, a: &WorkerSpec, lag: Duration, at: Instant) -> f64 {
    let (_, facts) = core.apply_kv_events(rank_of(a), &[], Some(lag), at);
    let grace = facts
        .iter()
        .find_map(|f| match f {
            Fact::PredictionGrace { seconds, .. } => Some(*seconds),
            _ => None,
        })
        .unwrap();
    grace
}

/// Books and frees a request for prompt `tag` at `end`; returns whether a sibling finds its
/// blocks just before and just after `end + grace`.
fn outlives_by(core: &Core, tag: u32, end: Instant, grace: Duration) -> (u32, u32) {
    let id = format!("r{tag}");
    let (s, _) = core
        .select_and_reserve(&request(&id, prompt(tag)), end)
        .unwrap();
    core.free(&id, Claim::Generation(s.generation), end);
    let margin = Duration::from_millis(1);
    (
        cached(core, prompt(tag), end + grace - margin),
        cached(core, prompt(tag), end + grace + margin),
    )
}

/// A CPU-starved engine publishes its stores seconds late: after a batch 3 s late, a request's
/// unconfirmed predictions outlive its end by twice that, so a follower still finds them.
#[test]
fn late_kv_events_lengthen_how_long_predictions_outlive_their_request() {
    let (core, a, t0) = precise_core(CoreConfig::default());
    assert_eq!(lagged_batch(&core, &a, Duration::from_millis(3), t0), 1.0);
    let slow = t0 + Duration::from_millis(100);
    assert_eq!(lagged_batch(&core, &a, Duration::from_secs(3), slow), 6.0);
    let end = slow + Duration::from_millis(200);
    assert_eq!(outlives_by(&core, 5, end, Duration::from_secs(6)), (4, 0));
    // A replayed batch (no lag) changes nothing.
    core.apply_kv_events(rank_of(&a), &[], None, end);
    assert_eq!(outlives_by(&core, 6, end, Duration::from_secs(6)), (4, 0));
}

/// Fast batches bring the grace back: it halves every 10 s of them, to the second it was.
#[test]
fn the_grace_decays_back_over_fast_batches() {
    let (core, a, t0) = precise_core(CoreConfig::default());
    lagged_batch(&core, &a, Duration::from_secs(3), t0);
    let fast = Duration::from_millis(5);
    let half = lagged_batch(&core, &a, fast, t0 + Duration::from_secs(10));
    assert!((half - 3.0).abs() < 1e-9, "{half}");
    let mut t = t0 + Duration::from_secs(10);
    for _ in 0..20 {
        t += Duration::from_secs(1);
        lagged_batch(&core, &a, fast, t);
    }
    assert_eq!(lagged_batch(&core, &a, fast, t), 1.0);
    assert_eq!(outlives_by(&core, 7, t, Duration::from_secs(1)), (4, 0));
}

/// The grace stops at 10 s: a lag at 5 s gives it, one just over (or an absurd one, clock
/// skew) gives no more.
#[test]
fn the_grace_cap_holds_for_a_lag_just_over_it() {
    let cap = Duration::from_secs(10);
    for (lag, tag) in [
        (Duration::from_secs(5), 8),
        (Duration::from_millis(5_001), 9),
        (Duration::from_secs(3_000), 10),
    ] {
        let (core, a, t0) = precise_core(CoreConfig::default());
        assert_eq!(lagged_batch(&core, &a, lag, t0), 10.0, "{lag:?}");
        assert_eq!(outlives_by(&core, tag, t0, cap), (4, 0), "{lag:?}");
    }
}
