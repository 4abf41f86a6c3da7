//! Flow control through [`Core`]: admission, release order, fairness, expiry, cancellation
//! and SLOs, with explicit instants (the core has no clock).
use super::*;
use crate::catalog::RankLayout;
use crate::facts::{QueueEvent, QueueExit};
use crate::flow::{FlowConfig, SaturationLimits};
use crate::request::PromptInput;
use std::time::Duration;

/// One rank that takes `per_rank` requests before it is saturated.
fn core_with(per_rank: u64, workers: &[&str], flow: FlowConfig) -> Core {
    let core = Core::new(CoreConfig {
        seed: Some(1),
        flow: FlowConfig {
            saturation: SaturationLimits {
                max_wait_seconds: None,
                max_active_requests: Some(per_rank),
                engine_waiting: None,
                engine_kv_usage: None,
            },
            ..flow
        },
        ..CoreConfig::default()
    });
    let specs = workers
        .iter()
        .enumerate()
        .map(|(i, name)| {
            WorkerSpec::for_test(name, "m", RankLayout::PerPort(vec![8000 + i as u16]))
        })
        .collect();
    core.apply_source_snapshot("catalog", specs, Instant::now())
        .unwrap();
    core
}

fn request(id: &str, priority: i32, key: &str) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::Tokens(vec![7; 64]),
        priority,
        fairness_key: Some(key.into()),
        ..Default::default()
    }
}

fn dispatched(core: &Core, r: &SelectionRequest, now: Instant) -> Selection {
    match core.admit(r, now).0 {
        Ok(Admission::Dispatched(s)) => *s,
        other => panic!("expected a dispatch, got {other:?}"),
    }
}

fn queued(core: &Core, r: &SelectionRequest, now: Instant) -> u64 {
    match core.admit(r, now).0 {
        Ok(Admission::Queued { ticket, .. }) => ticket,
        other => panic!("expected to queue, got {other:?}"),
    }
}

/// The tickets released in `facts`, in order, with their outcomes.
fn released(facts: &Facts) -> Vec<(u64, Result<Selection, SelectError>)> {
    facts
        .iter()
        .filter_map(|f| match f {
            Fact::Dequeued { ticket, result } => Some((*ticket, result.clone().map(|s| *s))),
            _ => None,
        })
        .collect()
}

fn free(core: &Core, s: &Selection, now: Instant) -> Facts {
    let (freed, facts) = core.free(&s.booking_id, Claim::Generation(s.generation), now);
    assert!(freed);
    facts
}

#[test]
fn a_saturated_fleet_queues_and_a_freed_booking_releases_the_next() {
    let core = core_with(1, &["a"], FlowConfig::default());
    let now = Instant::now();
    let first = dispatched(&core, &request("r1", 0, ""), now);
    let ticket = queued(&core, &request("r2", 0, ""), now);
    assert_eq!(core.waiting_requests(), 1);
    assert_eq!(
        core.live_bookings(),
        1,
        "a waiting request holds no booking"
    );
    let facts = free(&core, &first, now + Duration::from_millis(5));
    let out = released(&facts);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, ticket);
    let second = out[0].1.clone().unwrap();
    assert_eq!(second.booking_id, "r2");
    assert_eq!(core.live_bookings(), 1);
    assert_eq!(core.waiting_requests(), 0);
    assert!(facts.iter().any(|f| matches!(
        f,
        Fact::Queue { event: QueueEvent::Dispatched { waited_seconds }, .. }
            if (*waited_seconds - 0.005).abs() < 1e-9
    )));
    // The released booking is an ordinary one: freed once, then gone.
    free(&core, &second, now);
    assert_eq!(core.live_bookings(), 0);
    assert!(!core.free("r2", Claim::Any, now).0);
}

#[test]
fn release_is_by_priority_band_then_arrival() {
    let core = core_with(1, &["a"], FlowConfig::default());
    let now = Instant::now();
    let mut running = dispatched(&core, &request("busy", 0, ""), now);
    let low = queued(&core, &request("low", -1, ""), now);
    let normal1 = queued(&core, &request("normal1", 0, ""), now);
    let high = queued(&core, &request("high", 5, ""), now);
    let normal2 = queued(&core, &request("normal2", 0, ""), now);
    let mut order = Vec::new();
    for _ in 0..4 {
        let out = released(&free(&core, &running, now));
        assert_eq!(out.len(), 1);
        order.push(out[0].0);
        running = out[0].1.clone().unwrap();
    }
    assert_eq!(order, vec![high, normal1, normal2, low]);
}

#[test]
fn two_tenants_share_a_band_equally_while_both_are_backlogged() {
    let core = core_with(1, &["a"], FlowConfig::default());
    let now = Instant::now();
    let mut running = dispatched(&core, &request("busy", 0, ""), now);
    let mut tenant_of = HashMap::new();
    // 4:1 arrivals, interleaved as they would arrive.
    for i in 0..50 {
        let key = if i % 5 == 4 { "small" } else { "big" };
        tenant_of.insert(queued(&core, &request(&format!("r{i}"), 0, key), now), key);
    }
    let mut small = 0;
    for _ in 0..20 {
        let out = released(&free(&core, &running, now));
        let (ticket, result) = out.into_iter().next().unwrap();
        small += usize::from(tenant_of[&ticket] == "small");
        running = result.unwrap();
    }
    // Both backlogged (small has 10 waiting): each gets half of the 20 releases.
    assert_eq!(small, 10);
}

#[test]
fn the_queue_timeout_gives_503_or_429_for_sheddable_requests() {
    let flow = FlowConfig {
        queue_timeout: Duration::from_secs(2),
        ..FlowConfig::default()
    };
    let core = core_with(1, &["a"], flow);
    let now = Instant::now();
    let _running = dispatched(&core, &request("busy", 0, ""), now);
    let normal = queued(&core, &request("normal", 0, ""), now);
    let sheddable = queued(&core, &request("sheddable", -1, ""), now);
    assert_eq!(
        core.next_queue_deadline(),
        Some(now + Duration::from_secs(2))
    );
    assert!(released(&core.pump(now + Duration::from_secs(1))).is_empty());
    let facts = core.pump(now + Duration::from_secs(2));
    let out: HashMap<u64, SelectError> = released(&facts)
        .into_iter()
        .map(|(t, r)| (t, r.unwrap_err()))
        .collect();
    assert_eq!(out[&normal].label(), "unavailable");
    assert!(
        out[&normal].to_string().contains("queue timeout"),
        "{}",
        out[&normal]
    );
    assert_eq!(out[&sheddable].label(), "overloaded");
    assert_eq!(core.waiting_requests(), 0);
    let timeouts = facts
        .iter()
        .filter(|f| {
            matches!(
                f,
                Fact::Queue {
                    event: QueueEvent::Left {
                        exit: QueueExit::Timeout,
                        ..
                    },
                    ..
                }
            )
        })
        .count();
    assert_eq!(timeouts, 2);
}

#[test]
fn the_hosts_timer_expires_one_request_and_only_once() {
    let core = core_with(1, &["a"], FlowConfig::default());
    let now = Instant::now();
    let running = dispatched(&core, &request("busy", 0, ""), now);
    let t = queued(&core, &request("late", 0, ""), now);
    let (error, _) = core.expire_waiting(t, now + Duration::from_secs(30));
    assert_eq!(error.unwrap().label(), "unavailable");
    assert!(core.expire_waiting(t, now).0.is_none());
    assert!(released(&free(&core, &running, now)).is_empty());
}

#[test]
fn a_cancelled_request_leaves_the_queue_and_is_never_booked() {
    let core = core_with(1, &["a"], FlowConfig::default());
    let now = Instant::now();
    let running = dispatched(&core, &request("busy", 0, ""), now);
    let gone = queued(&core, &request("gone", 0, ""), now);
    let next = queued(&core, &request("next", 0, ""), now);
    assert!(core.cancel_waiting(gone, now).0);
    assert!(!core.cancel_waiting(gone, now).0, "cancelled once");
    let out = released(&free(&core, &running, now));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, next);
    assert_eq!(core.live_bookings(), 1);
    // Cancelling a request that was already released does nothing (the host frees its
    // booking through the released reservation).
    assert!(!core.cancel_waiting(next, now).0);
}

#[test]
fn a_full_band_refuses_at_once() {
    let flow = FlowConfig {
        band_capacity: 1,
        ..FlowConfig::default()
    };
    let core = core_with(1, &["a"], flow);
    let now = Instant::now();
    let _running = dispatched(&core, &request("busy", 0, ""), now);
    queued(&core, &request("w1", 0, ""), now);
    let (result, facts) = core.admit(&request("w2", 0, ""), now);
    assert_eq!(result.unwrap_err().label(), "unavailable");
    assert!(facts.iter().any(|f| matches!(
        f,
        Fact::Queue {
            event: QueueEvent::Left {
                exit: QueueExit::Full,
                ..
            },
            ..
        }
    )));
    // Another band still has room; a sheddable arrival to a full band gets 429.
    queued(&core, &request("s1", -1, ""), now);
    assert_eq!(
        core.admit(&request("s2", -1, ""), now)
            .0
            .unwrap_err()
            .label(),
        "overloaded"
    );
}

#[test]
fn a_rank_joining_releases_waiting_requests() {
    let core = core_with(1, &["a"], FlowConfig::default());
    let now = Instant::now();
    let _running = dispatched(&core, &request("busy", 0, ""), now);
    let t = queued(&core, &request("w", 0, ""), now);
    let specs = vec![
        WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![8000])),
        WorkerSpec::for_test("b", "m", RankLayout::PerPort(vec![8001])),
    ];
    let (_, facts) = core.apply_source_snapshot("catalog", specs, now).unwrap();
    let out = released(&facts);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, t);
    assert_eq!(out[0].1.as_ref().unwrap().primary.worker_name, "b");
}

#[test]
fn a_partition_losing_every_rank_fails_its_waiting_requests() {
    let core = core_with(1, &["a"], FlowConfig::default());
    let now = Instant::now();
    let _running = dispatched(&core, &request("busy", 0, ""), now);
    let t = queued(&core, &request("w", 0, ""), now);
    let (_, facts) = core.apply_source_snapshot("catalog", vec![], now).unwrap();
    let out = released(&facts);
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, t);
    assert_eq!(out[0].1.as_ref().unwrap_err().label(), "unavailable");
    assert_eq!(
        core.live_bookings(),
        0,
        "the running booking went with its rank"
    );
}

#[test]
fn an_unmeetable_slo_is_refused_at_once_and_a_meetable_one_waits() {
    let core = core_with(1, &["a"], FlowConfig::default());
    let now = Instant::now();
    // The prior line: 20 ms + 50 µs/token; 64 tokens need ~23 ms even on an idle rank.
    let tight = SelectionRequest {
        slo_ttft_ms: Some(5),
        ..request("tight", 0, "")
    };
    let err = core.admit(&tight, now).0.unwrap_err();
    assert_eq!(err.label(), "overloaded");
    assert!(err.to_string().contains("TTFT SLO of 5 ms"), "{err}");
    let running = dispatched(&core, &request("busy", 0, ""), now);
    let slo = SelectionRequest {
        slo_ttft_ms: Some(500),
        ..request("slo", 0, "")
    };
    let t = queued(&core, &slo, now);
    // Its deadline is the SLO's, earlier than the queue timeout.
    assert_eq!(
        core.next_queue_deadline(),
        Some(now + Duration::from_millis(500))
    );
    let out = released(&free(&core, &running, now + Duration::from_millis(100)));
    assert_eq!(out[0].0, t);
    assert!(out[0].1.is_ok());
    // Too late now: what remains of the SLO is less than an idle rank needs.
    let running = out[0].1.clone().unwrap();
    let late = queued(&core, &slo, now);
    let facts = free(&core, &running, now + Duration::from_millis(490));
    let out = released(&facts);
    assert_eq!(out[0].0, late);
    assert_eq!(out[0].1.as_ref().unwrap_err().label(), "overloaded");
}

#[test]
fn slo_attainment_is_reported_at_the_first_token() {
    let core = core_with(4, &["a"], FlowConfig::default());
    let now = Instant::now();
    let r = SelectionRequest {
        slo_ttft_ms: Some(100),
        priority: 3,
        ..request("r", 3, "")
    };
    let s = dispatched(&core, &r, now);
    let (_, facts) = core.mark_prefill_complete(
        &s.booking_id,
        Claim::Generation(s.generation),
        now + Duration::from_millis(150),
    );
    assert!(facts.iter().any(|f| *f
        == Fact::SloTtft {
            priority: 3,
            met: false
        }));
}

#[test]
fn without_flow_control_busy_ranks_refuse_at_once() {
    let core = Core::new(CoreConfig {
        flow: FlowConfig {
            enabled: false,
            ..FlowConfig::default()
        },
        busy: crate::config::BusyThresholds {
            active_prefill_tokens: Some(10),
            ..Default::default()
        },
        ..CoreConfig::default()
    });
    core.apply_source_snapshot(
        "catalog",
        vec![WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![1]))],
        Instant::now(),
    )
    .unwrap();
    let now = Instant::now();
    dispatched(&core, &request("r1", 0, ""), now);
    let err = core.admit(&request("r2", 0, ""), now).0.unwrap_err();
    assert_eq!(err.label(), "overloaded");
    assert_eq!(core.waiting_requests(), 0);
}

#[test]
fn with_flow_control_a_busy_threshold_makes_requests_wait() {
    let core = Core::new(CoreConfig {
        busy: crate::config::BusyThresholds {
            active_prefill_tokens: Some(10),
            ..Default::default()
        },
        ..CoreConfig::default()
    });
    core.apply_source_snapshot(
        "catalog",
        vec![WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![1]))],
        Instant::now(),
    )
    .unwrap();
    let now = Instant::now();
    let s = dispatched(&core, &request("r1", 0, ""), now);
    let t = queued(&core, &request("r2", 0, ""), now);
    // The first token takes r1's prefill off the rank: r2 fits.
    let (_, facts) =
        core.mark_prefill_complete(&s.booking_id, Claim::Generation(s.generation), now);
    assert_eq!(released(&facts)[0].0, t);
}

#[test]
fn a_request_waits_for_the_saturated_rank_caching_it_when_that_is_faster() {
    let core = core_with(1, &["a", "b"], FlowConfig::default());
    let now = Instant::now();
    let long = |id: &str, token: u32| SelectionRequest {
        prompt: PromptInput::Tokens(vec![token; 4096]),
        ..request(id, 0, "")
    };
    // The first request's prompt is now cached (predicted) on its rank, which it fills.
    let first = dispatched(&core, &long("first", 7), now);
    let (_, _) =
        core.mark_prefill_complete(&first.booking_id, Claim::Generation(first.generation), now);
    // The same prompt again: the cached rank is saturated, the other one free but it would
    // prefill 4096 tokens from scratch (~225 ms) against ~20 ms once the cached rank frees.
    let t = queued(&core, &long("again", 7), now);
    // An unrelated prompt has nothing to wait for: it takes the free rank at once.
    let other = dispatched(&core, &long("other", 9), now);
    assert_ne!(other.primary.worker_name, first.primary.worker_name);
    let out = released(&free(&core, &first, now));
    assert_eq!(out[0].0, t);
    assert_eq!(
        out[0].1.as_ref().unwrap().primary.worker_name,
        first.primary.worker_name
    );
}

#[test]
fn a_lower_band_never_takes_room_a_waiting_higher_band_declined() {
    let core = core_with(1, &["a", "b"], FlowConfig::default());
    let now = Instant::now();
    let long = |id: &str, token: u32, priority: i32| SelectionRequest {
        prompt: PromptInput::Tokens(vec![token; 4096]),
        ..request(id, priority, "")
    };
    let first = dispatched(&core, &long("first", 7, 0), now);
    core.mark_prefill_complete(&first.booking_id, Claim::Generation(first.generation), now);
    // High waits for the rank caching its prompt; the other rank has room.
    let high = queued(&core, &long("high", 7, 5), now);
    // A sheddable request may not take that room ahead of the waiting high one...
    let low = queued(&core, &long("low", 9, -1), now);
    // ...but one of the high band may.
    let peer = dispatched(&core, &long("peer", 11, 5), now);
    assert_ne!(peer.primary.worker_name, first.primary.worker_name);
    let out = released(&free(&core, &first, now));
    assert_eq!(out.len(), 1, "one rank freed: the high request goes first");
    assert_eq!(out[0].0, high);
    let out = released(&free(&core, &peer, now));
    assert_eq!(out[0].0, low);
}

#[test]
fn other_replicas_bookings_saturate_and_their_end_releases() {
    let core = core_with(1, &["a"], FlowConfig::default());
    let now = Instant::now();
    let rank = core
        .list_workers(None)
        .first()
        .map(|w| RankKey {
            worker_id: w.record.id,
            dp_rank: 0,
        })
        .unwrap();
    let elsewhere = RankLoad {
        active_requests: 1,
        ..RankLoad::default()
    };
    // Another replica (--shared-state) has the rank's one slot.
    core.set_remote_loads(&HashMap::from([(rank, elsewhere)]));
    let t = queued(&core, &request("here", 0, ""), now);
    assert!(released(&core.pump(now)).is_empty());
    // Its booking ended: the next load exchange says so, and a release pass places ours.
    core.set_remote_loads(&HashMap::new());
    let out = released(&core.pump(now));
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].0, t);
    assert!(out[0].1.is_ok());
}

#[test]
fn a_tpot_slo_goes_to_a_rank_decoding_few_enough_requests() {
    let core = Core::new(CoreConfig {
        seed: Some(1),
        ..CoreConfig::default()
    });
    let specs = vec![
        WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![8000])),
        WorkerSpec::for_test("b", "m", RankLayout::PerPort(vec![8001])),
    ];
    core.apply_source_snapshot("catalog", specs, Instant::now())
        .unwrap();
    let now = Instant::now();
    let key = |name: &str| {
        let r = core
            .records()
            .into_iter()
            .find(|r| r.spec.name == name)
            .unwrap();
        RankKey {
            worker_id: r.id,
            dp_rank: 0,
        }
    };
    // "a" decodes 200 requests (another replica's): ~30 ms per token at the prior line;
    // "b" decodes 150: ~25 ms. Both are far from saturated (no prefill queued).
    let decoding = |n| RankLoad {
        active_requests: n,
        ..RankLoad::default()
    };
    core.set_remote_loads(&HashMap::from([
        (key("a"), decoding(200)),
        (key("b"), decoding(150)),
    ]));
    let tpot = |ms| SelectionRequest {
        slo_tpot_ms: Some(ms),
        ..request("t", 0, "")
    };
    for _ in 0..4 {
        let s = dispatched(&core, &tpot(27), now);
        assert_eq!(s.primary.worker_name, "b", "only b decodes fast enough");
        free(&core, &s, now);
    }
    // No rank meets 20 ms now, but an idle one would: wait.
    queued(&core, &tpot(20), now);
    // Even an idle rank needs ~10 ms per token: refused at once.
    let err = core.admit(&tpot(5), now).0.unwrap_err();
    assert_eq!(err.label(), "overloaded");
    assert!(err.to_string().contains("TPOT SLO of 5 ms"), "{err}");
}

#[test]
fn tpot_attainment_is_reported_at_the_end_of_the_response() {
    let core = core_with(4, &["a"], FlowConfig::default());
    let now = Instant::now();
    let r = SelectionRequest {
        slo_tpot_ms: Some(50),
        ..request("r", 2, "")
    };
    let s = dispatched(&core, &r, now);
    let claim = Claim::Generation(s.generation);
    core.mark_prefill_complete(&s.booking_id, claim, now);
    // 11 tokens in 0.3 s after the first: 30 ms per token.
    let (done, facts) =
        core.decode_complete(&s.booking_id, claim, 11, now + Duration::from_millis(300));
    assert!(done);
    assert!(facts.iter().any(|f| *f
        == Fact::SloTpot {
            priority: 2,
            met: true
        }));
}

#[test]
fn hard_bound_sessions_wait_for_their_rank_while_others_flow_elsewhere() {
    let core = core_with(1, &["a", "b"], FlowConfig::default());
    let now = Instant::now();
    let session = |id: &str| SelectionRequest {
        session_id: Some("s".into()),
        ..request(id, 0, "")
    };
    let first = dispatched(&core, &session("s1"), now);
    let bound_to = first.primary.worker_name.clone();
    // The session's rank is full: the next turn waits for it...
    let t = queued(&core, &session("s2"), now);
    // ...while an unbound request behind it still gets the other rank.
    let other = dispatched(&core, &request("free", 0, ""), now);
    assert_ne!(other.primary.worker_name, bound_to);
    let out = released(&free(&core, &first, now));
    assert_eq!(out[0].0, t);
    assert_eq!(out[0].1.as_ref().unwrap().primary.worker_name, bound_to);
}
