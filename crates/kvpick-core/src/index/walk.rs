//! The match walk's steps over one block's holders: opening the match at the first block,
//! narrowing it block by block (the merge-join and the GPU-only intersection), and grouping a
//! block's holders by rank. Owns only these loops; what a holder is, the table and the walk's
//! order stay in the index ([`super`]).

use super::{retired, Holder, RankKey};

/// A block's holders as [`super::PrefixIndex::block_holders`] sees them.
pub(super) struct BlockHolders<'a> {
    /// Sorted by `who`.
    pub(super) holders: &'a [Holder],
    /// Equal ids = (almost surely) equal holder sets.
    pub(super) set_id: u64,
    /// No holder has expired.
    pub(super) fresh: bool,
    /// Every holder is live and in the GPU tier (so one per rank).
    pub(super) gpu_only: bool,
}

/// A tier still matching in [`super::PrefixIndex::find_matches`].
pub(super) const OPEN: u32 = u32::MAX;

/// The first block's holders start the match: one entry per rank, each tier open where held
/// (a tier not held ends at `start`, the blocks every rank holds).
#[inline]
pub(super) fn open_matches(
    mut groups: RankGroups,
    entries: &mut Vec<(u32, [u32; 3])>,
    live: &mut Vec<usize>,
    start: u32,
    ranks: &[Option<RankKey>],
) {
    while let Some((rank, tiers)) = groups.next_group() {
        // A cleared rank's holders wait for the purge: it matches nothing. Every later block
        // narrows these entries, so skipping it here skips it everywhere.
        if retired(ranks, rank) {
            continue;
        }
        let ends = tiers.map(|present| if present { OPEN } else { start });
        entries.push((rank, ends));
        live.push(entries.len() - 1);
    }
}

/// Block `i`'s holders, merge-joined against the ranks still matching (both in rank-id
/// order): a tier a rank no longer holds ends at `i`; a rank held in no tier leaves `live`.
#[inline]
pub(super) fn narrow_matches(
    mut groups: RankGroups,
    entries: &mut [(u32, [u32; 3])],
    live: &mut Vec<usize>,
    i: u32,
) {
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

/// [`narrow_matches`] for a block whose holders are all live and all in the GPU tier (one per
/// rank, the common case): a rank among them keeps every tier it still matches in, any other
/// rank stops matching at `i` in every tier. A plain sorted-set intersection, without grouping
/// holders by rank or testing their expiry.
#[inline]
pub(super) fn narrow_to_gpu_holders(
    holders: &[Holder],
    entries: &mut [(u32, [u32; 3])],
    live: &mut Vec<usize>,
    i: u32,
) {
    let mut next = 0usize;
    live.retain(|&at| {
        let (rank, ends) = &mut entries[at];
        while next < holders.len() && holders[next].rank_id() < *rank {
            next += 1;
        }
        let held = next < holders.len() && holders[next].rank_id() == *rank;
        if !held {
            for end in ends.iter_mut().filter(|e| **e == OPEN) {
                *end = i;
            }
        }
        held
    });
}

/// Walks a block's holders (sorted by rank id, then tier) one rank at a time, yielding which
/// tiers hold the block on that rank, counting a faster tier for every slower one, skipping
/// expired holders.
pub(super) struct RankGroups<'a> {
    pub(super) holders: &'a [Holder],
    pub(super) pos: usize,
    pub(super) now: u32,
}

impl RankGroups<'_> {
    pub(super) fn next_group(&mut self) -> Option<(u32, [bool; 3])> {
        while self.pos < self.holders.len() {
            let rank = self.holders[self.pos].rank_id();
            let mut tiers = [false; 3];
            while self.pos < self.holders.len() && self.holders[self.pos].rank_id() == rank {
                let holder = self.holders[self.pos];
                if holder.live(self.now) {
                    for t in tiers.iter_mut().skip(holder.tier()) {
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
