//! Split bookings through the public [`crate::Core`]: each rank's load is booked at the pick and
//! freed exactly once on every path (first token, free, expiry, a rank leaving, a move).

use std::time::{Duration, Instant};

use crate::catalog::RankLayout;
use crate::request::{Claim, DuplicateId, Holder, PromptInput, SelectionRequest};
use crate::types::{RankLoad, Role};
use crate::{Core, CoreConfig, PdConfig, WorkerSpec};

fn worker(name: &str, port: u16, role: Role) -> WorkerSpec {
    WorkerSpec {
        roles: vec![role],
        ..WorkerSpec::for_test(name, "m", RankLayout::PerPort(vec![port]))
    }
}

fn config() -> CoreConfig {
    CoreConfig {
        seed: Some(7),
        pd: PdConfig {
            // Idle ranks: splitting ties with prefilling locally, and ties split.
            transfer_block_cost: 0.0,
            ..PdConfig::default()
        },
        ..CoreConfig::default()
    }
}

fn core_of(specs: Vec<WorkerSpec>) -> Core {
    let core = Core::new(config());
    core.apply_source_snapshot("catalog", specs, Instant::now())
        .unwrap();
    core
}

/// One prefill rank `p` and two decode ranks `d1`, `d2`.
fn fleet() -> Core {
    core_of(vec![
        worker("p", 1, Role::Prefill),
        worker("d1", 2, Role::Decode),
        worker("d2", 3, Role::Decode),
    ])
}

fn request(id: &str, tokens: usize, holder: Holder) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::Tokens((0..tokens as u32).collect()),
        holder,
        on_duplicate: if holder == Holder::Api {
            DuplicateId::Reject
        } else {
            DuplicateId::Suffix
        },
        ..Default::default()
    }
}

fn load(core: &Core, name: &str) -> RankLoad {
    core.list_workers(None)
        .into_iter()
        .find(|w| w.record.spec.name == name)
        .and_then(|w| w.loads.first().copied())
        .unwrap_or_default()
}

fn idle(core: &Core) -> bool {
    ["p", "d1", "d2"]
        .iter()
        .all(|n| load(core, n) == RankLoad::default())
}

#[test]
fn a_long_prompt_is_split_and_both_ranks_are_booked() {
    let core = fleet();
    let now = Instant::now();
    let (s, _) = core
        .select_and_reserve(&request("r", 2048, Holder::Stream), now)
        .unwrap();
    let prefill = s.prefill.clone().expect("2048 uncached tokens split");
    assert_eq!(prefill.worker_name, "p");
    assert_ne!(
        s.primary.worker_name, "p",
        "a prefill rank is never the destination"
    );
    let decode = s.primary.worker_name.clone();
    assert_eq!(
        load(&core, "p"),
        RankLoad {
            active_prefill_tokens: 2048,
            active_decode_blocks: 128,
            active_requests: 1
        }
    );
    assert_eq!(
        load(&core, &decode),
        RankLoad {
            active_prefill_tokens: 0,
            active_decode_blocks: 128,
            active_requests: 1
        },
        "the decode rank pulls the KV: no prefill queued there"
    );
    // First token: the prefill rank is done, the decode rank decodes on.
    let claim = Claim::Generation(s.generation);
    assert!(core.mark_prefill_complete("r", claim, now).0);
    assert_eq!(load(&core, "p"), RankLoad::default());
    assert_eq!(load(&core, &decode).active_requests, 1);
    // A repeated mark frees nothing twice.
    assert!(core.mark_prefill_complete("r", claim, now).0);
    assert_eq!(load(&core, &decode).active_decode_blocks, 128);
    assert!(core.free("r", claim, now).0);
    assert!(idle(&core));
    assert!(!core.free("r", claim, now).0, "freed exactly once");
    assert!(idle(&core));
}

#[test]
fn a_free_before_the_first_token_frees_both_ranks() {
    let core = fleet();
    let now = Instant::now();
    let (s, _) = core
        .select_and_reserve(&request("r", 2048, Holder::Stream), now)
        .unwrap();
    assert!(s.prefill.is_some());
    assert!(core.free("r", Claim::Generation(s.generation), now).0);
    assert!(idle(&core));
    assert_eq!(core.live_bookings(), 0);
}

#[test]
fn a_short_uncached_part_prefills_on_the_decode_rank() {
    let core = fleet();
    let now = Instant::now();
    let (s, _) = core
        .select_and_reserve(&request("r", 256, Holder::Stream), now)
        .unwrap();
    assert!(
        s.prefill.is_none(),
        "256 tokens are under the 512 threshold"
    );
    assert_ne!(s.primary.worker_name, "p");
    assert_eq!(load(&core, "p"), RankLoad::default());
    assert_eq!(
        load(&core, &s.primary.worker_name).active_prefill_tokens,
        256
    );
    assert!(core.free("r", Claim::Generation(s.generation), now).0);
    assert!(idle(&core));
}

#[test]
fn without_roles_nothing_is_split() {
    let core = core_of(vec![worker("a", 1, Role::Both), worker("b", 2, Role::Both)]);
    let (s, _) = core
        .select_and_reserve(&request("r", 4096, Holder::Stream), Instant::now())
        .unwrap();
    assert!(s.prefill.is_none());
}

#[test]
fn the_prefill_rank_leaving_keeps_the_decode_booking() {
    let core = fleet();
    let now = Instant::now();
    let (s, _) = core
        .select_and_reserve(&request("r", 2048, Holder::Stream), now)
        .unwrap();
    let decode = s.primary.worker_name.clone();
    core.delete_source_worker("catalog", "p", now).unwrap();
    assert_eq!(core.live_bookings(), 1);
    assert_eq!(load(&core, &decode).active_requests, 1);
    let claim = Claim::Generation(s.generation);
    assert!(core.mark_prefill_complete("r", claim, now).0);
    assert_eq!(load(&core, &decode).active_decode_blocks, 128);
    // The prefill worker comes back: the old leg must not be taken off its fresh rank.
    core.upsert_source_worker("catalog", worker("p", 1, Role::Prefill), now)
        .unwrap();
    let (other, _) = core
        .select_and_reserve(&request("o", 2048, Holder::Stream), now)
        .unwrap();
    assert_eq!(other.prefill.map(|p| p.worker_name).as_deref(), Some("p"));
    assert!(core.free("r", claim, now).0);
    assert_eq!(
        load(&core, "p").active_prefill_tokens,
        2048,
        "o's leg stays"
    );
    assert!(core.free("o", Claim::Generation(other.generation), now).0);
    assert!(idle(&core));
}

#[test]
fn the_decode_rank_leaving_frees_the_prefill_leg() {
    let core = fleet();
    let now = Instant::now();
    let (s, _) = core
        .select_and_reserve(&request("r", 2048, Holder::Stream), now)
        .unwrap();
    core.delete_source_worker("catalog", &s.primary.worker_name, now)
        .unwrap();
    assert_eq!(core.live_bookings(), 0);
    assert!(idle(&core));
    assert!(!core.free("r", Claim::Generation(s.generation), now).0);
    assert!(
        !core
            .mark_prefill_complete("r", Claim::Generation(s.generation), now)
            .0
    );
    assert!(idle(&core));
}

#[test]
fn an_expired_api_booking_frees_both_ranks_and_api_free_frees_once() {
    let core = fleet();
    let t0 = Instant::now();
    let (s, _) = core
        .select_and_reserve(&request("a", 2048, Holder::Api), t0)
        .unwrap();
    assert!(s.prefill.is_some());
    let (reaped, _) = core.reap_expired(t0 + Duration::from_secs(301));
    assert_eq!(reaped, 1);
    assert!(idle(&core));
    assert!(!core.free("a", Claim::HeldBy(Holder::Api), t0).0);
    let (s, _) = core
        .select_and_reserve(&request("b", 2048, Holder::Api), t0)
        .unwrap();
    assert!(s.prefill.is_some());
    assert!(core.free("b", Claim::HeldBy(Holder::Api), t0).0);
    assert!(!core.free("b", Claim::HeldBy(Holder::Api), t0).0);
    assert!(idle(&core));
}

#[test]
fn a_moved_booking_moves_the_decode_side_only() {
    let core = fleet();
    let now = Instant::now();
    let (s, _) = core
        .select_and_reserve(&request("r", 2048, Holder::Stream), now)
        .unwrap();
    let (from, to) = if s.primary.worker_name == "d1" {
        ("d1", "d2")
    } else {
        ("d2", "d1")
    };
    let served = if to == "d1" {
        "127.0.0.1:2"
    } else {
        "127.0.0.1:3"
    };
    let claim = Claim::Generation(s.generation);
    assert!(core.move_booking("r", claim, served.parse().unwrap()).0);
    assert_eq!(load(&core, from), RankLoad::default());
    assert_eq!(load(&core, to).active_decode_blocks, 128);
    assert_eq!(
        load(&core, "p").active_prefill_tokens,
        2048,
        "the leg stays"
    );
    assert!(core.mark_prefill_complete("r", claim, now).0);
    assert_eq!(load(&core, "p"), RankLoad::default());
    assert!(core.free("r", claim, now).0);
    assert!(idle(&core));
}

#[test]
fn a_session_follows_its_decode_rank_and_the_prefill_is_rechosen() {
    let core = fleet();
    let now = Instant::now();
    let with_session = |id: &str| SelectionRequest {
        session_id: Some("s".into()),
        ..request(id, 2048, Holder::Stream)
    };
    let (first, _) = core.select_and_reserve(&with_session("r1"), now).unwrap();
    let (second, _) = core.select_and_reserve(&with_session("r2"), now).unwrap();
    assert_eq!(first.primary.worker_name, second.primary.worker_name);
    assert_ne!(second.primary.worker_name, "p");
    for s in [first, second] {
        assert!(
            core.free(&s.booking_id, Claim::Generation(s.generation), now)
                .0
        );
    }
    assert!(idle(&core));
}

#[test]
fn a_dp_worker_declares_one_role_per_rank() {
    let dp = WorkerSpec {
        roles: vec![Role::Prefill, Role::Decode],
        ..WorkerSpec::for_test("dp", "m", RankLayout::PerPort(vec![10, 11]))
    };
    let core = core_of(vec![dp]);
    let (s, _) = core
        .select_and_reserve(&request("r", 2048, Holder::Stream), Instant::now())
        .unwrap();
    assert_eq!((s.primary.key.dp_rank, s.primary.endpoint.port()), (1, 11));
    let prefill = s.prefill.expect("rank 0 prefills");
    assert_eq!((prefill.key.dp_rank, prefill.endpoint.port()), (0, 10));
    // Three roles for two ranks: the worker is kept out of scheduling.
    let bad = WorkerSpec {
        roles: vec![Role::Prefill, Role::Decode, Role::Decode],
        ..WorkerSpec::for_test("bad", "m", RankLayout::PerPort(vec![10, 11]))
    };
    let core = Core::new(config());
    core.apply_source_snapshot("catalog", vec![bad], Instant::now())
        .unwrap();
    let err = core.select_and_reserve(&request("r", 16, Holder::Stream), Instant::now());
    assert!(err.is_err());
}

fn inflight(facts: &crate::Facts) -> i64 {
    facts
        .iter()
        .map(|f| match f {
            crate::Fact::Inflight(n) => *n,
            _ => 0,
        })
        .sum()
}

/// The in-flight gauge counts a split pick as its two requests (decode booking and prefill leg)
/// and takes each off exactly once: the prefill rank leaving never drives it negative.
#[test]
fn the_inflight_gauge_counts_prefill_legs_in_and_out() {
    let core = fleet();
    let now = Instant::now();
    let mut gauge = 0;
    let (s, facts) = core
        .select_and_reserve(&request("r", 2048, Holder::Stream), now)
        .unwrap();
    assert!(s.prefill.is_some());
    gauge += inflight(&facts);
    assert_eq!(gauge, 2, "decode booking + prefill leg");
    let (_, _, facts) = core.delete_source_worker("catalog", "p", now).unwrap();
    gauge += inflight(&facts);
    assert_eq!(gauge, 1, "the leg left with its rank");
    let claim = Claim::Generation(s.generation);
    let (_, facts) = core.free("r", claim, now);
    gauge += inflight(&facts);
    assert_eq!(gauge, 0);
    // And a leg freed at the first token.
    let fresh = fleet();
    let (s, facts) = fresh
        .select_and_reserve(&request("r", 2048, Holder::Stream), now)
        .unwrap();
    let mut gauge = inflight(&facts);
    let claim = Claim::Generation(s.generation);
    gauge += inflight(&fresh.mark_prefill_complete("r", claim, now).1);
    assert_eq!(gauge, 1);
    gauge += inflight(&fresh.free("r", claim, now).1);
    assert_eq!(gauge, 0);
}

/// The decode booking that survives its prefill rank keeps its SLO and TPOT record: its first
/// token settles the TTFT SLO and its end the TPOT SLO (but is no TTFT observation).
#[test]
fn a_decode_booking_whose_prefill_rank_left_still_settles_its_slos() {
    let core = fleet();
    let now = Instant::now();
    let r = SelectionRequest {
        slo_ttft_ms: Some(60_000),
        slo_tpot_ms: Some(60_000),
        ..request("r", 2048, Holder::Stream)
    };
    let (s, _) = core.select_and_reserve(&r, now).unwrap();
    assert!(s.prefill.is_some());
    core.delete_source_worker("catalog", "p", now).unwrap();
    let claim = Claim::Generation(s.generation);
    let later = now + Duration::from_millis(200);
    let (_, facts) = core.mark_prefill_complete("r", claim, later);
    assert!(facts
        .iter()
        .any(|f| matches!(f, crate::Fact::SloTtft { met: true, .. })));
    assert!(!facts
        .iter()
        .any(|f| matches!(f, crate::Fact::TtftObserved { .. })));
    let (_, facts) = core.decode_complete("r", claim, 100, later + Duration::from_secs(1));
    assert!(facts
        .iter()
        .any(|f| matches!(f, crate::Fact::SloTpot { met: true, .. })));
}

/// With flow control, a saturated prefill rank is not chosen even when it caches the prompt:
/// another prefill rank takes the split, and with every prefill rank saturated (the cost still
/// preferring a split to a local prefill) the request waits.
#[test]
fn a_saturated_prefill_rank_is_not_chosen() {
    use std::collections::HashMap;
    let core = Core::new(CoreConfig {
        flow: crate::FlowConfig {
            saturation: crate::SaturationLimits {
                max_wait_seconds: None,
                max_active_requests: Some(1),
                engine_waiting: None,
                engine_kv_usage: None,
            },
            ..crate::FlowConfig::default()
        },
        ..config()
    });
    core.apply_source_snapshot(
        "catalog",
        vec![
            worker("p1", 1, Role::Prefill),
            worker("p2", 2, Role::Prefill),
            worker("d", 3, Role::Decode),
        ],
        Instant::now(),
    )
    .unwrap();
    let now = Instant::now();
    let key_of = |name: &str| {
        let r = core
            .records()
            .into_iter()
            .find(|r| r.spec.name == name)
            .unwrap();
        crate::RankKey {
            worker_id: r.id,
            dp_rank: 0,
        }
    };
    let (p1, p2) = (key_of("p1"), key_of("p2"));
    let tokens: Vec<u32> = (0..2048).collect();
    let hashes = crate::hash::prompt_hashes(&tokens, 16, crate::hash::BASE_SEED);
    let partition = crate::PartitionKey {
        model: "m".into(),
        routing_group: String::new(),
    };
    core.insert_blocks(&partition, p1, &hashes, crate::index::Tier::Gpu, None, now);
    // p1 caches the whole prompt: the cost splits onto it while it has room.
    let (s, _) = core
        .select(&request("probe", 2048, Holder::Stream), now)
        .unwrap();
    assert_eq!(s.prefill.map(|p| p.key), Some(p1));
    let busy = RankLoad {
        active_requests: 1,
        ..RankLoad::default()
    };
    core.set_remote_loads(&HashMap::from([(p1, busy)]));
    let (result, _) = core.admit(&request("r1", 2048, Holder::Stream), now);
    let Ok(crate::core::Admission::Dispatched(s)) = result else {
        panic!("{result:?}");
    };
    assert_eq!(s.prefill.map(|p| p.key), Some(p2), "not the saturated p1");
    core.free("r1", Claim::Generation(s.generation), now);
    core.set_remote_loads(&HashMap::from([(p1, busy), (p2, busy)]));
    // A prompt only p1 caches (r1's is on d now).
    let other: Vec<u32> = (5_000..7_048).collect();
    let hashes = crate::hash::prompt_hashes(&other, 16, crate::hash::BASE_SEED);
    core.insert_blocks(&partition, p1, &hashes, crate::index::Tier::Gpu, None, now);
    let r2 = SelectionRequest {
        prompt: PromptInput::Tokens(other),
        ..request("r2", 0, Holder::Stream)
    };
    let (result, _) = core.admit(&r2, now);
    assert!(
        matches!(result, Ok(crate::core::Admission::Queued { .. })),
        "{result:?}"
    );
}

/// A release pass over a P/D partition whose decode ranks are all saturated tries nothing: an
/// idle prefill-only rank is no room (every request needs a decode rank). Each attempt claims a
/// booking generation, so the next booking's generation counts the attempts made.
#[test]
fn an_idle_prefill_rank_is_no_room_for_a_release_pass() {
    let core = Core::new(CoreConfig {
        flow: crate::FlowConfig {
            saturation: crate::SaturationLimits {
                max_wait_seconds: None,
                max_active_requests: Some(1),
                engine_waiting: None,
                engine_kv_usage: None,
            },
            ..crate::FlowConfig::default()
        },
        ..config()
    });
    core.apply_source_snapshot(
        "catalog",
        vec![worker("p", 1, Role::Prefill), worker("d", 2, Role::Decode)],
        Instant::now(),
    )
    .unwrap();
    let now = Instant::now();
    // A short prompt prefills on d: d is saturated, p idle.
    let (result, _) = core.admit(&request("busy", 16, Holder::Stream), now);
    let Ok(crate::core::Admission::Dispatched(busy)) = result else {
        panic!("{result:?}");
    };
    assert!(busy.prefill.is_none());
    for i in 0..3 {
        let (result, _) = core.admit(&request(&format!("w{i}"), 16, Holder::Stream), now);
        assert!(matches!(result, Ok(crate::core::Admission::Queued { .. })));
    }
    for _ in 0..5 {
        core.pump(now);
    }
    let (_, facts) = core.free("busy", Claim::Generation(busy.generation), now);
    let released = facts.iter().find_map(|f| match f {
        crate::Fact::Dequeued {
            result: Ok(selection),
            ..
        } => Some(selection.generation),
        _ => None,
    });
    // w0's one attempt on arrival (an empty queue is tried at once), then its dispatch.
    assert_eq!(
        released,
        Some(busy.generation + 2),
        "no attempt while d was saturated"
    );
}
