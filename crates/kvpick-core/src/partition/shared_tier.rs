//! A partition's shared KV tier (ARCHITECTURE.md §7, "Shared tier"): the blocks a cluster-wide
//! KV store (LMCache, Mooncake store, SGLang HiCache with a shared backend) holds for the model,
//! which any rank can load instead of recomputing. Per partition, not per rank: a block stored
//! there by one engine serves every engine. Fed by the KV events whose medium is `EXTERNAL`
//! ([`crate::event::Medium::is_shared`]), read by a pick as runs of consecutive held blocks over
//! the prompt ([`SharedTier::runs`]). It owns only the set and its bound; the events' routing is
//! [`super::events`]', the weight in the cost is [`crate::decide`]'s. It never touches the
//! per-rank index.

#![warn(clippy::arithmetic_side_effects)]

use std::collections::HashMap;
use std::sync::Arc;

use super::stage::{Ask, Field};
use super::{Partition, State};
use crate::decide::{Candidate, Decision};
use crate::facts::Fact;
use crate::types::RankKey;

/// Configuration of shared KV stores (`--shared-cache-multiplier`, `--shared-cache-models`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SharedCacheConfig {
    /// Weight of a block the shared tier holds beyond a rank's own overlap, against a block the
    /// rank holds on its GPU (1) and a block it must recompute (0). 0 = no shared tier: `EXTERNAL`
    /// stores then count as the storing rank's disk tier, as without this feature.
    pub multiplier: f64,
    /// Models attached to a shared store; empty = every model (when `multiplier` > 0).
    pub models: Vec<String>,
}

impl SharedCacheConfig {
    /// The multiplier for `model`'s partitions, `None` when it has no shared tier.
    pub fn weight_for(&self, model: &str) -> Option<f64> {
        let attached = self.models.is_empty() || self.models.iter().any(|m| m == model);
        (self.multiplier > 0.0 && self.multiplier.is_finite() && attached)
            .then_some(self.multiplier)
    }
}

/// The shared tier's blocks (our chained hashes) and how engines name them.
#[derive(Debug)]
pub(crate) struct SharedTier {
    pub weight: f64,
    /// Block -> the stamp of its latest store (the oldest go first over `capacity`).
    blocks: HashMap<u64, u64>,
    /// `(storing rank, engine hash)` -> block: removals and tokenless stores name engine hashes,
    /// which are only unique per engine.
    engines: HashMap<(RankKey, u64), u64>,
    capacity: usize,
    stamp: u64,
}

impl SharedTier {
    pub fn new(weight: f64, capacity: usize) -> Self {
        SharedTier {
            weight,
            blocks: HashMap::new(),
            engines: HashMap::new(),
            capacity: capacity.max(1),
            stamp: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    /// The block a rank's engine hash names in the shared tier.
    pub fn resolve(&self, rank: RankKey, engine_hash: u64) -> Option<u64> {
        self.engines.get(&(rank, engine_hash)).copied()
    }

    /// Records that the store holds `seq` (named `engine_hash` by `rank`); over the capacity the
    /// oldest quarter goes, so a store that never reports removals cannot grow without bound.
    pub fn store(&mut self, rank: RankKey, engine_hash: u64, seq: u64) {
        self.stamp = self.stamp.wrapping_add(1);
        self.blocks.insert(seq, self.stamp);
        self.engines.insert((rank, engine_hash), seq);
        if self.blocks.len() > self.capacity {
            self.evict_oldest();
        }
    }

    /// The store evicted the block `rank` names `engine_hash`; false when it was never stored.
    pub fn remove(&mut self, rank: RankKey, engine_hash: u64) -> bool {
        match self.engines.remove(&(rank, engine_hash)) {
            Some(seq) => {
                self.blocks.remove(&seq);
                true
            }
            None => false,
        }
    }

    /// A rank restarted or left: its engine hashes mean nothing now (the store keeps its blocks).
    pub fn forget_rank(&mut self, rank: RankKey) {
        self.engines.retain(|(r, _), _| *r != rank);
    }

    pub fn clear(&mut self) {
        self.blocks.clear();
        self.engines.clear();
    }

    /// `runs[i]`: how many consecutive blocks from prompt block `i` on the store holds (a rank
    /// whose own overlap ends at `i` loads that many). Empty when the store holds none of them.
    pub fn runs(&self, hashes: &[u64]) -> Vec<u32> {
        if self.blocks.is_empty() || !hashes.iter().any(|h| self.blocks.contains_key(h)) {
            return Vec::new();
        }
        let mut runs = vec![0u32; hashes.len()];
        let mut next = 0u32;
        for (run, h) in runs.iter_mut().zip(hashes).rev() {
            next = if self.blocks.contains_key(h) {
                next.saturating_add(1)
            } else {
                0
            };
            *run = next;
        }
        runs
    }

    /// Drops the oldest quarter of the blocks (at least one), and the engine names of blocks no
    /// longer held.
    fn evict_oldest(&mut self) {
        let drop = (self.blocks.len() / 4).max(1);
        let mut stamps: Vec<u64> = self.blocks.values().copied().collect();
        let cut = drop.saturating_sub(1);
        stamps.select_nth_unstable(cut);
        let cutoff = stamps.get(cut).copied().unwrap_or(0);
        self.blocks.retain(|_, s| *s > cutoff);
        let blocks = &self.blocks;
        self.engines.retain(|_, seq| blocks.contains_key(seq));
    }
}

/// What a pick reads of the shared tier: the prompt's runs and the multiplier.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SharedView<'a> {
    pub runs: &'a [u32],
    pub weight: f64,
}

impl<'a> SharedView<'a> {
    /// The view of [`Partition::shared_runs`]' answer (none: no shared blocks).
    pub fn of(runs: Option<&'a (Vec<u32>, f64)>) -> Self {
        runs.map_or_else(Default::default, |(runs, weight)| SharedView {
            runs,
            weight: *weight,
        })
    }

    /// Blocks a rank whose own overlap ends at `depth` can load from the shared tier.
    pub fn beyond(&self, depth: u32) -> u32 {
        self.runs.get(depth as usize).copied().unwrap_or(0)
    }
}

impl Partition {
    /// The prompt's runs in the shared tier and the multiplier; `None` without a shared tier
    /// or when it holds none of the prompt's blocks.
    pub(super) fn shared_runs(&self, state: &State, ask: &Ask) -> Option<(Vec<u32>, f64)> {
        if !self.has_shared_tier {
            return None;
        }
        let kv = state.kv_read();
        let tier = kv.shared.as_ref()?;
        let runs = tier.runs(ask.prompt.match_hashes());
        (!runs.is_empty()).then_some((runs, tier.weight))
    }

    /// Records shared blocks without events (tests).
    #[cfg(test)]
    pub fn insert_shared(&self, seqs: &[u64]) {
        let mut kv = self.kv.write();
        if let Some(tier) = kv.shared.as_mut() {
            let rank = RankKey {
                worker_id: u64::MAX,
                dp_rank: 0,
            };
            for &seq in seqs {
                tier.store(rank, seq, seq);
            }
        }
    }

    /// The shared tier's size, as a fact (`None` without one).
    pub fn shared_tier_size(&self) -> Option<Fact> {
        if !self.has_shared_tier {
            return None;
        }
        let blocks = self.kv.read().shared.as_ref()?.len();
        Some(Fact::SharedTierSize {
            partition: Arc::clone(&self.key),
            blocks,
        })
    }

    /// On a booked pick where some candidate loads blocks from the shared tier: whether the
    /// same decision without the shared tier ranks another rank first (over the candidates the
    /// decision costed; sampling and pairs are not replayed). The caller reports it once the
    /// pick is booked (a try that ends up waiting is no pick).
    pub(super) fn shared_tier_changed(
        state: &mut State,
        ask: &Ask,
        field: &Field,
        decision: &Decision,
    ) -> Option<bool> {
        let temperature = ask
            .request
            .temperature
            .unwrap_or(ask.config.cost.router_temperature);
        let hit = field.candidates.iter().any(|c| c.shared_blocks > 0);
        if ask.booking.is_none() || !hit || temperature != 0.0 || state.ranks.split_roles {
            return None;
        }
        let without: Vec<Candidate> = field
            .candidates
            .iter()
            .map(|c| Candidate {
                shared_blocks: 0,
                ..*c
            })
            .collect();
        let plain = super::pipeline::rank(
            &without,
            ask.prompt,
            field.block_size,
            ask.request,
            ask.config,
            &mut state.rng,
        );
        Some(plain.ranking.first() != decision.ranking.first())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const R0: RankKey = RankKey {
        worker_id: 1,
        dp_rank: 0,
    };
    const R1: RankKey = RankKey {
        worker_id: 2,
        dp_rank: 0,
    };

    #[test]
    fn runs_count_consecutive_held_blocks_from_each_position() {
        let mut tier = SharedTier::new(0.5, 100);
        for (engine, seq) in [(10, 1), (11, 2), (13, 4)] {
            tier.store(R0, engine, seq);
        }
        assert_eq!(tier.runs(&[1, 2, 3, 4, 5]), vec![2, 1, 0, 1, 0]);
        assert!(tier.runs(&[7, 8]).is_empty());
        let view = SharedView {
            runs: &tier.runs(&[1, 2, 3]),
            weight: 0.5,
        };
        assert_eq!((view.beyond(0), view.beyond(2), view.beyond(9)), (2, 0, 0));
    }

    #[test]
    fn a_removal_by_the_storing_ranks_engine_hash_drops_the_block() {
        let mut tier = SharedTier::new(0.5, 100);
        tier.store(R0, 10, 1);
        assert!(!tier.remove(R1, 10), "another engine's hash names nothing");
        assert_eq!(tier.len(), 1);
        assert!(tier.remove(R0, 10));
        assert_eq!(tier.len(), 0);
        assert!(!tier.remove(R0, 10));
    }

    #[test]
    fn a_rank_forgotten_keeps_the_stores_blocks() {
        let mut tier = SharedTier::new(0.5, 100);
        tier.store(R0, 10, 1);
        tier.forget_rank(R0);
        assert_eq!(tier.len(), 1);
        assert_eq!(tier.resolve(R0, 10), None);
    }

    #[test]
    fn at_capacity_nothing_is_evicted_and_one_over_evicts_the_oldest() {
        let mut tier = SharedTier::new(0.5, 8);
        for i in 0..8u64 {
            tier.store(R0, 100 + i, i);
        }
        assert_eq!(tier.len(), 8, "at the capacity every block stays");
        tier.store(R0, 108, 8);
        assert!(tier.len() <= 8, "one over evicts");
        assert_eq!(tier.runs(&[0]), Vec::<u32>::new(), "the oldest went first");
        assert_eq!(tier.runs(&[8]), vec![1], "the newest stays");
        assert_eq!(tier.resolve(R0, 100), None, "its engine name went with it");
    }

    #[test]
    fn weight_only_for_attached_models_and_a_positive_multiplier() {
        let off = SharedCacheConfig::default();
        assert_eq!(off.weight_for("m"), None);
        let all = SharedCacheConfig {
            multiplier: 0.5,
            models: vec![],
        };
        assert_eq!(all.weight_for("m"), Some(0.5));
        let some = SharedCacheConfig {
            multiplier: 0.5,
            models: vec!["a".into()],
        };
        assert_eq!(
            (some.weight_for("a"), some.weight_for("b")),
            (Some(0.5), None)
        );
    }
}
