//! [`Core`]: the catalog as scheduled, the partitions and the registry of live bookings. Every
//! host (ext_proc, the gRPC API, the replay) drives this one type. It takes time as an argument
//! and returns what changed as [`Facts`]; it has no clock, no channels and no metrics of its own.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
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
use crate::partition::{Admitted, Claims, EventStats, Partition, SelectOutcome};
use crate::request::{clip, Claim, DuplicateId, Holder, SelectionRequest};
use crate::types::{PartitionKey, RankKey, RankLoad};
use crate::{PickedRank, Selection, WorkerView};

/// A live booking in the registry: where it lives and which generation of its id it is.
struct Registered {
    partition: Arc<Partition>,
    generation: u64,
    holder: Holder,
}

impl Registered {
    fn answers(&self, claim: Claim) -> bool {
        match claim {
            Claim::Generation(g) => self.generation == g,
            Claim::HeldBy(h) => self.holder == h,
            Claim::Any => true,
        }
    }
}

/// The selection core shared by every host.
pub struct Core {
    config: CoreConfig,
    catalog: Mutex<Catalog>,
    /// Set once the first catalog snapshot has been applied.
    synced: AtomicBool,
    partitions: RwLock<BTreeMap<PartitionKey, Arc<Partition>>>,
    /// Live booking ids -> the partition holding them (claims are made before scheduling).
    bookings: DashMap<String, Registered>,
    /// Source of booking generations (never 0, which means "nothing booked").
    generations: AtomicU64,
    /// Live bookings made through the API (bounded by `max_api_bookings`).
    api_bookings: AtomicUsize,
    trace: Mutex<VecDeque<String>>,
    /// Source of queue tickets (flow control).
    tickets: AtomicU64,
    /// Waiting requests -> the partition whose queue holds them.
    waiting: DashMap<u64, Arc<Partition>>,
    /// Release passes run over a non-empty queue (tests: nothing runs one without a change).
    release_passes: AtomicU64,
}

impl Claims for Core {
    fn claim(
        &self,
        request: &SelectionRequest,
        partition: &Arc<Partition>,
    ) -> Result<(String, u64), SelectError> {
        Core::claim(self, request, partition)
    }

    fn unclaim(&self, id: &str, generation: u64) {
        self.unregister(id, Claim::Generation(generation));
    }

    fn waiting_total(&self) -> usize {
        self.waiting.len()
    }
}

/// What [`Core::admit`] did with a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Admission {
    /// Booked now.
    Dispatched(Box<Selection>),
    /// Waiting for capacity. Its outcome comes later as a [`Fact::Dequeued`] for `ticket` from
    /// whichever core operation releases it, or from [`Core::expire_waiting`] at `deadline`;
    /// [`Core::cancel_waiting`] takes it out if its client goes away.
    Queued { ticket: u64, deadline: Instant },
}

impl Core {
    pub fn new(config: CoreConfig) -> Self {
        Core {
            config,
            catalog: Mutex::new(Catalog::default()),
            synced: AtomicBool::new(false),
            partitions: RwLock::new(BTreeMap::new()),
            bookings: DashMap::new(),
            generations: AtomicU64::new(0),
            api_bookings: AtomicUsize::new(0),
            trace: Mutex::new(VecDeque::new()),
            tickets: AtomicU64::new(0),
            waiting: DashMap::new(),
            release_passes: AtomicU64::new(0),
        }
    }

    /// Release passes run so far over a non-empty queue.
    pub fn release_passes(&self) -> u64 {
        self.release_passes.load(Ordering::Relaxed)
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
        let mut changed = Vec::new();
        for (key, change) in changes {
            let partition = self.partition(&key, now);
            changed.push(Arc::clone(&partition));
            let batch = partition.apply_batch(&change.gone, &change.upserts, now, &mut facts);
            for (id, reason) in batch.failed {
                if let Some(name) = catalog.mark_failed(id, reason.clone()) {
                    report.failed.push((name, reason));
                }
            }
            for (id, generation) in batch.dropped_bookings {
                self.unregister(&id, Claim::Generation(generation));
            }
        }
        self.synced.store(true, Ordering::Release);
        report.ready = catalog.any_schedulable();
        facts.push(Fact::CatalogWorkers(Facts::lifecycle_counts(
            catalog.records().map(|r| r.lifecycle),
        )));
        drop(catalog);
        // A rank joined or came back: waiting requests may fit now (or fail for good when
        // their partition lost every rank).
        for partition in &changed {
            self.pump_partition(partition, now, &mut facts);
        }
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
        self.resolve_partition_of(request.model.as_deref(), &request.routing_group)
    }

    fn resolve_partition_of(
        &self,
        model: Option<&str>,
        routing_group: &str,
    ) -> Result<Arc<Partition>, SelectError> {
        let partitions = self.partitions.read();
        let Some(model) = model else {
            return partitions
                .values()
                .filter(|p| p.schedulable_ranks() > 0)
                .max_by_key(|p| p.schedulable_ranks())
                .cloned()
                .ok_or_else(|| SelectError::Unavailable("no ready worker in the pool".into()));
        };
        let key = PartitionKey {
            model: model.to_string(),
            routing_group: routing_group.to_string(),
        };
        if let Some(p) = partitions.get(&key) {
            if p.schedulable_ranks() > 0 {
                return Ok(Arc::clone(p));
            }
        }
        partitions
            .values()
            .find(|p| p.routing_group_is(routing_group) && p.serves_adapter(model))
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
        let partition = self.resolve_partition(request)?;
        crate::request::check_block_hashes(&request.prompt, partition.block_size())?;
        Ok(partition)
    }

    /// Computes a decision without booking anything (the API's `Select`).
    pub fn select(
        &self,
        request: &SelectionRequest,
        now: Instant,
    ) -> Result<(Selection, Facts), SelectError> {
        let partition = self.ensure_ready(request)?;
        let mut facts = Facts::default();
        let outcome = partition.select(request, None, false, &self.config, now, &mut facts)?;
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
        let (booking_id, generation) = self.claim(request, &partition)?;
        let mut facts = Facts::default();
        let booking = Some((booking_id.as_str(), generation));
        let gate = self.config.flow.enabled && request.holder == Holder::Api;
        match partition.select(request, booking, gate, &self.config, now, &mut facts) {
            Ok(outcome) => {
                self.record_trace(request, &outcome);
                Ok((outcome.selection, facts))
            }
            Err(err) => {
                self.unregister(&booking_id, Claim::Generation(generation));
                Err(err)
            }
        }
    }

    /// Flow control's entry point for stream requests: books now unless every eligible rank is
    /// saturated (or requests wait ahead of it), else queues the request ([`Admission::Queued`]).
    /// With flow control off, and for API requests, it is [`Core::select_and_reserve`]. The
    /// facts come back even on an error: the release pass may have placed other requests.
    pub fn admit(
        &self,
        request: &SelectionRequest,
        now: Instant,
    ) -> (Result<Admission, SelectError>, Facts) {
        if !self.config.flow.enabled || request.holder == Holder::Api {
            return match self.select_and_reserve(request, now) {
                Ok((s, f)) => (Ok(Admission::Dispatched(Box::new(s))), f),
                Err(e) => (Err(e), Facts::default()),
            };
        }
        let partition = match self.ensure_ready(request) {
            Ok(p) => p,
            Err(e) => return (Err(e), Facts::default()),
        };
        let ticket = self
            .tickets
            .fetch_add(1, Ordering::Relaxed)
            .saturating_add(1);
        self.waiting.insert(ticket, Arc::clone(&partition));
        let mut facts = Facts::default();
        let admitted = partition.admit(request, ticket, self, &self.config, now, &mut facts);
        self.forget_dequeued(&facts, 0);
        let result = match admitted {
            Ok(Admitted::Dispatched(outcome)) => {
                self.waiting.remove(&ticket);
                self.record_trace(request, &outcome);
                Ok(Admission::Dispatched(Box::new(outcome.selection)))
            }
            Ok(Admitted::Queued { deadline }) => Ok(Admission::Queued { ticket, deadline }),
            Err(e) => {
                self.waiting.remove(&ticket);
                Err(e)
            }
        };
        (result, facts)
    }

    /// A release pass over one partition's queue.
    fn pump_partition(&self, partition: &Arc<Partition>, now: Instant, facts: &mut Facts) {
        if partition.queue_len() == 0 {
            return;
        }
        let start = facts.0.len();
        self.release_passes.fetch_add(1, Ordering::Relaxed);
        partition.pump(self, &self.config, now, facts);
        self.forget_dequeued(facts, start);
    }

    fn forget_dequeued(&self, facts: &Facts, start: usize) {
        for fact in facts.0.iter().skip(start) {
            if let Fact::Dequeued { ticket, .. } = fact {
                self.waiting.remove(ticket);
            }
        }
    }

    /// A release pass over every queue (hosts call it on a timer: an engine reading going stale
    /// frees capacity without any operation; the replay calls it as its clock advances).
    pub fn pump(&self, now: Instant) -> Facts {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        let mut facts = Facts::default();
        for p in &partitions {
            self.pump_partition(p, now, &mut facts);
        }
        facts
    }

    /// The waiting request's client went away: it leaves the queue. False when it is no longer
    /// waiting (its outcome is, or is about to be, a [`Fact::Dequeued`]).
    pub fn cancel_waiting(&self, ticket: u64, now: Instant) -> (bool, Facts) {
        let mut facts = Facts::default();
        let cancelled = self
            .waiting
            .remove(&ticket)
            .is_some_and(|(_, p)| p.cancel(ticket, now, &mut facts));
        (cancelled, facts)
    }

    /// The waiting request's deadline passed: it leaves the queue with the error its client gets
    /// (429 sheddable or SLO, 503 otherwise); `None` when it is no longer waiting.
    pub fn expire_waiting(&self, ticket: u64, now: Instant) -> (Option<SelectError>, Facts) {
        let mut facts = Facts::default();
        let error = self
            .waiting
            .remove(&ticket)
            .and_then(|(_, p)| p.expire(ticket, &self.config, now, &mut facts));
        (error, facts)
    }

    /// Requests waiting in every queue.
    pub fn waiting_requests(&self) -> usize {
        self.waiting.len()
    }

    /// The earliest deadline of any waiting request.
    pub fn next_queue_deadline(&self) -> Option<Instant> {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        partitions
            .iter()
            .filter_map(|p| p.next_queue_deadline())
            .min()
    }

    /// Claims the request id in the registry with a fresh generation. A live duplicate is
    /// refused (API) or suffixed (ext_proc): `#2` first, then the generation, which no live
    /// booking has, so a claim takes O(1) tries however often an id repeats.
    fn claim(
        &self,
        request: &SelectionRequest,
        partition: &Arc<Partition>,
    ) -> Result<(String, u64), SelectError> {
        if request.holder == Holder::Api {
            let max = self.config.max_api_bookings;
            let taken = self
                .api_bookings
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < max).then(|| n.saturating_add(1))
                });
            if taken.is_err() {
                return Err(SelectError::Overloaded(format!(
                    "{max} API bookings are live; free some first"
                )));
            }
        }
        let mut id = request.request_id.clone();
        let mut duplicates: u32 = 0;
        loop {
            let generation = self
                .generations
                .fetch_add(1, Ordering::Relaxed)
                .saturating_add(1);
            match self.bookings.entry(id) {
                dashmap::Entry::Vacant(v) => {
                    let id = v.key().clone();
                    v.insert(Registered {
                        partition: Arc::clone(partition),
                        generation,
                        holder: request.holder,
                    });
                    return Ok((id, generation));
                }
                dashmap::Entry::Occupied(_) if request.on_duplicate == DuplicateId::Reject => {
                    if request.holder == Holder::Api {
                        self.api_bookings.fetch_sub(1, Ordering::AcqRel);
                    }
                    return Err(SelectError::Conflict(format!(
                        "request id {} already has a live booking",
                        clip(&request.request_id)
                    )));
                }
                dashmap::Entry::Occupied(_) => {
                    duplicates = duplicates.saturating_add(1);
                    id = if duplicates == 1 {
                        format!("{}#2", request.request_id)
                    } else {
                        format!("{}#{generation}", request.request_id)
                    };
                }
            }
        }
    }

    /// Removes a booking from the registry if `claim` names it; returns its generation and
    /// partition.
    fn unregister(&self, id: &str, claim: Claim) -> Option<(u64, Arc<Partition>)> {
        let (_, entry) = self.bookings.remove_if(id, |_, r| r.answers(claim))?;
        if entry.holder == Holder::Api {
            self.api_bookings.fetch_sub(1, Ordering::AcqRel);
        }
        Some((entry.generation, entry.partition))
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

    fn booked(&self, id: &str, claim: Claim) -> Option<(u64, Arc<Partition>)> {
        let entry = self.bookings.get(id).filter(|r| r.answers(claim))?;
        Some((entry.generation, Arc::clone(&entry.partition)))
    }

    /// Marks the booking's prefill as done (first response byte at `now`; the time since the
    /// pick calibrates the TTFT estimator). Unknown ids are ignored.
    pub fn mark_prefill_complete(
        &self,
        booking_id: &str,
        claim: Claim,
        now: Instant,
    ) -> (bool, Facts) {
        let mut facts = Facts::default();
        let Some((generation, p)) = self.booked(booking_id, claim) else {
            return (false, facts);
        };
        let marked = p.prefill_complete(&(booking_id.to_string(), generation), now, &mut facts);
        // Nothing freed (a repeated first byte): no release pass.
        if marked == Some(true) {
            self.pump_partition(&p, now, &mut facts);
        }
        (marked.is_some(), facts)
    }

    /// How the picked rank answered the booking's request (its response status, or a reset
    /// before any response): outlier detection, and whether its first byte is a TTFT sample
    /// (only 2xx). Only the first answer counts; unknown ids are ignored.
    pub fn record_response(
        &self,
        booking_id: &str,
        claim: Claim,
        class: crate::facts::ResponseClass,
        now: Instant,
    ) -> (bool, Facts) {
        let mut facts = Facts::default();
        let recorded = self
            .booked(booking_id, claim)
            .is_some_and(|(generation, p)| {
                p.record_response(
                    &(booking_id.to_string(), generation),
                    class,
                    &self.config,
                    now,
                    &mut facts,
                )
            });
        (recorded, facts)
    }

    /// The booking's response ended after `output_tokens` tokens (call before freeing it): its
    /// decode speed calibrates the TPOT estimator and settles its TPOT SLO. Unknown ids are
    /// ignored.
    pub fn decode_complete(
        &self,
        booking_id: &str,
        claim: Claim,
        output_tokens: u64,
        now: Instant,
    ) -> (bool, Facts) {
        let mut facts = Facts::default();
        let done = self
            .booked(booking_id, claim)
            .is_some_and(|(generation, p)| {
                p.decode_complete(
                    &(booking_id.to_string(), generation),
                    output_tokens,
                    now,
                    &mut facts,
                )
            });
        (done, facts)
    }

    /// Frees a booking exactly once; unknown, repeated or foreign frees (a claim that does not
    /// name the id's current booking) are no-ops returning false.
    pub fn free(&self, booking_id: &str, claim: Claim, now: Instant) -> (bool, Facts) {
        let mut facts = Facts::default();
        let Some((generation, partition)) = self.unregister(booking_id, claim) else {
            return (false, facts);
        };
        let freed = partition.free(&(booking_id.to_string(), generation), now, &mut facts);
        if freed {
            self.pump_partition(&partition, now, &mut facts);
        }
        (freed, facts)
    }

    /// Moves a booking to the endpoint that actually served it (Envoy may fall back).
    pub fn move_booking(
        &self,
        booking_id: &str,
        claim: Claim,
        served: SocketAddr,
    ) -> (bool, Facts) {
        let mut facts = Facts::default();
        let Some((generation, p)) = self.booked(booking_id, claim) else {
            return (false, facts);
        };
        let moved = p.move_booking(&(booking_id.to_string(), generation), served, &mut facts);
        (moved, facts)
    }

    /// Reaps API bookings older than `booking_ttl` (streams free their own), expired index
    /// entries and idle sessions; returns the bookings reaped.
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
            let freed_any = !ids.is_empty();
            for (id, generation) in ids {
                self.unregister(&id, Claim::Generation(generation));
                reaped = reaped.saturating_add(1);
            }
            // Only reaped bookings free capacity here; time-driven changes (expiry, engine
            // readings going stale) are the host's timer pass ([`Core::pump`]).
            if freed_any {
                self.pump_partition(&p, now, &mut facts);
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
    pub fn apply_kv_events(
        &self,
        rank: RankKey,
        events: &[KvEvent],
        now: Instant,
    ) -> (EventStats, Facts) {
        let mut facts = Facts::default();
        let Some(partition) = self.partition_of_worker(rank.worker_id) else {
            // Not counted as facts: the rank is not (or no longer) in the catalog.
            let stats = EventStats {
                dropped: events.len() as u64,
                ..EventStats::default()
            };
            return (stats, facts);
        };
        let stats = partition.apply_events(rank, events, now, &mut facts);
        facts.push(Fact::KvEvents {
            applied: stats.applied,
            dropped: stats.dropped,
            block_size_mismatches: stats.block_size_mismatches,
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

    /// Stores one engine-metrics reading of a rank (the host's scraper calls this after each
    /// scrape). False when the rank is not in the catalog (it left while the scrape ran).
    pub fn record_engine_metrics(&self, rank: RankKey, metrics: crate::EngineMetrics) -> bool {
        self.partition_of_worker(rank.worker_id)
            .is_some_and(|p| p.record_engine_metrics(rank, metrics))
    }

    fn partition_of_worker(&self, worker_id: u64) -> Option<Arc<Partition>> {
        let key = self.catalog.lock().record(worker_id)?.partition_key();
        self.partitions.read().get(&key).cloned()
    }

    /// Sets the load other replicas of the picker booked, per rank (a rank not named has none).
    /// It is added to this process's own bookings wherever load is read for a decision.
    pub fn set_remote_loads(&self, loads: &HashMap<RankKey, RankLoad>) {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        for p in partitions {
            p.set_remote_loads(loads);
        }
    }

    /// This process's own booked load of every rank that has any (what it tells other replicas).
    pub fn local_loads(&self) -> Vec<(RankKey, RankLoad)> {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        let mut out = Vec::new();
        for p in partitions {
            p.local_loads(&mut out);
        }
        out
    }

    /// The partition a request for `model` resolves to and the session's binding there, if any.
    /// `None` when no partition serves the model (the pick will fail anyway).
    pub fn session_binding(
        &self,
        model: Option<&str>,
        routing_group: &str,
        sid: &str,
        now: Instant,
    ) -> Option<(PartitionKey, Option<RankKey>, Facts)> {
        let partition = self.resolve_partition_of(model, routing_group).ok()?;
        let mut facts = Facts::default();
        let rank = partition.bound_session(sid, now, self.config.sessions.ttl, &mut facts);
        Some(((*partition.key).clone(), rank, facts))
    }

    /// Installs a session binding decided elsewhere (another replica): later picks of the
    /// session follow it like a binding made here. Not installed when the partition or rank is
    /// unknown here or the session table is full of sessions with requests in flight.
    pub fn install_session_binding(
        &self,
        key: &PartitionKey,
        sid: &str,
        rank: RankKey,
        now: Instant,
    ) -> (crate::session::Installed, Facts) {
        let mut facts = Facts::default();
        let Some(partition) = self.partitions.read().get(key).cloned() else {
            return (crate::session::Installed::UnknownRank, facts);
        };
        let max = self.config.sessions.max_entries;
        let installed = partition.install_session(sid, rank, now, max, &mut facts);
        (installed, facts)
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
        crate::request::check_block_hashes(&request.prompt, partition.block_size())?;
        Ok(partition.overlaps(request, self.config.max_prompt_blocks, now))
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

#[cfg(test)]
mod booking_tests {
    use super::*;
    use crate::catalog::RankLayout;
    use crate::request::PromptInput;
    use crate::session::SessionOutcome;
    use std::time::Duration;

    fn core_with(config: CoreConfig) -> Core {
        let core = Core::new(config);
        let specs = vec![
            WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![1])),
            WorkerSpec::for_test("b", "m", RankLayout::PerPort(vec![2])),
        ];
        core.apply_source_snapshot("catalog", specs, Instant::now())
            .unwrap();
        core
    }

    fn request(id: &str, holder: Holder) -> SelectionRequest {
        SelectionRequest {
            request_id: id.into(),
            model: Some("m".into()),
            prompt: PromptInput::Tokens(vec![7; 64]),
            holder,
            on_duplicate: if holder == Holder::Api {
                DuplicateId::Reject
            } else {
                DuplicateId::Suffix
            },
            ..Default::default()
        }
    }

    fn inflight(core: &Core) -> u64 {
        core.list_workers(None)
            .iter()
            .flat_map(|w| &w.loads)
            .map(|l| l.active_requests)
            .sum()
    }

    fn key_of(core: &Core, name: &str) -> RankKey {
        let record = core
            .records()
            .into_iter()
            .find(|r| r.spec.name == name)
            .unwrap();
        RankKey {
            worker_id: record.id,
            dp_rank: 0,
        }
    }

    /// Another replica's load steers picks here; this process reports only its own bookings.
    #[test]
    fn remote_load_steers_picks_and_local_loads_report_only_own_bookings() {
        let core = core_with(CoreConfig::default());
        let now = Instant::now();
        let (a, b) = (key_of(&core, "a"), key_of(&core, "b"));
        let busy = RankLoad {
            active_prefill_tokens: 0,
            active_decode_blocks: 400,
            active_requests: 12,
        };
        core.set_remote_loads(&HashMap::from([(a, busy)]));
        for i in 0..8 {
            let (s, _) = core
                .select_and_reserve(&request(&format!("r{i}"), Holder::Api), now)
                .unwrap();
            assert_eq!(s.primary.key, b, "pick {i} avoids the remotely loaded rank");
            core.free(&s.booking_id, Claim::Any, now);
        }
        let (s, _) = core
            .select_and_reserve(&request("held", Holder::Api), now)
            .unwrap();
        let local = core.local_loads();
        assert_eq!(local.len(), 1, "{local:?}");
        assert_eq!((local[0].0, local[0].1.active_requests), (b, 1));
        core.free(&s.booking_id, Claim::Any, now);
        core.set_remote_loads(&HashMap::new());
        assert!(core.local_loads().is_empty());
        let picks: std::collections::HashSet<RankKey> = (0..32)
            .map(|i| {
                let mut r = request(&format!("q{i}"), Holder::Api);
                r.prompt = PromptInput::Tokens(vec![1000 + i; 64]);
                let (s, _) = core.select(&r, now).unwrap();
                s.primary.key
            })
            .collect();
        assert_eq!(picks.len(), 2, "the remote load is gone: ties again");
    }

    /// A binding installed from elsewhere is followed like one made here, and reported by
    /// `session_binding`; an unknown rank is refused.
    #[test]
    fn an_installed_session_binding_is_followed() {
        let core = core_with(CoreConfig::default());
        let now = Instant::now();
        let (a, b) = (key_of(&core, "a"), key_of(&core, "b"));
        let (key, bound, _) = core.session_binding(Some("m"), "", "s1", now).unwrap();
        assert_eq!(bound, None);
        let stranger = RankKey {
            worker_id: 999,
            dp_rank: 0,
        };
        assert_eq!(
            core.install_session_binding(&key, "s1", stranger, now).0,
            crate::session::Installed::UnknownRank
        );
        for target in [a, b] {
            assert!(core
                .install_session_binding(&key, "s1", target, now)
                .0
                .is_yes());
            for i in 0..4 {
                let mut r = request(&format!("{target:?}{i}"), Holder::Api);
                r.session_id = Some("s1".into());
                let (s, _) = core.select_and_reserve(&r, now).unwrap();
                assert_eq!(s.primary.key, target);
                assert_eq!(s.session, Some(SessionOutcome::Reused));
            }
            assert_eq!(
                core.session_binding(Some("m"), "", "s1", now).unwrap().1,
                Some(target)
            );
        }
        assert!(core.session_binding(Some("other"), "", "s1", now).is_none());
    }

    /// An API booking expires and its id is reused by a new booking: the first holder's late
    /// free (its own generation) must not free the second.
    #[test]
    fn a_stale_free_never_frees_a_newer_booking_of_the_same_id() {
        let core = core_with(CoreConfig::default());
        let t0 = Instant::now();
        let (first, _) = core
            .select_and_reserve(&request("r", Holder::Api), t0)
            .unwrap();
        let (reaped, _) = core.reap_expired(t0 + Duration::from_secs(301));
        assert_eq!(reaped, 1);
        let (second, _) = core
            .select_and_reserve(&request("r", Holder::Api), t0)
            .unwrap();
        assert_eq!(second.booking_id, "r", "the id is free again");
        assert_ne!(first.generation, second.generation);
        let (freed, _) = core.free("r", Claim::Generation(first.generation), t0);
        assert!(
            !freed,
            "the first holder's free names a booking that is gone"
        );
        assert_eq!(inflight(&core), 1, "the second booking still counts");
        let (freed, _) = core.free("r", Claim::Generation(second.generation), t0);
        assert!(freed);
        assert_eq!((inflight(&core), core.live_bookings()), (0, 0));
    }

    /// A worker leaves with a booking, the id is booked again on another worker, then the catalog
    /// pass that dropped the first forgets it: the registry must keep the new booking.
    #[test]
    fn dropping_a_worker_forgets_only_its_own_generation() {
        let core = core_with(CoreConfig::default());
        let now = Instant::now();
        let (first, _) = core
            .select_and_reserve(&request("r", Holder::Stream), now)
            .unwrap();
        let gone = first.primary.worker_name.clone();
        let keep = if gone == "a" { "b" } else { "a" };
        core.delete_source_worker("catalog", &gone, now).unwrap();
        assert_eq!(core.live_bookings(), 0);
        let (second, _) = core
            .select_and_reserve(&request("r", Holder::Stream), now)
            .unwrap();
        assert_eq!(second.primary.worker_name, keep);
        // A late free of the first booking (its stream ends now) is a no-op.
        assert!(!core.free("r", Claim::Generation(first.generation), now).0);
        assert_eq!(inflight(&core), 1);
        assert!(core.free("r", Claim::Generation(second.generation), now).0);
    }

    #[test]
    fn the_api_frees_only_api_bookings_and_holds_a_bounded_number() {
        let core = core_with(CoreConfig {
            max_api_bookings: 2,
            ..CoreConfig::default()
        });
        let now = Instant::now();
        let (stream, _) = core
            .select_and_reserve(&request("s", Holder::Stream), now)
            .unwrap();
        assert!(
            !core.free("s", Claim::HeldBy(Holder::Api), now).0,
            "not the API's"
        );
        assert!(
            !core
                .mark_prefill_complete("s", Claim::HeldBy(Holder::Api), now)
                .0
        );
        assert_eq!(inflight(&core), 1);
        core.select_and_reserve(&request("x", Holder::Api), now)
            .unwrap();
        core.select_and_reserve(&request("y", Holder::Api), now)
            .unwrap();
        let err = core
            .select_and_reserve(&request("z", Holder::Api), now)
            .unwrap_err();
        assert_eq!(err.label(), "overloaded", "{err}");
        assert!(core.free("y", Claim::HeldBy(Holder::Api), now).0);
        // A refused duplicate does not use up the bound: "z" still fits after it.
        assert_eq!(
            core.select_and_reserve(&request("x", Holder::Api), now)
                .unwrap_err()
                .label(),
            "conflict"
        );
        core.select_and_reserve(&request("z", Holder::Api), now)
            .unwrap();
        assert!(core.free("s", Claim::Generation(stream.generation), now).0);
    }

    #[test]
    fn only_api_bookings_expire() {
        let core = core_with(CoreConfig::default());
        let t0 = Instant::now();
        core.select_and_reserve(&request("s", Holder::Stream), t0)
            .unwrap();
        core.select_and_reserve(&request("a", Holder::Api), t0)
            .unwrap();
        let (reaped, _) = core.reap_expired(t0 + Duration::from_secs(3_600));
        assert_eq!(reaped, 1);
        assert_eq!(core.live_bookings(), 1);
        assert_eq!(inflight(&core), 1);
    }

    /// Repeated live ids are suffixed in O(1) tries: `#2`, then the generation.
    #[test]
    fn repeated_ids_get_distinct_suffixes() {
        let core = core_with(CoreConfig::default());
        let now = Instant::now();
        let ids: Vec<String> = (0..50)
            .map(|_| {
                core.select_and_reserve(&request("dup", Holder::Stream), now)
                    .unwrap()
                    .0
                    .booking_id
            })
            .collect();
        assert_eq!(ids[0], "dup");
        assert_eq!(ids[1], "dup#2");
        let distinct: std::collections::HashSet<&String> = ids.iter().collect();
        assert_eq!(distinct.len(), 50);
        assert_eq!(core.live_bookings(), 50);
    }
}

#[cfg(test)]
mod lifecycle_tests {
    use super::*;
    use crate::catalog::RankLayout;
    use crate::event::{KvEvent, Medium};
    use crate::request::PromptInput;
    use crate::types::Lifecycle;

    const BS: usize = 16;

    fn worker(name: &str, port: u16) -> WorkerSpec {
        WorkerSpec {
            block_size: Some(BS as u32),
            kv_events: Some(format!("tcp://127.0.0.1:{}", 5557 + port)),
            ..WorkerSpec::for_test(name, "m", RankLayout::PerPort(vec![port]))
        }
    }

    fn rank(spec: &WorkerSpec) -> RankKey {
        RankKey {
            worker_id: spec.worker_id(),
            dp_rank: 0,
        }
    }

    fn tokens() -> Vec<u32> {
        (0..(4 * BS) as u32).collect()
    }

    /// The engine announces the prompt's four blocks.
    fn announce(core: &Core, spec: &WorkerSpec) {
        let event = KvEvent::BlockStored {
            block_hashes: vec![11, 12, 13, 14],
            parent_block_hash: None,
            token_ids: tokens(),
            block_size: BS as u32,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            cache_salt: None,
            group_idx: None,
        };
        let (stats, _) = core.apply_kv_events(rank(spec), &[event], Instant::now());
        assert_eq!(stats.applied, 1);
    }

    fn overlap_on(core: &Core, name: &str) -> u32 {
        let request = SelectionRequest {
            model: Some("m".into()),
            prompt: PromptInput::Tokens(tokens()),
            ..Default::default()
        };
        let (_, ranks) = core.overlap_scores(&request, Instant::now()).unwrap();
        ranks
            .iter()
            .find(|(r, _)| r.worker_name == name)
            .map_or(0, |(_, d)| d.gpu)
    }

    fn apply(core: &Core, specs: Vec<WorkerSpec>) -> ApplyReport {
        core.apply_source_snapshot("catalog", specs, Instant::now())
            .unwrap()
            .0
    }

    #[test]
    fn a_worker_that_leaves_and_returns_with_a_fresh_engine_has_no_phantom_cache() {
        let core = Core::new(CoreConfig::default());
        let (a, b) = (worker("a", 1), worker("b", 2));
        apply(&core, vec![a.clone(), b.clone()]);
        announce(&core, &a);
        assert_eq!(overlap_on(&core, "a"), 4);
        apply(&core, vec![b.clone()]);
        apply(&core, vec![a.clone(), b]);
        assert_eq!(
            overlap_on(&core, "a"),
            0,
            "the old engine's blocks left with it"
        );
    }

    #[test]
    fn a_new_incarnation_forgets_the_cache_and_a_metadata_change_does_not() {
        let core = Core::new(CoreConfig::default());
        let a = worker("a", 1);
        apply(&core, vec![a.clone()]);
        announce(&core, &a);
        let relabelled = WorkerSpec {
            lora_adapters: vec!["x".into()],
            ..a.clone()
        };
        apply(&core, vec![relabelled.clone()]);
        assert_eq!(overlap_on(&core, "a"), 4, "same engine, new metadata");
        let restarted = WorkerSpec {
            incarnation: 7,
            ..relabelled
        };
        apply(&core, vec![restarted]);
        assert_eq!(overlap_on(&core, "a"), 0, "the engine restarted");
    }

    #[test]
    fn a_draining_worker_keeps_its_load_until_it_is_ready_again_or_deleted() {
        let core = Core::new(CoreConfig::default());
        let (a, b) = (worker("a", 1), worker("b", 2));
        apply(&core, vec![a.clone(), b.clone()]);
        let request = |id: &str| SelectionRequest {
            request_id: id.into(),
            model: Some("m".into()),
            subset: Some(crate::request::EndpointFilter::parse(["127.0.0.1:1"])),
            ..Default::default()
        };
        let now = Instant::now();
        let (booked, _) = core.select_and_reserve(&request("r"), now).unwrap();
        assert_eq!(booked.primary.worker_name, "a");
        let load_of_a = |core: &Core| {
            core.list_workers(None)
                .into_iter()
                .find(|w| w.record.spec.name == "a")
                .map(|w| (w.record.lifecycle, w.loads[0].active_requests))
        };
        let draining = WorkerSpec {
            draining: true,
            ..a.clone()
        };
        let report = apply(&core, vec![draining, b.clone()]);
        assert!(report.ready, "b is still schedulable");
        assert_eq!(load_of_a(&core), Some((Lifecycle::Draining, 1)));
        assert_eq!(core.live_bookings(), 1);
        let err = core.select(&request("x"), now).unwrap_err();
        assert_eq!(err.label(), "unavailable", "a draining rank is not picked");
        apply(&core, vec![a.clone(), b.clone()]);
        assert_eq!(
            load_of_a(&core),
            Some((Lifecycle::Schedulable, 1)),
            "back from a readiness flap with its in-flight load"
        );
        apply(&core, vec![b]);
        assert_eq!(load_of_a(&core), None);
        assert_eq!(core.live_bookings(), 0, "deleted: its bookings go");
    }

    fn overlap_at(core: &Core, name: &str, tokens: Vec<u32>, now: Instant) -> u32 {
        let request = SelectionRequest {
            model: Some("m".into()),
            prompt: PromptInput::Tokens(tokens),
            ..Default::default()
        };
        let (_, ranks) = core.overlap_scores(&request, now).unwrap();
        ranks
            .iter()
            .find(|(r, _)| r.worker_name == name)
            .map_or(0, |(_, d)| d.gpu)
    }

    /// A worker that declares a KV-event endpoint but whose engine publishes nothing is routed in
    /// approximate mode (picks remembered for `approx_ttl`), not silently with 2 s predictions.
    #[test]
    fn a_rank_is_precise_only_once_its_events_arrive() {
        let config = CoreConfig {
            kv_events: true,
            ..CoreConfig::default()
        };
        let core = Core::new(config);
        let a = worker("a", 1);
        apply(&core, vec![a.clone()]);
        let t0 = Instant::now();
        let pick = |id: &str, tokens: Vec<u32>| {
            let request = SelectionRequest {
                request_id: id.into(),
                model: Some("m".into()),
                prompt: PromptInput::Tokens(tokens),
                ..Default::default()
            };
            let (s, facts) = core.select_and_reserve(&request, t0).unwrap();
            core.free(&s.booking_id, Claim::Any, t0);
            facts
        };
        let silent: Vec<u32> = (1_000..1_000 + 4 * BS as u32).collect();
        pick("r1", silent.clone());
        let later = t0 + std::time::Duration::from_secs(10);
        assert_eq!(
            overlap_at(&core, "a", silent.clone(), later),
            4,
            "no events yet: the pick is remembered past the 2 s prediction"
        );
        announce(&core, &a);
        let (_, facts) = core.apply_kv_events(rank(&a), &[], t0);
        assert!(facts.iter().all(|f| !matches!(f, Fact::RankPrecise { .. })));
        let fresh: Vec<u32> = (5_000..5_000 + 4 * BS as u32).collect();
        pick("r2", fresh.clone());
        assert_eq!(
            overlap_at(&core, "a", fresh, later),
            0,
            "precise: a prediction lives only until the engine's events could confirm it"
        );
    }

    #[test]
    fn the_block_size_is_learned_from_events_and_mismatches_are_counted() {
        let core = Core::new(CoreConfig::default());
        let a = WorkerSpec {
            block_size: None,
            ..worker("a", 1)
        };
        apply(&core, vec![a.clone()]);
        let key = PartitionKey {
            model: "m".into(),
            routing_group: String::new(),
        };
        assert_eq!(core.block_size(&key), DEFAULT_BLOCK_SIZE);
        let tokens: Vec<u32> = (0..128).collect();
        let store = |hashes: Vec<u64>, tokens: Vec<u32>, size: u32| KvEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: None,
            token_ids: tokens,
            block_size: size,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            cache_salt: None,
            group_idx: None,
        };
        let now = Instant::now();
        let (stats, _) =
            core.apply_kv_events(rank(&a), &[store(vec![1, 2], tokens.clone(), 64)], now);
        assert_eq!((stats.applied, stats.block_size_mismatches), (1, 0));
        assert_eq!(core.block_size(&key), 64, "learned from the engine");
        assert_eq!(overlap_at(&core, "a", tokens.clone(), now), 2);
        let (stats, facts) =
            core.apply_kv_events(rank(&a), &[store(vec![3], (0..16).collect(), 16)], now);
        assert_eq!((stats.dropped, stats.block_size_mismatches), (1, 1));
        assert!(facts.iter().any(|f| matches!(
            f,
            Fact::KvEvents {
                block_size_mismatches: 1,
                ..
            }
        )));
    }

    /// vLLM mixes `cache_salt` into the first block: salted requests match only blocks stored
    /// under the same salt, and unsalted requests never match salted blocks.
    #[test]
    fn salted_blocks_match_only_requests_with_the_same_salt() {
        let core = Core::new(CoreConfig::default());
        let (a, b) = (worker("a", 1), worker("b", 2));
        apply(&core, vec![a.clone(), b.clone()]);
        let store = |salt: Option<&str>| KvEvent::BlockStored {
            block_hashes: vec![1, 2, 3, 4],
            parent_block_hash: None,
            token_ids: tokens(),
            block_size: BS as u32,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            cache_salt: salt.map(str::to_owned),
            group_idx: None,
        };
        let now = Instant::now();
        core.apply_kv_events(rank(&a), &[store(Some("tenant-1"))], now);
        core.apply_kv_events(rank(&b), &[store(None)], now);
        let overlaps = |salt: Option<&str>| {
            let request = SelectionRequest {
                model: Some("m".into()),
                prompt: PromptInput::Tokens(tokens()),
                cache_salt: salt.map(str::to_owned),
                ..Default::default()
            };
            let (_, ranks) = core.overlap_scores(&request, now).unwrap();
            let mut out: Vec<(String, u32)> = ranks
                .into_iter()
                .map(|(r, d)| (r.worker_name, d.gpu))
                .collect();
            out.sort();
            out
        };
        assert_eq!(
            overlaps(Some("tenant-1")),
            [("a".into(), 4), ("b".into(), 0)]
        );
        assert_eq!(overlaps(None), [("a".into(), 0), ("b".into(), 4)]);
        assert_eq!(
            overlaps(Some("tenant-2")),
            [("a".into(), 0), ("b".into(), 0)]
        );
    }
}

#[cfg(test)]
mod calibration_tests {
    //! The TTFT estimator end to end through the core: first tokens observed through
    //! `mark_prefill_complete` steer later picks.
    use super::*;
    use crate::catalog::RankLayout;
    use crate::request::PromptInput;
    use std::time::Duration;

    fn core(calibrate: bool) -> (Core, Instant) {
        let core = Core::new(CoreConfig {
            seed: Some(7),
            estimator: crate::estimate::EstimatorConfig {
                calibrate,
                ..Default::default()
            },
            ..CoreConfig::default()
        });
        let t0 = Instant::now();
        let specs = vec![
            WorkerSpec::for_test("fast", "m", RankLayout::PerPort(vec![8001])),
            WorkerSpec::for_test("slow", "m", RankLayout::PerPort(vec![8002])),
        ];
        core.apply_source_snapshot("catalog", specs, t0).unwrap();
        (core, t0)
    }

    /// Distinct prompts of 500..=4000 tokens (no shared prefix, so only speed tells the ranks
    /// apart), each served alone: `slow` takes three times as long to its first token.
    fn run(core: &Core, t0: Instant, requests: u32) -> [u32; 2] {
        let mut picks = [0u32; 2];
        let mut now = t0;
        for i in 0..requests {
            let len = 500 + (i * 37) % 3501;
            let request = SelectionRequest {
                request_id: format!("r{i}"),
                model: Some("m".into()),
                prompt: PromptInput::Tokens((0..len).map(|t| t + i * 1000).collect()),
                ..Default::default()
            };
            let (selection, _) = core.select_and_reserve(&request, now).unwrap();
            let slow = selection.primary.worker_name == "slow";
            picks[usize::from(slow)] += 1;
            let per_token = if slow { 150 } else { 50 };
            let ttft = Duration::from_micros(5_000 + per_token * u64::from(len));
            now += ttft;
            assert!(
                core.mark_prefill_complete(&request.request_id, Claim::Any, now)
                    .0
            );
            now += Duration::from_millis(1);
            assert!(core.free(&request.request_id, Claim::Any, now).0);
        }
        picks
    }

    #[test]
    fn a_rank_observed_slower_loses_its_share_of_idle_picks() {
        let (calibrated, t0) = core(true);
        // Until the slow rank has been seen slow enough, ties split; then the fast rank wins.
        run(&calibrated, t0, 200);
        let [fast, slow] = run(&calibrated, t0, 200);
        assert!(fast >= 180, "fast {fast} slow {slow}");
        // Without calibration both look the same: ties split evenly.
        let (blind, t0) = core(false);
        let [fast, slow] = run(&blind, t0, 400);
        assert!((150..=250).contains(&fast), "fast {fast} slow {slow}");
    }
}

#[cfg(test)]
mod flow_tests {
    //! Flow control through [`Core`]: admission, release order, fairness, expiry, cancellation
    //! and SLOs, with explicit instants (the core has no clock).
    use super::*;
    use crate::catalog::RankLayout;
    use crate::facts::{QueueEvent, QueueExit};
    use crate::flow::{FlowConfig, SaturationLimits};
    use crate::request::PromptInput;
    use std::time::Duration;

    /// One rank that takes `per_rank` requests before it is saturated.
    fn core_with(per_rank: u64, workers: &[&str], flow: FlowConfig) -> Core {
        let core = Core::new(CoreConfig {
            seed: Some(1),
            flow: FlowConfig {
                saturation: SaturationLimits {
                    max_wait_seconds: None,
                    max_active_requests: Some(per_rank),
                    engine_waiting: None,
                    engine_kv_usage: None,
                },
                ..flow
            },
            ..CoreConfig::default()
        });
        let specs = workers
            .iter()
            .enumerate()
            .map(|(i, name)| {
                WorkerSpec::for_test(name, "m", RankLayout::PerPort(vec![8000 + i as u16]))
            })
            .collect();
        core.apply_source_snapshot("catalog", specs, Instant::now())
            .unwrap();
        core
    }

    fn request(id: &str, priority: i32, key: &str) -> SelectionRequest {
        SelectionRequest {
            request_id: id.into(),
            model: Some("m".into()),
            prompt: PromptInput::Tokens(vec![7; 64]),
            priority,
            fairness_key: Some(key.into()),
            ..Default::default()
        }
    }

    fn dispatched(core: &Core, r: &SelectionRequest, now: Instant) -> Selection {
        match core.admit(r, now).0 {
            Ok(Admission::Dispatched(s)) => *s,
            other => panic!("expected a dispatch, got {other:?}"),
        }
    }

    fn queued(core: &Core, r: &SelectionRequest, now: Instant) -> u64 {
        match core.admit(r, now).0 {
            Ok(Admission::Queued { ticket, .. }) => ticket,
            other => panic!("expected to queue, got {other:?}"),
        }
    }

    /// The tickets released in `facts`, in order, with their outcomes.
    fn released(facts: &Facts) -> Vec<(u64, Result<Selection, SelectError>)> {
        facts
            .iter()
            .filter_map(|f| match f {
                Fact::Dequeued { ticket, result } => Some((*ticket, result.clone().map(|s| *s))),
                _ => None,
            })
            .collect()
    }

    fn free(core: &Core, s: &Selection, now: Instant) -> Facts {
        let (freed, facts) = core.free(&s.booking_id, Claim::Generation(s.generation), now);
        assert!(freed);
        facts
    }

    #[test]
    fn a_saturated_fleet_queues_and_a_freed_booking_releases_the_next() {
        let core = core_with(1, &["a"], FlowConfig::default());
        let now = Instant::now();
        let first = dispatched(&core, &request("r1", 0, ""), now);
        let ticket = queued(&core, &request("r2", 0, ""), now);
        assert_eq!(core.waiting_requests(), 1);
        assert_eq!(
            core.live_bookings(),
            1,
            "a waiting request holds no booking"
        );
        let facts = free(&core, &first, now + Duration::from_millis(5));
        let out = released(&facts);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, ticket);
        let second = out[0].1.clone().unwrap();
        assert_eq!(second.booking_id, "r2");
        assert_eq!(core.live_bookings(), 1);
        assert_eq!(core.waiting_requests(), 0);
        assert!(facts.iter().any(|f| matches!(
            f,
            Fact::Queue { event: QueueEvent::Dispatched { waited_seconds }, .. }
                if (*waited_seconds - 0.005).abs() < 1e-9
        )));
        // The released booking is an ordinary one: freed once, then gone.
        free(&core, &second, now);
        assert_eq!(core.live_bookings(), 0);
        assert!(!core.free("r2", Claim::Any, now).0);
    }

    #[test]
    fn release_is_by_priority_band_then_arrival() {
        let core = core_with(1, &["a"], FlowConfig::default());
        let now = Instant::now();
        let mut running = dispatched(&core, &request("busy", 0, ""), now);
        let low = queued(&core, &request("low", -1, ""), now);
        let normal1 = queued(&core, &request("normal1", 0, ""), now);
        let high = queued(&core, &request("high", 5, ""), now);
        let normal2 = queued(&core, &request("normal2", 0, ""), now);
        let mut order = Vec::new();
        for _ in 0..4 {
            let out = released(&free(&core, &running, now));
            assert_eq!(out.len(), 1);
            order.push(out[0].0);
            running = out[0].1.clone().unwrap();
        }
        assert_eq!(order, vec![high, normal1, normal2, low]);
    }

    #[test]
    fn two_tenants_share_a_band_equally_while_both_are_backlogged() {
        let core = core_with(1, &["a"], FlowConfig::default());
        let now = Instant::now();
        let mut running = dispatched(&core, &request("busy", 0, ""), now);
        let mut tenant_of = HashMap::new();
        // 4:1 arrivals, interleaved as they would arrive.
        for i in 0..50 {
            let key = if i % 5 == 4 { "small" } else { "big" };
            tenant_of.insert(queued(&core, &request(&format!("r{i}"), 0, key), now), key);
        }
        let mut small = 0;
        for _ in 0..20 {
            let out = released(&free(&core, &running, now));
            let (ticket, result) = out.into_iter().next().unwrap();
            small += usize::from(tenant_of[&ticket] == "small");
            running = result.unwrap();
        }
        // Both backlogged (small has 10 waiting): each gets half of the 20 releases.
        assert_eq!(small, 10);
    }

    #[test]
    fn the_queue_timeout_gives_503_or_429_for_sheddable_requests() {
        let flow = FlowConfig {
            queue_timeout: Duration::from_secs(2),
            ..FlowConfig::default()
        };
        let core = core_with(1, &["a"], flow);
        let now = Instant::now();
        let _running = dispatched(&core, &request("busy", 0, ""), now);
        let normal = queued(&core, &request("normal", 0, ""), now);
        let sheddable = queued(&core, &request("sheddable", -1, ""), now);
        assert_eq!(
            core.next_queue_deadline(),
            Some(now + Duration::from_secs(2))
        );
        assert!(released(&core.pump(now + Duration::from_secs(1))).is_empty());
        let facts = core.pump(now + Duration::from_secs(2));
        let out: HashMap<u64, SelectError> = released(&facts)
            .into_iter()
            .map(|(t, r)| (t, r.unwrap_err()))
            .collect();
        assert_eq!(out[&normal].label(), "unavailable");
        assert!(
            out[&normal].to_string().contains("queue timeout"),
            "{}",
            out[&normal]
        );
        assert_eq!(out[&sheddable].label(), "overloaded");
        assert_eq!(core.waiting_requests(), 0);
        let timeouts = facts
            .iter()
            .filter(|f| {
                matches!(
                    f,
                    Fact::Queue {
                        event: QueueEvent::Left {
                            exit: QueueExit::Timeout,
                            ..
                        },
                        ..
                    }
                )
            })
            .count();
        assert_eq!(timeouts, 2);
    }

    #[test]
    fn the_hosts_timer_expires_one_request_and_only_once() {
        let core = core_with(1, &["a"], FlowConfig::default());
        let now = Instant::now();
        let running = dispatched(&core, &request("busy", 0, ""), now);
        let t = queued(&core, &request("late", 0, ""), now);
        let (error, _) = core.expire_waiting(t, now + Duration::from_secs(30));
        assert_eq!(error.unwrap().label(), "unavailable");
        assert!(core.expire_waiting(t, now).0.is_none());
        assert!(released(&free(&core, &running, now)).is_empty());
    }

    #[test]
    fn a_cancelled_request_leaves_the_queue_and_is_never_booked() {
        let core = core_with(1, &["a"], FlowConfig::default());
        let now = Instant::now();
        let running = dispatched(&core, &request("busy", 0, ""), now);
        let gone = queued(&core, &request("gone", 0, ""), now);
        let next = queued(&core, &request("next", 0, ""), now);
        assert!(core.cancel_waiting(gone, now).0);
        assert!(!core.cancel_waiting(gone, now).0, "cancelled once");
        let out = released(&free(&core, &running, now));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, next);
        assert_eq!(core.live_bookings(), 1);
        // Cancelling a request that was already released does nothing (the host frees its
        // booking through the released reservation).
        assert!(!core.cancel_waiting(next, now).0);
    }

    #[test]
    fn a_full_band_refuses_at_once() {
        let flow = FlowConfig {
            band_capacity: 1,
            ..FlowConfig::default()
        };
        let core = core_with(1, &["a"], flow);
        let now = Instant::now();
        let _running = dispatched(&core, &request("busy", 0, ""), now);
        queued(&core, &request("w1", 0, ""), now);
        let (result, facts) = core.admit(&request("w2", 0, ""), now);
        assert_eq!(result.unwrap_err().label(), "unavailable");
        assert!(facts.iter().any(|f| matches!(
            f,
            Fact::Queue {
                event: QueueEvent::Left {
                    exit: QueueExit::Full,
                    ..
                },
                ..
            }
        )));
        // Another band still has room; a sheddable arrival to a full band gets 429.
        queued(&core, &request("s1", -1, ""), now);
        assert_eq!(
            core.admit(&request("s2", -1, ""), now)
                .0
                .unwrap_err()
                .label(),
            "overloaded"
        );
    }

    #[test]
    fn a_rank_joining_releases_waiting_requests() {
        let core = core_with(1, &["a"], FlowConfig::default());
        let now = Instant::now();
        let _running = dispatched(&core, &request("busy", 0, ""), now);
        let t = queued(&core, &request("w", 0, ""), now);
        let specs = vec![
            WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![8000])),
            WorkerSpec::for_test("b", "m", RankLayout::PerPort(vec![8001])),
        ];
        let (_, facts) = core.apply_source_snapshot("catalog", specs, now).unwrap();
        let out = released(&facts);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, t);
        assert_eq!(out[0].1.as_ref().unwrap().primary.worker_name, "b");
    }

    #[test]
    fn a_partition_losing_every_rank_fails_its_waiting_requests() {
        let core = core_with(1, &["a"], FlowConfig::default());
        let now = Instant::now();
        let _running = dispatched(&core, &request("busy", 0, ""), now);
        let t = queued(&core, &request("w", 0, ""), now);
        let (_, facts) = core.apply_source_snapshot("catalog", vec![], now).unwrap();
        let out = released(&facts);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, t);
        assert_eq!(out[0].1.as_ref().unwrap_err().label(), "unavailable");
        assert_eq!(
            core.live_bookings(),
            0,
            "the running booking went with its rank"
        );
    }

    #[test]
    fn an_unmeetable_slo_is_refused_at_once_and_a_meetable_one_waits() {
        let core = core_with(1, &["a"], FlowConfig::default());
        let now = Instant::now();
        // The prior line: 20 ms + 50 µs/token; 64 tokens need ~23 ms even on an idle rank.
        let tight = SelectionRequest {
            slo_ttft_ms: Some(5),
            ..request("tight", 0, "")
        };
        let err = core.admit(&tight, now).0.unwrap_err();
        assert_eq!(err.label(), "overloaded");
        assert!(err.to_string().contains("TTFT SLO of 5 ms"), "{err}");
        let running = dispatched(&core, &request("busy", 0, ""), now);
        let slo = SelectionRequest {
            slo_ttft_ms: Some(500),
            ..request("slo", 0, "")
        };
        let t = queued(&core, &slo, now);
        // Its deadline is the SLO's, earlier than the queue timeout.
        assert_eq!(
            core.next_queue_deadline(),
            Some(now + Duration::from_millis(500))
        );
        let out = released(&free(&core, &running, now + Duration::from_millis(100)));
        assert_eq!(out[0].0, t);
        assert!(out[0].1.is_ok());
        // Too late now: what remains of the SLO is less than an idle rank needs.
        let running = out[0].1.clone().unwrap();
        let late = queued(&core, &slo, now);
        let facts = free(&core, &running, now + Duration::from_millis(490));
        let out = released(&facts);
        assert_eq!(out[0].0, late);
        assert_eq!(out[0].1.as_ref().unwrap_err().label(), "overloaded");
    }

    #[test]
    fn slo_attainment_is_reported_at_the_first_token() {
        let core = core_with(4, &["a"], FlowConfig::default());
        let now = Instant::now();
        let r = SelectionRequest {
            slo_ttft_ms: Some(100),
            priority: 3,
            ..request("r", 3, "")
        };
        let s = dispatched(&core, &r, now);
        let (_, facts) = core.mark_prefill_complete(
            &s.booking_id,
            Claim::Generation(s.generation),
            now + Duration::from_millis(150),
        );
        assert!(facts.iter().any(|f| *f
            == Fact::SloTtft {
                priority: 3,
                met: false
            }));
    }

    #[test]
    fn without_flow_control_busy_ranks_refuse_at_once() {
        let core = Core::new(CoreConfig {
            flow: FlowConfig {
                enabled: false,
                ..FlowConfig::default()
            },
            busy: crate::config::BusyThresholds {
                active_prefill_tokens: Some(10),
                ..Default::default()
            },
            ..CoreConfig::default()
        });
        core.apply_source_snapshot(
            "catalog",
            vec![WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![1]))],
            Instant::now(),
        )
        .unwrap();
        let now = Instant::now();
        dispatched(&core, &request("r1", 0, ""), now);
        let err = core.admit(&request("r2", 0, ""), now).0.unwrap_err();
        assert_eq!(err.label(), "overloaded");
        assert_eq!(core.waiting_requests(), 0);
    }

    #[test]
    fn with_flow_control_a_busy_threshold_makes_requests_wait() {
        let core = Core::new(CoreConfig {
            busy: crate::config::BusyThresholds {
                active_prefill_tokens: Some(10),
                ..Default::default()
            },
            ..CoreConfig::default()
        });
        core.apply_source_snapshot(
            "catalog",
            vec![WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![1]))],
            Instant::now(),
        )
        .unwrap();
        let now = Instant::now();
        let s = dispatched(&core, &request("r1", 0, ""), now);
        let t = queued(&core, &request("r2", 0, ""), now);
        // The first token takes r1's prefill off the rank: r2 fits.
        let (_, facts) =
            core.mark_prefill_complete(&s.booking_id, Claim::Generation(s.generation), now);
        assert_eq!(released(&facts)[0].0, t);
    }

    #[test]
    fn a_request_waits_for_the_saturated_rank_caching_it_when_that_is_faster() {
        let core = core_with(1, &["a", "b"], FlowConfig::default());
        let now = Instant::now();
        let long = |id: &str, token: u32| SelectionRequest {
            prompt: PromptInput::Tokens(vec![token; 4096]),
            ..request(id, 0, "")
        };
        // The first request's prompt is now cached (predicted) on its rank, which it fills.
        let first = dispatched(&core, &long("first", 7), now);
        let (_, _) =
            core.mark_prefill_complete(&first.booking_id, Claim::Generation(first.generation), now);
        // The same prompt again: the cached rank is saturated, the other one free but it would
        // prefill 4096 tokens from scratch (~225 ms) against ~20 ms once the cached rank frees.
        let t = queued(&core, &long("again", 7), now);
        // An unrelated prompt has nothing to wait for: it takes the free rank at once.
        let other = dispatched(&core, &long("other", 9), now);
        assert_ne!(other.primary.worker_name, first.primary.worker_name);
        let out = released(&free(&core, &first, now));
        assert_eq!(out[0].0, t);
        assert_eq!(
            out[0].1.as_ref().unwrap().primary.worker_name,
            first.primary.worker_name
        );
    }

    #[test]
    fn a_lower_band_never_takes_room_a_waiting_higher_band_declined() {
        let core = core_with(1, &["a", "b"], FlowConfig::default());
        let now = Instant::now();
        let long = |id: &str, token: u32, priority: i32| SelectionRequest {
            prompt: PromptInput::Tokens(vec![token; 4096]),
            ..request(id, priority, "")
        };
        let first = dispatched(&core, &long("first", 7, 0), now);
        core.mark_prefill_complete(&first.booking_id, Claim::Generation(first.generation), now);
        // High waits for the rank caching its prompt; the other rank has room.
        let high = queued(&core, &long("high", 7, 5), now);
        // A sheddable request may not take that room ahead of the waiting high one...
        let low = queued(&core, &long("low", 9, -1), now);
        // ...but one of the high band may.
        let peer = dispatched(&core, &long("peer", 11, 5), now);
        assert_ne!(peer.primary.worker_name, first.primary.worker_name);
        let out = released(&free(&core, &first, now));
        assert_eq!(out.len(), 1, "one rank freed: the high request goes first");
        assert_eq!(out[0].0, high);
        let out = released(&free(&core, &peer, now));
        assert_eq!(out[0].0, low);
    }

    #[test]
    fn other_replicas_bookings_saturate_and_their_end_releases() {
        let core = core_with(1, &["a"], FlowConfig::default());
        let now = Instant::now();
        let rank = core
            .list_workers(None)
            .first()
            .map(|w| RankKey {
                worker_id: w.record.id,
                dp_rank: 0,
            })
            .unwrap();
        let elsewhere = RankLoad {
            active_requests: 1,
            ..RankLoad::default()
        };
        // Another replica (--shared-state) has the rank's one slot.
        core.set_remote_loads(&HashMap::from([(rank, elsewhere)]));
        let t = queued(&core, &request("here", 0, ""), now);
        assert!(released(&core.pump(now)).is_empty());
        // Its booking ended: the next load exchange says so, and a release pass places ours.
        core.set_remote_loads(&HashMap::new());
        let out = released(&core.pump(now));
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].0, t);
        assert!(out[0].1.is_ok());
    }

    #[test]
    fn a_tpot_slo_goes_to_a_rank_decoding_few_enough_requests() {
        let core = Core::new(CoreConfig {
            seed: Some(1),
            ..CoreConfig::default()
        });
        let specs = vec![
            WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![8000])),
            WorkerSpec::for_test("b", "m", RankLayout::PerPort(vec![8001])),
        ];
        core.apply_source_snapshot("catalog", specs, Instant::now())
            .unwrap();
        let now = Instant::now();
        let key = |name: &str| {
            let r = core
                .records()
                .into_iter()
                .find(|r| r.spec.name == name)
                .unwrap();
            RankKey {
                worker_id: r.id,
                dp_rank: 0,
            }
        };
        // "a" decodes 200 requests (another replica's): ~30 ms per token at the prior line;
        // "b" decodes 150: ~25 ms. Both are far from saturated (no prefill queued).
        let decoding = |n| RankLoad {
            active_requests: n,
            ..RankLoad::default()
        };
        core.set_remote_loads(&HashMap::from([
            (key("a"), decoding(200)),
            (key("b"), decoding(150)),
        ]));
        let tpot = |ms| SelectionRequest {
            slo_tpot_ms: Some(ms),
            ..request("t", 0, "")
        };
        for _ in 0..4 {
            let s = dispatched(&core, &tpot(27), now);
            assert_eq!(s.primary.worker_name, "b", "only b decodes fast enough");
            free(&core, &s, now);
        }
        // No rank meets 20 ms now, but an idle one would: wait.
        queued(&core, &tpot(20), now);
        // Even an idle rank needs ~10 ms per token: refused at once.
        let err = core.admit(&tpot(5), now).0.unwrap_err();
        assert_eq!(err.label(), "overloaded");
        assert!(err.to_string().contains("TPOT SLO of 5 ms"), "{err}");
    }

    #[test]
    fn tpot_attainment_is_reported_at_the_end_of_the_response() {
        let core = core_with(4, &["a"], FlowConfig::default());
        let now = Instant::now();
        let r = SelectionRequest {
            slo_tpot_ms: Some(50),
            ..request("r", 2, "")
        };
        let s = dispatched(&core, &r, now);
        let claim = Claim::Generation(s.generation);
        core.mark_prefill_complete(&s.booking_id, claim, now);
        // 11 tokens in 0.3 s after the first: 30 ms per token.
        let (done, facts) =
            core.decode_complete(&s.booking_id, claim, 11, now + Duration::from_millis(300));
        assert!(done);
        assert!(facts.iter().any(|f| *f
            == Fact::SloTpot {
                priority: 2,
                met: true
            }));
    }

    #[test]
    fn hard_bound_sessions_wait_for_their_rank_while_others_flow_elsewhere() {
        let core = core_with(1, &["a", "b"], FlowConfig::default());
        let now = Instant::now();
        let session = |id: &str| SelectionRequest {
            session_id: Some("s".into()),
            ..request(id, 0, "")
        };
        let first = dispatched(&core, &session("s1"), now);
        let bound_to = first.primary.worker_name.clone();
        // The session's rank is full: the next turn waits for it...
        let t = queued(&core, &session("s2"), now);
        // ...while an unbound request behind it still gets the other rank.
        let other = dispatched(&core, &request("free", 0, ""), now);
        assert_ne!(other.primary.worker_name, bound_to);
        let out = released(&free(&core, &first, now));
        assert_eq!(out[0].0, t);
        assert_eq!(out[0].1.as_ref().unwrap().primary.worker_name, bound_to);
    }
}

#[cfg(test)]
#[path = "core_api_tests.rs"]
mod api_tests;

#[cfg(test)]
#[path = "core_outlier_tests.rs"]
mod outlier_tests;
