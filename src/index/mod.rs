//! The KV index: which ranks hold which blocks, per tier, keyed by chained sequence hashes.
//! `find_matches` returns, per rank, the longest consecutive matched prefix in each tier. Entries
//! may carry an expiry (approximate / predicted entries inserted from routing decisions); expired
//! entries count as absent and are purged lazily. Memory is bounded by `max_blocks` with eviction
//! of the least recently touched blocks.
//!
//! This module knows nothing about requests, bookings or workers beyond `RankKey`.

pub mod hash;

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use crate::selection::RankKey;

/// Where a block lives on a rank. Lower tiers count less toward overlap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    Gpu = 0,
    Host = 1,
    Disk = 2,
}

/// Matched depths (in blocks) for one rank: `gpu <= host <= disk`, each the longest consecutive
/// prefix present in that tier or a faster one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TierDepths {
    pub gpu: u32,
    pub host: u32,
    pub disk: u32,
}

#[derive(Debug, Clone, Copy)]
struct Holder {
    rank: RankKey,
    tier: Tier,
    /// `None` = held until removed (KV events); `Some` = approximate/predicted entry.
    expires: Option<Instant>,
}

#[derive(Debug, Default)]
struct Block {
    holders: Vec<Holder>,
    touched: u64,
}

/// Per-partition block index.
#[derive(Debug)]
pub struct PrefixIndex {
    blocks: HashMap<u64, Block>,
    /// touch tick -> block hash, for LRU eviction.
    lru: BTreeMap<u64, u64>,
    tick: u64,
    max_blocks: usize,
}

impl PrefixIndex {
    pub fn new(max_blocks: usize) -> Self {
        PrefixIndex {
            blocks: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            max_blocks: max_blocks.max(1),
        }
    }

    pub fn capacity(&self) -> usize {
        self.max_blocks
    }

    pub fn len(&self) -> usize {
        self.blocks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    fn touch(&mut self, hash: u64) {
        self.tick += 1;
        let tick = self.tick;
        if let Some(block) = self.blocks.get_mut(&hash) {
            self.lru.remove(&block.touched);
            block.touched = tick;
            self.lru.insert(tick, hash);
        }
    }

    /// Records that `rank` holds the blocks `seq_hashes` (a prefix chain) in `tier`. With an
    /// expiry, an existing entry's expiry is extended, never shortened, and a permanent entry
    /// stays permanent.
    pub fn insert(
        &mut self,
        rank: RankKey,
        seq_hashes: &[u64],
        tier: Tier,
        expires: Option<Instant>,
    ) {
        for &h in seq_hashes {
            let block = self.blocks.entry(h).or_default();
            match block
                .holders
                .iter_mut()
                .find(|x| x.rank == rank && x.tier == tier)
            {
                Some(existing) => {
                    existing.expires = match (existing.expires, expires) {
                        (None, _) | (_, None) => None,
                        (Some(a), Some(b)) => Some(a.max(b)),
                    }
                }
                None => {
                    let at = block
                        .holders
                        .partition_point(|x| (x.rank, x.tier) < (rank, tier));
                    block.holders.insert(
                        at,
                        Holder {
                            rank,
                            tier,
                            expires,
                        },
                    );
                }
            }
            self.touch(h);
        }
        self.evict_over_capacity();
    }

    /// Forgets that `rank` holds `seq_hash` in `tier`.
    pub fn remove(&mut self, rank: RankKey, seq_hash: u64, tier: Tier) {
        if let Some(block) = self.blocks.get_mut(&seq_hash) {
            block
                .holders
                .retain(|x| !(x.rank == rank && x.tier == tier));
            if block.holders.is_empty() {
                let touched = block.touched;
                self.blocks.remove(&seq_hash);
                self.lru.remove(&touched);
            }
        }
    }

    /// Forgets every block of `rank` (rank left, engine restarted, `AllBlocksCleared`).
    pub fn clear_rank(&mut self, rank: RankKey) {
        let lru = &mut self.lru;
        self.blocks.retain(|_, block| {
            block.holders.retain(|x| x.rank != rank);
            if block.holders.is_empty() {
                lru.remove(&block.touched);
                false
            } else {
                true
            }
        });
    }

    fn evict_over_capacity(&mut self) {
        while self.blocks.len() > self.max_blocks {
            let Some((_, hash)) = self.lru.pop_first() else {
                break;
            };
            self.blocks.remove(&hash);
        }
    }

    /// Drops expired entries.
    pub fn purge_expired(&mut self, now: Instant) {
        let lru = &mut self.lru;
        self.blocks.retain(|_, block| {
            block.holders.retain(|x| x.expires.is_none_or(|e| e > now));
            if block.holders.is_empty() {
                lru.remove(&block.touched);
                false
            } else {
                true
            }
        });
    }

    /// Longest consecutive matched prefix per rank, per tier. Ranks with no match are absent.
    ///
    /// Holders are kept sorted by `(rank, tier)`, so each block is a merge-join against the ranks
    /// still matching: O(blocks × (live ranks + holders)), no allocation per block.
    pub fn find_matches(&self, seq_hashes: &[u64], now: Instant) -> HashMap<RankKey, TierDepths> {
        let mut live: Vec<(RankKey, TierDepths, [bool; 3])> = Vec::new();
        let mut finished: HashMap<RankKey, TierDepths> = HashMap::new();
        for (i, h) in seq_hashes.iter().enumerate() {
            let Some(block) = self.blocks.get(h) else {
                break;
            };
            let mut groups = RankGroups {
                holders: &block.holders,
                pos: 0,
                now,
            };
            if i == 0 {
                while let Some((rank, tiers)) = groups.next_group() {
                    if tiers[2] {
                        live.push((rank, TierDepths::default(), tiers));
                    }
                }
            } else {
                let mut pending = groups.next_group();
                for (rank, _, alive) in live.iter_mut() {
                    while pending.is_some_and(|(r, _)| r < *rank) {
                        pending = groups.next_group();
                    }
                    let here = match pending {
                        Some((r, tiers)) if r == *rank => tiers,
                        _ => [false; 3],
                    };
                    for t in 0..3 {
                        alive[t] &= here[t];
                    }
                }
            }
            live.retain(|(rank, depths, alive)| {
                if alive[2] {
                    true
                } else {
                    finished.insert(*rank, *depths);
                    false
                }
            });
            for (_, depths, alive) in live.iter_mut() {
                depths.gpu += alive[0] as u32;
                depths.host += alive[1] as u32;
                depths.disk += 1;
            }
            if live.is_empty() {
                break;
            }
        }
        finished.extend(live.into_iter().map(|(rank, depths, _)| (rank, depths)));
        finished.retain(|_, d| d.disk > 0);
        finished
    }
}

/// Walks a block's holders (sorted by rank, then tier) one rank at a time, yielding which tiers
/// hold the block on that rank, counting a faster tier for every slower one, skipping expired.
struct RankGroups<'a> {
    holders: &'a [Holder],
    pos: usize,
    now: Instant,
}

impl RankGroups<'_> {
    fn next_group(&mut self) -> Option<(RankKey, [bool; 3])> {
        while self.pos < self.holders.len() {
            let rank = self.holders[self.pos].rank;
            let mut tiers = [false; 3];
            while self.pos < self.holders.len() && self.holders[self.pos].rank == rank {
                let holder = &self.holders[self.pos];
                if holder.expires.is_none_or(|e| e > self.now) {
                    for t in tiers.iter_mut().skip(holder.tier as usize) {
                        *t = true;
                    }
                }
                self.pos += 1;
            }
            if tiers[2] {
                return Some((rank, tiers));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn rank(w: u64) -> RankKey {
        RankKey {
            worker_id: w,
            dp_rank: 0,
        }
    }

    #[test]
    fn longest_consecutive_prefix_per_rank_and_tier() {
        let mut idx = PrefixIndex::new(1000);
        let now = Instant::now();
        idx.insert(rank(1), &[10, 11, 12, 13], Tier::Gpu, None);
        idx.insert(rank(2), &[10, 11], Tier::Gpu, None);
        idx.insert(rank(2), &[12, 13], Tier::Host, None);
        idx.insert(rank(3), &[10, 12, 13], Tier::Gpu, None); // hole at 11
        let m = idx.find_matches(&[10, 11, 12, 13, 14], now);
        assert_eq!(
            m[&rank(1)],
            TierDepths {
                gpu: 4,
                host: 4,
                disk: 4
            }
        );
        assert_eq!(
            m[&rank(2)],
            TierDepths {
                gpu: 2,
                host: 4,
                disk: 4
            }
        );
        assert_eq!(
            m[&rank(3)],
            TierDepths {
                gpu: 1,
                host: 1,
                disk: 1
            }
        );
        assert!(
            idx.find_matches(&[99, 10], now).is_empty(),
            "no match at block 0"
        );
    }

    #[test]
    fn expiring_entries_and_purge() {
        let mut idx = PrefixIndex::new(1000);
        let now = Instant::now();
        idx.insert(
            rank(1),
            &[1, 2],
            Tier::Gpu,
            Some(now + Duration::from_secs(2)),
        );
        assert_eq!(idx.find_matches(&[1, 2], now)[&rank(1)].gpu, 2);
        assert!(idx
            .find_matches(&[1, 2], now + Duration::from_secs(2))
            .is_empty());
        // A permanent insert makes the entry permanent.
        idx.insert(rank(1), &[1], Tier::Gpu, None);
        idx.purge_expired(now + Duration::from_secs(3));
        assert_eq!(idx.len(), 1);
        assert_eq!(
            idx.find_matches(&[1, 2], now + Duration::from_secs(9))[&rank(1)].gpu,
            1
        );
    }

    #[test]
    fn bounded_with_lru_eviction_and_clear_rank() {
        let mut idx = PrefixIndex::new(3);
        idx.insert(rank(1), &[1, 2, 3], Tier::Gpu, None);
        idx.insert(rank(2), &[1], Tier::Gpu, None); // touches 1: 2 is now coldest
        idx.insert(rank(2), &[4], Tier::Gpu, None);
        assert_eq!(idx.len(), 3);
        let now = Instant::now();
        assert_eq!(
            idx.find_matches(&[1, 2, 3], now)[&rank(1)].gpu,
            1,
            "block 2 evicted"
        );
        idx.clear_rank(rank(2));
        assert_eq!(idx.len(), 2);
        idx.remove(rank(1), 1, Tier::Gpu);
        assert!(idx.find_matches(&[1], now).is_empty());
    }
}
