//! Outlier detection through the core: a rank that fails its requests leaves the picks, at most
//! half of a partition's ranks go, a probe brings it back, and a failed response neither
//! calibrates the estimator nor leaves predicted index entries behind.

use std::time::{Duration, Instant};

use super::*;
use crate::catalog::RankLayout;
use crate::facts::ResponseClass;
use crate::outlier::OutlierConfig;
use crate::request::PromptInput;

fn core_of(ranks: usize) -> Core {
    let core = Core::new(CoreConfig {
        seed: Some(3),
        outlier: OutlierConfig {
            consecutive_failures: 5,
            base_ejection: Duration::from_secs(10),
            ..OutlierConfig::default()
        },
        flow: crate::FlowConfig {
            enabled: false,
            ..Default::default()
        },
        ..CoreConfig::default()
    });
    let specs = (0..ranks)
        .map(|i| {
            WorkerSpec::for_test(
                &format!("w{i}"),
                "m",
                RankLayout::PerPort(vec![8000 + i as u16]),
            )
        })
        .collect();
    core.apply_source_snapshot("catalog", specs, Instant::now())
        .unwrap();
    core
}

/// A request for `tokens` and one token more: an engine computes a prompt's last token, so the
/// blocks of `tokens` are all reusable.
fn request(id: &str, tokens: std::ops::Range<u32>) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::Tokens(tokens.chain([u32::MAX]).collect()),
        ..Default::default()
    }
}

/// Books a request, answers it with `class` on whatever rank it got, frees it; returns the rank.
fn serve(core: &Core, id: &str, now: Instant, class_of: impl Fn(&str) -> ResponseClass) -> String {
    // A prompt of its own: no cached prefix pulls requests to one rank.
    let start = (crate::hash::prompt_hashes(&[id.len() as u32], 1, 0)[0]
        ^ id.bytes()
            .fold(0u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b))))
        as u32
        & 0x0fff_ffff;
    let (s, _) = core
        .select_and_reserve(&request(id, start..start + 32), now)
        .unwrap();
    let claim = Claim::Generation(s.generation);
    let worker = s.primary.worker_name.clone();
    core.record_response(id, claim, class_of(&worker), now);
    core.mark_prefill_complete(id, claim, now);
    core.free(id, claim, now);
    worker
}

#[test]
fn a_failing_rank_is_ejected_and_probed_back() {
    let core = core_of(4);
    let t0 = Instant::now();
    let broken = |w: &str| {
        if w == "w0" {
            ResponseClass::ServerError
        } else {
            ResponseClass::Success
        }
    };
    let mut served_by_w0 = 0;
    let mut ejected_at = None;
    for i in 0..200 {
        if serve(&core, &format!("r{i}"), t0, broken) == "w0" {
            served_by_w0 += 1;
        }
        if ejected_at.is_none() && served_by_w0 == 5 {
            ejected_at = Some(i);
        }
    }
    assert_eq!(served_by_w0, 5, "5 failures, then no more picks");
    // After the base ejection a probe goes; it fails: out for 2 x base.
    let t1 = t0 + Duration::from_secs(10);
    let mut probes = 0;
    for i in 0..20 {
        if serve(&core, &format!("p{i}"), t1, broken) == "w0" {
            probes += 1;
        }
    }
    assert_eq!(probes, 1, "one probe at a time");
    let t2 = t1 + Duration::from_secs(19);
    assert!((0..20).all(|i| serve(&core, &format!("q{i}"), t2, broken) != "w0"));
    // Healed: the next probe (after 2 x base) succeeds and the rank takes its share again.
    let healed = |_: &str| ResponseClass::Success;
    let t3 = t1 + Duration::from_secs(20);
    let back = (0..40)
        .filter(|i| serve(&core, &format!("h{i}"), t3, healed) == "w0")
        .count();
    assert!(back >= 5, "w0 serves again after its probe: {back} of 40");
}

#[test]
fn at_most_half_the_ranks_are_ejected() {
    let core = core_of(4);
    let now = Instant::now();
    let all_fail = |_: &str| ResponseClass::ServerError;
    for i in 0..200 {
        serve(&core, &format!("r{i}"), now, all_fail);
    }
    let mut used = std::collections::HashSet::new();
    for i in 0..40 {
        used.insert(serve(&core, &format!("s{i}"), now, all_fail));
    }
    assert_eq!(
        used.len(),
        2,
        "two of four ejected, two still serving: {used:?}"
    );
    // 4xx is the client's fault: never an ejection.
    let core = core_of(2);
    for i in 0..50 {
        serve(&core, &format!("c{i}"), now, |_| ResponseClass::ClientError);
    }
    let mut used = std::collections::HashSet::new();
    for i in 0..20 {
        used.insert(serve(&core, &format!("d{i}"), now, |_| {
            ResponseClass::Success
        }));
    }
    assert_eq!(used.len(), 2);
}

#[test]
fn a_failed_response_is_no_ttft_sample_and_drops_its_predicted_blocks() {
    let core = core_of(1);
    let now = Instant::now();
    let (s, _) = core.select_and_reserve(&request("a", 0..64), now).unwrap();
    let claim = Claim::Generation(s.generation);
    core.record_response("a", claim, ResponseClass::ServerError, now);
    let (_, facts) = core.mark_prefill_complete("a", claim, now + Duration::from_millis(5));
    assert!(!facts
        .iter()
        .any(|f| matches!(f, Fact::TtftObserved { .. } | Fact::SloTtft { .. })));
    core.free("a", claim, now);
    // The prompt is not cached on the rank: an identical request finds no overlap.
    let (s, _) = core.select(&request("b", 0..64), now).unwrap();
    assert_eq!(s.overlap_blocks, 0, "the failed pick's blocks were dropped");
    // A 2xx keeps them, and its first byte is a sample.
    let (s, _) = core.select_and_reserve(&request("c", 0..64), now).unwrap();
    let claim = Claim::Generation(s.generation);
    core.record_response("c", claim, ResponseClass::Success, now);
    let (_, facts) = core.mark_prefill_complete("c", claim, now + Duration::from_millis(5));
    assert!(facts.iter().any(|f| matches!(f, Fact::TtftObserved { .. })));
    core.free("c", claim, now);
    let (s, _) = core.select(&request("d", 0..64), now).unwrap();
    assert_eq!(s.overlap_blocks, 4);
    // A reset before any response drops them too, without blaming the rank.
    let (s, _) = core
        .select_and_reserve(&request("e", 100..164), now)
        .unwrap();
    let claim = Claim::Generation(s.generation);
    core.record_response("e", claim, ResponseClass::Reset, now);
    core.free("e", claim, now);
    let (s, _) = core.select(&request("f", 100..164), now).unwrap();
    assert_eq!(s.overlap_blocks, 0);
}

fn rank_of(core: &Core, name: &str) -> RankKey {
    let id = core
        .records()
        .into_iter()
        .find(|r| r.spec.name == name)
        .map(|r| r.id)
        .unwrap();
    RankKey {
        worker_id: id,
        dp_rank: 0,
    }
}

/// GPU blocks of `r`'s prompt cached on `worker`, as the index says now.
fn cached_on(core: &Core, r: &SelectionRequest, worker: &str, now: Instant) -> u32 {
    let (_, ranks) = core.overlap_scores(r, now).unwrap();
    ranks
        .iter()
        .find(|(p, _)| p.worker_name == worker)
        .map_or(0, |(_, d)| d.gpu)
}

/// Ejects w0 of `core` (every other rank answers 2xx) at `now`.
fn eject_w0(core: &Core, now: Instant) {
    let broken = |w: &str| {
        if w == "w0" {
            ResponseClass::ServerError
        } else {
            ResponseClass::Success
        }
    };
    for i in 0..100 {
        serve(core, &format!("eject{i}"), now, broken);
    }
}

/// Books requests (held) until one lands on `worker`; frees the others; returns it.
fn hold_on(core: &Core, worker: &str, holder: Holder, now: Instant) -> Option<Selection> {
    let mut found = None;
    let mut others = Vec::new();
    // Prompts no earlier call used: no cached prefix pulls them anywhere.
    let base = if holder == Holder::Api {
        20_000
    } else {
        40_000
    };
    for i in 0..40 {
        let start = base + 64 * i;
        let r = SelectionRequest {
            holder,
            on_duplicate: crate::request::DuplicateId::Reject,
            ..request(&format!("hold-{worker}-{holder:?}-{i}"), start..start + 64)
        };
        let (s, _) = core.select_and_reserve(&r, now).unwrap();
        if s.primary.worker_name == worker && found.is_none() {
            found = Some(s);
        } else {
            others.push(s);
        }
    }
    for s in others {
        core.free(&s.booking_id, Claim::Generation(s.generation), now);
    }
    found
}

#[test]
fn only_the_probes_own_answer_settles_a_half_open_rank() {
    let core = core_of(4);
    let t0 = Instant::now();
    // A long request on every rank, booked before anything failed.
    let early: Vec<Selection> = (0..4)
        .map(|i| {
            let r = request(&format!("early{i}"), 9000 + 64 * i..9064 + 64 * i);
            core.select_and_reserve(&r, t0).unwrap().0
        })
        .collect();
    let early_w0 = early
        .iter()
        .find(|s| s.primary.worker_name == "w0")
        .unwrap();
    eject_w0(&core, t0);
    let t1 = t0 + Duration::from_secs(10);
    let probe = hold_on(&core, "w0", Holder::Stream, t1).expect("a stream request probes w0");
    // The early request's late 2xx says nothing about the engine now.
    let claim = |s: &Selection| Claim::Generation(s.generation);
    core.record_response(
        &early_w0.booking_id,
        claim(early_w0),
        ResponseClass::Success,
        t1,
    );
    let (_, facts) = core.record_response(
        &probe.booking_id,
        claim(&probe),
        ResponseClass::ServerError,
        t1,
    );
    assert!(
        facts.iter().any(|f| matches!(
            f,
            Fact::Outlier {
                event: crate::outlier::HealthEvent::Reejected,
                ..
            }
        )),
        "the probe failed: w0 is out again ({facts:?})"
    );
    let ok = |_: &str| ResponseClass::Success;
    assert!((0..20).all(|i| serve(&core, &format!("after{i}"), t1, ok) != "w0"));
}

#[test]
fn an_api_booking_never_takes_the_probe() {
    let core = core_of(4);
    let t0 = Instant::now();
    eject_w0(&core, t0);
    let t1 = t0 + Duration::from_secs(10);
    // The API reports no answers: a probe it took would hold the rank out until it expires.
    assert!(hold_on(&core, "w0", Holder::Api, t1).is_none());
    let probe = hold_on(&core, "w0", Holder::Stream, t1).expect("a stream request probes w0");
    let claim = Claim::Generation(probe.generation);
    let (_, facts) = core.record_response(&probe.booking_id, claim, ResponseClass::Success, t1);
    assert!(facts.iter().any(|f| *f == Fact::EjectedRanks(-1)));
}

#[test]
fn a_4xx_and_a_reset_after_a_2xx_take_back_the_prediction_too() {
    let core = core_of(4);
    let now = Instant::now();
    for (i, answers) in [
        vec![ResponseClass::ClientError],
        // 200 headers, then the stream ended before any body byte.
        vec![ResponseClass::Success, ResponseClass::Reset],
    ]
    .into_iter()
    .enumerate()
    {
        let r = request(&format!("r{i}"), 7000 + 64 * i as u32..7064 + 64 * i as u32);
        let (s, _) = core.select_and_reserve(&r, now).unwrap();
        let worker = s.primary.worker_name.clone();
        assert_eq!(cached_on(&core, &r, &worker, now), 4);
        for class in answers {
            core.record_response(&s.booking_id, Claim::Generation(s.generation), class, now);
        }
        assert_eq!(cached_on(&core, &r, &worker, now), 0, "{i}");
        core.free(&s.booking_id, Claim::Generation(s.generation), now);
    }
    // A 2xx whose first byte came keeps it, whatever ends the stream.
    let r = request("kept", 8000..8064);
    let (s, _) = core.select_and_reserve(&r, now).unwrap();
    let claim = Claim::Generation(s.generation);
    core.record_response("kept", claim, ResponseClass::Success, now);
    core.mark_prefill_complete("kept", claim, now);
    core.record_response("kept", claim, ResponseClass::Reset, now);
    assert_eq!(cached_on(&core, &r, &s.primary.worker_name, now), 4);
}

#[test]
fn a_failure_takes_back_the_prediction_on_a_precise_rank_too() {
    let core = Core::new(CoreConfig {
        seed: Some(3),
        kv_events: true,
        flow: crate::FlowConfig {
            enabled: false,
            ..Default::default()
        },
        ..CoreConfig::default()
    });
    let spec = WorkerSpec {
        kv_events: Some("tcp://127.0.0.1:5557".into()),
        ..WorkerSpec::for_test("w0", "m", RankLayout::PerPort(vec![8000]))
    };
    let now = Instant::now();
    core.apply_source_snapshot("catalog", vec![spec], now)
        .unwrap();
    let w0 = rank_of(&core, "w0");
    // Its KV events flow: picks insert short-lived predictions until the events confirm them.
    core.apply_kv_events(w0, &[crate::event::KvEvent::AllBlocksCleared], None, now);
    let r = request("a", 0..64);
    let (s, _) = core.select_and_reserve(&r, now).unwrap();
    assert_eq!(cached_on(&core, &r, "w0", now), 4);
    core.record_response(
        "a",
        Claim::Generation(s.generation),
        ResponseClass::ServerError,
        now,
    );
    assert_eq!(
        cached_on(&core, &r, "w0", now),
        0,
        "the failed pick's prediction went"
    );
}

#[test]
fn blocks_the_engine_announced_survive_a_failure() {
    let core = core_of(1);
    let now = Instant::now();
    let w0 = rank_of(&core, "w0");
    // The engine announced the blocks (a permanent entry) before the request failed: they stay.
    let r = request("b", 100..164);
    let (s, _) = core.select_and_reserve(&r, now).unwrap();
    let hashes = crate::hash::salted_prompt_hashes(
        &(100..164).collect::<Vec<u32>>(),
        crate::DEFAULT_BLOCK_SIZE as usize,
        crate::hash::block_seed(None, None),
        None,
    );
    core.insert_blocks(
        &s.partition,
        w0,
        &hashes,
        crate::index::Tier::Gpu,
        None,
        now,
    );
    core.record_response(
        "b",
        Claim::Generation(s.generation),
        ResponseClass::ServerError,
        now,
    );
    assert_eq!(cached_on(&core, &r, "w0", now), 4);
}

#[test]
fn a_failed_split_request_takes_back_the_prefill_ranks_prediction() {
    use crate::types::Role;
    let core = Core::new(CoreConfig {
        seed: Some(7),
        pd: crate::PdConfig {
            transfer_block_cost: 0.0,
            ..crate::PdConfig::default()
        },
        flow: crate::FlowConfig {
            enabled: false,
            ..Default::default()
        },
        ..CoreConfig::default()
    });
    let worker = |name: &str, port: u16, role: Role| WorkerSpec {
        roles: vec![role],
        ..WorkerSpec::for_test(name, "m", RankLayout::PerPort(vec![port]))
    };
    let now = Instant::now();
    let specs = vec![
        worker("p", 1, Role::Prefill),
        worker("d1", 2, Role::Decode),
        worker("d2", 3, Role::Decode),
    ];
    core.apply_source_snapshot("catalog", specs, now).unwrap();
    let r = request("split", 0..2048);
    let (s, _) = core.select_and_reserve(&r, now).unwrap();
    assert_eq!(
        s.prefill.as_ref().map(|p| p.worker_name.as_str()),
        Some("p")
    );
    assert!(cached_on(&core, &r, "p", now) > 0);
    let claim = Claim::Generation(s.generation);
    core.record_response("split", claim, ResponseClass::ServerError, now);
    assert_eq!(cached_on(&core, &r, "p", now), 0);
    assert_eq!(cached_on(&core, &r, &s.primary.worker_name, now), 0);
}
