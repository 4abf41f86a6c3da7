//! The pure decision (ARCHITECTURE.md §4): given eligible candidates with their load, cached overlap
//! and calibrated speed ([`crate::estimate`]), compute each one's cost and choose. No locks, no
//! clocks, no I/O: the same inputs and RNG state always give the same answer, which is what makes
//! decisions unit-testable and replayable.
//!
//! The cost estimates, in units of one uncached prefill block at the partition's calibrated
//! speed, the latency a pick adds to the system:
//! - the request's own time to first token on the rank: the rank's scale × (fixed time + the
//!   prefill queued on it + its own uncached prefill), the [`crate::estimate`] model;
//! - the stall it inflicts on the rank's running decodes: an engine runs a prefill in the same
//!   iterations as its decodes (chunked prefill) or between them, so every request decoding
//!   while it runs waits for the new request's own prefill. Those are all the rank's booked
//!   requests: the ones decoding now, and the ones prefilling ahead of it (FIFO), which decode
//!   by the time its turn comes — `booked requests × own uncached prefill`;
//! - a small charge for held KV blocks and active requests (the decode batch it joins).
//!
//! Seconds of another request's delay count like seconds of this one's (`stall_weight` 1): the
//! cost is the pick's share of the fleet's total latency, so it keeps long uncached prefills off
//! ranks with many decodes, and as load rises (more decodes everywhere) the cached rank's saving
//! is worth more and the cache hit rate goes up by itself. The trade is bounded (`ttft_slack`): a
//! rank whose own predicted TTFT exceeds `ttft_slack ×` the best candidate's ranks after every rank
//! within it, so no request waits without bound to spare others a short stall — unless it caches
//! more of the prompt than the fastest candidate: that wait saves work everyone would queue behind.

use rand::Rng;

use crate::engine::{AdapterFit, EngineLoad};
use crate::types::{RankKey, RankLoad, TierDepths};

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
    /// The stall may only move a pick to a rank whose own predicted TTFT is at most this many
    /// times the best candidate's (plus one block): a request is never made to wait without
    /// bound to spare others a short stall. Ranks beyond it rank after every rank within it,
    /// except ranks that cache more of the prompt than the fastest one (their wait saves work).
    /// `f64::INFINITY` = no bound; 1 = the fastest first token, the stall only breaks ties.
    pub ttft_slack: f64,
    /// Weight of the stall a pick inflicts (its own uncached prefill, once per request booked on
    /// the rank) against its own time to first token; 0 = TTFT only.
    pub stall_weight: f64,
    /// Engine metrics ([`engine_metrics_cost`]): blocks per request waiting in the engine's queue.
    pub engine_waiting_weight: f64,
    /// Blocks at full KV-cache usage (linear in usage).
    pub engine_kv_usage_weight: f64,
    /// Blocks charged when the requested adapter is not loaded but the rank has room for it.
    pub adapter_load_weight: f64,
    /// Blocks charged when the requested adapter is not loaded and the rank is at `max_lora`.
    pub adapter_full_weight: f64,
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
            stall_weight: 1.0,
            ttft_slack: 1.5,
            engine_waiting_weight: DEFAULT_ENGINE_WAITING_WEIGHT,
            engine_kv_usage_weight: DEFAULT_ENGINE_KV_USAGE_WEIGHT,
            adapter_load_weight: DEFAULT_ADAPTER_LOAD_WEIGHT,
            adapter_full_weight: DEFAULT_ADAPTER_FULL_WEIGHT,
        }
    }
}

/// A request waiting in an engine's queue delays a new one about as much as prefilling a few
/// blocks: its own prefill runs first. 8 blocks is a short prompt's worth (128 tokens of 16).
pub const DEFAULT_ENGINE_WAITING_WEIGHT: f64 = 8.0;
/// A full KV cache costs like 16 uncached blocks: the engine is about to queue or preempt.
pub const DEFAULT_ENGINE_KV_USAGE_WEIGHT: f64 = 16.0;
/// Loading an adapter the rank has room for: a small detour (the load is fast, but a rank that
/// already runs it serves it with no load at all).
pub const DEFAULT_ADAPTER_LOAD_WEIGHT: f64 = 4.0;
/// A rank at `max_lora` without the adapter must evict one or queue the request.
pub const DEFAULT_ADAPTER_FULL_WEIGHT: f64 = 64.0;

/// One eligible rank: its load (from bookings), the request's cached overlap on it, its
/// calibrated speed, and what its engine last said about itself (only a fresh reading; see
/// [`crate::engine`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub key: RankKey,
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub active_requests: u64,
    /// Requests a new prefill on the rank stalls: every booked one — those decoding now and those
    /// still prefilling ahead of it (FIFO), which decode while its prefill runs.
    pub stalled_requests: u64,
    pub overlap: TierDepths,
    /// Blocks beyond `overlap` (its deepest tier) the model's shared KV store holds
    /// consecutively: the rank loads them rather than recomputing ([`cached_blocks`]).
    pub shared_blocks: u32,
    /// What a shared-tier block counts for against a GPU hit (1) and a recompute (0): the
    /// partition's `--shared-cache-multiplier`; 0 without a shared tier.
    pub shared_weight: f64,
    /// The engine's queue, batch and KV usage; `None` without a fresh scrape.
    pub engine: Option<EngineLoad>,
    /// Where the request's adapter stands on the rank (`Unknown` for base-model requests).
    pub adapter: AdapterFit,
    /// The rank's TTFT factor ([`crate::estimate::TtftEstimator::rank_scale`]); 1 = the
    /// partition's line.
    pub scale: f64,
    /// The line's fixed time in blocks of prefill (`fixed_seconds / seconds_per_block`).
    pub fixed_blocks: f64,
    /// Breaks cost ties, lowest first: the partition gives a rank a new, higher ticket whenever
    /// a decision picks it, so ties go to the rank picked least recently (round robin among
    /// equals) and a decision never draws one random number per rank.
    pub tie: u64,
}

impl Candidate {
    /// A candidate with this load and overlap at the partition's line (scale 1, no fixed time).
    pub fn new(key: RankKey, load: RankLoad, overlap: TierDepths) -> Self {
        Candidate {
            key,
            active_prefill_tokens: load.active_prefill_tokens,
            active_decode_blocks: load.active_decode_blocks,
            active_requests: load.active_requests,
            stalled_requests: load.active_requests,
            overlap,
            shared_blocks: 0,
            shared_weight: 0.0,
            scale: 1.0,
            fixed_blocks: 0.0,
            engine: None,
            adapter: AdapterFit::Unknown,
            tie: 0,
        }
    }
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

/// Blocks of the prompt the candidate need not prefill: its own overlap by tier
/// ([`overlap_score`]) and the shared tier's blocks beyond it, weighted by the multiplier. A
/// shared hit costs a load over the network: cheaper than a recompute, dearer than a local hit,
/// so the multiplier sits between 0 and 1 (Dynamo's `--shared-cache-multiplier`).
pub fn cached_blocks(c: &Candidate, params: &CostParams) -> f64 {
    overlap_score(c.overlap, params) + c.shared_weight * f64::from(c.shared_blocks)
}

/// A candidate's terms, computed once per decision: its own predicted TTFT, its own uncached
/// prefill, and its cost (which contains both).
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct Terms {
    /// `scale * (fixed + prefill_load_scale * ttft_blocks)`, blocks at the partition's speed.
    pub ttft: f64,
    /// The request's own uncached prefill, blocks.
    pub own: f64,
    pub cost: f64,
}

pub(crate) fn terms(
    c: &Candidate,
    prompt_tokens: u64,
    block_size: u32,
    params: &CostParams,
) -> Terms {
    let block = f64::from(block_size.max(1));
    let cached = params.overlap_score_credit * cached_blocks(c, params);
    let own = (prompt_tokens as f64 / block - cached).max(0.0);
    let waited = ((c.active_prefill_tokens + prompt_tokens) as f64 / block - cached).max(0.0);
    let ttft = c.fixed_blocks + params.prefill_load_scale * waited;
    let stall = params.stall_weight * c.stalled_requests as f64 * own;
    Terms {
        ttft: c.scale * ttft,
        own,
        cost: c.scale * (ttft + stall)
            + params.decode_block_weight * c.active_decode_blocks as f64
            + params.decode_active_request_weight * c.active_requests as f64
            + engine_metrics_cost(c, params),
    }
}

/// Prefill blocks the request waits for on the candidate: the queue plus its own uncached part.
pub fn ttft_blocks(c: &Candidate, prompt_tokens: u64, block_size: u32, params: &CostParams) -> f64 {
    let prefill_blocks =
        (c.active_prefill_tokens + prompt_tokens) as f64 / f64::from(block_size.max(1));
    (prefill_blocks - params.overlap_score_credit * cached_blocks(c, params)).max(0.0)
}

/// `scale * (fixed + prefill_load_scale * max(0, queued + prompt - credit * overlap))
///  + stall_weight * scale * stalled_requests * own_uncached
///  + decode_block_weight * decode_blocks + decode_active_request_weight * active_requests
///  + engine_metrics_cost`.
pub fn cost(c: &Candidate, prompt_tokens: u64, block_size: u32, params: &CostParams) -> f64 {
    terms(c, prompt_tokens, block_size, params).cost
}

/// What the rank's engine metrics add, in uncached-prefill blocks: what kvpick's own bookings
/// cannot see (engine-side queueing, traffic of other replicas or that bypassed kvpick, a filling
/// KV cache) and the adapter's fit. `engine_waiting_weight * waiting + engine_kv_usage_weight *
/// kv_usage + adapter charge` (`adapter_load_weight` when the rank has room for the adapter,
/// `adapter_full_weight` when it is at `max_lora` without it, 0 when it is loaded or unknown).
/// 0 without a fresh reading, so a rank that is not scraped (or went stale) is costed on
/// bookings alone.
pub fn engine_metrics_cost(c: &Candidate, params: &CostParams) -> f64 {
    let load = c.engine.map_or(0.0, |e| {
        params.engine_waiting_weight * e.waiting as f64
            + params.engine_kv_usage_weight * e.kv_usage.clamp(0.0, 1.0)
    });
    let adapter = match c.adapter {
        AdapterFit::Unknown | AdapterFit::Loaded => 0.0,
        AdapterFit::Room => params.adapter_load_weight,
        AdapterFit::Full => params.adapter_full_weight,
    };
    load + adapter
}

/// A cost as a gateway score: `1 / (1 + cost)`, in (0, 1], higher is better (llm-d-router's
/// scores are higher-is-better). 1 is a rank that costs nothing (the whole prompt cached, no
/// load); the cost comes back as `1 / score - 1`. A NaN or infinite cost scores 0.
pub fn gateway_score(cost: f64) -> f64 {
    if cost.is_nan() {
        return 0.0;
    }
    1.0 / (1.0 + cost.max(0.0))
}

/// Where a candidate ranks: ranks within the TTFT bound first, then by cost, then by the
/// rank's tie key, then by the rank itself (a total order that does not depend on the order of
/// the candidates, so a decision over a subset of them can be proved equal to one over all).
pub(crate) type RankingKey = (bool, f64, u64, RankKey);

pub(crate) fn ranking_cmp(a: &RankingKey, b: &RankingKey) -> std::cmp::Ordering {
    a.0.cmp(&b.0)
        .then(a.1.total_cmp(&b.1))
        .then(a.2.cmp(&b.2))
        .then(a.3.cmp(&b.3))
}

/// The TTFT bound of a decision: `ttft_slack ×` the best candidate's own predicted TTFT plus
/// one block, and the fastest candidates' smallest own uncached prefill. A rank is pushed back
/// ("beyond") only when it is slower than the bound and caches no more of the prompt than the
/// fastest one.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) struct TtftBound {
    pub bound: f64,
    pub fastest_own: f64,
}

impl TtftBound {
    /// From the best own TTFT and the smallest own uncached prefill among the candidates that
    /// reach it.
    pub fn new(best_ttft: f64, fastest_own: f64, params: &CostParams) -> Self {
        TtftBound {
            bound: params.ttft_slack.max(1.0) * best_ttft + 1.0,
            fastest_own,
        }
    }

    pub fn of(terms: &[Terms], params: &CostParams) -> Self {
        let best_ttft = terms.iter().map(|t| t.ttft).fold(f64::INFINITY, f64::min);
        // The smallest, not the first: the bound must not depend on the candidates' order.
        let fastest_own = terms
            .iter()
            .filter(|t| t.ttft == best_ttft)
            .map(|t| t.own)
            .fold(f64::INFINITY, f64::min);
        let fastest_own = if fastest_own.is_finite() {
            fastest_own
        } else {
            0.0
        };
        Self::new(best_ttft, fastest_own, params)
    }

    pub fn key(&self, t: &Terms, c: &Candidate) -> RankingKey {
        let beyond = t.ttft > self.bound && t.own >= self.fastest_own;
        (beyond, t.cost, c.tie, c.key)
    }
}

/// Temperature 0: lowest cost, ties by the candidates' tie keys (lowest first).
/// Temperature T > 0: sample with `p_i ∝ exp(-(c_i - c_min) / ((c_max - c_min) * T))`.
/// `ranking` holds the best `top` candidates (the pick first, then by cost); O(n) in the
/// candidates, no full sort.
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
    let terms: Vec<Terms> = candidates
        .iter()
        .map(|c| terms(c, prompt_tokens, block_size, params))
        .collect();
    let costs: Vec<f64> = terms.iter().map(|t| t.cost).collect();
    // A rank that caches more of the prompt than the fastest one is never pushed back: waiting
    // for its cache saves prefill work the fleet would otherwise queue behind, so the bound only
    // limits moves that cost work and time.
    let bound = TtftBound::of(&terms, params);
    let mut order: Vec<(RankingKey, usize)> = terms
        .iter()
        .zip(candidates)
        .enumerate()
        .map(|(i, (t, c))| (bound.key(t, c), i))
        .collect();
    let by_key = |a: &(RankingKey, usize), b: &(RankingKey, usize)| ranking_cmp(&a.0, &b.0);
    let top = top.clamp(1, order.len());
    if order.len() > top {
        order.select_nth_unstable_by(top - 1, by_key);
        order.truncate(top);
    }
    order.sort_unstable_by(by_key);
    let mut ranking: Vec<usize> = order.iter().map(|&(_, i)| i).collect();
    if temperature > 0.0 && candidates.len() > 1 {
        sample_by_temperature(&costs, temperature, top, &mut ranking, rng);
    }
    Decision { ranking, costs }
}

/// Temperature T > 0: moves a softmax sample of the costs to the front of `ranking`.
fn sample_by_temperature<R: Rng + ?Sized>(
    costs: &[f64],
    temperature: f64,
    top: usize,
    ranking: &mut Vec<usize>,
    rng: &mut R,
) {
    let (min, max) = costs
        .iter()
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), &c| {
            (lo.min(c), hi.max(c))
        });
    if max <= min {
        return;
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn cand(w: u64, decode: u64, overlap_gpu: u32) -> Candidate {
        Candidate::new(
            RankKey {
                worker_id: w,
                dp_rank: 0,
            },
            RankLoad {
                active_prefill_tokens: 0,
                active_decode_blocks: decode,
                active_requests: 0,
            },
            TierDepths {
                gpu: overlap_gpu,
                host: overlap_gpu,
                disk: overlap_gpu,
            },
        )
    }

    #[test]
    fn engine_queue_kv_usage_and_adapter_fit_add_to_the_cost() {
        let params = CostParams::default();
        let idle = cand(1, 0, 0);
        let mut queued = cand(2, 0, 0);
        queued.engine = Some(EngineLoad {
            waiting: 3,
            running: 10,
            kv_usage: 0.5,
        });
        // 8 * 3 waiting + 16 * 0.5 usage; running requests are the booking terms' business.
        assert_eq!(engine_metrics_cost(&queued, &params), 32.0);
        assert_eq!(engine_metrics_cost(&idle, &params), 0.0);
        assert_eq!(cost(&queued, 16, 16, &params), 1.0 + 32.0);
        let mut rng = StdRng::seed_from_u64(1);
        let d = decide(&[queued, idle], 16, 16, &params, 0.0, 2, &mut rng);
        assert_eq!(d.ranking, vec![1, 0], "the deep queue loses");
        // Adapter fit: loaded < room < full.
        let fits = [AdapterFit::Full, AdapterFit::Room, AdapterFit::Loaded];
        let cs: Vec<Candidate> = fits
            .iter()
            .enumerate()
            .map(|(i, &fit)| Candidate {
                adapter: fit,
                ..cand(i as u64, 0, 0)
            })
            .collect();
        let d = decide(&cs, 16, 16, &params, 0.0, 3, &mut rng);
        assert_eq!(d.ranking, vec![2, 1, 0]);
        assert_eq!(d.costs, vec![65.0, 5.0, 1.0]);
    }

    #[test]
    fn worked_example_picks_the_second_worker() {
        // Prefill 10 blocks (160 tokens of 16) on three workers, overlaps 2/5/8, decode 10/5/9.
        let cs = [cand(1, 10, 2), cand(2, 5, 5), cand(3, 9, 8)];
        let mut rng = StdRng::seed_from_u64(0);
        let design = CostParams {
            decode_block_weight: 1.0,
            ttft_slack: f64::INFINITY,
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
    fn stall_charges_own_uncached_prefill_per_booked_request() {
        // 320 tokens = 20 blocks. Rank 1 caches 15 of them but runs 10 decodes; rank 2 caches
        // nothing and runs none.
        let mut busy = cand(1, 0, 15);
        busy.stalled_requests = 10;
        let idle = cand(2, 0, 0);
        let p = CostParams {
            decode_block_weight: 0.0,
            ..Default::default()
        };
        // Own TTFT 5 blocks + 10 decodes × 5 blocks stalled = 55; idle: 20.
        assert_eq!(cost(&busy, 320, 16, &p), 55.0);
        assert_eq!(cost(&idle, 320, 16, &p), 20.0);
        // TTFT only (stall weight 0): the cached rank wins.
        let ttft_only = CostParams {
            stall_weight: 0.0,
            ..p
        };
        assert_eq!(cost(&busy, 320, 16, &ttft_only), 5.0);
        // Queued prefill is waited for, not stalled: it adds once, whatever the decodes.
        busy.active_prefill_tokens = 160;
        assert_eq!(cost(&busy, 320, 16, &p), 65.0);
    }

    #[test]
    fn the_ttft_slack_bounds_what_the_stall_may_cost_the_request() {
        // The cached rank (5 blocks of own TTFT) runs 10 requests; the idle one would take 20.
        let mut busy = cand(1, 0, 15);
        busy.stalled_requests = 10;
        let idle = cand(2, 0, 0);
        let cs = [busy, idle];
        let mut rng = StdRng::seed_from_u64(3);
        let unbounded = CostParams {
            ttft_slack: f64::INFINITY,
            ..Default::default()
        };
        // Without a bound the stall (55 vs 20) sends it to the idle rank: 4x its best TTFT.
        assert_eq!(
            decide(&cs, 320, 16, &unbounded, 0.0, 2, &mut rng).ranking,
            vec![1, 0]
        );
        // With slack 2 the idle rank is beyond 2 × 5 + 1 blocks: it ranks after the cached one.
        let bounded = CostParams::default();
        let d = decide(&cs, 320, 16, &bounded, 0.0, 2, &mut rng);
        assert_eq!(d.ranking, vec![0, 1]);
        // The costs reported are the same either way.
        assert_eq!(d.costs[0], cost(&busy, 320, 16, &bounded));
        // Slack 4: 20 <= 4 × 5 + 1, the stall decides again.
        let loose = CostParams {
            ttft_slack: 4.0,
            ..Default::default()
        };
        assert_eq!(
            decide(&cs, 320, 16, &loose, 0.0, 2, &mut rng).ranking,
            vec![1, 0]
        );
    }

    #[test]
    fn a_rank_scale_multiplies_its_time_terms() {
        let mut slow = cand(1, 100, 0);
        slow.scale = 2.0;
        slow.fixed_blocks = 3.0;
        slow.stalled_requests = 1;
        // 2 × (3 fixed + 10 own + 1 × 10 stall) + 0.01 × 100 decode blocks.
        assert_eq!(cost(&slow, 160, 16, &CostParams::default()), 47.0);
        let d = decide(
            &[slow, cand(2, 100, 0)],
            160,
            16,
            &CostParams::default(),
            0.0,
            2,
            &mut StdRng::seed_from_u64(1),
        );
        assert_eq!(d.ranking, vec![1, 0]);
    }

    #[test]
    fn ties_are_broken_uniformly() {
        // Equal costs: the lowest tie key wins (with random keys every winner is equally likely).
        let mut cs = [cand(1, 0, 0), cand(2, 0, 0), cand(3, 0, 0), cand(4, 0, 0)];
        let mut rng = StdRng::seed_from_u64(42);
        let mut counts = [0usize; 4];
        for _ in 0..8000 {
            for c in cs.iter_mut() {
                c.tie = rng.random();
            }
            counts[decide(&cs, 16, 16, &CostParams::default(), 0.0, 1, &mut rng).ranking[0]] += 1;
        }
        // Equal keys fall back to the rank order: deterministic, whatever the input order.
        for c in cs.iter_mut() {
            c.tie = 7;
        }
        cs.reverse();
        let d = decide(&cs, 16, 16, &CostParams::default(), 0.0, 4, &mut rng);
        assert_eq!(d.ranking, vec![3, 2, 1, 0]);
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
