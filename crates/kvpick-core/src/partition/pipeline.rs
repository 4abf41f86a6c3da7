//! The selection pipeline, one small stage per rule, in the order they apply:
//!
//! 1. [`prompt_blocks`]: the prompt reduced to chained block hashes;
//! 2. [`check_binding`]: is the session's bound rank still valid for this request?
//! 3. [`allowed_ranks`]: schedulable ranks inside the subset hint;
//! 4. [`apply_pin`]: an explicit pin narrows them (and must agree with a hard binding);
//! 5. [`narrow_adapter`]: a LoRA request goes where its adapter is loaded;
//! 6. [`drop_busy`]: ranks over a busy threshold go (a hard-bound rank stays);
//! 7. [`candidates`]: the survivors with their load and cached overlap (then, with flow
//!    control, an SLO keeps only ranks predicted to meet it: `admission`);
//! 8. [`rank`]: the cost function ([`crate::decide::decide`]);
//! 9. [`apply_affinity`]: hard affinity keeps the bound rank, soft keeps it within a margin;
//! 10. [`dispatch_or_wait`] (flow control on): a saturated pick gives way to a rank with room
//!     only if that one is no slower, else the request waits;
//! 11. [`picked_ranks`]: the primary and distinct fallback endpoints;
//! 12. [`endpoint_scores`] (when asked): the decision's costs of the destinations and the best
//!     other candidates, one per address, for the gateway.
//!
//! Every stage is a function of its arguments (the partition's rank table, the request, the
//! config): no lock, no clock, no metrics. The partition runs them under its lock and books the
//! result ([`super::Partition::select`]).

use crate::config::BusyThresholds;
use crate::decide::{Candidate, Decision};
use crate::error::SelectError;
use crate::estimate::TtftEstimator;
use crate::hash;
use crate::index::TierDepths;
use crate::outcome::{EndpointScore, PickedRank};
use crate::request::{clip, EndpointFilter, Pin, PromptInput};
use crate::session::{AffinityMode, Invalidation, SessionConfig};
use crate::types::{RankKey, RankLoad};
use std::time::{Duration, Instant};

use super::ranks::Slot;
use super::stage::{Affinity, Ask, Decided, Field, PromptBlocks, Refusal};

/// Complete blocks of a `tokens`-token prompt an engine can serve from its prefix cache: vLLM
/// always computes the prompt's last token (its cache hit is capped at `tokens - 1`), so a
/// block-aligned prompt of N blocks reuses at most N - 1, although the engine stores all N
/// after the prefill (the pick predicts all N). `hashed` caps it (`--max-prompt-blocks`).
pub(crate) fn reusable_blocks(tokens: u64, block_size: u32, hashed: usize) -> usize {
    let reusable = tokens
        .saturating_sub(1)
        .checked_div(u64::from(block_size))
        .unwrap_or(0);
    usize::try_from(reusable).map_or(hashed, |r| r.min(hashed))
}

/// The prompt's token count and the chained hashes of at most `max_blocks` leading blocks: a
/// prefix match needs only the prefix, and one huge prompt must not flush the index or hold the
/// partition lock for long. The token count (the load it adds) is never capped.
pub(crate) fn prompt_blocks(
    prompt: &PromptInput,
    block_size: u32,
    seed: u64,
    cache_salt: Option<&str>,
    max_blocks: usize,
) -> PromptBlocks {
    let bs = block_size as usize;
    let max_tokens = max_blocks.saturating_mul(bs);
    let (tokens, seq_hashes, present) = match prompt {
        PromptInput::None => (0, Vec::new(), false),
        PromptInput::Tokens(tokens) => (
            tokens.len() as u64,
            hash::salted_prompt_hashes(
                &tokens[..tokens.len().min(max_tokens)],
                bs,
                seed,
                cache_salt,
            ),
            true,
        ),
        PromptInput::MediaTokens { tokens, media } => (
            tokens.len() as u64,
            hash::media_prompt_hashes(
                &tokens[..tokens.len().min(max_tokens)],
                bs,
                seed,
                cache_salt,
                media,
            ),
            true,
        ),
        PromptInput::BlockHashes {
            seq_hashes,
            prompt_tokens,
        } => (
            *prompt_tokens,
            seq_hashes[..seq_hashes.len().min(max_blocks)].to_vec(),
            true,
        ),
        PromptInput::Text(all) => {
            let bytes = &all[..all.len().min(max_tokens.saturating_mul(4))];
            (
                (all.len() as u64).div_ceil(4),
                hash::salted_text_hashes(bytes, bs, seed, cache_salt),
                true,
            )
        }
    };
    PromptBlocks {
        tokens,
        reusable: reusable_blocks(tokens, block_size, seq_hashes.len()),
        seq_hashes,
        present,
    }
}

/// What a request allows: its subset hint and, for an adapter request, the adapter.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Allowed<'a> {
    pub subset: Option<&'a EndpointFilter>,
    pub adapter: Option<&'a str>,
}

impl Allowed<'_> {
    pub fn in_subset(&self, s: &Slot) -> bool {
        self.subset.is_none_or(|f| f.matches(&s.endpoint))
    }

    pub fn has_adapter(&self, s: &Slot) -> bool {
        self.adapter
            .is_none_or(|a| s.lora_adapters.iter().any(|l| l == a))
    }
}

/// Whether the session's bound rank may serve this request, and if not, why.
pub(crate) fn check_binding(slot: Option<&Slot>, allowed: &Allowed) -> Result<(), Invalidation> {
    match slot {
        None => Err(Invalidation::Gone),
        Some(s) if !s.schedulable => Err(Invalidation::Unschedulable),
        Some(s) if !allowed.in_subset(s) => Err(Invalidation::OutsideSubset),
        Some(s) if !allowed.has_adapter(s) => Err(Invalidation::Adapter),
        Some(_) => Ok(()),
    }
}

/// Positions (in `slots`, rank order) of the schedulable ranks inside the subset hint.
pub(crate) fn allowed_ranks(
    slots: &[(RankKey, Slot)],
    allowed: &Allowed,
    model: &str,
) -> Result<Vec<usize>, SelectError> {
    let eligible: Vec<usize> = slots
        .iter()
        .enumerate()
        .filter(|(_, (_, s))| s.schedulable && allowed.in_subset(s))
        .map(|(i, _)| i)
        .collect();
    if eligible.is_empty() {
        return Err(SelectError::Unavailable(if allowed.subset.is_some() {
            "subset hint matches no eligible endpoint".into()
        } else {
            format!("no ready worker serves model {}", clip(model))
        }));
    }
    Ok(eligible)
}

/// Narrows `eligible` to the pinned worker (and rank). The pinned worker must be schedulable and
/// inside the allowed set; a pin that contradicts a hard binding is a bad request, and under soft
/// affinity it wins (the binding is ignored: `bound` becomes `None`).
pub(crate) fn apply_pin(
    slots: &[(RankKey, Slot)],
    eligible: &mut Vec<usize>,
    pin: Pin,
    bound: &mut Option<RankKey>,
    mode: AffinityMode,
) -> Result<(), SelectError> {
    let worker_ranks = || {
        slots
            .iter()
            .filter(|(k, s)| k.worker_id == pin.worker_id && s.schedulable)
    };
    if worker_ranks().next().is_none() {
        return Err(SelectError::Unavailable(format!(
            "pinned worker {} is not available",
            pin.worker_id
        )));
    }
    if let Some(rank) = pin.dp_rank {
        if !worker_ranks().any(|(k, _)| k.dp_rank == rank) {
            return Err(SelectError::BadRequest(format!(
                "dp rank {rank} is out of range for worker {}",
                pin.worker_id
            )));
        }
    }
    let pin_matches =
        |k: &RankKey| k.worker_id == pin.worker_id && pin.dp_rank.is_none_or(|r| r == k.dp_rank);
    if let Some(b) = bound.filter(|b| !pin_matches(b)) {
        if mode == AffinityMode::Hard {
            return Err(SelectError::BadRequest(format!(
                "pin to worker {} contradicts the session's binding to worker {} rank {}",
                pin.worker_id, b.worker_id, b.dp_rank
            )));
        }
        *bound = None;
    }
    eligible.retain(|&i| slots.get(i).is_some_and(|(k, _)| pin_matches(k)));
    if eligible.is_empty() {
        return Err(SelectError::Unavailable(
            "pinned worker is outside the allowed endpoints".into(),
        ));
    }
    Ok(())
}

/// Narrows `eligible` to ranks with the requested adapter loaded.
pub(crate) fn narrow_adapter(
    slots: &[(RankKey, Slot)],
    eligible: &mut Vec<usize>,
    allowed: &Allowed,
) -> Result<(), SelectError> {
    let Some(adapter) = allowed.adapter else {
        return Ok(());
    };
    eligible.retain(|&i| slots.get(i).is_some_and(|(_, s)| allowed.has_adapter(s)));
    if eligible.is_empty() {
        return Err(SelectError::Unavailable(format!(
            "no eligible worker has adapter {} loaded",
            clip(adapter)
        )));
    }
    Ok(())
}

/// Whether a rank is at or over a busy threshold, each scaled by `fraction` (sheddable requests
/// see lower thresholds, so they are shed before critical ones).
pub(crate) fn is_busy(load: &RankLoad, busy: &BusyThresholds, fraction: f64) -> bool {
    let over = |value: u64, threshold: u64| value as f64 >= threshold as f64 * fraction;
    busy.active_decode_blocks
        .is_some_and(|t| over(load.active_decode_blocks, t))
        || busy
            .active_prefill_tokens
            .is_some_and(|t| over(load.active_prefill_tokens, t))
}

/// Drops ranks over a busy threshold. A hard-bound rank over its threshold is not silently
/// replaced (that would break hard affinity) nor silently overloaded: the request is refused with
/// 429, like a pin, and a sheddable one is shed first (its threshold is scaled down).
pub(crate) fn drop_busy(
    slots: &[(RankKey, Slot)],
    eligible: &mut Vec<usize>,
    busy: &BusyThresholds,
    priority: i32,
    hard_bound: Option<RankKey>,
    pinned: bool,
) -> Result<(), SelectError> {
    let sheddable = priority < 0;
    let fraction = if sheddable {
        busy.sheddable_fraction
    } else {
        1.0
    };
    let busy_rank = |i: usize| {
        slots
            .get(i)
            .is_none_or(|(_, s)| is_busy(&s.total_load(), busy, fraction))
    };
    if let Some(bound) = hard_bound {
        let bound_position = eligible
            .iter()
            .copied()
            .find(|&i| slots.get(i).is_some_and(|(k, _)| *k == bound));
        if bound_position.is_some_and(busy_rank) {
            return Err(SelectError::Overloaded(if sheddable {
                "sheddable request shed: the session's worker is near its busy threshold".into()
            } else {
                "the session's worker is over its busy threshold".into()
            }));
        }
    }
    eligible.retain(|&i| !busy_rank(i));
    if eligible.is_empty() {
        return Err(SelectError::Overloaded(if pinned {
            "pinned worker is over its busy threshold".into()
        } else if sheddable {
            "sheddable request shed: every eligible worker is near its busy threshold".into()
        } else {
            "all eligible workers are over their busy thresholds".into()
        }));
    }
    Ok(())
}

/// Outlier detection: ranks ejected for failing their requests take no picks (a session bound
/// to one moves). When every eligible rank is ejected they all stay (as Envoy's panic mode: a
/// failing rank may still serve, no rank never does); the 50% cap keeps that rare. A half-open
/// rank is available only to a request that may be its probe (`may_probe`: a stream's, whose
/// answer is reported).
pub(crate) fn drop_ejected(
    slots: &[(RankKey, Slot)],
    eligible: &mut Vec<usize>,
    bound: &mut Option<RankKey>,
    now: Instant,
    may_probe: bool,
) {
    let available = |i: &usize| {
        slots.get(*i).is_some_and(|(_, s)| {
            if may_probe {
                s.health.available(now)
            } else {
                s.health.in_service()
            }
        })
    };
    if !eligible.iter().any(available) {
        return;
    }
    eligible.retain(available);
    if let Some(b) = *bound {
        if !eligible
            .iter()
            .any(|&i| slots.get(i).is_some_and(|(k, _)| *k == b))
        {
            *bound = None;
        }
    }
}

/// API bookings: a rank already holding `cap` of them takes no more, so whoever reaches the
/// selection API cannot book one rank full (stream requests are bounded by their streams).
pub(crate) fn cap_api_bookings(
    slots: &[(RankKey, Slot)],
    eligible: &mut Vec<usize>,
    cap: u32,
) -> Result<(), SelectError> {
    eligible.retain(|&i| slots.get(i).is_some_and(|(_, s)| s.api_bookings < cap));
    if eligible.is_empty() {
        return Err(SelectError::Overloaded(format!(
            "every eligible worker holds {cap} API bookings (--max-api-bookings-per-rank)"
        )));
    }
    Ok(())
}

/// What flow control needs to tell whether a rank is saturated ([`crate::flow::is_saturated`]).
pub(crate) struct SaturationView<'a> {
    pub slots: &'a [(RankKey, Slot)],
    /// Candidate index -> slot index.
    pub eligible: &'a [usize],
    pub estimator: &'a crate::estimate::TtftEstimator,
    pub limits: &'a crate::flow::SaturationLimits,
    pub now: Instant,
    pub max_age: Duration,
}

/// The one saturation rule of a rank as the partition sees it: its booked load (this replica's
/// and the others'), the predicted wait for its booked prefill, and a fresh engine reading.
/// Both the decision's flow gate and the release pass's room check use it.
pub(crate) fn rank_saturated(
    key: &RankKey,
    slot: &Slot,
    estimator: &crate::estimate::TtftEstimator,
    limits: &crate::flow::SaturationLimits,
    now: Instant,
    max_age: Duration,
) -> bool {
    let load = slot.total_load();
    let wait = estimator.predict_wait(key, load.active_prefill_tokens as f64);
    let engine = slot.engine.as_ref().filter(|e| e.is_fresh(now, max_age));
    crate::flow::is_saturated(limits, &load, wait, engine)
}

impl SaturationView<'_> {
    /// Whether the rank of candidate `candidate` is saturated (a candidate out of range is).
    pub(crate) fn saturated(&self, candidate: usize) -> bool {
        let Some((key, s)) = self
            .eligible
            .get(candidate)
            .and_then(|&i| self.slots.get(i))
        else {
            return true;
        };
        rank_saturated(key, s, self.estimator, self.limits, self.now, self.max_age)
    }
}

/// Flow control, after the decision: a saturated rank takes no new request. When the pick is
/// saturated, the best rank with room (in cost order) takes the request only if it is predicted
/// to give the first token no later than the pick would; otherwise the request waits
/// ([`Refusal::Saturated`]) for the pick — typically the rank caching its prefix — rather than
/// being pushed onto an uncached rank just because that one is free. A hard-bound session's
/// rank is never replaced: the request waits for it.
pub(crate) fn dispatch_or_wait(
    ask: &Ask,
    field: &Field,
    decided: &mut Decided,
    view: &SaturationView,
) -> Result<(), Refusal> {
    let hard_bound_kept =
        decided.affinity == Affinity::Kept && ask.config.sessions.mode == AffinityMode::Hard;
    let (candidates, decision) = (&field.candidates, &mut decided.decision);
    let (prompt_tokens, block_size, params) =
        (ask.prompt.tokens, field.block_size, &ask.config.cost);
    let Some(&first) = decision.ranking.first() else {
        return Err(Refusal::Saturated);
    };
    if !view.saturated(first) {
        return Ok(());
    }
    if hard_bound_kept {
        return Err(Refusal::Saturated);
    }
    let Some(position) = decision.ranking.iter().position(|&c| !view.saturated(c)) else {
        return Err(Refusal::Saturated);
    };
    let ttft = |c: usize| {
        candidates.get(c).map_or(f64::INFINITY, |cand| {
            view.estimator.predict(
                &cand.key,
                crate::decide::ttft_blocks(cand, prompt_tokens, block_size, params)
                    * f64::from(block_size.max(1)),
            )
        })
    };
    let room = decision.ranking[position];
    if ttft(room) > ttft(first) {
        return Err(Refusal::Saturated);
    }
    decision.ranking.remove(position);
    decision.ranking.insert(0, room);
    Ok(())
}

/// What the candidates stage needs to read engine metrics: the time, the staleness bound and
/// the request's adapter.
#[derive(Debug, Clone, Copy)]
pub(crate) struct EngineView<'a> {
    pub now: std::time::Instant,
    pub max_age: std::time::Duration,
    pub adapter: Option<&'a str>,
    /// The prompt's runs in the partition's shared tier (empty without one).
    pub shared: super::shared_tier::SharedView<'a>,
}

/// The eligible ranks with their load, the prompt's matched depths and their fresh engine
/// readings (a stale one counts as none). Both `eligible` and `matches` are in rank order, so
/// one merge pass joins them.
pub(crate) fn candidates(
    slots: &[(RankKey, Slot)],
    eligible: &[usize],
    matches: &[(RankKey, TierDepths)],
    estimator: &TtftEstimator,
    block_size: u32,
    view: &EngineView,
) -> Vec<Candidate> {
    let fixed_blocks = fixed_blocks(estimator, block_size);
    let mut next_match = matches.iter().peekable();
    eligible
        .iter()
        .filter_map(|&i| slots.get(i))
        .map(|(key, slot)| {
            while next_match.peek().is_some_and(|(k, _)| k < key) {
                next_match.next();
            }
            let overlap = match next_match.peek() {
                Some((k, d)) if k == key => *d,
                _ => TierDepths::default(),
            };
            candidate(*key, slot, overlap, estimator, fixed_blocks, view)
        })
        .collect()
}

/// The line's fixed time in blocks of prefill.
pub(crate) fn fixed_blocks(estimator: &TtftEstimator, block_size: u32) -> f64 {
    let line = estimator.coefficients();
    line.fixed_seconds / (line.seconds_per_token * f64::from(block_size.max(1)))
}

/// One rank as the cost function sees it: its load, the prompt's overlap on it, its speed and
/// its fresh engine reading (a stale one counts as none).
pub(crate) fn candidate(
    key: RankKey,
    slot: &Slot,
    overlap: TierDepths,
    estimator: &TtftEstimator,
    fixed_blocks: f64,
    view: &EngineView,
) -> Candidate {
    let fresh = slot
        .engine
        .as_ref()
        .filter(|e| e.is_fresh(view.now, view.max_age));
    Candidate {
        scale: estimator.rank_scale(&key),
        fixed_blocks,
        engine: fresh.map(|e| e.load()),
        adapter: match (fresh, view.adapter) {
            (Some(e), Some(adapter)) => e.adapter_fit(adapter),
            _ => crate::engine::AdapterFit::Unknown,
        },
        tie: slot.tie,
        shared_blocks: view.shared.beyond(overlap.disk),
        shared_weight: view.shared.weight,
        ..Candidate::new(key, slot.total_load(), overlap)
    }
}

/// The cost function over the candidates ([`crate::decide::decide`]), with the request's
/// temperature and enough runners-up to find distinct fallback endpoints among multiplexed ranks.
pub(crate) fn rank<R: rand::Rng + ?Sized>(
    candidates: &[Candidate],
    prompt: &PromptBlocks,
    block_size: u32,
    request: &crate::request::SelectionRequest,
    config: &crate::config::CoreConfig,
    rng: &mut R,
) -> Decision {
    let temperature = request
        .temperature
        .unwrap_or(config.cost.router_temperature);
    crate::decide::decide(
        candidates,
        prompt.tokens,
        block_size,
        &config.cost,
        temperature,
        request.fallbacks.saturating_mul(8).saturating_add(1),
        rng,
    )
}

/// Hard affinity keeps the bound rank whenever it is a candidate; soft keeps it while its cost is
/// within `soft_margin_blocks` of the best.
pub(crate) fn apply_affinity(
    decision: &mut Decision,
    candidates: &[Candidate],
    bound: Option<RankKey>,
    sessions: &SessionConfig,
) -> Affinity {
    let Some(b) = bound else {
        return Affinity::Unbound;
    };
    let position = candidates.iter().position(|c| c.key == b);
    let best_cost = decision
        .ranking
        .first()
        .and_then(|&i| decision.costs.get(i))
        .copied()
        .unwrap_or(f64::INFINITY);
    let keep = match (sessions.mode, position) {
        (AffinityMode::Hard, Some(_)) => true,
        (AffinityMode::Soft, Some(p)) => decision
            .costs
            .get(p)
            .is_some_and(|&c| c <= best_cost + sessions.soft_margin_blocks),
        (_, None) => false,
    };
    match (keep, position) {
        (true, Some(p)) => {
            decision.ranking.retain(|&i| i != p);
            decision.ranking.insert(0, p);
            Affinity::Kept
        }
        _ => Affinity::Overridden,
    }
}

/// A child session's first pick: the parent session's rank goes first when it is a candidate
/// (eligible, not over a busy threshold, not ejected) and costs at most `soft_margin_blocks`
/// more than the best, the soft-affinity bound in either mode. A subagent shares its parent's
/// context, so its prompt is usually cached there already (and the cost says so); the margin
/// lets the tree stay together when the difference is only load.
pub(crate) fn prefer_parent(
    decision: &mut Decision,
    candidates: &[Candidate],
    parent: RankKey,
    sessions: &SessionConfig,
) -> crate::session::ParentPick {
    use crate::session::ParentPick;
    let first = decision.ranking.first().and_then(|&i| candidates.get(i));
    if first.is_some_and(|c| c.key == parent) {
        return ParentPick::Cheapest;
    }
    let soft = SessionConfig {
        mode: AffinityMode::Soft,
        ..sessions.clone()
    };
    match apply_affinity(decision, candidates, Some(parent), &soft) {
        Affinity::Kept => ParentPick::Preferred,
        _ => ParentPick::Declined,
    }
}

pub(crate) fn picked(slots: &[(RankKey, Slot)], position: usize) -> Option<PickedRank> {
    slots.get(position).map(|(key, s)| PickedRank {
        key: *key,
        worker_name: s.worker_name.to_string(),
        endpoint: s.endpoint,
        multiplexed: s.multiplexed,
    })
}

/// The primary (the ranking's first) and up to `fallbacks` runners-up on distinct endpoints
/// (multiplexed ranks of one pod share an address, so they are not fallbacks for each other).
pub(crate) fn picked_ranks(
    slots: &[(RankKey, Slot)],
    eligible: &[usize],
    ranking: &[usize],
    fallbacks: usize,
) -> Option<(PickedRank, Vec<PickedRank>)> {
    let position = |candidate: &usize| eligible.get(*candidate).copied();
    let primary = picked(slots, position(ranking.first()?)?)?;
    let mut rest: Vec<PickedRank> = Vec::new();
    for candidate in ranking.iter().skip(1) {
        if rest.len() == fallbacks {
            break;
        }
        let Some(next) = position(candidate).and_then(|p| picked(slots, p)) else {
            continue;
        };
        if next.endpoint != primary.endpoint && rest.iter().all(|f| f.endpoint != next.endpoint) {
            rest.push(next);
        }
    }
    Some((primary, rest))
}

/// At most `top` endpoints with the decision's cost (`decision.costs`, never recomputed): the
/// destinations first (their own rank's cost), then the other candidates by cost (ties by rank),
/// one per address — the first rank seen at an address speaks for it, which is the cheapest
/// one of a multiplexed engine that is not a destination. `top` 0 returns an empty vector
/// without allocating; otherwise O(candidates × log) for the sort and O(candidates × top) for
/// the address check, paid only by requests that ask.
pub(crate) fn endpoint_scores(
    slots: &[(RankKey, Slot)],
    eligible: &[usize],
    candidates: &[Candidate],
    decision: &Decision,
    destinations: &[&PickedRank],
    top: usize,
) -> Vec<EndpointScore> {
    if top == 0 {
        return Vec::new();
    }
    let cost_of = |i: usize| decision.costs.get(i).copied().unwrap_or(f64::INFINITY);
    let score_of = |i: usize| -> Option<EndpointScore> {
        let (key, slot) = slots.get(*eligible.get(i)?)?;
        Some(EndpointScore {
            endpoint: slot.endpoint,
            rank: *key,
            cost: cost_of(i),
        })
    };
    let mut out: Vec<EndpointScore> = Vec::with_capacity(top.min(candidates.len()));
    for d in destinations {
        if out.len() == top {
            return out;
        }
        if let Some(i) = candidates.iter().position(|c| c.key == d.key) {
            out.extend(score_of(i));
        }
    }
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_unstable_by(|&a, &b| {
        cost_of(a)
            .total_cmp(&cost_of(b))
            .then_with(|| candidates[a].key.cmp(&candidates[b].key))
    });
    for i in order {
        if out.len() == top {
            break;
        }
        if let Some(s) = score_of(i) {
            if out.iter().all(|o| o.endpoint != s.endpoint) {
                out.push(s);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
