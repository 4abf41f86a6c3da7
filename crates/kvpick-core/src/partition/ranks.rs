//! A partition's ranks as scheduled: their endpoint, adapters, schedulability and load. Only the
//! partition mutates them; the pipeline stages read them.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;

use super::load_order::LoadOrder;
use crate::engine::EngineMetrics;
use crate::types::{RankKey, RankLoad, Role};

#[derive(Debug)]
pub(crate) struct Slot {
    pub worker_name: Arc<str>,
    pub endpoint: SocketAddr,
    pub multiplexed: bool,
    pub lora_adapters: Arc<[String]>,
    /// Prefill/decode role (`Both` unless the worker declares one).
    pub role: Role,
    /// Picks may go here: the catalog lists the rank as schedulable (`listed`) and its engine is
    /// not known to be down (`reachable`). Kept as one field because every stage reads it.
    pub schedulable: bool,
    /// The catalog's lifecycle is `Schedulable`.
    pub listed: bool,
    /// The host has not reported the engine unreachable ([`crate::Core::set_rank_reachable`]).
    pub reachable: bool,
    pub kv_events: bool,
    /// The engine run this slot's index entries belong to ([`crate::WorkerSpec::incarnation`]).
    pub incarnation: u64,
    /// One of the rank's KV events has applied: its index entries come from the engine, so the
    /// pick's own predictions need to live only until the engine's events confirm them.
    pub events_seen: bool,
    /// Load booked here, by this process.
    pub load: RankLoad,
    /// Load booked on this rank by other replicas of the picker, as the host last learned it
    /// ([`crate::Core::set_remote_loads`]); it counts for the decision and the busy thresholds.
    pub remote_load: RankLoad,
    /// The last engine-metrics reading (the decision uses it only while fresh).
    pub engine: Option<EngineMetrics>,
    /// Since when every engine reading has shown fewer requests than are booked here
    /// (reconciliation, [`super::decay`]).
    pub engine_short_since: Option<std::time::Instant>,
    /// Live bookings the gRPC API holds on this rank (bounded per rank,
    /// [`crate::CoreConfig::max_api_bookings_per_rank`]).
    pub api_bookings: u32,
    /// Outlier detection: ejected ranks take no picks ([`crate::outlier`]).
    pub health: crate::outlier::RankHealth,
    /// Breaks cost ties ([`crate::decide::Candidate::tie`]): a ticket taken when the rank
    /// becomes schedulable and whenever a decision picks it ([`RankTable::touch`]).
    pub tie: u64,
}

impl Slot {
    /// A rank just added to the table: idle, not yet schedulable, no KV events seen.
    pub fn new(
        worker_name: Arc<str>,
        endpoint: SocketAddr,
        multiplexed: bool,
        lora_adapters: Arc<[String]>,
        role: Role,
        incarnation: u64,
    ) -> Self {
        Slot {
            worker_name,
            endpoint,
            multiplexed,
            lora_adapters,
            role,
            schedulable: false,
            listed: false,
            reachable: true,
            kv_events: false,
            incarnation,
            events_seen: false,
            load: RankLoad::default(),
            remote_load: RankLoad::default(),
            engine: None,
            engine_short_since: None,
            api_bookings: 0,
            health: Default::default(),
            tie: 0,
        }
    }

    /// An idle, schedulable rank of worker `w{port}` at 10.0.0.1:`port` (unit tests).
    #[cfg(test)]
    pub fn for_test(port: u16) -> Self {
        Slot {
            schedulable: true,
            listed: true,
            ..Slot::new(
                Arc::from(format!("w{port}").as_str()),
                SocketAddr::from(([10, 0, 0, 1], port)),
                false,
                Arc::from(Vec::<String>::new()),
                Role::Both,
                0,
            )
        }
    }

    /// Derives `schedulable` from the catalog's listing and the engine's reachability.
    pub fn refresh_schedulable(&mut self) {
        self.schedulable = self.listed && self.reachable;
    }

    /// What the decision sees: this process's bookings plus the other replicas'.
    pub fn total_load(&self) -> RankLoad {
        let (local, remote) = (&self.load, &self.remote_load);
        RankLoad {
            active_prefill_tokens: local
                .active_prefill_tokens
                .saturating_add(remote.active_prefill_tokens),
            active_decode_blocks: local
                .active_decode_blocks
                .saturating_add(remote.active_decode_blocks),
            active_requests: local.active_requests.saturating_add(remote.active_requests),
        }
    }

    /// Adds one request's load: its queued prefill tokens and its KV blocks.
    pub fn add_load(&mut self, prefill_tokens: u64, decode_blocks: u64) {
        let load = &mut self.load;
        load.active_prefill_tokens = load.active_prefill_tokens.saturating_add(prefill_tokens);
        load.active_decode_blocks = load.active_decode_blocks.saturating_add(decode_blocks);
        load.active_requests = load.active_requests.saturating_add(1);
    }

    /// Takes one request's load off again.
    pub fn remove_load(&mut self, prefill_tokens: u64, decode_blocks: u64) {
        let load = &mut self.load;
        load.active_prefill_tokens = load.active_prefill_tokens.saturating_sub(prefill_tokens);
        load.active_decode_blocks = load.active_decode_blocks.saturating_sub(decode_blocks);
        load.active_requests = load.active_requests.saturating_sub(1);
    }
}

/// The partition's ranks: a vector sorted by `RankKey` (the hot path walks it by index, in the
/// same order as index matches) plus a key -> position map. Mutations during a catalog batch may
/// leave it unsorted; [`RankTable::finish`] restores order once per batch.
///
/// The schedulable ranks are also kept in [`LoadOrder`]: every mutable access marks the rank
/// dirty, and [`RankTable::sync_order`] (before each decision) moves the dirty ones.
#[derive(Debug, Default)]
pub(crate) struct RankTable {
    pub slots: Vec<(RankKey, Slot)>,
    positions: HashMap<RankKey, usize>,
    /// Some rank is not `Both`: picks go through the pair decision ([`crate::disagg`]).
    pub split_roles: bool,
    order: LoadOrder,
    /// Ranks handed out mutably since the last sync.
    dirty: Vec<RankKey>,
    /// Every rank may have changed (a catalog batch, the other replicas' loads).
    resync_all: bool,
    /// The next tie ticket: ties go to the rank picked least recently.
    next_ticket: u64,
    /// Bumped when a rank joins or leaves ([`RankTable::epoch`]).
    epoch: u64,
}

impl RankTable {
    pub fn get(&self, key: &RankKey) -> Option<&Slot> {
        self.positions
            .get(key)
            .and_then(|&i| self.slots.get(i))
            .map(|(_, s)| s)
    }

    pub fn get_mut(&mut self, key: &RankKey) -> Option<&mut Slot> {
        self.mark_dirty(*key);
        self.positions
            .get(key)
            .and_then(|&i| self.slots.get_mut(i))
            .map(|(_, s)| s)
    }

    fn mark_dirty(&mut self, key: RankKey) {
        if self.resync_all {
            return;
        }
        if self.dirty.len() > self.slots.len() {
            self.resync_all = true;
            self.dirty.clear();
        } else {
            self.dirty.push(key);
        }
    }

    /// Every slot, mutably; the load order is rebuilt at the next sync.
    pub fn slots_mut(&mut self) -> impl Iterator<Item = (&RankKey, &mut Slot)> {
        self.resync_all = true;
        self.dirty.clear();
        self.slots.iter_mut().map(|(k, s)| (&*k, s))
    }

    /// Brings the load order up to date with the slots; a rank new to it takes a tie ticket (in
    /// dirty order, or in rank order after a batch).
    pub fn sync_order(&mut self) {
        if std::mem::take(&mut self.resync_all) {
            self.dirty.clear();
            // `remove` takes a rank out of the order at once, so only loads can be stale here.
            for i in 0..self.slots.len() {
                self.sync_at(i);
            }
            return;
        }
        for key in std::mem::take(&mut self.dirty) {
            match self.positions.get(&key) {
                Some(&i) => self.sync_at(i),
                None => {
                    self.order.remove(&key);
                }
            }
        }
    }

    fn sync_at(&mut self, i: usize) {
        let Some((key, slot)) = self.slots.get_mut(i) else {
            return;
        };
        if !slot.schedulable {
            self.order.remove(key);
            return;
        }
        let load = slot.total_load();
        let fresh = !self.order.contains(key);
        self.order
            .upsert(*key, load.active_requests, load.active_prefill_tokens);
        if fresh {
            slot.tie = self.next_ticket;
            self.next_ticket = self.next_ticket.wrapping_add(1);
            self.order.set_tie(*key, slot.tie);
        }
    }

    /// A decision picked `key`: it goes behind the ranks it ties with, so ties go round robin,
    /// to the rank picked least recently (booked or dry run alike).
    pub fn touch(&mut self, key: &RankKey) {
        let Some(&i) = self.positions.get(key) else {
            return;
        };
        if let Some((_, slot)) = self.slots.get_mut(i) {
            slot.tie = self.next_ticket;
            self.next_ticket = self.next_ticket.wrapping_add(1);
            self.order.set_tie(*key, slot.tie);
        }
    }

    /// The schedulable ranks by load (valid after [`RankTable::sync_order`]).
    pub fn order(&self) -> &LoadOrder {
        &self.order
    }

    /// Changes whenever a rank joins or leaves the table.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    pub fn position(&self, key: &RankKey) -> Option<usize> {
        self.positions.get(key).copied()
    }

    pub fn keys(&self) -> impl Iterator<Item = &RankKey> {
        self.slots.iter().map(|(k, _)| k)
    }

    pub fn iter(&self) -> impl Iterator<Item = (&RankKey, &Slot)> {
        self.slots.iter().map(|(k, s)| (k, s))
    }

    pub fn values(&self) -> impl Iterator<Item = &Slot> {
        self.slots.iter().map(|(_, s)| s)
    }

    pub fn get_or_insert_with(&mut self, key: RankKey, make: impl FnOnce() -> Slot) -> &mut Slot {
        self.mark_dirty(key);
        let i = match self.positions.get(&key) {
            Some(&i) => i,
            None => {
                self.epoch = self.epoch.wrapping_add(1);
                let i = self.slots.len();
                self.slots.push((key, make()));
                self.positions.insert(key, i);
                i
            }
        };
        &mut self.slots[i].1
    }

    pub fn remove(&mut self, key: &RankKey) -> Option<Slot> {
        self.order.remove(key);
        let i = self.positions.remove(key)?;
        self.epoch = self.epoch.wrapping_add(1);
        let (_, slot) = self.slots.swap_remove(i);
        if let Some((moved, _)) = self.slots.get(i) {
            self.positions.insert(*moved, i);
        }
        Some(slot)
    }

    /// Ends a catalog batch: restores rank order and has the next sync move only the ranks the
    /// batch touched (every mutation marked them dirty), in rank order so a rank new to the load
    /// order takes its tie ticket where a pass over every rank would give it. At thousands of
    /// ranks a pod change must not cost every pick after it a pass over the table.
    pub fn finish(&mut self) {
        if !self.slots.is_sorted_by_key(|(k, _)| *k) {
            self.slots.sort_unstable_by_key(|(k, _)| *k);
            self.positions = self
                .slots
                .iter()
                .enumerate()
                .map(|(i, (k, _))| (*k, i))
                .collect();
        }
        self.split_roles = self.slots.iter().any(|(_, s)| s.role != Role::Both);
        self.dirty.sort_unstable();
        self.dirty.dedup();
    }
}

#[cfg(test)]
#[allow(clippy::arithmetic_side_effects)] // small test numbers, not network input
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn slot(port: u16) -> Slot {
        Slot::for_test(port)
    }

    /// Every rank's place in the load order and tie ticket.
    fn placed(table: &RankTable) -> Vec<(u64, u64, RankKey)> {
        let mut places: Vec<_> = table.order().by_prefill().copied().collect();
        places.sort_unstable();
        places
    }

    /// One random catalog batch (new ranks appended out of order, load and schedulability
    /// changes, departures) applied the same way to both tables.
    fn batch(rng: &mut StdRng, tables: &mut [&mut RankTable; 2]) {
        for _ in 0..rng.random_range(1..12) {
            let key = RankKey {
                worker_id: rng.random_range(0..40),
                dp_rank: rng.random_range(0..2),
            };
            let op = rng.random_range(0..4);
            let prefill = rng.random_range(0..3u64) * 100;
            let schedulable = rng.random_bool(0.8);
            for table in tables.iter_mut() {
                match op {
                    0 => {
                        table.remove(&key);
                    }
                    1 => {
                        table.get_or_insert_with(key, || slot(8000)).schedulable = schedulable;
                    }
                    _ => {
                        if let Some(s) = table.get_mut(&key) {
                            s.load.active_prefill_tokens = prefill;
                            s.load.active_requests = prefill / 100;
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn a_batch_syncs_only_what_it_touched_as_a_full_pass_would() {
        let mut rng = StdRng::seed_from_u64(3);
        for _ in 0..200 {
            let (mut incremental, mut full) = (RankTable::default(), RankTable::default());
            for _ in 0..rng.random_range(1..30) {
                batch(&mut rng, &mut [&mut incremental, &mut full]);
                incremental.finish();
                full.finish();
                full.resync_all = true;
                incremental.sync_order();
                full.sync_order();
                assert_eq!(placed(&incremental), placed(&full));
                let ties = |t: &RankTable| t.iter().map(|(k, s)| (*k, s.tie)).collect::<Vec<_>>();
                assert_eq!(ties(&incremental), ties(&full));
                // A decision between batches touches a rank: both move it behind its equals.
                let touched = incremental.keys().nth(rng.random_range(0..4)).copied();
                if let Some(key) = touched {
                    incremental.touch(&key);
                    full.touch(&key);
                }
            }
        }
    }
}
