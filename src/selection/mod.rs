//! The selection core: the one place that owns the worker catalog as scheduled, the partitions
//! (`(model, routing_group)`: ranks, load, KV index, bookings) and decides where a request goes.
//! Hosts (ext_proc, the gRPC selection API, replay) translate their protocol into a
//! [`SelectionRequest`] and the returned [`Reservation`] back; they never keep scheduling state of
//! their own. The decision itself ([`decide`]) is a pure function of a candidate snapshot.
//!
//! This module must not do network I/O, parse HTTP bodies, or know about Envoy.

mod decide;
mod partition;
pub mod reconcile;
pub mod session;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;

use dashmap::DashMap;
use parking_lot::{Mutex, RwLock};
use tokio::sync::watch;

pub use decide::{
    cost, decide, overlap_score, Candidate, CostParams, Decision, DEFAULT_DECODE_BLOCK_WEIGHT,
};
pub use partition::{EventStats, PartitionKey};
use partition::{Partition, SelectOutcome};
pub use session::{AffinityMode, SessionConfig, SessionOutcome};

use crate::catalog::{RankEndpoint, WorkerSpec};
use crate::index::TierDepths;
use crate::metrics::Metrics;

/// Block size used by a partition whose workers do not declare one.
pub const DEFAULT_BLOCK_SIZE: u32 = 16;

/// A worker's lifecycle as the scheduler sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lifecycle {
    Incomplete,
    Schedulable,
    Draining,
    Unschedulable,
}

impl Lifecycle {
    pub fn as_str(self) -> &'static str {
        match self {
            Lifecycle::Incomplete => "Incomplete",
            Lifecycle::Schedulable => "Schedulable",
            Lifecycle::Draining => "Draining",
            Lifecycle::Unschedulable => "Unschedulable",
        }
    }
    const ALL: [Lifecycle; 4] = [
        Lifecycle::Incomplete,
        Lifecycle::Schedulable,
        Lifecycle::Draining,
        Lifecycle::Unschedulable,
    ];
}

/// `(worker_id, dp_rank)`: the schedulable unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RankKey {
    pub worker_id: u64,
    pub dp_rank: u32,
}

/// Restricts candidates to a set of endpoints (`ip:port` exact, or bare `ip` for any port).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EndpointFilter {
    exact: HashSet<SocketAddr>,
    any_port: HashSet<IpAddr>,
}

impl EndpointFilter {
    /// Parses entries; unparsable entries are ignored (they match nothing).
    pub fn parse<'a>(entries: impl IntoIterator<Item = &'a str>) -> Self {
        let mut filter = EndpointFilter::default();
        for raw in entries {
            let entry = raw.trim();
            if let Ok(addr) = entry.parse::<SocketAddr>() {
                filter.exact.insert(addr);
            } else if let Ok(ip) = entry.trim_matches(['[', ']']).parse::<IpAddr>() {
                filter.any_port.insert(ip);
            }
        }
        filter
    }

    pub fn matches(&self, endpoint: &SocketAddr) -> bool {
        self.exact.contains(endpoint) || self.any_port.contains(&endpoint.ip())
    }

    pub fn is_empty(&self) -> bool {
        self.exact.is_empty() && self.any_port.is_empty()
    }
}

/// What to do when a live booking already has the request id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DuplicateId {
    /// ext_proc: suffix the id so two streams never share a booking.
    #[default]
    Suffix,
    /// gRPC API: refuse with 409.
    Reject,
}

/// The prompt as far as the host knows it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum PromptInput {
    /// No prompt (e.g. `GET /v1/models`): load-only routing.
    #[default]
    None,
    /// Engine token ids: exact block hashes.
    Tokens(Vec<u32>),
    /// Precomputed chained block hashes (gRPC callers that hash themselves).
    BlockHashes {
        seq_hashes: Vec<u64>,
        prompt_tokens: u64,
    },
    /// Prompt text without a tokenizer: hashed in 4-byte pseudo-tokens. Prefix-stable, so our own
    /// routing decisions still find shared prefixes, but never comparable with engine KV events.
    Text(Vec<u8>),
}

/// An explicit pin to a worker (and optionally one of its ranks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pin {
    pub worker_id: u64,
    pub dp_rank: Option<u32>,
}

/// Everything a host knows about a request that matters for the pick.
#[derive(Debug, Clone, Default)]
pub struct SelectionRequest {
    pub request_id: String,
    /// `None` for requests without a model (e.g. `GET /v1/models`): any partition.
    pub model: Option<String>,
    pub routing_group: String,
    pub prompt: PromptInput,
    pub cache_salt: Option<String>,
    /// Subset hint / allowed set; `None` means the whole pool.
    pub subset: Option<EndpointFilter>,
    pub pin: Option<Pin>,
    pub fallbacks: usize,
    /// Per-request override of `router_temperature`.
    pub temperature: Option<f64>,
    /// Negative = sheddable.
    pub priority: i32,
    /// Session for affinity (at most 256 bytes; hosts reject longer ids).
    pub session_id: Option<String>,
    pub on_duplicate: DuplicateId,
}

/// One picked rank, with everything a host needs to route to it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PickedRank {
    pub key: RankKey,
    pub worker_name: String,
    pub endpoint: SocketAddr,
    pub multiplexed: bool,
}

/// The outcome of a successful pick.
#[derive(Debug, Clone)]
pub struct Selection {
    pub booking_id: String,
    pub partition: PartitionKey,
    pub primary: PickedRank,
    pub fallbacks: Vec<PickedRank>,
    /// Blocks of the prompt already cached on the primary (GPU tier).
    pub overlap_blocks: u32,
    /// Complete blocks in the prompt.
    pub prompt_blocks: u32,
    pub prompt_tokens: u64,
    pub cost: f64,
    /// What session affinity did, when the request had a session id.
    pub session: Option<SessionOutcome>,
}

/// Why a pick failed; maps to an HTTP status (and a gRPC code on the API).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectError {
    #[error("{0}")]
    BadRequest(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    Overloaded(String),
    #[error("{0}")]
    Unavailable(String),
}

impl SelectError {
    pub fn http_status(&self) -> u16 {
        match self {
            SelectError::BadRequest(_) => 400,
            SelectError::Conflict(_) => 409,
            SelectError::Overloaded(_) => 429,
            SelectError::Unavailable(_) => 503,
        }
    }
}

/// Result of applying one catalog snapshot.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    pub added: usize,
    pub updated: usize,
    pub unchanged: usize,
    pub removed: usize,
    /// Workers kept out of scheduling (e.g. block-size conflict), with the reason.
    pub failed: Vec<(String, String)>,
    /// Partitions that received a batch (one publish each).
    pub partitions_published: usize,
}

/// A worker as the core holds it.
#[derive(Debug, Clone)]
pub struct WorkerRecord {
    pub id: u64,
    pub spec: WorkerSpec,
    pub ranks: Vec<RankEndpoint>,
    pub lifecycle: Lifecycle,
    pub reason: String,
}

impl WorkerRecord {
    pub fn partition_key(&self) -> PartitionKey {
        PartitionKey {
            model: self.spec.model.clone(),
            routing_group: self.spec.routing_group.clone(),
        }
    }
}

/// Load of one rank, derived only from bookings.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RankLoad {
    pub active_prefill_tokens: u64,
    pub active_decode_blocks: u64,
    pub active_requests: u64,
}

/// A read-only view of one worker and its per-rank load, for listing.
#[derive(Debug, Clone)]
pub struct WorkerView {
    pub record: WorkerRecord,
    pub loads: Vec<RankLoad>,
}

/// Busy thresholds (DESIGN §5); a rank at or over either is not eligible.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BusyThresholds {
    pub active_decode_blocks: Option<u64>,
    pub active_prefill_tokens: Option<u64>,
    /// Sheddable requests (priority < 0) see the thresholds scaled by this (0..1], so they are
    /// refused with 429 before critical requests are.
    pub sheddable_fraction: f64,
}

impl Default for BusyThresholds {
    fn default() -> Self {
        BusyThresholds {
            active_decode_blocks: None,
            active_prefill_tokens: None,
            sheddable_fraction: 0.8,
        }
    }
}

/// Core settings that are not per request.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    pub booking_ttl: Duration,
    /// Seed for tie-breaking and sampling; `None` seeds from the OS.
    pub seed: Option<u64>,
    pub cost: CostParams,
    pub busy: BusyThresholds,
    /// Whether explicit worker pins (`x-dynamo-worker-instance-id`) are honoured.
    pub allow_pins: bool,
    /// TTL of blocks inserted from our own routing decisions when a worker has no KV events.
    pub approx_ttl: Duration,
    /// TTL of predicted blocks inserted for every pick, until the engine's events confirm them.
    pub predicted_ttl: Duration,
    /// Whether KV events are consumed (off: every worker is in approximate mode).
    pub kv_events: bool,
    /// Bound on blocks per partition index.
    pub index_max_blocks: usize,
    /// Keep a trace of the last N decisions (differential tests, debugging); 0 = off.
    pub trace_decisions: usize,
    pub sessions: SessionConfig,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            booking_ttl: Duration::from_secs(300),
            seed: None,
            cost: CostParams::default(),
            busy: BusyThresholds::default(),
            allow_pins: false,
            approx_ttl: Duration::from_secs(120),
            predicted_ttl: Duration::from_secs(2),
            kv_events: false,
            index_max_blocks: 1 << 20,
            trace_decisions: 0,
            sessions: SessionConfig::default(),
        }
    }
}

/// Which catalog source produced a set of workers; the catalog is the union of all sources.
pub type SourceName = &'static str;

struct Catalog {
    sources: BTreeMap<SourceName, Vec<WorkerSpec>>,
    records: HashMap<u64, WorkerRecord>,
}

/// The selection core shared by every host.
pub struct SelectionCore {
    config: CoreConfig,
    metrics: Metrics,
    catalog: Mutex<Catalog>,
    /// Set once the first catalog snapshot has been applied.
    synced: AtomicBool,
    partitions: RwLock<BTreeMap<PartitionKey, Arc<Partition>>>,
    /// Live booking ids -> the partition holding them (claims are made before scheduling).
    bookings: DashMap<String, Arc<Partition>>,
    ready_tx: watch::Sender<bool>,
    /// Bumped after every applied catalog snapshot (KV-event subscriptions follow it).
    catalog_tx: watch::Sender<u64>,
    trace: Mutex<Vec<String>>,
}

impl SelectionCore {
    pub fn new(config: CoreConfig, metrics: Metrics) -> Arc<Self> {
        let (ready_tx, _) = watch::channel(false);
        let (catalog_tx, _) = watch::channel(0);
        Arc::new(SelectionCore {
            catalog_tx,
            config,
            metrics,
            catalog: Mutex::new(Catalog {
                sources: BTreeMap::new(),
                records: HashMap::new(),
            }),
            synced: AtomicBool::new(false),
            partitions: RwLock::new(BTreeMap::new()),
            bookings: DashMap::new(),
            ready_tx,
            trace: Mutex::new(Vec::new()),
        })
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn config(&self) -> &CoreConfig {
        &self.config
    }

    /// Ticks after every applied catalog snapshot.
    pub fn catalog_changes(&self) -> watch::Receiver<u64> {
        self.catalog_tx.subscribe()
    }

    /// Ready = the catalog has synced and at least one worker is schedulable.
    pub fn readiness(&self) -> watch::Receiver<bool> {
        self.ready_tx.subscribe()
    }

    /// Applies the static/default source's complete snapshot.
    pub fn apply_snapshot(&self, specs: Vec<WorkerSpec>) -> Result<ApplyReport, String> {
        self.apply_source_snapshot("catalog", specs)
    }

    /// Replaces one source's workers with `specs` and reconciles the union of all sources
    /// (DESIGN §4): duplicate ids are rejected before anything changes; unchanged workers are
    /// skipped; changed ones are replaced in one batch per partition (surviving ranks keep their
    /// bookings); workers absent from every source are deleted with their bookings.
    pub fn apply_source_snapshot(
        &self,
        source: SourceName,
        specs: Vec<WorkerSpec>,
    ) -> Result<ApplyReport, String> {
        let mut catalog = self.catalog.lock();
        let mut seen = HashSet::new();
        for (name, list) in catalog
            .sources
            .iter()
            .filter(|(name, _)| **name != source)
            .map(|(n, l)| (*n, l.as_slice()))
            .chain(std::iter::once((source, specs.as_slice())))
        {
            for spec in list {
                if !seen.insert(spec.worker_id()) {
                    return Err(format!(
                        "duplicate worker {}/{} in snapshot (source {name})",
                        spec.namespace, spec.name
                    ));
                }
            }
        }
        catalog.sources.insert(source, specs);
        let desired: HashMap<u64, WorkerSpec> = catalog
            .sources
            .values()
            .flatten()
            .map(|s| (s.worker_id(), s.clone()))
            .collect();
        let report = self.reconcile(&mut catalog, desired);
        self.synced.store(true, Ordering::Release);
        self.publish_catalog_metrics(&catalog);
        let ready = catalog
            .records
            .values()
            .any(|w| w.lifecycle == Lifecycle::Schedulable);
        drop(catalog);
        self.ready_tx.send_replace(ready);
        self.catalog_tx.send_modify(|v| *v += 1);
        Ok(report)
    }

    /// Adds or replaces one worker of a source (matched by name) and reconciles.
    pub fn upsert_source_worker(
        &self,
        source: SourceName,
        spec: WorkerSpec,
    ) -> Result<ApplyReport, String> {
        let mut list = self
            .catalog
            .lock()
            .sources
            .get(source)
            .cloned()
            .unwrap_or_default();
        list.retain(|w| w.name != spec.name);
        list.push(spec);
        self.apply_source_snapshot(source, list)
    }

    /// Removes one worker of a source by name; returns whether it existed.
    pub fn delete_source_worker(&self, source: SourceName, name: &str) -> Result<bool, String> {
        let mut list = self
            .catalog
            .lock()
            .sources
            .get(source)
            .cloned()
            .unwrap_or_default();
        let before = list.len();
        list.retain(|w| w.name != name);
        let found = list.len() != before;
        self.apply_source_snapshot(source, list)?;
        Ok(found)
    }

    fn reconcile(
        &self,
        catalog: &mut Catalog,
        mut desired: HashMap<u64, WorkerSpec>,
    ) -> ApplyReport {
        let mut report = ApplyReport::default();
        // Per partition: ranks to remove (by worker) and records to upsert.
        let mut removals: BTreeMap<PartitionKey, Vec<WorkerRecord>> = BTreeMap::new();
        let mut upserts: BTreeMap<PartitionKey, Vec<WorkerRecord>> = BTreeMap::new();
        let existing: Vec<u64> = catalog.records.keys().copied().collect();
        for id in existing {
            let old = &catalog.records[&id];
            match desired.remove(&id) {
                None => {
                    removals
                        .entry(old.partition_key())
                        .or_default()
                        .push(old.clone());
                    catalog.records.remove(&id);
                    report.removed += 1;
                }
                Some(spec) if spec == old.spec => report.unchanged += 1,
                Some(spec) => {
                    let new = record_for(id, spec);
                    if new.partition_key() != old.partition_key() {
                        removals
                            .entry(old.partition_key())
                            .or_default()
                            .push(old.clone());
                    }
                    upserts
                        .entry(new.partition_key())
                        .or_default()
                        .push(new.clone());
                    catalog.records.insert(id, new);
                    report.updated += 1;
                }
            }
        }
        let mut added: Vec<(u64, WorkerSpec)> = desired.into_iter().collect();
        added.sort_by_key(|(id, _)| *id);
        for (id, spec) in added {
            let new = record_for(id, spec);
            upserts
                .entry(new.partition_key())
                .or_default()
                .push(new.clone());
            catalog.records.insert(id, new);
            report.added += 1;
        }
        let keys: HashSet<PartitionKey> = removals.keys().chain(upserts.keys()).cloned().collect();
        let mut keys: Vec<PartitionKey> = keys.into_iter().collect();
        keys.sort();
        for key in keys {
            let partition = self.partition(&key);
            let gone = removals.remove(&key).unwrap_or_default();
            let ups = upserts.remove(&key).unwrap_or_default();
            let result = partition.apply_batch(&gone, &ups, &self.metrics);
            for (id, reason) in result.failed {
                if let Some(record) = catalog.records.get_mut(&id) {
                    record.lifecycle = Lifecycle::Unschedulable;
                    record.reason = reason.clone();
                    report.failed.push((record.spec.name.clone(), reason));
                }
            }
            for id in result.dropped_bookings {
                self.bookings.remove(&id);
            }
            report.partitions_published += 1;
        }
        report
    }

    /// The partition for `key`, created lazily.
    fn partition(&self, key: &PartitionKey) -> Arc<Partition> {
        if let Some(p) = self.partitions.read().get(key) {
            return Arc::clone(p);
        }
        let mut partitions = self.partitions.write();
        Arc::clone(
            partitions
                .entry(key.clone())
                .or_insert_with(|| Arc::new(Partition::new(key.clone(), &self.config))),
        )
    }

    fn publish_catalog_metrics(&self, catalog: &Catalog) {
        for lifecycle in Lifecycle::ALL {
            let n = catalog
                .records
                .values()
                .filter(|w| w.lifecycle == lifecycle)
                .count();
            self.metrics
                .catalog_workers
                .with_label_values(&[lifecycle.as_str()])
                .set(n as i64);
        }
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

    /// Computes a decision without booking anything (the API's `Select`).
    pub fn select(&self, request: &SelectionRequest) -> Result<Selection, SelectError> {
        self.ensure_synced()?;
        let partition = self.resolve_partition(request)?;
        let outcome = partition.select(request, None, &self.config, &self.metrics)?;
        Ok(outcome.selection)
    }

    fn ensure_synced(&self) -> Result<(), SelectError> {
        // Read on every pick: an atomic, not the catalog lock.
        if self.synced.load(Ordering::Acquire) {
            Ok(())
        } else {
            Err(SelectError::Unavailable("catalog not synced yet".into()))
        }
    }

    /// Picks a rank and books it atomically: the request id is claimed first, then the decision
    /// and the booking are made under the partition's lock. The returned guard frees the booking
    /// when dropped unless [`Reservation::detach`] hands it to an explicit [`SelectionCore::free`].
    pub fn select_and_reserve(
        self: &Arc<Self>,
        request: &SelectionRequest,
    ) -> Result<Reservation, SelectError> {
        self.ensure_synced()?;
        let partition = self.resolve_partition(request)?;
        let booking_id = self.claim(&request.request_id, request.on_duplicate, &partition)?;
        match partition.select(request, Some(&booking_id), &self.config, &self.metrics) {
            Ok(outcome) => {
                self.record_trace(request, &outcome);
                Ok(Reservation {
                    core: Arc::clone(self),
                    selection: outcome.selection,
                    armed: true,
                })
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
        let mut n = 1;
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
                dashmap::Entry::Occupied(_) => n += 1,
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
            trace.remove(0);
        }
        trace.push(line);
    }

    /// The decision trace (when `trace_decisions > 0`).
    pub fn decision_trace(&self) -> Vec<String> {
        self.trace.lock().clone()
    }

    /// Marks the booking's prefill as done (first response byte). Unknown ids are ignored.
    pub fn mark_prefill_complete(&self, booking_id: &str) -> bool {
        let Some(partition) = self.bookings.get(booking_id).map(|p| Arc::clone(&p)) else {
            return false;
        };
        partition.prefill_complete(booking_id, &self.metrics)
    }

    /// Frees a booking exactly once; unknown or repeated frees are no-ops returning false.
    pub fn free(&self, booking_id: &str) -> bool {
        let Some((_, partition)) = self.bookings.remove(booking_id) else {
            return false;
        };
        partition.free(booking_id, &self.metrics)
    }

    /// Moves a booking to the endpoint that actually served it (Envoy may fall back).
    pub fn move_booking(&self, booking_id: &str, served: SocketAddr) -> bool {
        let Some(partition) = self.bookings.get(booking_id).map(|p| Arc::clone(&p)) else {
            return false;
        };
        partition.move_booking(booking_id, served, &self.metrics)
    }

    /// Reaps bookings older than `booking_ttl` and expired index entries; returns bookings reaped.
    pub fn reap_expired(&self, now: Instant) -> usize {
        let partitions: Vec<Arc<Partition>> = self.partitions.read().values().cloned().collect();
        let mut reaped = 0;
        for p in partitions {
            for id in p.reap(
                now,
                self.config.booking_ttl,
                self.config.sessions.ttl,
                &self.metrics,
            ) {
                self.bookings.remove(&id);
                reaped += 1;
            }
        }
        self.metrics.bookings_expired.inc_by(reaped as u64);
        reaped
    }

    /// Number of live bookings.
    pub fn live_bookings(&self) -> usize {
        self.bookings.len()
    }

    /// The catalog with per-rank load, sorted by worker name.
    pub fn list_workers(&self, model: Option<&str>) -> Vec<WorkerView> {
        let records: Vec<WorkerRecord> = self
            .catalog
            .lock()
            .records
            .values()
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
                    .collect();
                WorkerView { record, loads }
            })
            .collect();
        views.sort_by(|a, b| a.record.spec.name.cmp(&b.record.spec.name));
        views
    }

    /// Records that `rank` holds `seq_hashes` in the partition `key` (KV events, warm-up, tests).
    pub fn insert_blocks(
        &self,
        key: &PartitionKey,
        rank: RankKey,
        seq_hashes: &[u64],
        tier: crate::index::Tier,
        expires: Option<Instant>,
    ) {
        self.partition(key)
            .insert_blocks(rank, seq_hashes, tier, expires);
    }

    /// Applies KV events published by one rank. Returns what was applied / dropped.
    pub fn apply_kv_events(
        &self,
        rank: RankKey,
        events: &[crate::events::decode::KvEvent],
    ) -> EventStats {
        let Some(partition) = self.partition_of_worker(rank.worker_id) else {
            return EventStats {
                applied: 0,
                dropped: events.len() as u64,
            };
        };
        let stats = partition.apply_events(rank, events);
        self.metrics
            .kv_events
            .with_label_values(&["applied"])
            .inc_by(stats.applied);
        self.metrics
            .kv_events
            .with_label_values(&["dropped"])
            .inc_by(stats.dropped);
        let key = &partition.key;
        self.metrics
            .index_blocks
            .with_label_values(&[&key.model, &key.routing_group])
            .set(partition.index_len() as i64);
        stats
    }

    /// Forgets a rank's blocks (its engine restarted).
    pub fn clear_rank(&self, rank: RankKey) {
        if let Some(partition) = self.partition_of_worker(rank.worker_id) {
            partition.clear_rank(rank);
        }
    }

    fn partition_of_worker(&self, worker_id: u64) -> Option<Arc<Partition>> {
        let key = self.catalog.lock().records.get(&worker_id)?.partition_key();
        self.partitions.read().get(&key).cloned()
    }

    /// KV-event subscriptions the catalog asks for: one per rank of every schedulable-or-not
    /// worker that declares an endpoint, `(rank, events endpoint, replay endpoint)`.
    pub fn kv_event_endpoints(&self) -> Vec<(RankKey, String, Option<String>)> {
        let catalog = self.catalog.lock();
        let mut out = Vec::new();
        for record in catalog.records.values() {
            let Some(base) = &record.spec.kv_events else {
                continue;
            };
            for rank in &record.ranks {
                let Some(events) = offset_endpoint(base, rank.dp_rank) else {
                    continue;
                };
                let replay = record
                    .spec
                    .kv_replay
                    .as_deref()
                    .and_then(|r| offset_endpoint(r, rank.dp_rank));
                out.push((
                    RankKey {
                        worker_id: record.id,
                        dp_rank: rank.dp_rank,
                    },
                    events,
                    replay,
                ));
            }
        }
        out.sort();
        out
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
    ) -> Result<(u32, Vec<(PickedRank, TierDepths)>), SelectError> {
        let partition = self.resolve_partition(request)?;
        Ok(partition.overlaps(request))
    }
}

/// `tcp://host:port` for rank 0 becomes `tcp://host:(port + rank)` (vLLM and SGLang offset their
/// KV-event ports by data-parallel rank).
pub fn offset_endpoint(base: &str, rank: u32) -> Option<String> {
    let (head, port) = base.rsplit_once(':')?;
    let port: u32 = port.parse().ok()?;
    let port = u16::try_from(port + rank).ok()?;
    Some(format!("{head}:{port}"))
}

fn record_for(id: u64, spec: WorkerSpec) -> WorkerRecord {
    let ranks = spec.rank_endpoints();
    let (lifecycle, reason) = if ranks.is_empty() {
        (Lifecycle::Incomplete, "no ranks".to_string())
    } else {
        (Lifecycle::Schedulable, String::new())
    };
    WorkerRecord {
        id,
        spec,
        ranks,
        lifecycle,
        reason,
    }
}

/// Keeps client input in messages short (DESIGN §3: never more than 128 bytes echoed).
pub fn clip(s: &str) -> String {
    const MAX: usize = 128;
    if s.len() <= MAX {
        return s.to_string();
    }
    let mut end = MAX;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}...", &s[..end])
}

/// A booked pick. Dropping it frees the booking, so a request abandoned at any await point never
/// leaks load.
pub struct Reservation {
    core: Arc<SelectionCore>,
    selection: Selection,
    armed: bool,
}

impl Reservation {
    pub fn selection(&self) -> &Selection {
        &self.selection
    }

    pub fn booking_id(&self) -> &str {
        &self.selection.booking_id
    }

    pub fn mark_prefill_complete(&self) {
        self.core.mark_prefill_complete(&self.selection.booking_id);
    }

    /// Moves the booking to the endpoint that served the request.
    pub fn served_by(&self, endpoint: SocketAddr) -> bool {
        self.core.move_booking(&self.selection.booking_id, endpoint)
    }

    /// Frees the booking now.
    pub fn free(mut self) {
        self.armed = false;
        self.core.free(&self.selection.booking_id);
    }

    /// Keeps the booking alive past this guard: it is freed by an explicit
    /// [`SelectionCore::free`] or by expiry.
    pub fn detach(mut self) -> Selection {
        self.armed = false;
        self.selection.clone()
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.armed {
            self.core.free(&self.selection.booking_id);
        }
    }
}

#[cfg(test)]
mod tests;
