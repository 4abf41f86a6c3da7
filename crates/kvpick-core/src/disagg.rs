//! The prefill/decode pair decision (ARCHITECTURE.md §4a), pure like [`crate::decide`]: given the
//! eligible candidates of a partition whose ranks declare roles ([`Role`]), choose the decode rank
//! (the request's destination), then whether to disaggregate, then the prefill rank.
//!
//! It owns only the choice. It must not touch bookings, sessions, the index or the estimator:
//! the partition runs it under its lock and books both ranks ([`crate::Core`]); session affinity
//! is applied by the pipeline to the decode ranking this module returns. A partition whose ranks
//! are all `Both` never calls it, so aggregated serving is exactly what it was.
//!
//! 1. **Decode rank**: [`decode_cost`] — the KV the rank holds (headroom), its batch (every
//!    active request lengthens each decode step) and the prefill queued on it (a local prefill
//!    stalls the decodes, this one's first token included), plus its engine-metrics charge, less
//!    the transfer its cached prefix saves. Prefill-only ranks are never destinations; a session
//!    bound to a decode rank keeps it (the pipeline's affinity stage).
//! 2. **Disaggregate?** Only when the prompt's part not cached on the decode rank is at least
//!    [`PdConfig::threshold_tokens`], and the best prefill rank's cost (its own predicted TTFT at
//!    its calibrated speed, [`crate::decide::cost`], plus the transfer of the blocks the decode
//!    rank lacks) is at most prefilling on the decode rank (its predicted TTFT plus the stall it
//!    inflicts on the rank's decodes, the same cost function). Comparing TTFT alone (a bound
//!    like `ttft_slack`) was measured worse on the replay: prefilling locally next to a batch of
//!    decodes is exactly what disaggregation exists to avoid.
//! 3. **Prefill rank**: [`crate::decide::decide`] over the prefill-capable ranks (not the decode
//!    rank) — cached overlap and queued prefill; a prefill-only rank runs no decodes, so it has no
//!    one to stall.

use rand::Rng;

use crate::decide::{cost, decide, engine_metrics_cost, overlap_score, Candidate, CostParams};
use crate::types::Role;

/// Settings of the pair decision.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PdConfig {
    /// Disaggregate only when at least this many prompt tokens are not cached on the decode rank.
    pub threshold_tokens: u64,
    /// Cost of moving one KV block from the prefill rank to the decode rank, in blocks of
    /// uncached prefill (NIXL/RDMA moves a block far faster than a GPU computes it).
    pub transfer_block_cost: f64,
    /// Weight of one active request on a decode rank (it lengthens every decode step), blocks.
    pub decode_request_weight: f64,
}

impl Default for PdConfig {
    fn default() -> Self {
        PdConfig {
            threshold_tokens: 512,
            transfer_block_cost: 0.05,
            decode_request_weight: 1.0,
        }
    }
}

/// The eligible candidates and each one's role, position for position: what both halves of the
/// pair decision read.
#[derive(Debug, Clone, Copy)]
pub struct RoledCandidates<'a> {
    pub candidates: &'a [Candidate],
    pub roles: &'a [Role],
}

/// What the pair decision chose: the decode ranking (candidate positions, best first; only
/// decode-capable ranks) and its costs (`f64::INFINITY` for ranks that cannot decode).
#[derive(Debug, Clone, PartialEq)]
pub struct DecodeRanking {
    pub ranking: Vec<usize>,
    pub costs: Vec<f64>,
}

/// The prefill side of a pair, when disaggregating pays.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PrefillChoice {
    /// Position of the prefill rank in the candidates.
    pub position: usize,
    /// Its cost including the transfer, and the cost of prefilling on the decode rank instead.
    pub remote_cost: f64,
    pub local_cost: f64,
}

/// The cost of a rank as the destination of a decode: held KV blocks, active requests, queued
/// prefill (blocks) and the engine-metrics charge, at the rank's calibrated speed; less the
/// transfer its cached prefix of the prompt saves (a session's next turn stays where its KV is).
pub fn decode_cost(c: &Candidate, block_size: u32, params: &CostParams, pd: &PdConfig) -> f64 {
    let queued = c.active_prefill_tokens as f64 / f64::from(block_size.max(1));
    c.scale
        * (params.prefill_load_scale * queued + pd.decode_request_weight * c.active_requests as f64)
        + params.decode_block_weight * c.active_decode_blocks as f64
        + engine_metrics_cost(c, params)
        - pd.transfer_block_cost * overlap_score(c.overlap, params)
}

/// Ranks the decode-capable candidates by [`decode_cost`], lowest first, ties uniformly at
/// random. `None` when no candidate can decode.
pub fn rank_decode<R: Rng + ?Sized>(
    field: RoledCandidates<'_>,
    block_size: u32,
    params: &CostParams,
    pd: &PdConfig,
    rng: &mut R,
) -> Option<DecodeRanking> {
    let RoledCandidates { candidates, roles } = field;
    let costs: Vec<f64> = candidates
        .iter()
        .zip(roles)
        .map(|(c, role)| {
            if role.decodes() {
                decode_cost(c, block_size, params, pd)
            } else {
                f64::INFINITY
            }
        })
        .collect();
    let mut order: Vec<(f64, u64, usize)> = costs
        .iter()
        .enumerate()
        .filter(|(i, _)| roles.get(*i).is_some_and(|r| r.decodes()))
        .map(|(i, &c)| (c, rng.random::<u64>(), i))
        .collect();
    if order.is_empty() {
        return None;
    }
    order.sort_unstable_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    Some(DecodeRanking {
        ranking: order.into_iter().map(|(_, _, i)| i).collect(),
        costs,
    })
}

/// Whether to prefill elsewhere for the decode rank at `decode`, and where. `None` = prefill on
/// the decode rank (short uncached part, no prefill-capable rank, or a local prefill costs less).
pub fn choose_prefill<R: Rng + ?Sized>(
    field: RoledCandidates<'_>,
    decode: usize,
    prompt_tokens: u64,
    block_size: u32,
    params: &CostParams,
    pd: &PdConfig,
    rng: &mut R,
) -> Option<PrefillChoice> {
    let RoledCandidates { candidates, roles } = field;
    let local = candidates.get(decode)?;
    let block = f64::from(block_size.max(1));
    let cached_blocks = params.overlap_score_credit * overlap_score(local.overlap, params);
    let uncached_blocks = (prompt_tokens as f64 / block - cached_blocks).max(0.0);
    if uncached_blocks * block < pd.threshold_tokens as f64 {
        return None;
    }
    let positions: Vec<usize> = (0..candidates.len())
        .filter(|&i| i != decode && roles.get(i).is_some_and(|r| r.prefills()))
        .collect();
    if positions.is_empty() {
        return None;
    }
    let prefill_side: Vec<Candidate> = positions
        .iter()
        .filter_map(|&i| {
            let c = candidates.get(i)?;
            let prefill_only = roles.get(i) == Some(&Role::Prefill);
            Some(Candidate {
                // A prefill-only rank runs no decodes: nobody waits for this prefill but itself.
                stalled_requests: if prefill_only { 0 } else { c.stalled_requests },
                ..*c
            })
        })
        .collect();
    let decision = decide(
        &prefill_side,
        prompt_tokens,
        block_size,
        params,
        params.router_temperature,
        1,
        rng,
    );
    let best = *decision.ranking.first()?;
    let position = *positions.get(best)?;
    let remote = decision.costs.get(best).copied()? + pd.transfer_block_cost * uncached_blocks;
    let local_cost = cost(local, prompt_tokens, block_size, params);
    (remote <= local_cost).then_some(PrefillChoice {
        position,
        remote_cost: remote,
        local_cost,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{RankKey, RankLoad, TierDepths};
    use rand::rngs::StdRng;
    use rand::SeedableRng;

    fn roled<'a>(candidates: &'a [Candidate], roles: &'a [Role]) -> RoledCandidates<'a> {
        RoledCandidates { candidates, roles }
    }

    fn cand(w: u64, load: RankLoad, overlap: u32) -> Candidate {
        Candidate::new(
            RankKey {
                worker_id: w,
                dp_rank: 0,
            },
            load,
            TierDepths {
                gpu: overlap,
                host: overlap,
                disk: overlap,
            },
        )
    }

    fn load(prefill: u64, blocks: u64, requests: u64) -> RankLoad {
        RankLoad {
            active_prefill_tokens: prefill,
            active_decode_blocks: blocks,
            active_requests: requests,
        }
    }

    const P: Role = Role::Prefill;
    const D: Role = Role::Decode;

    #[test]
    fn prefill_only_ranks_are_never_destinations() {
        let cs = [cand(1, load(0, 0, 0), 0), cand(2, load(0, 900, 9), 0)];
        let mut rng = StdRng::seed_from_u64(1);
        let p = CostParams::default();
        let r = rank_decode(roled(&cs, &[P, D]), 16, &p, &PdConfig::default(), &mut rng);
        assert_eq!(r.map(|r| r.ranking), Some(vec![1]));
        let none = rank_decode(roled(&cs, &[P, P]), 16, &p, &PdConfig::default(), &mut rng);
        assert!(none.is_none(), "no decode-capable rank, no destination");
    }

    #[test]
    fn the_decode_rank_is_the_one_with_the_least_decode_load() {
        let cs = [
            cand(1, load(0, 4000, 20), 0),
            cand(2, load(0, 100, 2), 0),
            cand(3, load(8000, 100, 2), 0),
        ];
        let mut rng = StdRng::seed_from_u64(1);
        let p = CostParams::default();
        let r = rank_decode(
            roled(&cs, &[D, D, D]),
            16,
            &p,
            &PdConfig::default(),
            &mut rng,
        );
        // 20 decodes on 4000 blocks (40 + 20) weigh less than 500 blocks of queued prefill.
        assert_eq!(r.map(|r| r.ranking), Some(vec![1, 0, 2]));
    }

    #[test]
    fn among_equal_decode_ranks_the_one_caching_the_prompt_wins() {
        let cs = [cand(1, load(0, 100, 2), 0), cand(2, load(0, 100, 2), 300)];
        let p = CostParams::default();
        for seed in 0..8 {
            let mut rng = StdRng::seed_from_u64(seed);
            let r = rank_decode(roled(&cs, &[D, D]), 16, &p, &PdConfig::default(), &mut rng);
            assert_eq!(r.and_then(|r| r.ranking.first().copied()), Some(1));
        }
    }

    #[test]
    fn a_short_uncached_part_is_prefilled_on_the_decode_rank() {
        let decode_rank = cand(1, load(0, 500, 10), 0);
        let prefill_rank = cand(2, load(0, 0, 0), 0);
        let cs = [decode_rank, prefill_rank];
        let mut rng = StdRng::seed_from_u64(1);
        let (p, pd) = (CostParams::default(), PdConfig::default());
        let short = choose_prefill(roled(&cs, &[D, P]), 0, 256, 16, &p, &pd, &mut rng);
        assert!(short.is_none(), "256 tokens < 512 threshold");
        let long = choose_prefill(roled(&cs, &[D, P]), 0, 8192, 16, &p, &pd, &mut rng);
        assert_eq!(long.map(|c| c.position), Some(1));
        // The same long prompt mostly cached on the decode rank: its uncached part is short.
        let cached = [cand(1, load(0, 500, 10), 500), prefill_rank];
        let hit = choose_prefill(roled(&cached, &[D, P]), 0, 8192, 16, &p, &pd, &mut rng);
        assert!(hit.is_none(), "8192 - 500 * 16 = 192 uncached tokens");
    }

    #[test]
    fn disaggregation_must_beat_the_local_prefill() {
        // An idle decode rank (nobody to stall) next to a prefill rank with a deep queue.
        let cs = [cand(1, load(0, 0, 0), 0), cand(2, load(64_000, 0, 1), 0)];
        let mut rng = StdRng::seed_from_u64(1);
        let (p, pd) = (CostParams::default(), PdConfig::default());
        assert!(choose_prefill(roled(&cs, &[D, P]), 0, 8192, 16, &p, &pd, &mut rng).is_none());
        // The same prefill queue next to a decode rank with 40 decodes to stall.
        let busy = [cand(1, load(0, 2000, 40), 0), cs[1]];
        let choice = choose_prefill(roled(&busy, &[D, P]), 0, 8192, 16, &p, &pd, &mut rng);
        let choice = choice.expect("40 stalled decodes outweigh the queue");
        assert!(choice.remote_cost < choice.local_cost);
    }

    #[test]
    fn the_prefill_rank_is_chosen_by_cached_overlap_and_prefill_load() {
        let cs = [
            cand(1, load(0, 2000, 40), 0),
            cand(2, load(0, 0, 0), 0),
            cand(3, load(0, 0, 0), 400),
            cand(4, load(16_000, 0, 2), 500),
        ];
        let roles = [D, P, P, P];
        let mut rng = StdRng::seed_from_u64(1);
        let (p, pd) = (CostParams::default(), PdConfig::default());
        let choice = choose_prefill(roled(&cs, &roles), 0, 8192, 16, &p, &pd, &mut rng);
        assert_eq!(choice.map(|c| c.position), Some(2), "cached and idle wins");
        // A decode-only rank never prefills for another one, and the decode rank not for itself.
        let roles = [D, D, D, D];
        assert!(choose_prefill(roled(&cs, &roles), 0, 8192, 16, &p, &pd, &mut rng).is_none());
    }
}
