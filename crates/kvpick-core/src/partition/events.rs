//! KV events applied to a partition's index: the router recomputes block hashes from the events'
//! token ids, so engine hashes are only keys (for removals and tokenless stores), kept per rank in
//! an [`EngineMap`].

use crate::event::{KvEvent, Medium};
use crate::hash;
use crate::index::{MixedMap, PrefixIndex, Tier};
use crate::types::RankKey;

use super::Partition;

/// What happened to a batch of KV events.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct EventStats {
    pub applied: u64,
    /// Events that could not be applied (unknown parent or block, block-size mismatch, unknown rank).
    pub dropped: u64,
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
}

/// Indexes stored blocks under our own chained hashes (recomputed from the token ids; a tokenless
/// store is resolved through the engine map). False when any block could not be applied: a chain
/// we never saw the start of, a block-size mismatch, a tokenless block we do not know, or too few
/// tokens.
fn store_blocks(
    index: &mut PrefixIndex,
    map: &mut EngineMap,
    rank: RankKey,
    stored: &StoredBlocks,
    block_size: usize,
) -> bool {
    let tokenless = stored.token_ids.is_empty();
    let mut parent = match stored.parent {
        None => None,
        Some(h) => match map.entries.get(&h) {
            Some(&seq) => Some(seq),
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
            match map.entries.get(engine_hash) {
                Some(&seq) => seq,
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
            let local = hash::block_hash(block, stored.seed);
            parent.map_or(local, |p| hash::chain(p, local))
        };
        map.entries.insert(*engine_hash, seq);
        index.insert(rank, &[seq], stored.tier, None);
        parent = Some(seq);
    }
    ok
}

impl Partition {
    /// Applies one rank's KV events to the index. The router recomputes block hashes from the
    /// events' token ids (engine hashes are only keys for removal and tokenless stores).
    pub fn apply_events(&self, rank: RankKey, events: &[KvEvent]) -> EventStats {
        let block_size = self.block_size() as usize;
        let mut stats = EventStats::default();
        let mut guard = self.state.lock();
        let state = &mut *guard;
        if state.ranks.get(&rank).is_none() {
            stats.dropped = events.len() as u64;
            return stats;
        }
        let map = state.engines.entry(rank).or_default();
        for event in events {
            let ok = match event {
                KvEvent::AllBlocksCleared => {
                    state.index.clear_rank(rank);
                    map.entries.clear();
                    true
                }
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium,
                    ..
                } => {
                    let tier = tier_of(medium);
                    let mut all_known = true;
                    for h in block_hashes {
                        let Some(&seq) = map.entries.get(h) else {
                            all_known = false;
                            continue;
                        };
                        if !state.index.release(rank, seq, tier) {
                            map.entries.remove(h);
                        }
                    }
                    all_known
                }
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    block_size: event_block_size,
                    medium,
                    lora_name,
                    ..
                } => {
                    let stored = StoredBlocks {
                        block_hashes,
                        parent: *parent_block_hash,
                        token_ids,
                        event_block_size: *event_block_size as usize,
                        tier: tier_of(medium),
                        seed: hash::block_seed(lora_name.as_deref(), None),
                    };
                    store_blocks(&mut state.index, map, rank, &stored, block_size)
                }
            };
            if ok {
                stats.applied = stats.applied.saturating_add(1);
            } else {
                stats.dropped = stats.dropped.saturating_add(1);
            }
        }
        stats
    }

    /// Forgets every block of a rank (engine restart).
    pub fn clear_rank(&self, rank: RankKey) {
        let mut state = self.state.lock();
        state.index.clear_rank(rank);
        state.engines.remove(&rank);
    }
}
