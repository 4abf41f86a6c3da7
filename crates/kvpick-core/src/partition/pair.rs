//! The prefill/decode pair stage of a partition with role-split ranks: it runs the pure pair
//! decision ([`crate::disagg`]) over the pipeline's candidates, and books and unbooks the prefill
//! rank's part of a booking (its [`PrefillLeg`]).
//!
//! It owns only the prefill leg. It must not touch the decode side of a booking, sessions or the
//! estimator: [`super::Partition`] books the decode rank as for any pick, and frees the leg
//! through [`unbook_leg`] exactly where it frees the booking (first token, free, expiry, a rank
//! leaving). A booking has at most one leg and `Option::take` removes it, so the leg is freed
//! exactly once on every path.

use rand::rngs::StdRng;

use crate::config::CoreConfig;
use crate::decide::{Candidate, Decision};
use crate::disagg::{self, PrefillChoice};
use crate::error::SelectError;
use crate::facts::Facts;
use crate::types::{RankKey, Role};

use super::pipeline::SaturationView;
use super::ranks::Slot;
use super::stage::{Ask, Decided, Field, Pick, Refusal};
use super::{health, load_fact, State};

/// The prefill rank's load held by a split booking until its first token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PrefillLeg {
    pub rank: RankKey,
    pub prefill_tokens: u64,
    pub blocks: u64,
}

/// The decode ranking (prefill-only ranks excluded) and each candidate's role, for
/// [`prefill_for`] once session affinity has settled the decode rank. A session bound to a rank
/// that cannot decode is not followed.
pub(crate) fn decide_pair(
    slots: &[(RankKey, Slot)],
    eligible: &[usize],
    candidates: &[Candidate],
    block_size: u32,
    config: &CoreConfig,
    bound: &mut Option<RankKey>,
    rng: &mut StdRng,
) -> Result<(Decision, Vec<Role>), SelectError> {
    let roles: Vec<Role> = eligible
        .iter()
        .map(|&i| slots.get(i).map_or(Role::Both, |(_, s)| s.role))
        .collect();
    if let Some(b) = *bound {
        let decodes = candidates
            .iter()
            .zip(&roles)
            .any(|(c, r)| c.key == b && r.decodes());
        if !decodes {
            *bound = None;
        }
    }
    let field = disagg::RoledCandidates {
        candidates,
        roles: &roles,
    };
    let ranking = disagg::rank_decode(field, block_size, &config.cost, &config.pd, rng)
        .ok_or_else(|| SelectError::Unavailable("no eligible decode rank".into()))?;
    Ok((
        Decision {
            ranking: ranking.ranking,
            costs: ranking.costs,
        },
        roles,
    ))
}

/// The prefill side for the decode rank the pipeline settled on (`decision.ranking[0]`), when
/// the decision was split by roles. With flow control (`saturation`) a saturated prefill rank is
/// not chosen: when the cost's choice is saturated, the best unsaturated prefill rank takes it
/// if it still beats a local prefill; otherwise the request waits ([`Refusal::Saturated`]),
/// since the cost says a split — even behind the saturated rank's queue — beats prefilling on
/// the decode rank.
pub(crate) fn prefill_for(
    ask: &Ask,
    field: &Field,
    decided: &Decided,
    rng: &mut StdRng,
    saturation: Option<&SaturationView>,
) -> Result<Option<PrefillChoice>, Refusal> {
    let Some(roles) = decided.roles.as_deref() else {
        return Ok(None);
    };
    let Some(&decode) = decided.decision.ranking.first() else {
        return Ok(None);
    };
    let config = ask.config;
    let mut choose = |roles: &[Role]| {
        let roled = disagg::RoledCandidates {
            candidates: &field.candidates,
            roles,
        };
        disagg::choose_prefill(
            roled,
            decode,
            ask.prompt.tokens,
            field.block_size,
            &config.cost,
            &config.pd,
            rng,
        )
    };
    let Some(choice) = choose(roles) else {
        return Ok(None);
    };
    let Some(view) = saturation.filter(|v| v.saturated(choice.position)) else {
        return Ok(Some(choice));
    };
    // Saturated prefill ranks take no prefill: hide them from the choice.
    let open: Vec<Role> = roles
        .iter()
        .enumerate()
        .map(|(i, &role)| {
            if i != decode && role.prefills() && view.saturated(i) {
                Role::Decode
            } else {
                role
            }
        })
        .collect();
    choose(&open).map(Some).ok_or(Refusal::Saturated)
}

/// Books the prefill rank's part of a split pick: the prompt's uncached tokens there, the KV it
/// holds until the transfer, one request; the prompt's blocks (`chain`) become predicted entries
/// of the prefill rank (it caches what it prefills), and what it predicted there comes back with
/// the leg. `None` when the pick is not split or its prefill rank is gone.
pub(crate) fn book_leg(
    state: &mut State,
    ask: &Ask,
    pick: &Pick,
    chain: &std::sync::Arc<[u64]>,
    facts: &mut Facts,
) -> Option<(PrefillLeg, Option<health::PredictedChain>)> {
    let (rank, overlap) = pick.prefill?;
    let block_size = u64::from(pick.block_size.max(1));
    let tokens = pick.prompt.tokens;
    let cached = u64::from(overlap.gpu)
        .saturating_mul(block_size)
        .min(tokens);
    let leg = PrefillLeg {
        rank,
        prefill_tokens: tokens.saturating_sub(cached),
        blocks: tokens.div_ceil(block_size),
    };
    let slot = state.ranks.get_mut(&rank)?;
    slot.add_load(leg.prefill_tokens, leg.blocks);
    // The leg is one request on its rank: in the in-flight gauge until it is unbooked (or its
    // rank leaves, which takes every request on the rank off the gauge).
    facts.push(crate::facts::Fact::Inflight(1));
    let (precise, expires) = health::prediction_life(slot, ask.config, ask.now);
    facts.push(load_fact(slot, rank));
    if !chain.is_empty() {
        state.predict(rank, chain, expires);
    }
    Some((leg, health::predicted_on(rank, chain, overlap.gpu, precise)))
}

/// Takes a prefill leg's load off its rank (no-op for `None` or a rank that left).
pub(crate) fn unbook_leg(state: &mut State, leg: Option<&PrefillLeg>, facts: &mut Facts) {
    let Some(leg) = leg else {
        return;
    };
    if let Some(slot) = state.ranks.get_mut(&leg.rank) {
        slot.remove_load(leg.prefill_tokens, leg.blocks);
        facts.push(load_fact(slot, leg.rank));
        facts.push(crate::facts::Fact::Inflight(-1));
    }
}

#[cfg(test)]
mod tests;
