//! The partition's ranks as the catalog declares them: a batch of rank changes applied under the
//! lock (new, updated, draining, gone), the block size adopted from the first worker that declares
//! one, and what a departing rank takes with it (its bookings, sessions and index entries). It must
//! not decide anything: selection is [`super::select`].

#![warn(clippy::arithmetic_side_effects)]

use super::*;
use crate::error::ConfigError;

impl Partition {
    /// Applies one batch of catalog changes under one lock (one publish).
    pub fn apply_batch(
        &self,
        gone: &[WorkerRecord],
        upserts: &[WorkerRecord],
        now: Instant,
        facts: &mut Facts,
    ) -> BatchResult {
        let mut result = BatchResult {
            failed: Vec::new(),
            dropped_bookings: Vec::new(),
        };
        let mut state = self.lock_state();
        for record in gone {
            Self::drop_worker(
                &mut state,
                record.id,
                now,
                facts,
                &mut result.dropped_bookings,
            );
        }
        for record in upserts {
            if let Err(reason) = self.adopt_block_size(&mut state, record, now) {
                result.failed.push((record.id, reason.to_string()));
                Self::drop_worker(
                    &mut state,
                    record.id,
                    now,
                    facts,
                    &mut result.dropped_bookings,
                );
                continue;
            }
            Self::upsert_ranks(&mut state, record, now, facts, &mut result.dropped_bookings);
        }
        state.ranks.finish();
        let n = state.ranks.values().filter(|s| s.schedulable).count();
        self.schedulable.store(n, Ordering::Relaxed);
        result
    }

    /// Takes a worker's declared block size, or refuses the worker when another one declared a
    /// different size. The first declaration (or the only worker changing it) starts the index
    /// afresh: hashes of another block size never match.
    pub(super) fn adopt_block_size(
        &self,
        state: &mut State,
        record: &WorkerRecord,
        now: Instant,
    ) -> Result<(), ConfigError> {
        let Some(declared) = record.spec.block_size else {
            return Ok(());
        };
        let others_declare = state.ranks.keys().any(|k| k.worker_id != record.id);
        match state.declared_block_size {
            Some(current) if current != declared && others_declare => {
                Err(ConfigError::BlockSizeConflict {
                    declared,
                    current,
                    model: self.key.model.clone(),
                })
            }
            Some(current) if current == declared => Ok(()),
            _ => {
                let afresh = state.declared_block_size.is_some() || declared != DEFAULT_BLOCK_SIZE;
                state.declared_block_size = Some(declared);
                // One KV write for the reset and the new size: events applying without the
                // state lock never see one without the other.
                let mut kv = state.kv_write();
                if afresh {
                    // Engine hashes map to our hashes of the old size: both start afresh.
                    kv.reset(now);
                }
                self.block_size.store(declared, Ordering::Relaxed);
                kv.block_size_known = true;
                Ok(())
            }
        }
    }

    /// Makes the partition's ranks of `record` match it: ranks that moved or went are dropped
    /// (with their bookings), surviving ranks keep their load, new ones start idle.
    pub(super) fn upsert_ranks(
        state: &mut State,
        record: &WorkerRecord,
        now: Instant,
        facts: &mut Facts,
        dropped: &mut Vec<BookingRef>,
    ) {
        let wanted: HashMap<u32, _> = record.ranks.iter().map(|r| (r.dp_rank, *r)).collect();
        let stale: Vec<RankKey> = state
            .ranks
            .iter()
            .filter(|(k, s)| {
                k.worker_id == record.id
                    && wanted
                        .get(&k.dp_rank)
                        .is_none_or(|r| s.endpoint != r.endpoint)
            })
            .map(|(k, _)| *k)
            .collect();
        // One pass over the index for all of them (drop_rank's own clear then finds nothing).
        state.kv_write().clear_ranks(&stale);
        for key in stale {
            Self::drop_rank(state, key, now, facts, dropped);
        }
        let mut restarted = Vec::new();
        let lora: Arc<[String]> = record.spec.lora_adapters.clone().into();
        let name: Arc<str> = record.spec.name.as_str().into();
        for rank in &record.ranks {
            let key = RankKey {
                worker_id: record.id,
                dp_rank: rank.dp_rank,
            };
            let new_rank = state.ranks.get(&key).is_none();
            if new_rank {
                state.kv_write().members.insert(key);
            }
            let slot = state.ranks.get_or_insert_with(key, || {
                Slot::new(
                    Arc::clone(&name),
                    rank.endpoint,
                    rank.multiplexed,
                    Arc::clone(&lora),
                    rank.role,
                    record.spec.incarnation,
                )
            });
            if slot.incarnation != record.spec.incarnation {
                // The engine restarted under the same worker: its KV cache is empty now (its
                // blocks are forgotten below, with the worker's other ranks, in one pass).
                slot.incarnation = record.spec.incarnation;
                restarted.push(key);
                slot.events_seen = false;
                slot.engine = None;
            }
            slot.worker_name = Arc::clone(&name);
            slot.multiplexed = rank.multiplexed;
            slot.lora_adapters = Arc::clone(&lora);
            slot.role = rank.role;
            slot.listed = record.lifecycle == Lifecycle::Schedulable;
            slot.refresh_schedulable();
            slot.kv_events = record.spec.kv_events.is_some();
            if new_rank {
                facts.push(Fact::RankPrecise {
                    worker: Arc::clone(&name),
                    dp_rank: key.dp_rank,
                    precise: false,
                });
            }
        }
        if !restarted.is_empty() {
            let mut kv = state.kv_write();
            kv.clear_ranks(&restarted);
            for key in &restarted {
                kv.precise.remove(key);
            }
        }
    }

    /// Drops every rank of a worker (and their bookings).
    pub(super) fn drop_worker(
        state: &mut State,
        worker_id: u64,
        now: Instant,
        facts: &mut Facts,
        dropped: &mut Vec<BookingRef>,
    ) {
        let keys: Vec<RankKey> = state
            .ranks
            .keys()
            .filter(|k| k.worker_id == worker_id)
            .copied()
            .collect();
        // One pass over the index for all of them (drop_rank's own clear then finds nothing).
        state.kv_write().clear_ranks(&keys);
        for key in keys {
            Self::drop_rank(state, key, now, facts, dropped);
        }
    }

    pub(super) fn drop_rank(
        state: &mut State,
        key: RankKey,
        now: Instant,
        facts: &mut Facts,
        dropped: &mut Vec<BookingRef>,
    ) {
        let Some(slot) = state.ranks.remove(&key) else {
            return;
        };
        state.estimator.forget(&key);
        // The rank's engine is gone (deleted, moved, re-addressed): what it cached must not
        // attract requests if a worker of the same id comes back with a fresh engine.
        {
            let mut kv = state.kv_write();
            kv.clear_rank(key);
            kv.members.remove(&key);
            kv.precise.remove(&key);
            kv.size_mismatch.remove(&key);
        }
        let mut leases = Vec::new();
        let mut legs = Vec::new();
        let mut leg_chains = Vec::new();
        state.bookings.retain(|id, b| {
            if b.prefill.as_ref().is_some_and(|leg| leg.rank == key) {
                // The prefill rank left: its load went with it; the decode side lives on, its
                // first token still settles the SLO and TPOT (but is no TTFT observation).
                b.prefill = None;
                b.prefill_rank_gone = true;
                b.predicted[1] = None;
            }
            if b.rank == key {
                dropped.push((id.clone(), b.generation));
                leases.extend(b.session.take());
                legs.extend(b.prefill.take());
                // The request is over for its prefill rank too (the decode rank's own entries
                // went with its clear).
                leg_chains.push(b.predicted[1].take());
                false
            } else {
                true
            }
        });
        for sid in leases {
            state.sessions.release(&sid, now);
        }
        for leg in legs {
            pair::unbook_leg(state, Some(&leg), facts);
        }
        for chain in leg_chains {
            health::end(state, chain, now);
        }
        facts.push(Fact::Inflight(negative(slot.load.active_requests)));
        if slot.health.is_ejected() {
            facts.push(Fact::EjectedRanks(-1));
        }
        facts.push(Fact::RankGone {
            worker: slot.worker_name,
            dp_rank: key.dp_rank,
        });
    }
}
