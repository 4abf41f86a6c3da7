//! The KV index: which ranks hold which blocks, per tier, keyed by chained sequence hashes.
//! `find_matches` returns, per rank, the longest consecutive matched prefix in each tier. Entries
//! may carry an expiry (approximate / predicted entries inserted from routing decisions); expired
//! entries count as absent and are purged lazily. Entries from KV events are permanent and
//! reference-counted (an engine may store the same block twice). Memory is bounded by
//! `max_blocks` with eviction of the least recently touched blocks. The table is split into
//! `shards`; purging, eviction (in a big index) and early growth each work one shard at a
//! time, so no single operation walks or rehashes the whole table under the partition lock.
//!
//! Layout, for memory (ARCHITECTURE.md §7: ≤ 64 bytes per indexed (block, rank) pair): ranks are interned
//! to dense `u32` ids, a holder is 8 bytes (`id << 2 | tier`, then a refcount or an expiry in
//! milliseconds since the index's epoch), and a block held by one rank — the common case — is a
//! single 24-byte table entry with its holder inline. Blocks with several holders keep them in a
//! slab of sorted holder lists.
//!
//! This module knows nothing about requests, bookings or workers beyond `RankKey`.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Duration;
use std::time::Instant;

mod retire;
mod shards;
mod walk;

use crate::types::RankKey;
pub use crate::types::{Tier, TierDepths};
use shards::Shards;
pub use shards::PURGE_SHARDS;
use walk::{
    narrow_matches, narrow_to_gpu_holders, open_matches, BlockHolders, RankGroups, RankWalk,
};

/// `state` flag: a permanent holder; the low bits are its reference count.
const PERMANENT: u32 = 1 << 31;
/// `who` of an entry whose holders live in the slab (`Entry::multi`).
const MULTI: u32 = u32::MAX;
/// Largest expiry time unit (ms since epoch + 1) before the epoch is moved forward.
const REBASE_AT: u32 = 1 << 30;

/// One (rank, tier) holding a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Holder {
    /// `rank_id << 2 | tier`; holder lists sort by it (rank, then tier).
    who: u32,
    /// `PERMANENT | refcount`, or the expiry in time units (always ≥ 1).
    state: u32,
}

impl Holder {
    fn rank_id(self) -> u32 {
        self.who >> 2
    }
    fn tier(self) -> usize {
        (self.who & 3) as usize
    }
    fn is_permanent(self) -> bool {
        self.state & PERMANENT != 0
    }
    fn live(self, now: u32) -> bool {
        self.is_permanent() || self.state > now
    }
    fn expiry(self) -> Option<u32> {
        (!self.is_permanent()).then_some(self.state)
    }
    /// Adds an insert to this holder: a permanent insert counts a reference (an expiring holder
    /// becomes permanent); an expiring insert extends the expiry of an expiring holder.
    fn absorb(&mut self, state: u32) {
        match (self.is_permanent(), state & PERMANENT != 0) {
            (true, true) => {
                self.state = PERMANENT | (self.state & !PERMANENT).saturating_add(1).min(!PERMANENT)
            }
            (false, true) => self.state = PERMANENT | 1,
            (true, false) => {}
            (false, false) => self.state = self.state.max(state),
        }
    }
}

/// A block's table entry: 20 bytes with its key.
#[derive(Debug, Clone, Copy)]
struct Entry {
    /// The only holder, or `who == MULTI` when the holders are in the slab at index `state`.
    holder: Holder,
    /// LRU clock at the last insert touching this block.
    touched: u32,
}

impl Entry {
    fn multi(&self) -> u32 {
        debug_assert_eq!(self.holder.who, MULTI);
        self.holder.state
    }
}

/// A block key stored with 4-byte alignment, so a table entry packs into 20 bytes, not 24.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct BlockKey([u32; 2]);

impl BlockKey {
    fn new(h: u64) -> Self {
        BlockKey([h as u32, (h >> 32) as u32])
    }
    #[cfg(test)]
    fn get(self) -> u64 {
        self.0[0] as u64 | ((self.0[1] as u64) << 32)
    }
}

impl std::hash::Hash for BlockKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.0[0] as u64 | ((self.0[1] as u64) << 32));
    }
}

/// Holders of a block held by several (rank, tier)s, sorted by `who`.
#[derive(Debug, Default)]
struct Multi {
    /// XOR of the holders' fingerprints: equal ids = (almost surely) equal holder sets.
    set_id: u64,
    /// No holder expires before this (0: none expires). Conservative: may be earlier.
    min_expiry: u32,
    /// Holders in the GPU tier (each a distinct rank).
    gpu: u32,
    holders: Vec<Holder>,
}

impl Multi {
    fn refresh(&mut self) {
        self.set_id = self.holders.iter().fold(0, |id, h| id ^ fingerprint(h.who));
        self.gpu = self.holders.iter().filter(|h| h.tier() == 0).count() as u32;
        self.min_expiry = self
            .holders
            .iter()
            .filter_map(|h| h.expiry())
            .min()
            .unwrap_or(0);
    }
}

/// The splitmix64 finalizer: a cheap, well-mixed 64-bit hash of a 64-bit value.
fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn fingerprint(who: u32) -> u64 {
    splitmix64(
        (who as u64)
            .wrapping_add(1)
            .wrapping_mul(0x9E37_79B9_7F4A_7C15),
    )
}

/// A cleared rank's id, whose holders are still in the table (skipped by every walk).
fn retired(ranks: &[Option<RankKey>], id: u32) -> bool {
    ranks.get(id as usize).is_none_or(Option::is_none)
}

/// Retiring ids the shared-prefix check looks past ([`PrefixIndex::universal_but_retired`]): a
/// binary search per id per shared block; beyond this many it waits for the sweep.
const MAX_RETIRED_CHECKED: usize = 64;

/// From this capacity on, eviction works a shard at a time (each shard then holds thousands of
/// blocks, enough for its ages to stand for the table's).
const SHARDED_EVICTION_FROM: usize = 65_536;

/// A sharded eviction step removes this fraction (1/n) of one shard. A step costs two passes
/// over the shard whatever it removes (the age sample, then the retain), so each removed block
/// costs n entries visited: a quarter keeps that at 4 (a sixteenth made eviction a fifth of the
/// CPU of a 220 KB request at capacity), while one step still removes only a quarter of one
/// shard (1/64 of an index of 16 shards; at most 1/16 of the capacity when keys do not spread).
const EVICT_SHARD_FRACTION: usize = 4;

/// Hashes `u64` keys of unknown distribution (engine block hashes: sometimes small integers)
/// with one splitmix64 finalizer instead of SipHash.
#[derive(Default)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        splitmix64(self.0.wrapping_add(0x9E37_79B9_7F4A_7C15))
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = self.0.rotate_left(8) ^ *b as u64;
        }
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

/// A `u64`-keyed map hashed with [`MixHasher`].
pub type MixedMap<V> = HashMap<u64, V, BuildHasherDefault<MixHasher>>;

/// Hands each new index its own range of rank epochs.
static INDEX_EPOCHS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Per-partition block index.
#[derive(Debug)]
pub struct PrefixIndex {
    blocks: Shards<Entry>,
    /// The step (of [`PURGE_SHARDS`]) the next purge runs. Only `purge_shard_step` moves it, so
    /// any [`PURGE_SHARDS`] consecutive steps visit every shard: what frees a retired id.
    purge_cursor: usize,
    slab: Vec<Multi>,
    free_slab: Vec<u32>,
    rank_ids: HashMap<RankKey, u32>,
    /// Bumped when a rank is interned or cleared ([`PrefixIndex::rank_epoch`]).
    rank_epoch: u64,
    /// Where `rank_epoch` is also published, for readers without the index's lock
    /// ([`PrefixIndex::publish_rank_epoch`]).
    epoch_cell: Option<std::sync::Arc<std::sync::atomic::AtomicU64>>,
    /// Interned id -> rank (`None`: free id, reusable).
    ranks: Vec<Option<RankKey>>,
    free_ranks: Vec<u32>,
    /// Cleared ranks' ids: `None` in `ranks`, their holders still in the table until the purge
    /// steps drop them ([`retire`]).
    retiring: retire::Retiring,
    /// XOR of every interned rank's GPU-tier fingerprint: the holder-set id of a block every
    /// live rank holds in the GPU tier, and no other holder ([`PrefixIndex::universal_prefix`]).
    live_gpu_set: u64,
    /// Time unit 1 = this instant; units are milliseconds.
    epoch: Instant,
    tick: u32,
    max_blocks: usize,
}

impl PrefixIndex {
    /// An empty index; `now` anchors its clock (expiries are kept relative to it).
    pub fn new(max_blocks: usize, now: Instant) -> Self {
        PrefixIndex {
            blocks: Shards::for_capacity(max_blocks),
            purge_cursor: 0,
            slab: Vec::new(),
            free_slab: Vec::new(),
            rank_ids: HashMap::new(),
            // Distinct per index, so a replaced index never repeats an epoch a cache saw.
            rank_epoch: INDEX_EPOCHS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) << 32,
            epoch_cell: None,
            ranks: Vec::new(),
            free_ranks: Vec::new(),
            retiring: retire::Retiring::default(),
            live_gpu_set: 0,
            // Slightly in the past, so instants a little before creation still order correctly.
            epoch: now.checked_sub(Duration::from_secs(3600)).unwrap_or(now),
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

    /// Heap bytes held by the index (table, holder slab, rank interning), from capacities.
    pub fn heap_bytes(&self) -> usize {
        let buckets: usize = self
            .blocks
            .maps
            .iter()
            .map(|m| match m.capacity() {
                0 => 0,
                c => (c * 8 / 7).next_power_of_two(),
            })
            .sum();
        let table = buckets * (std::mem::size_of::<(BlockKey, Entry)>() + 1);
        let slab = self.slab.capacity() * std::mem::size_of::<Multi>()
            + self
                .slab
                .iter()
                .map(|m| m.holders.capacity() * std::mem::size_of::<Holder>())
                .sum::<usize>();
        let interning = self.ranks.capacity() * std::mem::size_of::<Option<RankKey>>()
            + self.rank_ids.capacity() * (std::mem::size_of::<(RankKey, u32)>() + 1);
        table + slab + interning
    }

    /// Time units of `t`: milliseconds since the epoch, plus one (0 never occurs), saturating.
    fn units(&self, t: Instant) -> u32 {
        let ms = t.saturating_duration_since(self.epoch).as_millis();
        ms.saturating_add(1).min((PERMANENT - 1) as u128) as u32
    }

    fn intern(&mut self, rank: RankKey) -> u32 {
        if let Some(&id) = self.rank_ids.get(&rank) {
            return id;
        }
        let id = match self.free_ranks.pop() {
            Some(id) => {
                self.ranks[id as usize] = Some(rank);
                id
            }
            None => {
                self.ranks.push(Some(rank));
                (self.ranks.len() - 1) as u32
            }
        };
        self.rank_ids.insert(rank, id);
        self.live_gpu_set ^= fingerprint(id << 2);
        self.bump_rank_epoch();
        id
    }

    // Holders only name interned ids, so a miss is a bug in this module, not bad input.
    #[allow(clippy::expect_used)]
    fn rank_of(&self, id: u32) -> RankKey {
        self.ranks[id as usize].expect("interned rank id in use")
    }

    /// Records that `rank` holds the blocks `seq_hashes` (a prefix chain) in `tier`. With an
    /// expiry, an existing entry's expiry is extended, never shortened, and a permanent entry
    /// stays permanent; without one, the entry is permanent and counts one more reference.
    pub fn insert(
        &mut self,
        rank: RankKey,
        seq_hashes: &[u64],
        tier: Tier,
        expires: Option<Instant>,
    ) {
        if seq_hashes.is_empty() {
            return;
        }
        let who = (self.intern(rank) << 2) | tier as u32;
        let state = match expires {
            None => PERMANENT | 1,
            Some(e) => self.units(e),
        };
        let n = seq_hashes.len().min(1 << 30) as u32;
        if self.tick > u32::MAX - n {
            self.halve_ticks();
        }
        // A chain's first block is its most shared one: it ends up most recently touched, so
        // eviction takes chains from their tails, as engines do.
        self.tick += n;
        let holder = Holder { who, state };
        self.blocks
            .grow_one_early(self.max_blocks / self.blocks.maps.len());
        for (i, &h) in seq_hashes.iter().enumerate() {
            let touched = self.tick - (i as u32).min(n - 1);
            match self.blocks.entry(BlockKey::new(h)) {
                hashbrown::hash_map::Entry::Vacant(v) => {
                    v.insert(Entry { holder, touched });
                }
                hashbrown::hash_map::Entry::Occupied(mut o) => {
                    let entry = o.get_mut();
                    entry.touched = touched;
                    upsert(entry, &mut self.slab, &mut self.free_slab, holder);
                }
            }
        }
        self.evict_over_capacity();
    }

    fn halve_ticks(&mut self) {
        for entry in self.blocks.values_mut() {
            entry.touched /= 2;
        }
        self.tick /= 2;
    }

    /// Drops one reference of `rank` to `seq_hash` in `tier` (an engine's `BlockRemoved`); an
    /// expiring holder is removed outright. Returns whether `rank` still holds the block
    /// permanently in some tier.
    pub fn release(&mut self, rank: RankKey, seq_hash: u64, tier: Tier) -> bool {
        let Some(&id) = self.rank_ids.get(&rank) else {
            return false;
        };
        let who = (id << 2) | tier as u32;
        let Some(entry) = self.blocks.get_mut(&BlockKey::new(seq_hash)) else {
            return false;
        };
        let drop_one = |h: &mut Holder| {
            let count = h.state & !PERMANENT;
            if h.is_permanent() && count > 1 {
                h.state = PERMANENT | (count - 1);
                false
            } else {
                true
            }
        };
        if entry.holder.who != MULTI {
            if entry.holder.who == who && drop_one(&mut entry.holder) {
                self.blocks.remove(&BlockKey::new(seq_hash));
                return false;
            }
            return entry.holder.rank_id() == id && entry.holder.is_permanent();
        }
        let multi = &mut self.slab[entry.multi() as usize];
        if let Ok(at) = multi.holders.binary_search_by_key(&who, |h| h.who) {
            if drop_one(&mut multi.holders[at]) {
                multi.holders.remove(at);
            }
        }
        let still = multi
            .holders
            .iter()
            .any(|h| h.rank_id() == id && h.is_permanent());
        retain_holders(entry, &mut self.slab, &mut self.free_slab, |_| true);
        still
    }

    /// Forgets that `rank` holds `seq_hash` in `tier`, whatever its reference count.
    pub fn remove(&mut self, rank: RankKey, seq_hash: u64, tier: Tier) {
        let Some(&id) = self.rank_ids.get(&rank) else {
            return;
        };
        let who = (id << 2) | tier as u32;
        self.retain_in(seq_hash, |h| h.who != who);
    }

    /// Forgets an expiring (predicted or approximate) entry of `rank` for `seq_hash` in `tier`;
    /// one from the engine's KV events (permanent) stays. True when one went.
    pub fn drop_expiring(&mut self, rank: RankKey, seq_hash: u64, tier: Tier) -> bool {
        let Some(&id) = self.rank_ids.get(&rank) else {
            return false;
        };
        let who = (id << 2) | tier as u32;
        let mut dropped = false;
        self.retain_in(seq_hash, |h| {
            let goes = h.who == who && !h.is_permanent();
            dropped |= goes;
            !goes
        });
        dropped
    }

    /// Brings `rank`'s expiring entry of `seq_hash` in `tier` to expire by `at` at the latest
    /// (a permanent entry, or one expiring sooner, is left as it is).
    pub fn expire_by(&mut self, rank: RankKey, seq_hash: u64, tier: Tier, at: Instant) {
        let Some(&id) = self.rank_ids.get(&rank) else {
            return;
        };
        let who = (id << 2) | tier as u32;
        let limit = self.units(at);
        let Some(entry) = self.blocks.get_mut(&BlockKey::new(seq_hash)) else {
            return;
        };
        let shorten = |h: &mut Holder| {
            if h.who == who && !h.is_permanent() {
                h.state = h.state.min(limit);
            }
        };
        if entry.holder.who != MULTI {
            shorten(&mut entry.holder);
        } else {
            self.slab[entry.multi() as usize]
                .holders
                .iter_mut()
                .for_each(shorten);
        }
    }

    fn retain_in(&mut self, seq_hash: u64, keep: impl FnMut(&Holder) -> bool) {
        if let Some(entry) = self.blocks.get_mut(&BlockKey::new(seq_hash)) {
            if !retain_holders(entry, &mut self.slab, &mut self.free_slab, keep) {
                self.blocks.remove(&BlockKey::new(seq_hash));
            }
        }
    }

    /// Forgets every block of `rank` (rank left, engine restarted, `AllBlocksCleared`).
    pub fn clear_rank(&mut self, rank: RankKey) {
        self.clear_ranks(&[rank]);
    }

    /// Forgets every block of each of `ranks` at once, without a pass over the index: their ids
    /// retire (matches skip their holders from now on; a rank interned again gets a new id) and
    /// the purge steps drop the holders later ([`retire`]). A pod whose engine restarts, or an
    /// engine repeating `AllBlocksCleared`, costs O(ranks), not O(index), under the lock.
    pub fn clear_ranks(&mut self, ranks: &[RankKey]) {
        let mut cleared = false;
        for rank in ranks {
            let Some(id) = self.rank_ids.remove(rank) else {
                continue;
            };
            self.ranks[id as usize] = None;
            self.live_gpu_set ^= fingerprint(id << 2);
            self.retiring.retire(id);
            cleared = true;
        }
        if cleared {
            self.bump_rank_epoch();
        }
    }

    /// Cleared ranks whose holders the purge steps have not yet all dropped.
    pub fn retiring_ranks(&self) -> usize {
        self.retiring.len()
    }

    /// Over `max_blocks`, evicts the least recently touched blocks, in batches so no ordered
    /// structure has to be kept on every touch. A big index evicts a shard at a time
    /// ([`PrefixIndex::evict_shard_step`]) so no insert pays for a pass over the whole table
    /// under the partition lock; a small one evicts exactly, down to 15/16 of capacity.
    fn evict_over_capacity(&mut self) {
        // Cleared ranks' blocks go first, shard by shard: the clear left them for the sweep, and
        // they must not push live blocks out (an eager clear would have freed them already).
        // At most one round: every id retired before it is then free.
        let mut swept = 0;
        while self.blocks.len() > self.max_blocks
            && !self.retiring.is_empty()
            && swept < PURGE_SHARDS
        {
            self.purge_shard_step(None);
            swept += 1;
        }
        if self.blocks.len() <= self.max_blocks {
            return;
        }
        if self.max_blocks < SHARDED_EVICTION_FROM {
            self.evict_exact();
            return;
        }
        while self.blocks.len() > self.max_blocks {
            self.evict_shard_step();
        }
    }

    /// Evicts the oldest quarter ([`EVICT_SHARD_FRACTION`]) of the largest shard. Keys spread
    /// uniformly over the shards, so every shard's ages follow the same distribution and its
    /// oldest quarter is (about) its share of the table's; taking the largest shard keeps the
    /// shards level and makes progress when keys do not spread (block hashes that are small
    /// integers).
    fn evict_shard_step(&mut self) {
        let Some(map) = self.blocks.maps.iter_mut().max_by_key(|m| m.len()) else {
            return;
        };
        let len = map.len();
        // Keys that do not spread leave one shard holding the table: a quarter of it would be a
        // quarter of the index, so never more than a sixteenth of the capacity at once.
        let excess = (len / EVICT_SHARD_FRACTION)
            .min(self.max_blocks / 16)
            .max(1);
        // The cutoff from a sample of about 4,096 ages: the walk to every `step`-th entry reads
        // only those entries, but it still visits every control byte, so with the retain a step
        // is two passes over the shard.
        let step = (len / 4_096).max(1);
        let ticks: Vec<u32> = map.values().step_by(step).map(|e| e.touched).collect();
        let sampled = ticks.len();
        let k = (excess * sampled / len).clamp(1, sampled) - 1;
        let (cutoff, older) = nth_oldest(ticks, k);
        // The ties the sample says are still needed once everything older has gone.
        let ties = excess.saturating_sub(older * len / sampled);
        let mut evict = evicting(&mut self.slab, &mut self.free_slab, cutoff, ties);
        map.retain(|_, entry| !evict(entry));
    }

    /// Evicts down to `max_blocks - max_blocks / 16`, exactly by age over the whole table.
    fn evict_exact(&mut self) {
        let target = self.max_blocks - self.max_blocks / 16;
        let excess = self.blocks.len() - target;
        let ticks: Vec<u32> = self.blocks.values().map(|e| e.touched).collect();
        let (cutoff, older) = nth_oldest(ticks, excess - 1);
        // Ties at the cutoff: evict only as many as needed.
        let mut evict = evicting(&mut self.slab, &mut self.free_slab, cutoff, excess - older);
        self.blocks.retain(|_, entry| !evict(entry));
    }

    /// Drops expired entries of every shard; moves the time epoch forward when expiries near the
    /// end of their range.
    pub fn purge_expired(&mut self, now: Instant) {
        for _ in 0..PURGE_SHARDS {
            self.purge_expired_step(now);
        }
    }

    /// Drops the expired entries of one shard (the next, round robin): 1/[`PURGE_SHARDS`] of the
    /// work of a full purge, so a periodic caller bounds what it does under the partition lock.
    /// Expired entries already count as absent; purging only returns their memory.
    pub fn purge_expired_step(&mut self, now: Instant) {
        let now_units = self.units(now);
        self.purge_shard_step(Some(now_units));
        if now_units >= REBASE_AT {
            self.rebase(now, now_units);
        }
    }

    /// One purge step (the next sixteenth of the shards, round robin): drops cleared ranks'
    /// holders and, at `now_units`, expired ones. Every step, with or without a time, counts
    /// toward freeing retired ids.
    fn purge_shard_step(&mut self, now_units: Option<u32>) {
        let step = self.purge_cursor % PURGE_SHARDS;
        self.purge_cursor = (step + 1) % PURGE_SHARDS;
        let sweeping = !self.retiring.is_empty();
        let (slab, free, ranks) = (&mut self.slab, &mut self.free_slab, &self.ranks);
        let retired = |h: &Holder| retired(ranks, h.rank_id());
        let live = |h: &Holder| now_units.is_none_or(|now| h.live(now));
        let mut keep = |_: &BlockKey, entry: &mut Entry| {
            let (fresh, clean) = match entry.holder.who {
                MULTI => {
                    let m = &slab[entry.multi() as usize];
                    let clean = !sweeping || !m.holders.iter().any(retired);
                    let fresh = now_units.is_none_or(|now| m.min_expiry == 0 || m.min_expiry > now);
                    (fresh, clean)
                }
                _ => (live(&entry.holder), !sweeping || !retired(&entry.holder)),
            };
            (fresh && clean) || retain_holders(entry, slab, free, |h| live(h) && !retired(h))
        };
        // This step's sixteenth of the shards (every one when there are only 16).
        let shards = self.blocks.maps.len();
        for shard in (step..shards).step_by(PURGE_SHARDS) {
            self.blocks.maps[shard].retain(&mut keep);
        }
        // Every shard has now been purged of these ids' holders: they may name new ranks.
        let ready = self.retiring.stepped();
        self.free_ranks.extend(ready);
    }

    /// Moves the epoch to (about) `now`; every remaining expiring holder expires after `now`.
    fn rebase(&mut self, now: Instant, now_units: u32) {
        let new_epoch = now.checked_sub(Duration::from_secs(3600)).unwrap_or(now);
        let shift = self.units(new_epoch) - 1;
        let _ = now_units;
        let shifted = |h: &mut Holder| {
            if !h.is_permanent() {
                h.state = h.state.saturating_sub(shift).max(1);
            }
        };
        for entry in self.blocks.values_mut() {
            if entry.holder.who != MULTI {
                shifted(&mut entry.holder);
            }
        }
        for m in &mut self.slab {
            m.holders.iter_mut().for_each(shifted);
            m.refresh();
        }
        self.epoch = new_epoch;
    }

    /// Longest consecutive matched prefix per rank, per tier, sorted by rank. Ranks with no
    /// match are absent.
    ///
    /// Holders are sorted by `(rank id, tier)`, so a block is a merge-join against the ranks
    /// still matching; a block whose holder set equals the previous block's (a shared prefix)
    /// and has nothing expired is skipped in O(1), and one whose holders are all live and in the
    /// GPU tier is a plain sorted-set intersection. A rank's depth in a tier is the block index
    /// at which it stopped matching there.
    pub fn find_matches(&self, seq_hashes: &[u64], now: Instant) -> Vec<(RankKey, TierDepths)> {
        self.matches_from(seq_hashes, 0, self.units(now))
    }

    /// [`PrefixIndex::find_matches`] for a caller that knows every rank it schedules is
    /// interned here ([`PrefixIndex::holds_rank`]): the leading blocks every interned rank holds
    /// in the GPU tier (a shared system prompt, say) come back as `base`, once, and `ranks`
    /// lists only the ranks that match deeper than that. Any rank not listed matches exactly
    /// `base` blocks in every tier. What it costs grows with the ranks that match beyond the
    /// common prefix, not with the ranks.
    pub fn find_matches_over(&self, seq_hashes: &[u64], now: Instant) -> Matches {
        let now = self.units(now);
        let base = self.universal_prefix(seq_hashes, now);
        Matches {
            base,
            ranks: self.matches_from(seq_hashes, base, now),
            epoch: self.rank_epoch,
        }
    }

    /// One rank's matched depths (what [`PrefixIndex::find_matches`] reports for it): costs the
    /// blocks it matches, whatever other ranks hold ([`RankWalk`]).
    pub fn rank_depths(&self, rank: &RankKey, seq_hashes: &[u64], now: Instant) -> TierDepths {
        let Some(&id) = self.rank_ids.get(rank) else {
            return TierDepths::default();
        };
        let now = self.units(now);
        let mut walk = RankWalk::new(id);
        for h in seq_hashes {
            let Some(entry) = self.blocks.get(&BlockKey::new(*h)) else {
                break;
            };
            if !walk.step(self.block_holders(entry, now), now) {
                break;
            }
        }
        walk.depths()
    }

    /// What the match walks need to know of a block's holders, inline or in the slab.
    fn block_holders<'a>(&'a self, entry: &'a Entry, now: u32) -> BlockHolders<'a> {
        match entry.holder.who {
            MULTI => {
                let m = &self.slab[entry.multi() as usize];
                let fresh = m.min_expiry == 0 || m.min_expiry > now;
                BlockHolders {
                    holders: m.holders.as_slice(),
                    set_id: m.set_id,
                    fresh,
                    gpu_only: fresh && m.gpu as usize == m.holders.len(),
                }
            }
            who => {
                let fresh = entry.holder.live(now);
                BlockHolders {
                    holders: std::slice::from_ref(&entry.holder),
                    set_id: fingerprint(who),
                    fresh,
                    gpu_only: fresh && entry.holder.tier() == 0,
                }
            }
        }
    }

    /// Ranks interned here (holding or having held a block since their last clear).
    pub fn live_ranks(&self) -> usize {
        self.rank_ids.len()
    }

    /// Whether `rank` is interned (a rank that is not holds no block).
    pub fn holds_rank(&self, rank: &RankKey) -> bool {
        self.rank_ids.contains_key(rank)
    }

    /// Changes whenever a rank is interned or cleared.
    pub fn rank_epoch(&self) -> u64 {
        self.rank_epoch
    }

    /// Keeps `cell` equal to [`PrefixIndex::rank_epoch`] from now on, so a caller holding the
    /// index behind a lock can tell whether a rank was interned or cleared without taking it.
    pub fn publish_rank_epoch(&mut self, cell: std::sync::Arc<std::sync::atomic::AtomicU64>) {
        cell.store(self.rank_epoch, std::sync::atomic::Ordering::Release);
        self.epoch_cell = Some(cell);
    }

    fn bump_rank_epoch(&mut self) {
        self.rank_epoch = self.rank_epoch.wrapping_add(1);
        if let Some(cell) = &self.epoch_cell {
            cell.store(self.rank_epoch, std::sync::atomic::Ordering::Release);
        }
    }

    /// How many leading blocks of the prompt every interned rank holds, fresh, in the GPU tier.
    fn universal_prefix(&self, seq_hashes: &[u64], now: u32) -> u32 {
        let everyone = self.rank_ids.len();
        let mut base = 0u32;
        for h in seq_hashes {
            let Some(entry) = self.blocks.get(&BlockKey::new(*h)) else {
                break;
            };
            // Every live rank, in the GPU tier, fresh, and no other holder (a cleared rank's
            // holders may still be listed: the set id tells them apart from a live rank's).
            let BlockHolders {
                holders,
                set_id,
                fresh,
                gpu_only,
            } = self.block_holders(entry, now);
            let universal = (gpu_only && holders.len() == everyone && set_id == self.live_gpu_set)
                || (fresh && self.universal_but_retired(holders, set_id, everyone));
            if !universal {
                break;
            }
            base += 1;
        }
        base
    }

    /// Whether these holders, less those of cleared ranks still waiting for the sweep, are every
    /// live rank in the GPU tier: restarts every few seconds must not turn the shared-prefix
    /// shortcut off for good. Bounded: with many ids retiring it waits for the sweep.
    fn universal_but_retired(&self, holders: &[Holder], set_id: u64, everyone: usize) -> bool {
        if self.retiring.is_empty() || self.retiring.len() > MAX_RETIRED_CHECKED {
            return false;
        }
        let (mut live, mut set) = (holders.len(), set_id);
        for id in self.retiring.ids() {
            let from = holders.partition_point(|h| h.rank_id() < id);
            for h in holders[from..].iter().take_while(|h| h.rank_id() == id) {
                live = live.saturating_sub(1);
                set ^= fingerprint(h.who);
            }
        }
        // Equal holder-set ids: the live holders are exactly the live ranks' GPU holders.
        live > 0 && live == everyone && set == self.live_gpu_set
    }

    /// The matches from block `start` on, given that every rank holds the blocks before it:
    /// the ranks holding block `start` and how far they match; `start` blocks for the others.
    fn matches_from(&self, seq_hashes: &[u64], start: u32, now: u32) -> Vec<(RankKey, TierDepths)> {
        // Per rank seen at block `start`: where each tier stopped matching (OPEN = matching).
        let mut entries: Vec<(u32, [u32; 3])> = Vec::new();
        // Positions in `entries` still matching in some tier, in rank-id order.
        let mut live: Vec<usize> = Vec::new();
        let mut depth = start;
        let mut prev_set = 0u64;
        for (i, h) in seq_hashes.iter().enumerate().skip(start as usize) {
            let Some(entry) = self.blocks.get(&BlockKey::new(*h)) else {
                break;
            };
            let i = i as u32;
            let BlockHolders {
                holders,
                set_id,
                fresh,
                gpu_only,
            } = self.block_holders(entry, now);
            let groups = RankGroups {
                holders,
                pos: 0,
                now,
            };
            if i == start {
                open_matches(groups, &mut entries, &mut live, start, &self.ranks);
            } else if fresh && set_id == prev_set {
                // The same live holders as the block before: nobody's tiers changed.
            } else if gpu_only {
                narrow_to_gpu_holders(holders, &mut entries, &mut live, i);
            } else {
                narrow_matches(groups, &mut entries, &mut live, i);
            }
            prev_set = set_id;
            if live.is_empty() {
                break;
            }
            depth = i + 1;
        }
        self.depths(entries, depth)
    }

    /// Each matched rank's depths, capped at the prefix matched by any (`depth`), sorted by
    /// rank; ranks with no block matched in any tier left out.
    fn depths(&self, entries: Vec<(u32, [u32; 3])>, depth: u32) -> Vec<(RankKey, TierDepths)> {
        let mut out: Vec<(RankKey, TierDepths)> = entries
            .into_iter()
            .map(|(id, ends)| {
                let d = ends.map(|e| e.min(depth));
                (
                    self.rank_of(id),
                    TierDepths {
                        gpu: d[0],
                        host: d[1],
                        disk: d[2],
                    },
                )
            })
            .filter(|(_, d)| d.disk > 0)
            .collect();
        out.sort_unstable_by_key(|(rank, _)| *rank);
        out
    }
}

/// [`PrefixIndex::find_matches_over`]: the blocks every rank holds, and who matches deeper.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Matches {
    pub base: u32,
    pub ranks: Vec<(RankKey, TierDepths)>,
    /// [`PrefixIndex::rank_epoch`] when they were taken: `base` speaks for the ranks interned
    /// then.
    pub epoch: u64,
}

impl Matches {
    /// A rank's depths: listed, else the shared prefix.
    pub fn depths_of(&self, rank: &RankKey) -> TierDepths {
        match self.ranks.binary_search_by_key(rank, |m| m.0) {
            Ok(i) => self.ranks.get(i).map_or_else(TierDepths::default, |m| m.1),
            Err(_) => TierDepths {
                gpu: self.base,
                host: self.base,
                disk: self.base,
            },
        }
    }
}

/// Adds `holder` to a block: merged into the same (rank, tier) if present, else inserted in order.
fn upsert(entry: &mut Entry, slab: &mut Vec<Multi>, free: &mut Vec<u32>, holder: Holder) {
    if entry.holder.who != MULTI {
        if entry.holder.who == holder.who {
            entry.holder.absorb(holder.state);
            return;
        }
        let mut holders = vec![entry.holder, holder];
        holders.sort_unstable_by_key(|h| h.who);
        let mut multi = Multi {
            holders,
            ..Default::default()
        };
        multi.refresh();
        let at = match free.pop() {
            Some(at) => {
                slab[at as usize] = multi;
                at
            }
            None => {
                slab.push(multi);
                (slab.len() - 1) as u32
            }
        };
        entry.holder = Holder {
            who: MULTI,
            state: at,
        };
        return;
    }
    let multi = &mut slab[entry.multi() as usize];
    match multi.holders.binary_search_by_key(&holder.who, |h| h.who) {
        // The expiry may now be later; `min_expiry` stays conservative.
        Ok(at) => multi.holders[at].absorb(holder.state),
        Err(at) => {
            multi.holders.insert(at, holder);
            multi.set_id ^= fingerprint(holder.who);
            if holder.tier() == 0 {
                multi.gpu += 1;
            }
            if let Some(e) = holder.expiry() {
                multi.min_expiry = if multi.min_expiry == 0 {
                    e
                } else {
                    multi.min_expiry.min(e)
                };
            }
        }
    }
}

/// Keeps the holders `keep` accepts; returns whether any is left. A slab list shrunk to one
/// holder moves back inline.
fn retain_holders(
    entry: &mut Entry,
    slab: &mut [Multi],
    free: &mut Vec<u32>,
    mut keep: impl FnMut(&Holder) -> bool,
) -> bool {
    if entry.holder.who != MULTI {
        return keep(&entry.holder);
    }
    let at = entry.multi();
    let multi = &mut slab[at as usize];
    multi.holders.retain(|h| keep(h));
    match multi.holders.len() {
        0 => {
            release_slab(slab, free, at);
            false
        }
        1 => {
            entry.holder = multi.holders[0];
            release_slab(slab, free, at);
            true
        }
        _ => {
            multi.refresh();
            true
        }
    }
}

/// The `k`-th smallest (0-based) of the LRU ticks, the eviction cutoff, and how many ticks are
/// smaller (older) than it.
fn nth_oldest(mut ticks: Vec<u32>, k: usize) -> (u32, usize) {
    let (before, &mut cutoff, _) = ticks.select_nth_unstable(k);
    (cutoff, before.iter().filter(|&&t| t < cutoff).count())
}

/// The eviction test of a table pass: true for every entry touched before `cutoff` and for the
/// first `ties` touched at it (ties go only as far as needed); frees their slab lists. An entry
/// older than the cutoff never survives a pass, whatever the order the table visits entries in.
fn evicting<'a>(
    slab: &'a mut [Multi],
    free: &'a mut Vec<u32>,
    cutoff: u32,
    mut ties: usize,
) -> impl FnMut(&Entry) -> bool + 'a {
    move |entry| {
        if entry.touched == cutoff {
            if ties == 0 {
                return false;
            }
            ties -= 1;
        } else if entry.touched > cutoff {
            return false;
        }
        if entry.holder.who == MULTI {
            release_slab(slab, free, entry.multi());
        }
        true
    }
}

fn release_slab(slab: &mut [Multi], free: &mut Vec<u32>, at: u32) {
    slab[at as usize] = Multi::default();
    free.push(at);
}

#[cfg(test)]
mod tests;
