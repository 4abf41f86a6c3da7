//! KV events applied to a partition's index: the router recomputes block hashes from the events'
//! token ids, so engine hashes are only keys (for removals and tokenless stores), kept per rank in
//! an [`EngineMap`].

use crate::event::{KvEvent, Medium};
use crate::hash;
use crate::index::{MixedMap, Tier};
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
                    let tier = tier_of(medium);
                    let seed = hash::block_seed(lora_name.as_deref(), None);
                    let mut parent = match parent_block_hash {
                        None => None,
                        Some(h) => match map.entries.get(h) {
                            Some(&seq) => Some(seq),
                            None if token_ids.is_empty() => None,
                            // A chain we never saw the start of cannot be hashed like requests.
                            None => {
                                stats.dropped += 1;
                                continue;
                            }
                        },
                    };
                    if !token_ids.is_empty() && *event_block_size as usize != block_size {
                        stats.dropped += 1;
                        continue;
                    }
                    let mut ok = true;
                    for (i, engine_hash) in block_hashes.iter().enumerate() {
                        let seq = if token_ids.is_empty() {
                            match map.entries.get(engine_hash) {
                                Some(&seq) => seq,
                                None => {
                                    ok = false;
                                    continue;
                                }
                            }
                        } else {
                            let Some(block) = token_ids.get(i * block_size..(i + 1) * block_size)
                            else {
                                ok = false;
                                break;
                            };
                            let local = hash::block_hash(block, seed);
                            match parent {
                                None => local,
                                Some(p) => hash::chain(p, local),
                            }
                        };
                        map.entries.insert(*engine_hash, seq);
                        state.index.insert(rank, &[seq], tier, None);
                        parent = Some(seq);
                    }
                    ok
                }
            };
            if ok {
                stats.applied += 1;
            } else {
                stats.dropped += 1;
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
