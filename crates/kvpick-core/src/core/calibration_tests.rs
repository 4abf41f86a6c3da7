//! The TTFT estimator end to end through the core: first tokens observed through
//! `mark_prefill_complete` steer later picks.
use super::*;
use crate::catalog::RankLayout;
use crate::request::PromptInput;
use std::time::Duration;

fn core(calibrate: bool) -> (Core, Instant) {
    let core = Core::new(CoreConfig {
        seed: Some(7),
        estimator: crate::estimate::EstimatorConfig {
            calibrate,
            ..Default::default()
        },
        ..CoreConfig::default()
    });
    let t0 = Instant::now();
    let specs = vec![
        WorkerSpec::for_test("fast", "m", RankLayout::PerPort(vec![8001])),
        WorkerSpec::for_test("slow", "m", RankLayout::PerPort(vec![8002])),
    ];
    core.apply_source_snapshot("catalog", specs, t0).unwrap();
    (core, t0)
}

/// Distinct prompts of 500..=4000 tokens (no shared prefix, so only speed tells the ranks
/// apart), each served alone: `slow` takes three times as long to its first token.
fn run(core: &Core, t0: Instant, requests: u32) -> [u32; 2] {
    let mut picks = [0u32; 2];
    let mut now = t0;
    for i in 0..requests {
        let len = 500 + (i * 37) % 3501;
        let request = SelectionRequest {
            request_id: format!("r{i}"),
            model: Some("m".into()),
            prompt: PromptInput::Tokens((0..len).map(|t| t + i * 1000).collect()),
            ..Default::default()
        };
        let (selection, _) = core.select_and_reserve(&request, now).unwrap();
        let slow = selection.primary.worker_name == "slow";
        picks[usize::from(slow)] += 1;
        let per_token = if slow { 150 } else { 50 };
        let ttft = Duration::from_micros(5_000 + per_token * u64::from(len));
        now += ttft;
        assert!(
            core.mark_prefill_complete(&request.request_id, Claim::Any, now)
                .0
        );
        now += Duration::from_millis(1);
        assert!(core.free(&request.request_id, Claim::Any, now).0);
    }
    picks
}

#[test]
fn a_rank_observed_slower_loses_its_share_of_idle_picks() {
    let (calibrated, t0) = core(true);
    // Until the slow rank has been seen slow enough, ties split; then the fast rank wins.
    run(&calibrated, t0, 200);
    let [fast, slow] = run(&calibrated, t0, 200);
    assert!(fast >= 180, "fast {fast} slow {slow}");
    // Without calibration both look the same: ties split evenly.
    let (blind, t0) = core(false);
    let [fast, slow] = run(&blind, t0, 400);
    assert!((150..=250).contains(&fast), "fast {fast} slow {slow}");
}
