//! The KV index: which ranks hold which blocks, per tier, keyed by chained sequence hashes.
//! `find_matches` returns, per rank, the longest consecutive matched prefix in each tier. Entries
//! may carry an expiry (approximate / predicted entries inserted from routing decisions); expired
//! entries count as absent and are purged lazily. Memory is bounded by `max_blocks` with eviction
//! of the least recently touched blocks.
//!
//! This module knows nothing about requests, bookings or workers beyond `RankKey`.

pub mod hash;

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use tokio::time::Instant;

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
    /// Sorted by `(rank, tier)`.
    holders: Vec<Holder>,
    touched: u64,
    /// XOR of the holders' `(rank, tier)` fingerprints: equal ids = (almost surely) equal sets,
    /// which lets a lookup skip blocks whose holders are those of the previous block.
    set_id: u64,
    /// No holder expires before this (`None`: none expires). Conservative: may be earlier.
    min_expiry: Option<Instant>,
}

fn fingerprint(rank: RankKey, tier: Tier) -> u64 {
    // splitmix64 finalizer over the packed key.
    let mut z = rank
        .worker_id
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(((rank.dp_rank as u64) << 2) | tier as u64);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Block {
    fn upsert(&mut self, rank: RankKey, tier: Tier, expires: Option<Instant>) {
        let at = self
            .holders
            .partition_point(|x| (x.rank, x.tier) < (rank, tier));
        match self.holders.get_mut(at) {
            Some(existing) if existing.rank == rank && existing.tier == tier => {
                existing.expires = match (existing.expires, expires) {
                    (None, _) | (_, None) => None,
                    (Some(a), Some(b)) => Some(a.max(b)),
                };
            }
            _ => {
                self.holders.insert(
                    at,
                    Holder {
                        rank,
                        tier,
                        expires,
                    },
                );
                self.set_id ^= fingerprint(rank, tier);
                if let Some(e) = expires {
                    self.min_expiry = Some(self.min_expiry.map_or(e, |m| m.min(e)));
                }
            }
        }
    }

    fn retain(&mut self, keep: impl FnMut(&Holder) -> bool) {
        self.holders.retain(keep);
        self.set_id = self
            .holders
            .iter()
            .fold(0, |id, h| id ^ fingerprint(h.rank, h.tier));
        self.min_expiry = self.holders.iter().filter_map(|h| h.expires).min();
    }
}

/// Block keys are already xxh3 outputs (uniformly distributed), so hashing them again (SipHash)
/// only costs time on the lookup path: use the key itself.
#[derive(Default)]
struct PreHashed(u64);

impl Hasher for PreHashed {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        // Only u64 keys are hashed here; fold anything else in so it is still correct.
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ *b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// Per-partition block index.
#[derive(Debug)]
pub struct PrefixIndex {
    blocks: HashMap<u64, Block, BuildHasherDefault<PreHashed>>,
    tick: u64,
    max_blocks: usize,
}

impl PrefixIndex {
    pub fn new(max_blocks: usize) -> Self {
        PrefixIndex {
            blocks: HashMap::default(),
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
            self.tick += 1;
            let block = self.blocks.entry(h).or_default();
            block.upsert(rank, tier, expires);
            block.touched = self.tick;
        }
        self.evict_over_capacity();
    }

    /// Forgets that `rank` holds `seq_hash` in `tier`.
    pub fn remove(&mut self, rank: RankKey, seq_hash: u64, tier: Tier) {
        if let Some(block) = self.blocks.get_mut(&seq_hash) {
            block.retain(|x| !(x.rank == rank && x.tier == tier));
            if block.holders.is_empty() {
                self.blocks.remove(&seq_hash);
            }
        }
    }

    /// Forgets every block of `rank` (rank left, engine restarted, `AllBlocksCleared`).
    pub fn clear_rank(&mut self, rank: RankKey) {
        self.blocks.retain(|_, block| {
            block.retain(|x| x.rank != rank);
            !block.holders.is_empty()
        });
    }

    /// Evicts the least recently touched blocks once over capacity. Eviction works in batches
    /// (down to 63/64 of capacity) so its O(blocks) scan is paid once per many inserts, and no
    /// ordered structure has to be maintained on every touch.
    fn evict_over_capacity(&mut self) {
        if self.blocks.len() <= self.max_blocks {
            return;
        }
        let target = self.max_blocks - self.max_blocks / 64;
        let excess = self.blocks.len() - target;
        let mut ticks: Vec<u64> = self.blocks.values().map(|b| b.touched).collect();
        let (_, cutoff, _) = ticks.select_nth_unstable(excess - 1);
        let cutoff = *cutoff;
        self.blocks.retain(|_, b| b.touched > cutoff);
    }

    /// Drops expired entries.
    pub fn purge_expired(&mut self, now: Instant) {
        self.blocks.retain(|_, block| {
            if block.min_expiry.is_some_and(|e| e <= now) {
                block.retain(|x| x.expires.is_none_or(|e| e > now));
            }
            !block.holders.is_empty()
        });
    }

    /// Longest consecutive matched prefix per rank, per tier, sorted by rank. Ranks with no
    /// match are absent.
    ///
    /// Holders are sorted by `(rank, tier)`, so a block is a merge-join against the ranks still
    /// matching; a block whose holder set equals the previous block's (a shared prefix) and has
    /// nothing expired is skipped in O(1). A rank's depth in a tier is the block index at which
    /// it stopped matching there.
    pub fn find_matches(&self, seq_hashes: &[u64], now: Instant) -> Vec<(RankKey, TierDepths)> {
        const OPEN: u32 = u32::MAX;
        // Per rank seen at block 0: where each tier stopped matching (OPEN = still matching).
        let mut entries: Vec<(RankKey, [u32; 3])> = Vec::new();
        // Positions in `entries` still matching in some tier, in rank order.
        let mut live: Vec<usize> = Vec::new();
        let mut depth = 0u32;
        let mut prev_set = 0u64;
        for (i, h) in seq_hashes.iter().enumerate() {
            let Some(block) = self.blocks.get(h) else {
                break;
            };
            let i = i as u32;
            let fresh = block.min_expiry.is_none_or(|e| e > now);
            if i == 0 {
                let mut groups = RankGroups {
                    holders: &block.holders,
                    pos: 0,
                    now,
                };
                while let Some((rank, tiers)) = groups.next_group() {
                    let ends = tiers.map(|present| if present { OPEN } else { 0 });
                    entries.push((rank, ends));
                    live.push(entries.len() - 1);
                }
            } else if !(fresh && block.set_id == prev_set) {
                let mut groups = RankGroups {
                    holders: &block.holders,
                    pos: 0,
                    now,
                };
                let mut pending = groups.next_group();
                live.retain(|&at| {
                    let (rank, ends) = &mut entries[at];
                    while pending.is_some_and(|(r, _)| r < *rank) {
                        pending = groups.next_group();
                    }
                    let here = match pending {
                        Some((r, tiers)) if r == *rank => tiers,
                        _ => [false; 3],
                    };
                    for t in 0..3 {
                        if ends[t] == OPEN && !here[t] {
                            ends[t] = i;
                        }
                    }
                    ends[2] == OPEN
                });
            }
            prev_set = block.set_id;
            if live.is_empty() {
                break;
            }
            depth = i + 1;
        }
        entries
            .into_iter()
            .map(|(rank, ends)| {
                let d = ends.map(|e| e.min(depth));
                (
                    rank,
                    TierDepths {
                        gpu: d[0],
                        host: d[1],
                        disk: d[2],
                    },
                )
            })
            .filter(|(_, d)| d.disk > 0)
            .collect()
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

    fn matches(idx: &PrefixIndex, hashes: &[u64], now: Instant) -> HashMap<RankKey, TierDepths> {
        idx.find_matches(hashes, now).into_iter().collect()
    }

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
        let m = matches(&idx, &[10, 11, 12, 13, 14], now);
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
            matches(&idx, &[99, 10], now).is_empty(),
            "no match at block 0"
        );
    }

    /// The obvious definition, block by block, for comparison.
    fn naive(idx: &PrefixIndex, hashes: &[u64], now: Instant) -> HashMap<RankKey, TierDepths> {
        let present = |h: u64, rank: RankKey, tier: usize| {
            idx.blocks.get(&h).is_some_and(|b| {
                b.holders.iter().any(|x| {
                    x.rank == rank && (x.tier as usize) <= tier && x.expires.is_none_or(|e| e > now)
                })
            })
        };
        let mut out = HashMap::new();
        let ranks: std::collections::BTreeSet<RankKey> = idx
            .blocks
            .values()
            .flat_map(|b| b.holders.iter().map(|h| h.rank))
            .collect();
        for rank in ranks {
            let depth = |tier| {
                hashes
                    .iter()
                    .take_while(|h| present(**h, rank, tier))
                    .count() as u32
            };
            let d = TierDepths {
                gpu: depth(0),
                host: depth(1),
                disk: depth(2),
            };
            if d.disk > 0 {
                out.insert(rank, d);
            }
        }
        out
    }

    #[test]
    fn matches_the_naive_definition_on_random_indexes() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let now = Instant::now();
        for _ in 0..300 {
            let mut idx = PrefixIndex::new(10_000);
            let chain: Vec<u64> = (0..24).map(|_| rng.random_range(0..40)).collect();
            for _ in 0..rng.random_range(1..30) {
                let rank = RankKey {
                    worker_id: rng.random_range(0..6),
                    dp_rank: rng.random_range(0..2),
                };
                let start = rng.random_range(0..chain.len());
                let end = rng.random_range(start..=chain.len());
                let tier = [Tier::Gpu, Tier::Host, Tier::Disk][rng.random_range(0..3)];
                let expires = match rng.random_range(0..3) {
                    0 => None,
                    1 => Some(now - Duration::from_secs(1)),
                    _ => Some(now + Duration::from_secs(1)),
                };
                idx.insert(rank, &chain[start..end], tier, expires);
            }
            if rng.random_bool(0.2) {
                idx.clear_rank(RankKey {
                    worker_id: 1,
                    dp_rank: 0,
                });
            }
            let got = idx.find_matches(&chain, now);
            assert!(got.windows(2).all(|w| w[0].0 < w[1].0), "sorted by rank");
            assert_eq!(
                got.into_iter().collect::<HashMap<_, _>>(),
                naive(&idx, &chain, now)
            );
        }
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
        assert_eq!(matches(&idx, &[1, 2], now)[&rank(1)].gpu, 2);
        assert!(idx
            .find_matches(&[1, 2], now + Duration::from_secs(2))
            .is_empty());
        // A permanent insert makes the entry permanent.
        idx.insert(rank(1), &[1], Tier::Gpu, None);
        idx.purge_expired(now + Duration::from_secs(3));
        assert_eq!(idx.len(), 1);
        assert_eq!(
            matches(&idx, &[1, 2], now + Duration::from_secs(9))[&rank(1)].gpu,
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
            matches(&idx, &[1, 2, 3], now)[&rank(1)].gpu,
            1,
            "block 2 evicted"
        );
        idx.clear_rank(rank(2));
        assert_eq!(idx.len(), 2);
        idx.remove(rank(1), 1, Tier::Gpu);
        assert!(matches(&idx, &[1], now).is_empty());
    }
}
