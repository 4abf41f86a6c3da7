//! KV events applied to a partition's index: the router recomputes block hashes from the events'
//! token ids, so engine hashes are only keys (for removals and tokenless stores), kept per rank in
//! an [`EngineMap`].

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::event::{BlockMedia, KvEvent, Medium};
use crate::facts::{Fact, Facts};
use crate::hash;
use crate::index::{MixedMap, PrefixIndex, Tier};
use crate::types::RankKey;

use super::shared_tier::SharedTier;
use super::Partition;

/// What happened to a batch of KV events.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EventStats {
    pub applied: u64,
    /// Events that could not be applied (unknown parent or block, block-size mismatch, unknown rank).
    pub dropped: u64,
    /// Of `dropped`: stores whose block size is not the partition's.
    pub block_size_mismatches: u64,
}

/// The block sizes of one batch's stores that carry tokens: how many were of another size, the
/// last such size, and whether one store of the partition's size applied.
#[derive(Debug, Default, Clone, Copy)]
struct BatchSizes {
    /// Stores dropped for their block size.
    mismatches: u64,
    mismatched: Option<u32>,
    matched: bool,
}

/// Engine block hash -> our chained hash, for one rank. Reference counts per tier live in the
/// index's holders, so an entry is 16 bytes.
#[derive(Debug, Default)]
pub(crate) struct EngineMap {
    pub(super) entries: MixedMap<u64>,
}

fn tier_of(medium: &Medium) -> Tier {
    match medium {
        Medium::Gpu => Tier::Gpu,
        Medium::Cpu => Tier::Host,
        Medium::Disk | Medium::Other(_) => Tier::Disk,
    }
}

/// One `BlockStored` event, as [`store_blocks`] needs it.
struct StoredBlocks<'a> {
    block_hashes: &'a [u64],
    parent: Option<u64>,
    token_ids: &'a [u32],
    event_block_size: usize,
    tier: Tier,
    seed: u64,
    /// Mixed into the first block when this store starts a sequence.
    cache_salt: Option<&'a str>,
    /// Multimodal keys by block index (sorted by block, as decoded).
    media: &'a [BlockMedia],
}

/// Applies one KV event of `rank` to the index; false when it is dropped (a stored block of
/// another block size, a removal naming a block never stored).
fn apply_event(
    index: &mut PrefixIndex,
    map: &mut EngineMap,
    shared: Option<&mut SharedTier>,
    rank: RankKey,
    event: &KvEvent,
    block_size: usize,
    sizes: &mut BatchSizes,
) -> bool {
    match event {
        KvEvent::AllBlocksCleared => {
            index.clear_rank(rank);
            map.entries.clear();
            if let Some(shared) = shared {
                shared.forget_rank(rank);
            }
            true
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            ..
        } if medium.is_shared() && shared.is_some() => {
            let Some(shared) = shared else { return false };
            // Every block is removed, known or not: no short circuit.
            let removed = block_hashes
                .iter()
                .filter(|h| shared.remove(rank, **h))
                .count();
            removed == block_hashes.len()
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            ..
        } => remove_blocks(index, map, rank, block_hashes, tier_of(medium)),
        KvEvent::BlockStored {
            token_ids,
            block_size: event_block_size,
            ..
        } if !token_ids.is_empty() && *event_block_size as usize != block_size => {
            sizes.mismatches = sizes.mismatches.saturating_add(1);
            sizes.mismatched = Some(*event_block_size);
            false
        }
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size: event_block_size,
            medium,
            lora_name,
            cache_salt,
            media,
            ..
        } => {
            sizes.matched |= !token_ids.is_empty();
            let shared = shared.filter(|_| medium.is_shared());
            let stored = StoredBlocks {
                block_hashes,
                parent: *parent_block_hash,
                token_ids,
                event_block_size: *event_block_size as usize,
                tier: tier_of(medium),
                seed: hash::block_seed(lora_name.as_deref(), None),
                cache_salt: cache_salt.as_deref(),
                media,
            };
            match shared {
                Some(shared) => {
                    store_blocks(&mut SharedSink { shared, map, rank }, &stored, block_size)
                }
                None => store_blocks(&mut RankSink { index, map, rank }, &stored, block_size),
            }
        }
    }
}

/// Takes `rank`'s blocks named by engine hashes off `tier`; false when one was never stored.
fn remove_blocks(
    index: &mut PrefixIndex,
    map: &mut EngineMap,
    rank: RankKey,
    block_hashes: &[u64],
    tier: Tier,
) -> bool {
    let mut all_known = true;
    for h in block_hashes {
        let Some(&seq) = map.entries.get(h) else {
            all_known = false;
            continue;
        };
        if !index.release(rank, seq, tier) {
            map.entries.remove(h);
        }
    }
    all_known
}

/// Where a store's blocks go: resolves engine hashes (parents, tokenless blocks) and records
/// each block under our hash.
trait BlockSink {
    fn resolve(&self, engine_hash: u64) -> Option<u64>;
    fn put(&mut self, engine_hash: u64, seq: u64, tier: Tier);
}

/// The storing rank's own tiers in the index.
struct RankSink<'a> {
    index: &'a mut PrefixIndex,
    map: &'a mut EngineMap,
    rank: RankKey,
}

impl BlockSink for RankSink<'_> {
    fn resolve(&self, engine_hash: u64) -> Option<u64> {
        self.map.entries.get(&engine_hash).copied()
    }

    fn put(&mut self, engine_hash: u64, seq: u64, tier: Tier) {
        self.map.entries.insert(engine_hash, seq);
        self.index.insert(self.rank, &[seq], tier, None);
    }
}

/// The partition's shared tier: a parent or tokenless block is named by the storing rank's
/// engine, in the shared tier or (offloaded from its GPU) in its own map.
struct SharedSink<'a> {
    shared: &'a mut SharedTier,
    map: &'a EngineMap,
    rank: RankKey,
}

impl BlockSink for SharedSink<'_> {
    fn resolve(&self, engine_hash: u64) -> Option<u64> {
        self.shared
            .resolve(self.rank, engine_hash)
            .or_else(|| self.map.entries.get(&engine_hash).copied())
    }

    fn put(&mut self, engine_hash: u64, seq: u64, _tier: Tier) {
        self.shared.store(self.rank, engine_hash, seq);
    }
}

/// Indexes stored blocks under our own chained hashes (recomputed from the token ids; a tokenless
/// store is resolved through the engine map). False when any block could not be applied: a chain
/// we never saw the start of, a block-size mismatch, a tokenless block we do not know, or too few
/// tokens.
fn store_blocks(sink: &mut impl BlockSink, stored: &StoredBlocks, block_size: usize) -> bool {
    let tokenless = stored.token_ids.is_empty();
    let mut parent = match stored.parent {
        None => None,
        Some(h) => match sink.resolve(h) {
            Some(seq) => Some(seq),
            None if tokenless => None,
            // A chain we never saw the start of cannot be hashed like requests.
            None => return false,
        },
    };
    if !tokenless && stored.event_block_size != block_size {
        return false;
    }
    let mut ok = true;
    for (i, engine_hash) in stored.block_hashes.iter().enumerate() {
        let seq = if tokenless {
            match sink.resolve(*engine_hash) {
                Some(seq) => seq,
                None => {
                    ok = false;
                    continue;
                }
            }
        } else {
            let start = i.saturating_mul(block_size);
            let Some(block) = stored
                .token_ids
                .get(start..start.saturating_add(block_size))
            else {
                ok = false;
                break;
            };
            let seed = if i == 0 && stored.parent.is_none() {
                hash::salted(stored.seed, stored.cache_salt)
            } else {
                stored.seed
            };
            let local =
                hash::fold_media(hash::block_hash(block, seed), &block_keys(stored.media, i));
            parent.map_or(local, |p| hash::chain(p, local))
        };
        sink.put(*engine_hash, seq, stored.tier);
        parent = Some(seq);
    }
    ok
}

/// The media keys of block `i` of a store, in order.
fn block_keys(media: &[BlockMedia], i: usize) -> Vec<hash::MediaKey> {
    media
        .iter()
        .filter(|m| m.block as usize == i)
        .map(|m| m.key)
        .collect()
}

impl Partition {
    /// Applies one rank's KV events to the index. The router recomputes block hashes from the
    /// events' token ids (engine hashes are only keys for removal and tokenless stores).
    ///
    /// A partition whose workers never declared a block size learns it from the first stored
    /// block of another size (its index starts afresh); after that, stores of another size are
    /// dropped and counted as mismatches. A rank counts as precise (its picks' predicted entries
    /// live only `predicted_ttl`) once one of its events has applied.
    ///
    /// `lag`: how late the batch arrived (engine timestamp to now, measured by the host on a
    /// live batch; `None` for a replayed one): it adapts the partition's end grace
    /// ([`super::grace`]), reported as a fact.
    pub fn apply_events(
        &self,
        rank: RankKey,
        events: &[KvEvent],
        lag: Option<Duration>,
        now: Instant,
        facts: &mut Facts,
    ) -> EventStats {
        // The common case needs only the KV side: a member rank already precise, the block
        // size settled. Picks (under the state lock) never wait for it.
        let fast = {
            let mut kv = self.kv.write();
            if !kv.members.contains(&rank) {
                return EventStats {
                    dropped: events.len() as u64,
                    ..EventStats::default()
                };
            }
            if let Some(lag) = lag {
                let grace = kv.grace.observe(lag, now);
                facts.push(self.grace_fact(grace));
            }
            (kv.block_size_known && kv.precise.contains(&rank))
                .then(|| self.apply_to(&mut kv, rank, events))
        };
        if let Some((stats, change)) = fast {
            if let Some(engine) = change {
                // Rare (once per change of the engine's standing): the worker's name is under
                // the state lock, taken after the KV lock was released.
                let state = self.lock_state();
                self.size_fact(&state, rank, engine, facts);
            }
            return stats;
        }
        let mut guard = self.lock_state();
        let state = &mut *guard;
        if state.ranks.get(&rank).is_none() {
            return EventStats {
                dropped: events.len() as u64,
                ..EventStats::default()
            };
        }
        self.learn_block_size(state, events, now);
        let (stats, change) = self.apply_to(&mut state.kv_write(), rank, events);
        if let Some(engine) = change {
            self.size_fact(state, rank, engine, facts);
        }
        if stats.applied > 0 {
            if let Some(slot) = state.ranks.get_mut(&rank).filter(|s| !s.events_seen) {
                slot.events_seen = true;
                let worker = Arc::clone(&slot.worker_name);
                state.kv_write().precise.insert(rank);
                facts.push(Fact::RankPrecise {
                    worker,
                    dp_rank: rank.dp_rank,
                    precise: true,
                });
            }
        }
        stats
    }

    /// The partition's end grace, as a fact.
    pub(super) fn grace_fact(&self, grace: Duration) -> Fact {
        Fact::PredictionGrace {
            partition: Arc::clone(&self.key),
            seconds: grace.as_secs_f64(),
        }
    }

    /// The fact of a rank's changed block-size standing (`engine`: the size its stores carry, or
    /// `None` once they match again).
    fn size_fact(
        &self,
        state: &super::State,
        rank: RankKey,
        engine: Option<u32>,
        facts: &mut Facts,
    ) {
        if let Some(slot) = state.ranks.get(&rank) {
            facts.push(Fact::BlockSizeMismatch {
                worker: Arc::clone(&slot.worker_name),
                dp_rank: rank.dp_rank,
                partition: self.block_size(),
                engine,
            });
        }
    }

    /// Applies the events to the index and the rank's engine map. Also returns a change of the
    /// rank's block-size standing: `Some(Some(size))` when its stores started to carry (another)
    /// size than the partition's, `Some(None)` when a store of the partition's size applied after
    /// a mismatch.
    pub(super) fn apply_to(
        &self,
        kv: &mut super::Kv,
        rank: RankKey,
        events: &[KvEvent],
    ) -> (EventStats, Option<Option<u32>>) {
        let mut stats = EventStats::default();
        let mut sizes = BatchSizes::default();
        let block_size = self.block_size() as usize;
        if events
            .iter()
            .any(|e| matches!(e, KvEvent::AllBlocksCleared))
        {
            // Predictions of this rank made before the clear and not yet written are dropped.
            kv.clear_log.record(Some(&[rank]));
        }
        let super::Kv {
            index,
            engines,
            size_mismatch,
            shared,
            ..
        } = kv;
        let map = engines.entry(rank).or_default();
        for event in events {
            let shared = shared.as_mut();
            if apply_event(index, map, shared, rank, event, block_size, &mut sizes) {
                stats.applied = stats.applied.saturating_add(1);
            } else {
                stats.dropped = stats.dropped.saturating_add(1);
            }
        }
        stats.block_size_mismatches = sizes.mismatches;
        let change = match sizes.mismatched {
            Some(size) if size_mismatch.insert(rank, size) != Some(size) => Some(Some(size)),
            Some(_) => None,
            None if sizes.matched => size_mismatch.remove(&rank).map(|_| None),
            None => None,
        };
        (stats, change)
    }

    /// Adopts the block size of the first stored block when no worker declared one.
    fn learn_block_size(&self, state: &mut super::State, events: &[KvEvent], now: Instant) {
        if state.declared_block_size.is_some() {
            return;
        }
        let learned = events.iter().find_map(|e| match e {
            KvEvent::BlockStored {
                token_ids,
                block_size,
                ..
            } if !token_ids.is_empty() && *block_size > 0 => Some(*block_size),
            _ => None,
        });
        if let Some(size) = learned {
            state.declared_block_size = Some(size);
            // One KV write for the reset and the new size (events may apply without the state
            // lock once `block_size_known` is set).
            let mut kv = state.kv_write();
            if size != self.block_size() {
                kv.reset(now);
                self.block_size
                    .store(size, std::sync::atomic::Ordering::Relaxed);
            }
            kv.block_size_known = true;
        }
    }

    /// Forgets every block of a rank (engine restart).
    pub fn clear_rank(&self, rank: RankKey) {
        let state = self.lock_state();
        state.kv_write().clear_rank(rank);
    }
}
