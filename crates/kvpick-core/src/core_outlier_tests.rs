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

fn request(id: &str, tokens: std::ops::Range<u32>) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: Some("m".into()),
        prompt: PromptInput::Tokens(tokens.collect()),
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
