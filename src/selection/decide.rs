//! The pure decision: given candidate ranks and their load, choose the primary and fallbacks.
//! No locks, no clocks, no I/O: the same inputs and RNG state give the same answer.

use rand::Rng;

use super::RankKey;

/// One eligible rank and the load the decision looks at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub key: RankKey,
    pub active_requests: u64,
}

/// Every candidate index, best first; `ranking[0]` is the pick.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decision {
    pub ranking: Vec<usize>,
}

/// Least in-flight requests wins; ties are broken uniformly at random.
pub fn decide<R: Rng + ?Sized>(candidates: &[Candidate], rng: &mut R) -> Decision {
    assert!(
        !candidates.is_empty(),
        "decide needs at least one candidate"
    );
    // Random tie-break keys drawn once per candidate keep the order a strict total order.
    let mut order: Vec<(u64, u64, usize)> = candidates
        .iter()
        .enumerate()
        .map(|(i, c)| (c.active_requests, rng.random::<u64>(), i))
        .collect();
    order.sort_unstable();
    Decision {
        ranking: order.into_iter().map(|(_, _, i)| i).collect(),
    }
}
