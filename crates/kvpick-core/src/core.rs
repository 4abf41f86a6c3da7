//! [`Core`]: the catalog as scheduled, the partitions and the registry of live bookings. Every
//! host (ext_proc, the gRPC API, the replay) drives this one type. It takes time as an argument
//! and returns what changed as [`Facts`]; it has no clock, no channels and no metrics of its own.

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use dashmap::DashMap;
use parking_lot::{Mutex, RwLock};

use crate::catalog::{ApplyReport, Catalog, SourceName, WorkerRecord, WorkerSpec};
use crate::config::{CoreConfig, DEFAULT_BLOCK_SIZE};
use crate::error::{CatalogError, SelectError};
use crate::event::KvEvent;
use crate::facts::{Fact, Facts};
use crate::index::{Tier, TierDepths};
use crate::partition::{EventStats, Partition, SelectOutcome};
use crate::request::{clip, DuplicateId, SelectionRequest};
use crate::types::{PartitionKey, RankKey, RankLoad};
use crate::{PickedRank, Selection, WorkerView};

/// The selection core shared by every host.
pub struct Core {
    config: CoreConfig,
    catalog: Mutex<Catalog>,
    /// Set once the first catalog snapshot has been applied.
    synced: AtomicBool,
    partitions: RwLock<BTreeMap<PartitionKey, Arc<Partition>>>,
    /// Live booking ids -> the partition holding them (claims are made before scheduling).
    bookings: DashMap<String, Arc<Partition>>,
    trace: Mutex<VecDeque<String>>,
}

impl Core {
    pub fn new(config: CoreConfig) -> Self {
        Core {
            config,
            catalog: Mutex::new(Catalog::default()),
            synced: AtomicBool::new(false),
            partitions: RwLock::new(BTreeMap::new()),
            bookings: DashMap::new(),
            trace: Mutex::new(VecDeque::new()),
        }
    }

    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    /// Replaces one source's workers with `specs` and reconciles the union of all sources:
    /// duplicate ids are rejected before anything changes; unchanged workers are skipped; changed
    /// ones are replaced in one batch per partition (surviving ranks keep their bookings);
    /// workers absent from every source are deleted with their bookings.
    pub fn apply_source_snapshot(
        &self,
        source: SourceName,
        specs: Vec<WorkerSpec>,
        now: Instant,
    ) -> Result<(ApplyReport, Facts), CatalogError> {
        self.modify_source(source, |list| *list = specs, now)
            .map(|((), report, facts)| (report, facts))
    }

    /// Edits one source's worker list with `edit` and reconciles, all under the catalog lock, so
    /// concurrent edits of one source never lose each other's changes.
    pub fn modify_source<R>(
        &self,
        source: SourceName,
        edit: impl FnOnce(&mut Vec<WorkerSpec>) -> R,
        now: Instant,
    ) -> Result<(R, ApplyReport, Facts), CatalogError> {
        let mut catalog = self.catalog.lock();
        let mut list = catalog.source(source).to_vec();
        let result = edit(&mut list);
        let (mut report, changes) = catalog.replace_source(source, list)?;
        let mut facts = Facts::default();
        for (key, change) in changes {
            let partition = self.partition(&key, now);
            let batch = partition.apply_batch(&change.gone, &change.upserts, now, &mut facts);
            for (id, reason) in batch.failed {
                if let Some(name) = catalog.mark_failed(id, reason.clone()) {
                    report.failed.push((name, reason));
                }
            }
            for id in batch.dropped_bookings {
                self.bookings.remove(&id);
            }
        }
        self.synced.store(true, Ordering::Release);
        report.ready = catalog.any_schedulable();
        facts.push(Fact::CatalogWorkers(Facts::lifecycle_counts(
            catalog.records().map(|r| r.lifecycle),
        )));
        Ok((result, report, facts))
    }

    /// Adds or replaces one worker of a source (matched by name) and reconciles.
    pub fn upsert_source_worker(
        &self,
        source: SourceName,
        spec: WorkerSpec,
        now: Instant,
    ) -> Result<(ApplyReport, Facts), CatalogError> {
        self.modify_source(
            source,
            |list| {
                list.retain(|w| w.name != spec.name);
                list.push(spec);
            },
            now,
        )
        .map(|((), report, facts)| (report, facts))
    }

    /// Removes one worker of a source by name; says whether it existed.
    pub fn delete_source_worker(
        &self,
        source: SourceName,
        name: &str,
        now: Instant,
    ) -> Result<(bool, ApplyReport, Facts), CatalogError> {
        self.modify_source(
            source,
            |list| {
                let before = list.len();
                list.retain(|w| w.name != name);
                list.len() != before
            },
            now,
        )
    }

    /// The partition for `key`, created lazily.
    fn partition(&self, key: &PartitionKey, now: Instant) -> Arc<Partition> {
        if let Some(p) = self.partitions.read().get(key) {
            return Arc::clone(p);
        }
        let mut partitions = self.partitions.write();
        Arc::clone(
            partitions
                .entry(key.clone())
                .or_insert_with(|| Arc::new(Partition::new(key.clone(), &self.config, now))),
        )
    }

    /// Finds the partition a request belongs to: its `(model, routing_group)`, else a partition
    /// serving the model as a LoRA adapter; requests without a model go to the partition with the
    /// most schedulable ranks.
    fn resolve_partition(&self, request: &SelectionRequest) -> Result<Arc<Partition>, SelectError> {
        let partitions = self.partitions.read();
        let Some(model) = &request.model else {
            return partitions
                .values()
                .filter(|p| p.schedulable_ranks() > 0)
                .max_by_key(|p| p.schedulable_ranks())
                .cloned()
                .ok_or_else(|| SelectError::Unavailable("no ready worker in the pool".into()));
        };
        let key = PartitionKey {
            model: model.clone(),
            routing_group: request.routing_group.clone(),
        };
        if let Some(p) = partitions.get(&key) {
            if p.schedulable_ranks() > 0 {
                return Ok(Arc::clone(p));
            }
        }
        partitions
            .values()
            .find(|p| p.routing_group_is(&request.routing_group) && p.serves_adapter(model))
            .cloned()
            .ok_or_else(|| {
                SelectError::Unavailable(format!("no ready worker serves model {}", clip(model)))
            })
    }

    fn ensure_ready(&self, request: &SelectionRequest) -> Result<Arc<Partition>, SelectError> {
        request.validate()?;
        // Read on every pick: an atomic, not the catalog lock.
        if !self.synced.load(Ordering::Acquire) {
            return Err(SelectError::Unavailable("catalog not synced yet".into()));
        }
        self.resolve_partition(request)
    }

    /// Computes a decision without booking anything (the API's `Select`).
    pub fn select(
        &self,
        request: &SelectionRequest,
        now: Instant,
    ) -> Result<(Selection, Facts), SelectError> {
        let partition = self.ensure_ready(request)?;
        let mut facts = Facts::default();
        let outcome = partition.select(request, None, &self.config, now, &mut facts)?;
        Ok((outcome.selection, facts))
    }

    /// Picks a rank and books it atomically: the request id is claimed first, then the decision
    /// and the booking are made under the partition's lock. The booking lives until
    /// [`Core::free`] or expiry.
    pub fn select_and_reserve(
        &self,
        request: &SelectionRequest,
        now: Instant,
    ) -> Result<(Selection, Facts), SelectError> {
        let partition = self.ensure_ready(request)?;
        let booking_id = self.claim(&request.request_id, request.on_duplicate, &partition)?;
        let mut facts = Facts::default();
        match partition.select(request, Some(&booking_id), &self.config, now, &mut facts) {
            Ok(outcome) => {
                self.record_trace(request, &outcome);
                Ok((outcome.selection, facts))
            }
            Err(err) => {
                self.bookings.remove(&booking_id);
                Err(err)
            }
        }
    }

    fn claim(
        &self,
        request_id: &str,
        on_duplicate: DuplicateId,
        partition: &Arc<Partition>,
    ) -> Result<String, SelectError> {
        let mut n: u64 = 1;
        loop {
            let id = if n == 1 {
                request_id.to_string()
            } else {
                format!("{request_id}#{n}")
            };
            match self.bookings.entry(id) {
                dashmap::Entry::Vacant(v) => {
                    let id = v.key().clone();
                    v.insert(Arc::clone(partition));
                    return Ok(id);
                }
                dashmap::Entry::Occupied(_) if on_duplicate == DuplicateId::Reject => {
                    return Err(SelectError::Conflict(format!(
                        "request id {} already has a live booking",
                        clip(request_id)
                    )))
                }
                dashmap::Entry::Occupied(_) => n = n.saturating_add(1),
            }
        }
    }

    fn record_trace(&self, request: &SelectionRequest, outcome: &SelectOutcome) {
        if self.config.trace_decisions == 0 {
            return;
        }
        let s = &outcome.selection;
        let line = format!(
            "{} partition={}/{} pick={}:{} overlap={} cost={:.3} candidates={}",
            request.request_id,
            s.partition.model,
            s.partition.routing_group,
            s.primary.key.worker_id,
            s.primary.key.dp_rank,
            s.overlap_blocks,
            s.cost,
            outcome.trace
        );
        let mut trace = self.trace.lock();
        if trace.len() >= self.config.trace_decisions {
            trace.pop_front();
        }
        trace.push_back(line);
    }

    /// The decision trace (when `trace_decisions > 0`), oldest first.
    pub fn decision_trace(&self) -> Vec<String> {
        self.trace.lock().iter().cloned().collect()
    }

    fn booked_partition(&self, booking_id: &str) -> Option<Arc<Partition>> {
        self.bookings.get(booking_id).map(|p| Arc::clone(&p))
    }

    /// Marks the booking's prefill as done (first response byte). Unknown ids are ignored.
    pub fn mark_prefill_complete(&self, booking_id: &str) -> (bool, Facts) {
        let mut facts = Facts::default();
        let done = self
            .booked_partition(booking_id)
            .is_some_and(|p| p.prefill_complete(booking_id, &mut facts));
        (done, facts)
    }

    /// Frees a booking exactly once; unknown or repeated frees are no-ops returning false.
    pub fn free(&self, booking_id: &str, now: Instant) -> (bool, Facts) {
        let mut facts = Facts::default();
        let Some((_, partition)) = self.bookings.remove(booking_id) else {
            return (false, facts);
        };
        let freed = partition.free(booking_id, now, &mut facts);
        (freed, facts)
    }

    /// Moves a booking to the endpoint that actually served it (Envoy may fall back).
    pub fn move_booking(
        &self,
        booking_id: &str,
        served: SocketAddr,
        now: Instant,
    ) -> (bool, Facts) {
        let mut facts = Facts::default();
        let moved = self
            .booked_partition(booking_id)
            .is_some_and(|p| p.move_booking(booking_id, served, now, &mut facts));
        (moved, facts)
    }

    /// Reaps bookings older than `booking_ttl`, expired index entries and idle sessions; returns
    /// the bookings reaped.
    pub fn reap_expired(&self, now: Instant) -> (usize, Facts) {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        let mut facts = Facts::default();
        let mut reaped: usize = 0;
        for p in partitions {
            let ids = p.reap(
                now,
                self.config.booking_ttl,
                self.config.sessions.ttl,
                &mut facts,
            );
            for id in ids {
                self.bookings.remove(&id);
                reaped = reaped.saturating_add(1);
            }
        }
        facts.push(Fact::BookingsExpired(reaped as u64));
        (reaped, facts)
    }

    /// Number of live bookings.
    pub fn live_bookings(&self) -> usize {
        self.bookings.len()
    }

    /// Every worker record (for hosts that derive their own view, e.g. KV subscriptions).
    pub fn records(&self) -> Vec<WorkerRecord> {
        self.catalog.lock().records().cloned().collect()
    }

    /// The catalog with per-rank load, sorted by worker name.
    pub fn list_workers(&self, model: Option<&str>) -> Vec<WorkerView> {
        let records: Vec<WorkerRecord> = self
            .catalog
            .lock()
            .records()
            .filter(|w| model.is_none_or(|m| w.spec.serves(m)))
            .cloned()
            .collect();
        let mut views: Vec<WorkerView> = records
            .into_iter()
            .map(|record| {
                let partition = self.partitions.read().get(&record.partition_key()).cloned();
                let loads = record
                    .ranks
                    .iter()
                    .map(|r| {
                        partition
                            .as_ref()
                            .and_then(|p| {
                                p.load_of(RankKey {
                                    worker_id: record.id,
                                    dp_rank: r.dp_rank,
                                })
                            })
                            .unwrap_or_default()
                    })
                    .collect::<Vec<RankLoad>>();
                WorkerView { record, loads }
            })
            .collect();
        views.sort_by(|a, b| a.record.spec.name.cmp(&b.record.spec.name));
        views
    }

    /// Records that `rank` holds `seq_hashes` in the partition `key` (warm-up, tests).
    pub fn insert_blocks(
        &self,
        key: &PartitionKey,
        rank: RankKey,
        seq_hashes: &[u64],
        tier: Tier,
        expires: Option<Instant>,
        now: Instant,
    ) {
        self.partition(key, now)
            .insert_blocks(rank, seq_hashes, tier, expires);
    }

    /// Applies KV events published by one rank. Returns what was applied / dropped.
    pub fn apply_kv_events(&self, rank: RankKey, events: &[KvEvent]) -> (EventStats, Facts) {
        let mut facts = Facts::default();
        let Some(partition) = self.partition_of_worker(rank.worker_id) else {
            // Not counted as facts: the rank is not (or no longer) in the catalog.
            let stats = EventStats {
                applied: 0,
                dropped: events.len() as u64,
            };
            return (stats, facts);
        };
        let stats = partition.apply_events(rank, events);
        facts.push(Fact::KvEvents {
            applied: stats.applied,
            dropped: stats.dropped,
        });
        facts.push(partition.index_size());
        (stats, facts)
    }

    /// Forgets a rank's blocks (its engine restarted).
    pub fn clear_rank(&self, rank: RankKey) {
        if let Some(partition) = self.partition_of_worker(rank.worker_id) {
            partition.clear_rank(rank);
        }
    }

    fn partition_of_worker(&self, worker_id: u64) -> Option<Arc<Partition>> {
        let key = self.catalog.lock().record(worker_id)?.partition_key();
        self.partitions.read().get(&key).cloned()
    }

    /// The block size of a model's partition (default until a worker declares one).
    pub fn block_size(&self, key: &PartitionKey) -> u32 {
        self.partitions
            .read()
            .get(key)
            .map_or(DEFAULT_BLOCK_SIZE, |p| p.block_size())
    }

    /// Per-rank overlap (GPU-tier blocks) of a prompt in a model's partition, for the API.
    pub fn overlap_scores(
        &self,
        request: &SelectionRequest,
        now: Instant,
    ) -> Result<(u32, Vec<(PickedRank, TierDepths)>), SelectError> {
        request.validate()?;
        let partition = self.resolve_partition(request)?;
        Ok(partition.overlaps(request, now))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::RankLayout;

    /// Before `modify_source`, an upsert read the source list, dropped the lock and wrote the
    /// list back, so two concurrent upserts of different workers could lose one. Eight threads
    /// upsert distinct workers into one source at once, many rounds: every worker must survive.
    #[test]
    fn concurrent_upserts_of_one_source_lose_nothing() {
        const THREADS: usize = 8;
        const ROUNDS: usize = 50;
        let core = Core::new(CoreConfig::default());
        let barrier = std::sync::Barrier::new(THREADS);
        std::thread::scope(|scope| {
            for t in 0..THREADS {
                let (core, barrier) = (&core, &barrier);
                scope.spawn(move || {
                    for round in 0..ROUNDS {
                        if round % 10 == 0 {
                            barrier.wait();
                        }
                        let name = format!("w{t}-{round}");
                        let spec = WorkerSpec::for_test(&name, "m", RankLayout::PerPort(vec![1]));
                        core.upsert_source_worker("api", spec, Instant::now())
                            .unwrap();
                    }
                });
            }
        });
        assert_eq!(core.catalog.lock().source("api").len(), THREADS * ROUNDS);
        assert_eq!(core.records().len(), THREADS * ROUNDS);
        // Deletes race the same way.
        std::thread::scope(|scope| {
            for t in 0..THREADS {
                let core = &core;
                scope.spawn(move || {
                    for round in 0..ROUNDS {
                        let (found, _, _) = core
                            .delete_source_worker("api", &format!("w{t}-{round}"), Instant::now())
                            .unwrap();
                        assert!(found);
                    }
                });
            }
        });
        assert!(core.records().is_empty());
    }
}
