//! The match walk's steps over one block's holders: opening the match at the first block,
//! narrowing it block by block (the merge-join and the GPU-only intersection), and grouping a
//! block's holders by rank. Owns only these loops; what a holder is, the table and the walk's
//! order stay in the index ([`super`]).

use super::{retired, Holder, RankKey, TierDepths};

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

/// One rank's walk down a prompt's blocks ([`super::PrefixIndex::rank_depths`], a hard-bound
/// session's overlap): where each of its tiers stopped matching, as the merge-join would have
/// found for it. A block with the same fresh holders as the one before changes nothing; any
/// other is one search for the rank among its holders, started where the rank stood in the
/// last list searched ([`lower_bound_near`]).
pub(super) struct RankWalk {
    id: u32,
    /// Where each tier stopped matching (`OPEN`: still matching).
    ends: [u32; 3],
    /// Blocks matched so far in some tier (the next block's index).
    depth: u32,
    prev_set: Option<u64>,
    /// The rank's position in the last holder list it was searched in. Consecutive blocks of a
    /// prompt have nearly the same holders (they differ by the ranks whose match ends or
    /// begins there), so the rank sits at or near the same position in the next list: a
    /// search from here reads one or two holders where a binary search over a block held by
    /// hundreds of ranks reads a cache line per halving.
    hint: usize,
}

impl RankWalk {
    pub(super) fn new(id: u32) -> Self {
        RankWalk {
            id,
            ends: [OPEN; 3],
            depth: 0,
            prev_set: None,
            hint: 0,
        }
    }

    /// The next block's holders; false once the rank matches it in no tier (the walk is over).
    pub(super) fn step(&mut self, block: BlockHolders, now: u32) -> bool {
        let i = self.depth;
        // The same live holders as the block before: the rank's tiers did not change.
        let same = block.fresh && self.prev_set == Some(block.set_id);
        self.prev_set = Some(block.set_id);
        if !same {
            let fastest = self.fastest_tier(block.holders, now);
            for (t, end) in self.ends.iter_mut().enumerate() {
                // A tier counts a block held in it or in a faster one.
                if *end == OPEN && fastest > t {
                    *end = i;
                }
            }
        }
        if self.ends[2] != OPEN {
            return false;
        }
        self.depth = i.saturating_add(1);
        true
    }

    /// The fastest tier the rank holds the block in, live (3: none).
    fn fastest_tier(&mut self, holders: &[Holder], now: u32) -> usize {
        let from = lower_bound_near(holders, self.id, self.hint);
        // An inline holder says nothing of where the rank sits in the next shared block.
        if holders.len() > 1 {
            self.hint = from;
        }
        holders
            .get(from..)
            .unwrap_or_default()
            .iter()
            .take_while(|h| h.rank_id() == self.id)
            .filter(|h| h.live(now))
            .map(|h| h.tier())
            .min()
            .unwrap_or(3)
    }

    pub(super) fn depths(&self) -> TierDepths {
        let d = self.ends.map(|e| e.min(self.depth));
        TierDepths {
            gpu: d[0],
            host: d[1],
            disk: d[2],
        }
    }
}

/// The first position in `holders` (sorted by rank id) whose rank id is at least `id`, as
/// `partition_point` gives it, found by galloping out from `hint`: O(log d) reads for an answer
/// `d` positions away, so one or two when the hint is right.
pub(super) fn lower_bound_near(holders: &[Holder], id: u32, hint: usize) -> usize {
    let below = |at: usize| holders.get(at).is_some_and(|h| h.rank_id() < id);
    let n = holders.len();
    let hint = hint.min(n);
    let (lo, hi) = if hint == 0 || below(hint - 1) {
        // Everything before `hint` is below `id`: gallop forward.
        let (mut lo, mut step) = (hint, 1usize);
        while lo.saturating_add(step) <= n && below(lo + step - 1) {
            lo += step;
            step = step.saturating_mul(2);
        }
        (lo, lo.saturating_add(step).min(n))
    } else {
        // `holders[hint - 1]` is at or past `id`: gallop backward.
        let (mut hi, mut step) = (hint - 1, 1usize);
        while hi >= step && !below(hi - step) {
            hi -= step;
            step = step.saturating_mul(2);
        }
        (hi.checked_sub(step).map_or(0, |at| at + 1), hi)
    };
    lo + holders
        .get(lo..hi)
        .unwrap_or_default()
        .partition_point(|h| h.rank_id() < id)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Galloping from any hint finds what a binary search over the whole list finds, for
    /// ids below, among, between and above the holders (several tiers per rank included).
    #[test]
    fn the_search_from_a_hint_is_the_binary_search() {
        let mut seed = 0x2545_F491_4F6C_DD1Du64;
        let mut next = move |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        for _ in 0..2_000 {
            let len = next(40) as usize;
            let mut holders: Vec<Holder> = (0..len)
                .map(|_| Holder {
                    who: (next(64) as u32) << 2 | next(3) as u32,
                    state: 1,
                })
                .collect();
            holders.sort_unstable_by_key(|h| h.who);
            holders.dedup_by_key(|h| h.who);
            let id = next(70) as u32;
            let hint = next(50) as usize;
            assert_eq!(
                lower_bound_near(&holders, id, hint),
                holders.partition_point(|h| h.rank_id() < id),
                "id {id} hint {hint} in {:?}",
                holders.iter().map(|h| h.who).collect::<Vec<_>>()
            );
        }
    }
}
