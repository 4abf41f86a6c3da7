//! Held bookings (ARCHITECTURE.md §3): a prefill past its expected time without a first byte
//! decays to its request slot, and bookings an engine does not show are reconciled, with
//! explicit instants (the core has no clock).
use super::*;
use crate::catalog::RankLayout;
use crate::config::BookingBounds;
use crate::flow::{FlowConfig, SaturationLimits};
use crate::request::PromptInput;
use crate::EngineMetrics;
use std::time::Duration;

/// One rank, saturated by prefill (0.5 s of booked wait) as by default, or by `max_requests`;
/// engine readings stay fresh for a minute (the tests read every few seconds).
fn core_with(max_requests: Option<u64>) -> Core {
    let core = Core::new(CoreConfig {
        seed: Some(1),
        engine_metrics_max_age: Duration::from_secs(60),
        flow: FlowConfig {
            saturation: SaturationLimits {
                max_wait_seconds: Some(0.5),
                max_active_requests: max_requests,
                engine_waiting: None,
                engine_kv_usage: None,
            },
            ..FlowConfig::default()
        },
        ..CoreConfig::default()
    });
    let spec = WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![8000]));
    core.apply_source_snapshot("catalog", vec![spec], Instant::now())
        .unwrap();
    core
}

/// A request whose prompt shares no block with another id's (ids differ in their first byte).
fn request(id: &str, tokens: usize) -> SelectionRequest {
    let base = u32::from(id.as_bytes()[0]) * 1_000_000;
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::Tokens((base..base + tokens as u32).collect()),
        ..Default::default()
    }
}

fn dispatched(core: &Core, r: &SelectionRequest, now: Instant) -> Selection {
    match core.admit(r, now).0 {
        Ok(Admission::Dispatched(s)) => *s,
        other => panic!("expected a dispatch, got {other:?}"),
    }
}

fn load(core: &Core) -> RankLoad {
    core.list_workers(None)[0].loads[0]
}

fn rank(core: &Core) -> RankKey {
    let w = &core.list_workers(None)[0].record;
    RankKey {
        worker_id: w.id,
        dp_rank: 0,
    }
}

fn count(facts: &Facts, f: impl Fn(&Fact) -> Option<u64>) -> u64 {
    facts.iter().filter_map(f).sum()
}

fn decayed(facts: &Facts) -> u64 {
    count(facts, |f| match f {
        Fact::BookingsDecayed(n) => Some(*n),
        _ => None,
    })
}

fn reconciled(facts: &Facts) -> u64 {
    count(facts, |f| match f {
        Fact::BookingsReconciled(n) => Some(*n),
        _ => None,
    })
}

fn inflight(facts: &Facts) -> i64 {
    facts
        .iter()
        .map(|f| match f {
            Fact::Inflight(n) => *n,
            _ => 0,
        })
        .sum()
}

fn expected(s: &Selection) -> Duration {
    BookingBounds::default().expected_prefill(s.predicted_ttft_seconds)
}

#[test]
fn expected_prefill_is_the_prediction_times_the_margin_over_the_floor() {
    let b = BookingBounds::default();
    assert_eq!(b.expected_prefill(0.01), Duration::from_secs(2));
    assert_eq!(b.expected_prefill(1.0), Duration::from_secs(3));
    // A 200k-token prefill at the prior's 50 µs a token: 10 s predicted, counted for 30 s.
    assert_eq!(b.expected_prefill(10.0), Duration::from_secs(30));
    assert_eq!(b.expected_prefill(f64::NAN), Duration::from_secs(2));
    assert_eq!(b.expected_prefill(f64::INFINITY), Duration::from_secs(2));
    assert_eq!(b.expected_prefill(1e30), Duration::from_secs(3600));
}

#[test]
fn a_held_prefill_stops_saturating_its_rank_at_its_expected_time_and_keeps_its_slot() {
    let core = core_with(None);
    let t0 = Instant::now();
    // 25,000 tokens (a 100 KB body): 1.27 s predicted at the prior, over the 0.5 s of wait.
    let held = dispatched(&core, &request("held", 25_000), t0);
    let deadline = t0 + expected(&held);
    assert!(expected(&held) > Duration::from_secs(3));
    let waiting = flow_tests::queued(&core, &request("good", 64), t0);
    // Just before the deadline: still saturated, nothing decays, nothing is released.
    let facts = core.decay_bookings(deadline - Duration::from_millis(1));
    assert_eq!(decayed(&facts), 0);
    assert!(flow_tests::released(&core.pump(deadline - Duration::from_millis(1))).is_empty());
    assert_eq!(load(&core).active_prefill_tokens, 25_000);
    // At it: the prefill stops counting, the waiting request is released onto the rank.
    let facts = core.decay_bookings(deadline);
    assert_eq!(decayed(&facts), 1);
    let out = flow_tests::released(&facts);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, waiting);
    let good = out[0].1.clone().unwrap();
    let l = load(&core);
    assert_eq!(l.active_requests, 2, "the held booking keeps its slot");
    assert_eq!(
        l.active_prefill_tokens, 64,
        "only the good request's prefill"
    );
    // Its late first byte takes nothing more off; the free takes its slot.
    assert!(
        core.mark_prefill_complete("held", Claim::Generation(held.generation), deadline)
            .0
    );
    assert_eq!(load(&core).active_prefill_tokens, 64);
    assert!(
        core.free("held", Claim::Generation(held.generation), deadline)
            .0
    );
    assert!(
        core.free("good", Claim::Generation(good.generation), deadline)
            .0
    );
    assert_eq!(load(&core), RankLoad::default());
    // Decaying again later finds nothing (the entries of freed bookings are skipped).
    assert_eq!(
        decayed(&core.decay_bookings(deadline + Duration::from_secs(60))),
        0
    );
}

#[test]
fn a_short_prefill_decays_at_the_floor_and_a_pick_decays_what_is_due_first() {
    let core = core_with(Some(2));
    let t0 = Instant::now();
    let a = dispatched(&core, &request("a", 64), t0);
    assert_eq!(expected(&a), Duration::from_secs(2));
    let floor = t0 + Duration::from_secs(2);
    let _ = dispatched(&core, &request("b", 64), floor - Duration::from_millis(1));
    assert_eq!(load(&core).active_prefill_tokens, 128);
    // Saturated by requests (2): the pick queues, but decays `a`'s prefill first.
    let (admitted, facts) = core.admit(&request("c", 64), floor);
    assert!(matches!(admitted, Ok(Admission::Queued { .. })));
    assert_eq!(decayed(&facts), 1);
    assert_eq!(load(&core).active_prefill_tokens, 64);
    assert_eq!(load(&core).active_requests, 2);
}

#[test]
fn a_prefill_that_completes_in_time_never_decays() {
    let core = core_with(None);
    let t0 = Instant::now();
    let s = dispatched(&core, &request("r", 25_000), t0);
    core.mark_prefill_complete(
        "r",
        Claim::Generation(s.generation),
        t0 + Duration::from_secs(1),
    );
    assert_eq!(
        decayed(&core.decay_bookings(t0 + Duration::from_secs(60))),
        0
    );
    assert_eq!(load(&core).active_requests, 1);
}

fn reading(running: u64, waiting: u64, at: Instant) -> EngineMetrics {
    EngineMetrics {
        waiting,
        running,
        kv_usage: 0.0,
        adapters: Vec::new().into(),
        max_adapters: None,
        at,
    }
}

#[test]
fn bookings_the_engine_does_not_show_for_the_window_are_reconciled_oldest_first() {
    let core = core_with(Some(2));
    let key = rank(&core);
    let t0 = Instant::now();
    let old = dispatched(&core, &request("old", 64), t0);
    let young = dispatched(&core, &request("young", 64), t0 + Duration::from_secs(1));
    let mut facts = Facts::default();
    let mut record = |running, at| {
        let (known, f) = core.record_engine_metrics(key, reading(running, 0, at));
        assert!(known);
        let n = reconciled(&f);
        facts.0.extend(f.0);
        n
    };
    // The engine shows one request from t0 + 2 s: the window starts there.
    let start = t0 + Duration::from_secs(2);
    assert_eq!(record(1, start), 0);
    // Just short of 15 s: nothing.
    assert_eq!(record(1, start + Duration::from_millis(14_999)), 0);
    // At 15 s: one booking too many; the oldest goes, the other keeps its load.
    assert_eq!(record(1, start + Duration::from_secs(15)), 1);
    let l = load(&core);
    assert_eq!(l.active_requests, 1);
    assert_eq!(l.active_decode_blocks, 4);
    assert_eq!(inflight(&facts), -1);
    // The reconciled booking is still its stream's: its first byte, move and free change
    // nothing on the rank, and the young one's free leaves the rank idle, never negative.
    let later = start + Duration::from_secs(16);
    assert!(
        core.mark_prefill_complete("old", Claim::Generation(old.generation), later)
            .0
    );
    let (freed, f) = core.free("old", Claim::Generation(old.generation), later);
    assert!(freed);
    assert_eq!(inflight(&f), 0);
    assert_eq!(load(&core).active_requests, 1);
    assert!(!core.free("old", Claim::Generation(old.generation), later).0);
    let (freed, f) = core.free("young", Claim::Generation(young.generation), later);
    assert!(freed);
    assert_eq!(inflight(&f), -1);
    assert_eq!(load(&core), RankLoad::default());
}

#[test]
fn a_reading_that_shows_every_booking_restarts_the_window() {
    let core = core_with(Some(1));
    let key = rank(&core);
    let t0 = Instant::now();
    let _held = dispatched(&core, &request("held", 64), t0);
    let waiting = flow_tests::queued(&core, &request("next", 64), t0);
    let at = |s: u64| t0 + Duration::from_secs(s);
    assert_eq!(
        reconciled(&core.record_engine_metrics(key, reading(0, 0, at(1))).1),
        0
    );
    // The engine shows it again at 10 s: the window restarts.
    assert_eq!(
        reconciled(&core.record_engine_metrics(key, reading(1, 0, at(10))).1),
        0
    );
    assert_eq!(
        reconciled(&core.record_engine_metrics(key, reading(0, 0, at(11))).1),
        0
    );
    assert_eq!(
        reconciled(&core.record_engine_metrics(key, reading(0, 0, at(25))).1),
        0
    );
    // 15 s after 11 s: reconciled, and the waiting request is released in the same call.
    let (_, facts) = core.record_engine_metrics(key, reading(0, 0, at(26)));
    assert_eq!(reconciled(&facts), 1);
    let out = flow_tests::released(&facts);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, waiting);
    assert_eq!(load(&core).active_requests, 1);
}

#[test]
fn only_bookings_older_than_the_window_are_reconciled() {
    let core = core_with(None);
    let key = rank(&core);
    let t0 = Instant::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let _ = dispatched(&core, &request("old", 64), t0);
    assert_eq!(
        reconciled(&core.record_engine_metrics(key, reading(0, 0, at(1))).1),
        0
    );
    // Booked after the window opened: the engine may simply not have it yet.
    let _ = dispatched(&core, &request("new", 64), at(10));
    let (_, facts) = core.record_engine_metrics(key, reading(0, 0, at(16)));
    assert_eq!(reconciled(&facts), 1);
    assert_eq!(load(&core).active_requests, 1);
}

#[test]
fn reconciliation_off_keeps_every_booking() {
    let core = Core::new(CoreConfig {
        bookings: BookingBounds {
            reconcile_after: None,
            ..BookingBounds::default()
        },
        ..CoreConfig::default()
    });
    let spec = WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![8000]));
    core.apply_source_snapshot("catalog", vec![spec], Instant::now())
        .unwrap();
    let key = rank(&core);
    let t0 = Instant::now();
    let _ = core.select_and_reserve(&request("r", 64), t0).unwrap();
    for s in [1, 100, 1000] {
        let at = t0 + Duration::from_secs(s);
        assert_eq!(
            reconciled(&core.record_engine_metrics(key, reading(0, 0, at)).1),
            0
        );
    }
    assert_eq!(load(&core).active_requests, 1);
}

#[test]
fn a_gap_in_readings_longer_than_their_freshness_restarts_the_window() {
    let core = Core::new(CoreConfig {
        engine_metrics_max_age: Duration::from_secs(1),
        ..CoreConfig::default()
    });
    let spec = WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![8000]));
    core.apply_source_snapshot("catalog", vec![spec], Instant::now())
        .unwrap();
    let key = rank(&core);
    let t0 = Instant::now();
    let _ = core.select_and_reserve(&request("r", 64), t0).unwrap();
    let ms = |m: u64| t0 + Duration::from_millis(m);
    // Readings 1 s apart (at their freshness): the window runs from the first.
    for m in (0..15_000).step_by(1000) {
        assert_eq!(
            reconciled(&core.record_engine_metrics(key, reading(0, 0, ms(m))).1),
            0
        );
    }
    // 1.001 s later (just over), where the window would have closed: the scraper saw nothing
    // in between, so the window restarts instead.
    assert_eq!(
        reconciled(&core.record_engine_metrics(key, reading(0, 0, ms(15_001))).1),
        0
    );
    assert_eq!(load(&core).active_requests, 1);
    for m in (16_001..30_001).step_by(1000) {
        assert_eq!(
            reconciled(&core.record_engine_metrics(key, reading(0, 0, ms(m))).1),
            0
        );
    }
    assert_eq!(
        reconciled(&core.record_engine_metrics(key, reading(0, 0, ms(30_001))).1),
        1
    );
}
