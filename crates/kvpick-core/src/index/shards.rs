//! The block table of the KV index, split into shards by key bits, with the identity hasher its
//! (already uniform) keys need, in the system allocator's memory. Owns only the table's layout;
//! what an entry means, eviction and purging stay in the index ([`super`]).

use std::alloc::System;
use std::hash::{BuildHasherDefault, Hasher};

use hashbrown::HashMap;

use super::BlockKey;

/// Block keys are already xxh3 outputs (uniformly distributed), so hashing them again (SipHash)
/// only costs time on the lookup path: use the key itself.
#[derive(Default)]
pub(super) struct PreHashed(u64);

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

/// One shard's table. Its memory comes from the system allocator, not the process's global one
/// (mimalloc), because mimalloc backs big blocks with transparent huge pages: a table grows (and,
/// once eviction's tombstones fill it, doubles once more) while traffic flows, under the
/// partition's KV lock, and each first touch of a fresh huge page zeroes 2 MiB inside that
/// insert. On the development VM (Firecracker) that stalled single inserts 60–170 ms; from the
/// system allocator (glibc: 4 KiB pages under the usual `madvise` THP mode) the same growth's
/// worst insert is ~2.5 ms, and the table's steady-state inserts cost the same
/// (docs/benchmarks.md, "Index tables off huge pages"). `kvpick serve` also turns huge pages off
/// for its whole process unless `--huge-pages`; this keeps the tables off them when it is given.
pub(super) type PreHashedMap<V> = HashMap<BlockKey, V, BuildHasherDefault<PreHashed>, System>;

pub(super) type ShardEntry<'a, V> =
    hashbrown::hash_map::Entry<'a, BlockKey, V, BuildHasherDefault<PreHashed>, System>;

fn new_map<V>() -> PreHashedMap<V> {
    HashMap::with_hasher_in(BuildHasherDefault::default(), System)
}

/// Purge steps per sweep of the block table: each periodic step walks 1/16 of it (bounded work
/// under the partition lock) instead of the whole index.
pub const PURGE_SHARDS: usize = 16;

/// Most blocks one shard holds once the index is full. A shard's table grows by rehashing all of
/// it in one insert, under the KV write lock every pick of the partition needs; bounding a
/// shard bounds that stall (about 1.5 ms at this size on the 2-core machine), whatever
/// `--index-max-blocks` is. With 16 shards a 32M-block index grew in 16 inserts of ~155 ms each.
pub(super) const MAX_SHARE: usize = 65_536;

/// Most shards (bits 40..56 of the key pick one).
const MAX_SHARDS: usize = 1 << 16;

/// The block table split by bits 40.. of the (already uniform) key, which the table itself
/// uses neither for its bucket index (low bits) nor for its control bytes (top 7 bits): at least
/// [`PURGE_SHARDS`], a power of two, enough that none holds more than [`MAX_SHARE`] blocks.
#[derive(Debug)]
pub(super) struct Shards<V> {
    pub(super) maps: Vec<PreHashedMap<V>>,
    /// `maps.len() - 1`.
    mask: usize,
}

impl<V> Shards<V> {
    /// Enough shards for an index of `max_blocks`.
    pub(super) fn for_capacity(max_blocks: usize) -> Self {
        let count = max_blocks
            .div_ceil(MAX_SHARE)
            .next_power_of_two()
            .clamp(PURGE_SHARDS, MAX_SHARDS);
        Shards {
            maps: (0..count).map(|_| new_map()).collect(),
            mask: count - 1,
        }
    }

    pub(super) fn shard(&self, key: &BlockKey) -> usize {
        ((key.0[1] >> 8) as usize) & self.mask
    }

    pub(super) fn map(&self, key: &BlockKey) -> &PreHashedMap<V> {
        &self.maps[self.shard(key)]
    }

    pub(super) fn map_mut(&mut self, key: &BlockKey) -> &mut PreHashedMap<V> {
        let shard = self.shard(key);
        &mut self.maps[shard]
    }

    pub(super) fn get(&self, key: &BlockKey) -> Option<&V> {
        self.map(key).get(key)
    }

    pub(super) fn get_mut(&mut self, key: &BlockKey) -> Option<&mut V> {
        self.map_mut(key).get_mut(key)
    }

    pub(super) fn entry(&mut self, key: BlockKey) -> ShardEntry<'_, V> {
        self.map_mut(&key).entry(key)
    }

    pub(super) fn remove(&mut self, key: &BlockKey) -> Option<V> {
        self.map_mut(key).remove(key)
    }

    /// Grows (doubles) at most one shard early: the first with less than a quarter of its
    /// capacity left, if that capacity is below `share` (the blocks each shard holds once the
    /// index is full, so it would grow anyway). Keys spread evenly, so every shard reaches its
    /// growth point at about the same insert; growing them one insert at a time spreads the
    /// rehashing over as many inserts as there are shards instead of stalling one for the whole
    /// table.
    pub(super) fn grow_one_early(&mut self, share: usize) {
        let due = self.maps.iter_mut().find(|m| {
            let capacity = m.capacity();
            capacity < share && capacity - m.len() < capacity / 4
        });
        if let Some(m) = due {
            let left = m.capacity() - m.len();
            m.reserve(left + 1);
        }
    }

    pub(super) fn len(&self) -> usize {
        self.maps.iter().map(HashMap::len).sum()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.maps.iter().all(HashMap::is_empty)
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &V> {
        self.maps.iter().flat_map(HashMap::values)
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut V> {
        self.maps.iter_mut().flat_map(HashMap::values_mut)
    }

    #[cfg(test)]
    pub(super) fn keys(&self) -> impl Iterator<Item = &BlockKey> {
        self.maps.iter().flat_map(HashMap::keys)
    }

    #[cfg(test)]
    pub(super) fn contains_key(&self, key: &BlockKey) -> bool {
        self.map(key).contains_key(key)
    }

    pub(super) fn retain(&mut self, mut keep: impl FnMut(&BlockKey, &mut V) -> bool) {
        for m in &mut self.maps {
            m.retain(&mut keep);
        }
    }
}
