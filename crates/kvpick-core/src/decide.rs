//! The pure decision (ARCHITECTURE.md §4): given eligible candidates with their load and cached overlap,
//! compute each one's cost and choose. No locks, no clocks, no I/O: the same inputs and RNG state
//! always give the same answer, which is what makes decisions unit-testable and replayable.

use rand::Rng;

use crate::types::{RankKey, TierDepths};

/// Default weight of a decode block. ARCHITECTURE.md §4 counts a held KV block like an uncached prefill
/// block (1.0); prefilling a block costs an engine far more GPU time than keeping one in a decode
/// batch, and on the Mooncake replay (`kvpick replay`) 1.0 spreads long prompts away from the
/// ranks that cache them. 0.01 keeps decode load as the tie-breaker it is.
pub const DEFAULT_DECODE_BLOCK_WEIGHT: f64 = 0.01;

/// Cost-function weights. Defaults are ARCHITECTURE.md §4's, except `decode_block_weight`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CostParams {
    pub overlap_score_credit: f64,
    pub prefill_load_scale: f64,
    /// Weight of each active KV block (decode load) against an uncached prefill block.
    pub decode_block_weight: f64,
    pub decode_active_request_weight: f64,
    pub host_tier_weight: f64,
    pub disk_tier_weight: f64,
    pub router_temperature: f64,
}

impl Default for CostParams {
    fn default() -> Self {
        CostParams {
            overlap_score_credit: 1.0,
            prefill_load_scale: 1.0,
            decode_block_weight: DEFAULT_DECODE_BLOCK_WEIGHT,
            decode_active_request_weight: 0.0,
            host_tier_weight: 0.75,
            disk_tier_weight: 0.25,
            router_temperature: 0.0,
        }
    }
}

/// One eligible rank: its load (from bookings) and the request's cached overlap on it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub key: RankKey,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub active_requests: u64,
    pub overlap: TierDepths,
}

/// The outcome: every candidate index best first (`ranking[0]` is the pick) and each
/// candidate's cost (same order as the input).
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub ranking: Vec<usize>,
    pub costs: Vec<f64>,
}

/// Overlap in blocks, lower tiers weighted down.
pub fn overlap_score(depths: TierDepths, params: &CostParams) -> f64 {
    let gpu = depths.gpu as f64;
    let host_only = depths.host.saturating_sub(depths.gpu) as f64;
    let disk_only = depths.disk.saturating_sub(depths.host) as f64;
    gpu + params.host_tier_weight * host_only + params.disk_tier_weight * disk_only
}

/// `prefill_load_scale * max(0, prefill_blocks - credit * overlap)
///  + decode_block_weight * decode_blocks + decode_active_request_weight * active_requests`.
pub fn cost(c: &Candidate, prompt_tokens: u64, block_size: u32, params: &CostParams) -> f64 {
    let prefill_blocks = (c.active_prefill_tokens + prompt_tokens) as f64 / block_size as f64;
    let uncached =
        (prefill_blocks - params.overlap_score_credit * overlap_score(c.overlap, params)).max(0.0);
    params.prefill_load_scale * uncached
        + params.decode_block_weight * c.active_decode_blocks as f64
        + params.decode_active_request_weight * c.active_requests as f64
}

/// Temperature 0: lowest cost, ties uniformly at random. Temperature T > 0: sample with
/// `p_i ∝ exp(-(c_i - c_min) / ((c_max - c_min) * T))`. `ranking` holds the best `top`
/// candidates (the pick first, then by cost); O(n) in the candidates, no full sort.
pub fn decide<R: Rng + ?Sized>(
    candidates: &[Candidate],
    prompt_tokens: u64,
    block_size: u32,
    params: &CostParams,
    temperature: f64,
    top: usize,
    rng: &mut R,
) -> Decision {
    assert!(
        !candidates.is_empty(),
        "decide needs at least one candidate"
    );
    let costs: Vec<f64> = candidates
        .iter()
        .map(|c| cost(c, prompt_tokens, block_size, params))
        .collect();
    // A random key per candidate makes tie-breaking uniform and the order total.
    let mut order: Vec<(f64, u64, usize)> = costs
        .iter()
        .enumerate()
        .map(|(i, &c)| (c, rng.random::<u64>(), i))
        .collect();
    let by_cost =
        |a: &(f64, u64, usize), b: &(f64, u64, usize)| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1));
    let top = top.clamp(1, order.len());
    if order.len() > top {
        order.select_nth_unstable_by(top - 1, by_cost);
        order.truncate(top);
    }
    order.sort_unstable_by(by_cost);
    let mut ranking: Vec<usize> = order.iter().map(|&(_, _, i)| i).collect();
    if temperature > 0.0 && candidates.len() > 1 {
        let (min, max) = costs
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &c| {
                (lo.min(c), hi.max(c))
            });
        if max > min {
            let scale = (max - min) * temperature;
            let weights: Vec<f64> = costs.iter().map(|&c| (-(c - min) / scale).exp()).collect();
            let total: f64 = weights.iter().sum();
            let mut x = rng.random::<f64>() * total;
            let mut chosen = weights.len() - 1;
            for (i, w) in weights.iter().enumerate() {
                if x < *w {
                    chosen = i;
                    break;
                }
                x -= w;
            }
            ranking.retain(|&i| i != chosen);
            ranking.insert(0, chosen);
            ranking.truncate(top);
        }
    }
    Decision { ranking, costs }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn cand(w: u64, decode: u64, overlap_gpu: u32) -> Candidate {
        Candidate {
            key: RankKey {
                worker_id: w,
                dp_rank: 0,
            },
            active_prefill_tokens: 0,
            active_decode_blocks: decode,
            active_requests: 0,
            overlap: TierDepths {
                gpu: overlap_gpu,
                host: overlap_gpu,
                disk: overlap_gpu,
            },
        }
    }

    #[test]
    fn worked_example_picks_the_second_worker() {
        // Prefill 10 blocks (160 tokens of 16) on three workers, overlaps 2/5/8, decode 10/5/9.
        let cs = [cand(1, 10, 2), cand(2, 5, 5), cand(3, 9, 8)];
        let mut rng = StdRng::seed_from_u64(0);
        let design = CostParams {
            decode_block_weight: 1.0,
            ..Default::default()
        };
        let d = decide(&cs, 160, 16, &design, 0.0, 3, &mut rng);
        assert_eq!(d.costs, vec![18.0, 10.0, 11.0]);
        assert_eq!(d.ranking, vec![1, 2, 0]);
    }

    #[test]
    fn weights_and_tiers() {
        let params = CostParams {
            decode_active_request_weight: 2.0,
            prefill_load_scale: 0.5,
            decode_block_weight: 1.0,
            ..Default::default()
        };
        let mut c = cand(1, 3, 0);
        c.active_requests = 4;
        c.active_prefill_tokens = 32;
        c.overlap = TierDepths {
            gpu: 1,
            host: 3,
            disk: 7,
        };
        // prefill (32+160)/16 = 12; overlap 1 + 0.75*2 + 0.25*4 = 3.5; 0.5*8.5 + 3 + 8 = 15.25
        assert_eq!(cost(&c, 160, 16, &params), 15.25);
        // Overlap never makes the prefill term negative.
        c.overlap = TierDepths {
            gpu: 100,
            host: 100,
            disk: 100,
        };
        // Only decode load is left: 3 blocks at the default weight 0.01.
        assert_eq!(cost(&c, 160, 16, &CostParams::default()), 0.03);
    }

    #[test]
    fn ties_are_broken_uniformly() {
        let cs = [cand(1, 0, 0), cand(2, 0, 0), cand(3, 0, 0), cand(4, 0, 0)];
        let mut rng = StdRng::seed_from_u64(42);
        let mut counts = [0usize; 4];
        for _ in 0..8000 {
            counts[decide(&cs, 16, 16, &CostParams::default(), 0.0, 1, &mut rng).ranking[0]] += 1;
        }
        // Expected 2000 each; 5 sigma ≈ 194.
        for c in counts {
            assert!((1800..=2200).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn temperature_samples_by_softmax() {
        // Costs 0, 1, 2 with T = 1: weights e^0, e^-0.5, e^-1.
        let cs = [cand(1, 0, 0), cand(2, 1, 0), cand(3, 2, 0)];
        let mut rng = StdRng::seed_from_u64(9);
        let mut counts = [0f64; 3];
        let n = 30_000;
        for _ in 0..n {
            let d = decide(&cs, 0, 16, &CostParams::default(), 1.0, 1, &mut rng);
            counts[d.ranking[0]] += 1.0;
        }
        let w = [1.0f64, (-0.5f64).exp(), (-1.0f64).exp()];
        let total: f64 = w.iter().sum();
        for i in 0..3 {
            let p = w[i] / total;
            let sigma = (p * (1.0 - p) / n as f64).sqrt();
            let observed = counts[i] / n as f64;
            assert!((observed - p).abs() < 5.0 * sigma, "{i}: {observed} vs {p}");
        }
        // Temperature 0 never picks a costlier rank.
        for _ in 0..100 {
            assert_eq!(
                decide(&cs, 0, 16, &CostParams::default(), 0.0, 1, &mut rng).ranking[0],
                0
            );
        }
    }
}
