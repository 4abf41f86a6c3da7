//! What other processes tell the partition: loads booked by other kvpick replicas, this replica's
//! own loads to publish, session bindings decided elsewhere, engine-metrics readings, and blocks
//! inserted from outside a pick. It must not decide or book.

use super::*;

impl Partition {
    /// Sets every rank's load booked by other replicas: `loads` names it, a rank it does not
    /// name has none.
    pub fn set_remote_loads(&self, loads: &HashMap<RankKey, RankLoad>) {
        let mut state = self.lock_state();
        for (key, slot) in state.ranks.slots_mut() {
            slot.remote_load = loads.get(key).copied().unwrap_or_default();
        }
    }

    /// Appends this process's own load of every rank that has any.
    pub fn local_loads(&self, out: &mut Vec<(RankKey, RankLoad)>) {
        let state = self.lock_state();
        out.extend(
            state
                .ranks
                .iter()
                .filter(|(_, s)| s.load != RankLoad::default())
                .map(|(k, s)| (*k, s.load)),
        );
    }

    /// The session's live binding, if any (an expired one is dropped, as on a pick).
    pub fn bound_session(
        &self,
        sid: &str,
        now: Instant,
        ttl: Duration,
        facts: &mut Facts,
    ) -> Option<RankKey> {
        let lookup = self.lock_state().sessions.bound_rank(sid, now, ttl);
        if lookup.expired {
            facts.push(Fact::SessionsLive(-1));
            facts.push(Fact::SessionsExpired(1));
        }
        lookup.rank
    }

    /// Binds `sid` to `rank` as decided elsewhere (another replica); in-flight requests keep
    /// their leases. Not installed when the rank is not in this partition or the table is full
    /// of leased sessions.
    pub fn install_session(
        &self,
        sid: &str,
        rank: RankKey,
        now: Instant,
        max_entries: usize,
        facts: &mut Facts,
    ) -> crate::session::Installed {
        use crate::session::Installed;
        let mut state = self.lock_state();
        if state.ranks.get(&rank).is_none() {
            return Installed::UnknownRank;
        }
        match state.sessions.bind(sid, rank, now, max_entries) {
            Bound::Yes { created, evicted } => {
                binding_facts(created, evicted, facts);
                Installed::Yes
            }
            Bound::Full => Installed::TableFull,
        }
    }

    /// Stores a rank's engine-metrics reading and reconciles the rank's bookings with it
    /// ([`super::decay`]); `None` when the rank is not in the partition, else how many bookings
    /// were reconciled.
    pub fn record_engine_metrics(
        &self,
        key: RankKey,
        metrics: crate::engine::EngineMetrics,
        config: &CoreConfig,
        facts: &mut Facts,
    ) -> Option<u64> {
        let mut guard = self.lock_state();
        let state = &mut *guard;
        let slot = state.ranks.get_mut(&key)?;
        // Readings further apart than a reading stays fresh saw nothing in between: the
        // reconciliation window restarts rather than spanning the gap.
        let gap = slot.engine.as_ref().is_none_or(|e| {
            metrics.at.saturating_duration_since(e.at) > config.engine_metrics_max_age
        });
        if gap {
            slot.engine_short_since = None;
        }
        slot.engine = Some(metrics.clone());
        let reconciled = Self::reconcile(state, key, &metrics, config, facts);
        guard.unlock(facts);
        Some(reconciled)
    }

    /// A rank's load and standing, for listing.
    pub fn rank_view(&self, key: RankKey) -> Option<(RankLoad, crate::outcome::RankStatus)> {
        let state = self.lock_state();
        let slot = state.ranks.get(&key)?;
        let status = crate::outcome::RankStatus {
            reachable: slot.reachable,
            mismatched_block_size: state.kv_read().size_mismatch.get(&key).copied(),
        };
        Some((slot.load, status))
    }

    /// The partition's block size once a worker declared it or an event taught it.
    pub fn known_block_size(&self) -> Option<u32> {
        self.lock_state().declared_block_size
    }

    /// Inserts blocks for a rank (KV events, tests, warm-up).
    pub fn insert_blocks(
        &self,
        rank: RankKey,
        seq_hashes: &[u64],
        tier: Tier,
        expires: Option<Instant>,
    ) {
        self.kv
            .write()
            .index
            .insert(rank, seq_hashes, tier, expires);
    }
}
