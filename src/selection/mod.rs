//! The selection core: the one place that owns the worker catalog as scheduled, the bookings and
//! the per-rank load, and decides where a request goes. Hosts (ext_proc, the gRPC selection API)
//! translate their protocol into a [`SelectionRequest`] and the returned [`Reservation`] back; they
//! never keep scheduling state of their own. The decision itself ([`decide`]) is a pure function of
//! a candidate snapshot so it can be unit-tested and replayed without I/O.
//!
//! This module must not do network I/O, parse HTTP bodies, or know about Envoy.

mod decide;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use rand::rngs::StdRng;
use rand::SeedableRng;
use tokio::sync::watch;

pub use decide::{decide, Candidate, Decision};

use crate::catalog::{RankEndpoint, WorkerSpec};
use crate::metrics::Metrics;

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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DuplicateId {
    /// ext_proc: suffix the id so two streams never share a booking.
    Suffix,
    /// gRPC API: refuse with 409.
    Reject,
}

/// Everything a host knows about a request that matters for the pick.
#[derive(Debug, Clone)]
pub struct SelectionRequest {
    pub request_id: String,
    /// `None` for requests without a model (e.g. `GET /v1/models`): any worker.
    pub model: Option<String>,
    /// Subset hint / allowed set; `None` means the whole pool.
    pub subset: Option<EndpointFilter>,
    pub fallbacks: usize,
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
    pub primary: PickedRank,
    pub fallbacks: Vec<PickedRank>,
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

/// A read-only view of one worker and its per-rank load, for listing.
#[derive(Debug, Clone)]
pub struct WorkerView {
    pub record: WorkerRecord,
    pub active_requests: Vec<u64>,
}

#[derive(Debug)]
struct Booking {
    rank: RankKey,
    created: Instant,
    prefill_complete: bool,
}

#[derive(Debug, Default)]
struct RankLoad {
    active_requests: u64,
}

#[derive(Default)]
struct CoreState {
    synced: bool,
    workers: HashMap<u64, WorkerRecord>,
    loads: HashMap<RankKey, RankLoad>,
    bookings: HashMap<String, Booking>,
}

/// Core settings that are not per request.
#[derive(Debug, Clone)]
pub struct CoreConfig {
    pub booking_ttl: Duration,
    /// Seed for tie-breaking; `None` seeds from the OS.
    pub seed: Option<u64>,
}

impl Default for CoreConfig {
    fn default() -> Self {
        CoreConfig {
            booking_ttl: Duration::from_secs(300),
            seed: None,
        }
    }
}

/// The selection core shared by every host.
pub struct SelectionCore {
    config: CoreConfig,
    metrics: Metrics,
    state: Mutex<CoreState>,
    rng: Mutex<StdRng>,
    ready_tx: watch::Sender<bool>,
}

impl SelectionCore {
    pub fn new(config: CoreConfig, metrics: Metrics) -> Arc<Self> {
        let rng = match config.seed {
            Some(seed) => StdRng::seed_from_u64(seed),
            None => StdRng::from_os_rng(),
        };
        let (ready_tx, _) = watch::channel(false);
        Arc::new(SelectionCore {
            config,
            metrics,
            state: Mutex::new(CoreState::default()),
            rng: Mutex::new(rng),
            ready_tx,
        })
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Ready = the catalog has synced and at least one worker is schedulable.
    pub fn readiness(&self) -> watch::Receiver<bool> {
        self.ready_tx.subscribe()
    }

    /// Applies a complete desired snapshot: duplicates are rejected before anything changes;
    /// unchanged workers are skipped; changed ones replaced (their surviving ranks keep their
    /// bookings); workers absent from the snapshot are deleted with their bookings.
    pub fn apply_snapshot(&self, specs: Vec<WorkerSpec>) -> Result<ApplyReport, String> {
        let mut seen = HashSet::with_capacity(specs.len());
        for spec in &specs {
            if !seen.insert(spec.worker_id()) {
                return Err(format!(
                    "duplicate worker {}/{} in snapshot",
                    spec.namespace, spec.name
                ));
            }
        }
        let mut report = ApplyReport::default();
        let mut state = self.state.lock();
        let mut desired: HashMap<u64, WorkerSpec> =
            specs.into_iter().map(|s| (s.worker_id(), s)).collect();
        let existing: Vec<u64> = state.workers.keys().copied().collect();
        for id in existing {
            match desired.remove(&id) {
                None => {
                    let record = state.workers.remove(&id).expect("listed above");
                    self.drop_ranks(&mut state, &record, 0);
                    report.removed += 1;
                }
                Some(spec) => {
                    let record = state.workers.get(&id).expect("listed above");
                    if record.spec == spec {
                        report.unchanged += 1;
                        continue;
                    }
                    let old = record.clone();
                    let new = Self::record_for(id, spec);
                    // Ranks that still exist keep their bookings; the rest are dropped.
                    let keep = if old.ranks.iter().zip(&new.ranks).all(|(a, b)| a == b) {
                        new.ranks.len().min(old.ranks.len())
                    } else {
                        0
                    };
                    self.drop_ranks(&mut state, &old, keep);
                    state.workers.insert(id, new);
                    report.updated += 1;
                }
            }
        }
        for (id, spec) in desired {
            state.workers.insert(id, Self::record_for(id, spec));
            report.added += 1;
        }
        state.synced = true;
        self.publish_catalog_metrics(&state);
        let ready = state
            .workers
            .values()
            .any(|w| w.lifecycle == Lifecycle::Schedulable);
        drop(state);
        self.ready_tx.send_replace(ready);
        Ok(report)
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

    /// Drops bookings and load of `record`'s ranks from index `keep` on.
    fn drop_ranks(&self, state: &mut CoreState, record: &WorkerRecord, keep: usize) {
        let gone: HashSet<RankKey> = record.ranks[keep..]
            .iter()
            .map(|r| RankKey {
                worker_id: record.id,
                dp_rank: r.dp_rank,
            })
            .collect();
        if gone.is_empty() {
            return;
        }
        state.bookings.retain(|_, b| !gone.contains(&b.rank));
        for key in &gone {
            if let Some(load) = state.loads.remove(key) {
                self.metrics.inflight_total.sub(load.active_requests as i64);
            }
            let _ = self
                .metrics
                .inflight
                .remove_label_values(&[&record.spec.name, &key.dp_rank.to_string()]);
        }
    }

    fn publish_catalog_metrics(&self, state: &CoreState) {
        for lifecycle in Lifecycle::ALL {
            let n = state
                .workers
                .values()
                .filter(|w| w.lifecycle == lifecycle)
                .count();
            self.metrics
                .catalog_workers
                .with_label_values(&[lifecycle.as_str()])
                .set(n as i64);
        }
    }

    /// Picks a rank and books it atomically. The returned guard frees the booking when dropped
    /// unless [`Reservation::detach`] hands it over to an explicit [`SelectionCore::free`].
    pub fn select_and_reserve(
        self: &Arc<Self>,
        request: &SelectionRequest,
    ) -> Result<Reservation, SelectError> {
        let mut state = self.state.lock();
        if !state.synced {
            return Err(SelectError::Unavailable("catalog not synced yet".into()));
        }
        let mut candidates = Vec::new();
        let mut serving = 0usize;
        for worker in state.workers.values() {
            if worker.lifecycle != Lifecycle::Schedulable {
                continue;
            }
            if let Some(model) = &request.model {
                if !worker.spec.serves(model) {
                    continue;
                }
            }
            serving += 1;
            for rank in &worker.ranks {
                if let Some(subset) = &request.subset {
                    if !subset.matches(&rank.endpoint) {
                        continue;
                    }
                }
                let key = RankKey {
                    worker_id: worker.id,
                    dp_rank: rank.dp_rank,
                };
                let active = state.loads.get(&key).map_or(0, |l| l.active_requests);
                candidates.push(Candidate {
                    key,
                    active_requests: active,
                });
            }
        }
        if candidates.is_empty() {
            let message = if serving == 0 {
                match &request.model {
                    Some(model) => format!("no ready worker serves model {}", clip(model)),
                    None => "no ready worker in the pool".to_string(),
                }
            } else {
                "subset hint matches no eligible endpoint".to_string()
            };
            return Err(SelectError::Unavailable(message));
        }
        // Sort for a deterministic candidate order (HashMap iteration is not), so a seeded run
        // replays exactly.
        candidates.sort_by_key(|c| c.key);
        let decision = decide(&candidates, &mut *self.rng.lock());

        let mut booking_id = request.request_id.clone();
        if state.bookings.contains_key(&booking_id) {
            match request.on_duplicate {
                DuplicateId::Reject => {
                    return Err(SelectError::Conflict(format!(
                        "request id {} already has a live booking",
                        clip(&booking_id)
                    )))
                }
                DuplicateId::Suffix => {
                    let mut n = 2;
                    while state
                        .bookings
                        .contains_key(&format!("{}#{n}", request.request_id))
                    {
                        n += 1;
                    }
                    booking_id = format!("{}#{n}", request.request_id);
                }
            }
        }
        let primary_key = candidates[decision.ranking[0]].key;
        state.bookings.insert(
            booking_id.clone(),
            Booking {
                rank: primary_key,
                created: Instant::now(),
                prefill_complete: false,
            },
        );
        state.loads.entry(primary_key).or_default().active_requests += 1;
        let picked = |key: RankKey| -> PickedRank {
            let worker = &state.workers[&key.worker_id];
            let rank = worker
                .ranks
                .iter()
                .find(|r| r.dp_rank == key.dp_rank)
                .expect("candidate rank exists");
            PickedRank {
                key,
                worker_name: worker.spec.name.clone(),
                endpoint: rank.endpoint,
                multiplexed: rank.multiplexed,
            }
        };
        let primary = picked(primary_key);
        // Fallbacks are distinct endpoints: multiplexed ranks of one pod share an address.
        let mut fallbacks: Vec<PickedRank> = Vec::new();
        for &i in &decision.ranking[1..] {
            if fallbacks.len() == request.fallbacks {
                break;
            }
            let next = picked(candidates[i].key);
            if next.endpoint != primary.endpoint
                && fallbacks.iter().all(|f| f.endpoint != next.endpoint)
            {
                fallbacks.push(next);
            }
        }
        self.metrics
            .inflight
            .with_label_values(&[&primary.worker_name, &primary_key.dp_rank.to_string()])
            .inc();
        self.metrics.inflight_total.inc();
        drop(state);
        Ok(Reservation {
            core: Arc::clone(self),
            selection: Selection {
                booking_id,
                primary,
                fallbacks,
            },
            armed: true,
        })
    }

    /// Marks the booking's prefill as done (first response byte). Unknown ids are ignored.
    pub fn mark_prefill_complete(&self, booking_id: &str) -> bool {
        let mut state = self.state.lock();
        match state.bookings.get_mut(booking_id) {
            Some(b) => {
                b.prefill_complete = true;
                true
            }
            None => false,
        }
    }

    /// Frees a booking exactly once; unknown or repeated frees are no-ops returning false.
    pub fn free(&self, booking_id: &str) -> bool {
        let mut state = self.state.lock();
        let Some(booking) = state.bookings.remove(booking_id) else {
            return false;
        };
        self.release_load(&mut state, booking.rank);
        true
    }

    fn release_load(&self, state: &mut CoreState, rank: RankKey) {
        if let Some(load) = state.loads.get_mut(&rank) {
            load.active_requests = load.active_requests.saturating_sub(1);
            self.metrics.inflight_total.dec();
            if let Some(worker) = state.workers.get(&rank.worker_id) {
                self.metrics
                    .inflight
                    .with_label_values(&[&worker.spec.name, &rank.dp_rank.to_string()])
                    .dec();
            }
        }
    }

    /// Moves a booking to the endpoint that actually served it (Envoy may fall back). Returns
    /// whether the booking moved.
    pub fn move_booking(&self, booking_id: &str, served: SocketAddr) -> bool {
        let mut state = self.state.lock();
        let Some(current) = state.bookings.get(booking_id).map(|b| b.rank) else {
            return false;
        };
        let target = state.workers.values().find_map(|w| {
            w.ranks
                .iter()
                .find(|r| r.endpoint == served)
                .map(|r| RankKey {
                    worker_id: w.id,
                    dp_rank: r.dp_rank,
                })
        });
        let Some(target) = target else { return false };
        let same_endpoint = state
            .workers
            .get(&current.worker_id)
            .and_then(|w| w.ranks.iter().find(|r| r.dp_rank == current.dp_rank))
            .is_some_and(|r| r.endpoint == served);
        if same_endpoint || target == current {
            return false;
        }
        self.release_load(&mut state, current);
        state.loads.entry(target).or_default().active_requests += 1;
        self.metrics.inflight_total.inc();
        let name = state.workers[&target.worker_id].spec.name.clone();
        self.metrics
            .inflight
            .with_label_values(&[&name, &target.dp_rank.to_string()])
            .inc();
        state.bookings.get_mut(booking_id).expect("checked").rank = target;
        true
    }

    /// Reaps bookings older than `booking_ttl`; returns how many.
    pub fn reap_expired(&self, now: Instant) -> usize {
        let ttl = self.config.booking_ttl;
        let mut state = self.state.lock();
        let expired: Vec<(String, RankKey)> = state
            .bookings
            .iter()
            .filter(|(_, b)| now.duration_since(b.created) >= ttl)
            .map(|(id, b)| (id.clone(), b.rank))
            .collect();
        for (id, rank) in &expired {
            state.bookings.remove(id);
            self.release_load(&mut state, *rank);
        }
        self.metrics.bookings_expired.inc_by(expired.len() as u64);
        expired.len()
    }

    /// Number of live bookings.
    pub fn live_bookings(&self) -> usize {
        self.state.lock().bookings.len()
    }

    /// The catalog with per-rank load, sorted by worker name.
    pub fn list_workers(&self, model: Option<&str>) -> Vec<WorkerView> {
        let state = self.state.lock();
        let mut views: Vec<WorkerView> = state
            .workers
            .values()
            .filter(|w| model.is_none_or(|m| w.spec.serves(m)))
            .map(|w| WorkerView {
                active_requests: w
                    .ranks
                    .iter()
                    .map(|r| {
                        state
                            .loads
                            .get(&RankKey {
                                worker_id: w.id,
                                dp_rank: r.dp_rank,
                            })
                            .map_or(0, |l| l.active_requests)
                    })
                    .collect(),
                record: w.clone(),
            })
            .collect();
        views.sort_by(|a, b| a.record.spec.name.cmp(&b.record.spec.name));
        views
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
