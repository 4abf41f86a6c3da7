//! The selection core bound to this process: [`SelectionCore`] wraps [`kvpick_core::Core`] (which
//! decides, books and reconciles, with no I/O) with what a running server adds around it: the
//! clock (tokio's, so tests and the replay can pause it), Prometheus metrics (the core's
//! [`Facts`], applied after its locks are released), the readiness and catalog-change channels,
//! and the RAII [`Reservation`] that frees a booking when a request is abandoned.
//!
//! Hosts (ext_proc, the gRPC API) use this type; they never keep scheduling state of their own.
//! This module must not parse request bodies or know about Envoy.

pub mod admission;
pub mod reconcile;
pub mod remote;
pub mod sharing;

use std::net::SocketAddr;
use std::sync::{Arc, OnceLock, Weak};

use tokio::sync::watch;

pub use kvpick_core::core::RemoteQuery;
pub use kvpick_core::decide::DEFAULT_DECODE_BLOCK_WEIGHT;
pub use kvpick_core::session;
use kvpick_core::Core;
pub use kvpick_core::RemoteOverlap;
pub use kvpick_core::{
    clip, cost, decide, overlap_score, AffinityMode, ApplyReport, BusyThresholds, Candidate,
    CatalogError, Claim, CoreConfig, CostParams, Decision, DuplicateId, EndpointFilter, EventStats,
    Fact, Facts, Holder, Lifecycle, PartitionKey, PickedRank, Pin, PromptInput, RankKey, RankLoad,
    SelectError, Selection, SelectionRequest, SessionConfig, SessionOutcome, SourceName,
    WorkerRecord, WorkerView, DEFAULT_BLOCK_SIZE,
};
pub use remote::RemoteIndex;
pub use sharing::{SessionLookupJob, SharedHooks};

use crate::observability::metrics::Metrics;
use kvpick_core::catalog::WorkerSpec;
use kvpick_core::index::{Tier, TierDepths};

/// The process clock the core is given: tokio's, so a paused test or replay clock reaches it.
pub use crate::clock::now;

/// HTTP status of a selection error, for the ext_proc host (the API maps to gRPC codes).
pub trait ToHttpStatus {
    fn http_status(&self) -> u16;
}

impl ToHttpStatus for SelectError {
    fn http_status(&self) -> u16 {
        match self {
            SelectError::BadRequest(_) => 400,
            SelectError::Conflict(_) => 409,
            SelectError::Overloaded(_) => 429,
            SelectError::Unavailable(_) => 503,
        }
    }
}

/// The selection core shared by every host of this process.
pub struct SelectionCore {
    core: Core,
    metrics: Metrics,
    ready_tx: watch::Sender<bool>,
    /// Bumped after every applied catalog snapshot (KV-event subscriptions follow it).
    catalog_tx: watch::Sender<u64>,
    /// `--shared-state`: sessions and load shared with the other replicas (unset: none).
    shared: OnceLock<Arc<dyn SharedHooks>>,
    /// `--kv-index-remote`: the index this replica queries instead of the engines' events.
    remote: OnceLock<Arc<dyn remote::RemoteIndex>>,
    /// Flow control: where released requests' reservations go ([`admission`]).
    mailboxes: admission::Mailboxes,
    /// This core's own `Arc` (a released request's [`Reservation`] holds one).
    this: Weak<SelectionCore>,
}

impl SelectionCore {
    pub fn new(config: CoreConfig, metrics: Metrics) -> Arc<Self> {
        let (ready_tx, _) = watch::channel(false);
        let (catalog_tx, _) = watch::channel(0);
        // The pool gauges read load against the limits flow control applies.
        metrics
            .pool
            .configure(crate::observability::epp_metrics::pool::PoolConfig {
                limits: config.flow.saturation,
                stale_after: config.engine_metrics_max_age,
            });
        Arc::new_cyclic(|this: &Weak<SelectionCore>| {
            // Each scrape reads the index sizes (`kvpick_index_blocks` is current whatever
            // changed an index: a clear's sweep, a purge, not only what reports a fact).
            let scraped = this.clone();
            metrics.on_scrape(move || {
                scraped
                    .upgrade()
                    .map(|core| core.core.index_sizes())
                    .unwrap_or_default()
            });
            SelectionCore {
                core: Core::new(config),
                metrics,
                ready_tx,
                catalog_tx,
                shared: OnceLock::new(),
                remote: OnceLock::new(),
                mailboxes: admission::Mailboxes::default(),
                this: this.clone(),
            }
        })
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    pub fn config(&self) -> Arc<CoreConfig> {
        self.core.config()
    }

    /// The pure core, for callers that manage time and facts themselves.
    pub fn inner(&self) -> &Core {
        &self.core
    }

    /// Ticks after every applied catalog snapshot.
    pub fn catalog_changes(&self) -> watch::Receiver<u64> {
        self.catalog_tx.subscribe()
    }

    /// Ready = the catalog has synced and at least one worker is schedulable.
    pub fn readiness(&self) -> watch::Receiver<bool> {
        self.ready_tx.subscribe()
    }

    /// Applies an operation's facts: metrics, then any queued request it released goes to its
    /// waiter.
    fn record(&self, facts: Facts) {
        self.metrics.apply(&facts);
        self.deliver(&facts);
    }

    fn reservation(self: &Arc<Self>, selection: Selection) -> Reservation {
        Reservation {
            core: Arc::clone(self),
            selection,
            armed: true,
        }
    }

    fn catalog_applied(&self, report: &ApplyReport, facts: Facts) {
        self.record(facts);
        // Holding requests for a pool at zero needs kvpick itself ready (its health SERVING, so
        // the gateway keeps calling it) once the catalog has synced, ranks or not.
        let hold = self.core.config().flow.hold_when_no_endpoints;
        self.ready_tx.send_replace(report.ready || hold);
        self.catalog_tx.send_modify(|v| *v += 1);
    }

    /// Applies the static/default source's complete snapshot.
    pub fn apply_snapshot(&self, specs: Vec<WorkerSpec>) -> Result<ApplyReport, CatalogError> {
        self.apply_source_snapshot("catalog", specs)
    }

    /// Replaces one source's workers with `specs` and reconciles the union of all sources.
    pub fn apply_source_snapshot(
        &self,
        source: SourceName,
        specs: Vec<WorkerSpec>,
    ) -> Result<ApplyReport, CatalogError> {
        let (report, facts) = self.core.apply_source_snapshot(source, specs, now())?;
        self.catalog_applied(&report, facts);
        Ok(report)
    }

    /// Adds or replaces one worker of a source (matched by name) and reconciles, atomically.
    pub fn upsert_source_worker(
        &self,
        source: SourceName,
        spec: WorkerSpec,
    ) -> Result<ApplyReport, CatalogError> {
        let (report, facts) = self.core.upsert_source_worker(source, spec, now())?;
        self.catalog_applied(&report, facts);
        Ok(report)
    }

    /// Removes one worker of a source by name, atomically; returns whether it existed.
    pub fn delete_source_worker(
        &self,
        source: SourceName,
        name: &str,
    ) -> Result<bool, CatalogError> {
        let (found, report, facts) = self.core.delete_source_worker(source, name, now())?;
        self.catalog_applied(&report, facts);
        Ok(found)
    }

    /// Computes a decision without booking anything (the API's `Select`).
    pub fn select(&self, request: &SelectionRequest) -> Result<Selection, SelectError> {
        let (selection, facts) = self.core.select(request, now())?;
        self.record(facts);
        Ok(selection)
    }

    /// Installs a session binding decided by another replica.
    pub fn install_session_binding(
        &self,
        key: &PartitionKey,
        sid: &str,
        rank: RankKey,
    ) -> session::Installed {
        let (installed, facts) = self.core.install_session_binding(key, sid, rank, now());
        self.record(facts);
        installed
    }

    /// Sets the load the other replicas booked, per rank.
    pub fn set_remote_loads(&self, loads: &std::collections::HashMap<RankKey, RankLoad>) {
        self.core.set_remote_loads(loads);
        // Other replicas' load fell: waiting requests may fit now.
        self.pump_queues();
    }

    /// Picks a rank and books it atomically. The returned guard frees the booking when dropped
    /// unless [`Reservation::detach`] hands it to an explicit [`SelectionCore::free`].
    pub fn select_and_reserve(
        self: &Arc<Self>,
        request: &SelectionRequest,
    ) -> Result<Reservation, SelectError> {
        let session = self.session_before(request);
        let (selection, facts) = self.core.select_and_reserve(request, now())?;
        self.record(facts);
        self.after_pick(&selection, session.as_ref());
        Ok(self.reservation(selection))
    }

    /// The decision trace (when `trace_decisions > 0`).
    pub fn decision_trace(&self) -> Vec<String> {
        self.core.decision_trace()
    }

    /// Marks the booking's prefill as done (first response byte). Unknown ids are ignored.
    pub fn mark_prefill_complete(&self, booking_id: &str) -> bool {
        self.mark_prefill_complete_claimed(booking_id, Claim::Any)
    }

    /// [`SelectionCore::mark_prefill_complete`] of the booking `claim` names.
    pub fn mark_prefill_complete_claimed(&self, booking_id: &str, claim: Claim) -> bool {
        let (done, facts) = self.core.mark_prefill_complete(booking_id, claim, now());
        self.record(facts);
        done
    }

    /// Frees the id's current booking exactly once, whoever holds it (tests, tools); unknown or
    /// repeated frees are no-ops returning false.
    pub fn free(&self, booking_id: &str) -> bool {
        self.free_claimed(booking_id, Claim::Any)
    }

    /// Frees the booking `claim` names: a stream frees only its own generation, the API only
    /// bookings the API made.
    pub fn free_claimed(&self, booking_id: &str, claim: Claim) -> bool {
        let (freed, facts) = self.core.free(booking_id, claim, now());
        self.record(facts);
        freed
    }

    /// Moves a booking to the endpoint that actually served it (Envoy may fall back).
    pub fn move_booking(&self, booking_id: &str, claim: Claim, served: SocketAddr) -> bool {
        let (moved, facts) = self.core.move_booking(booking_id, claim, served);
        self.record(facts);
        moved
    }

    /// Reaps bookings older than `booking_ttl` and expired index entries; returns bookings reaped.
    pub fn reap_expired(&self, now: tokio::time::Instant) -> usize {
        let (reaped, facts) = self.core.reap_expired(now.into_std());
        self.record(facts);
        reaped
    }

    /// Sweeps cleared ranks' holders out of the indexes, one shard per call
    /// ([`kvpick_core::Core::sweep_cleared_ranks`]).
    pub fn sweep_cleared_ranks(&self, now: tokio::time::Instant) -> usize {
        self.core.sweep_cleared_ranks(now.into_std())
    }

    /// Number of live bookings.
    pub fn live_bookings(&self) -> usize {
        self.core.live_bookings()
    }

    /// The catalog with per-rank load, sorted by worker name.
    pub fn list_workers(&self, model: Option<&str>) -> Vec<WorkerView> {
        self.core.list_workers(model)
    }

    /// Records that `rank` holds `seq_hashes` in the partition `key` (warm-up, tests).
    pub fn insert_blocks(
        &self,
        key: &PartitionKey,
        rank: RankKey,
        seq_hashes: &[u64],
        tier: Tier,
        expires: Option<tokio::time::Instant>,
    ) {
        self.core.insert_blocks(
            key,
            rank,
            seq_hashes,
            tier,
            expires.map(tokio::time::Instant::into_std),
            now(),
        );
    }

    /// Applies KV events published by one rank, without a lag (a replayed batch, tests).
    /// Returns what was applied / dropped.
    pub fn apply_kv_events(
        &self,
        rank: RankKey,
        events: &[kvpick_core::event::KvEvent],
    ) -> EventStats {
        self.apply_kv_batch(rank, events, None)
    }

    /// Applies one batch of KV events published by one rank; `lag` is how late a live batch
    /// arrived (its timestamp to now, `crate::sources::events::event_lag`), `None` for a replayed one. The
    /// lag lengthens how long the partition's unconfirmed predictions outlive their request
    /// (`kvpick_prediction_grace_seconds`).
    pub fn apply_kv_batch(
        &self,
        rank: RankKey,
        events: &[kvpick_core::event::KvEvent],
        lag: Option<std::time::Duration>,
    ) -> EventStats {
        let (stats, facts) = self.core.apply_kv_events(rank, events, lag, now());
        self.record(facts);
        stats
    }

    /// Forgets a rank's blocks (its engine restarted).
    pub fn clear_rank(&self, rank: RankKey) {
        self.core.clear_rank(rank);
    }

    /// Marks a rank's engine reachable or not (the KV-event subscription's probe, the engine
    /// scraper); an unreachable rank takes no picks. Metrics and logs once per change.
    /// One engine-metrics reading of a rank: stored, and the rank's bookings reconciled with
    /// it (what that frees is released to waiting requests). False when the rank is gone.
    pub fn record_engine_metrics(
        &self,
        rank: RankKey,
        reading: kvpick_core::EngineMetrics,
    ) -> bool {
        let (known, facts) = self.core.record_engine_metrics(rank, reading);
        self.record(facts);
        known
    }

    pub fn set_rank_reachable(&self, rank: RankKey, reachable: bool) {
        let facts = self.core.set_rank_reachable(rank, reachable, now());
        self.record(facts);
    }

    /// The block size of a model's partition (default until a worker declares one).
    pub fn block_size(&self, key: &PartitionKey) -> u32 {
        self.core.block_size(key)
    }

    /// Per-rank overlap (GPU-tier blocks) of a prompt in a model's partition, for the API.
    pub fn overlap_scores(
        &self,
        request: &SelectionRequest,
    ) -> Result<(u32, Vec<(PickedRank, TierDepths)>), SelectError> {
        self.core.overlap_scores(request, now())
    }
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

    fn own(&self) -> Claim {
        Claim::Generation(self.selection.generation)
    }

    pub fn mark_prefill_complete(&self) {
        self.core
            .mark_prefill_complete_claimed(&self.selection.booking_id, self.own());
    }

    /// The picked rank answered with HTTP `status` (a 5xx counts against it; only 2xx make its
    /// first byte a TTFT sample).
    pub fn response_status(&self, status: u16) {
        self.record_response(kvpick_core::ResponseClass::of_status(status));
    }

    /// The stream ended before any response (client gone, or Envoy reset it): the index
    /// entries the pick predicted go, and the rank is not blamed.
    pub fn response_reset(&self) {
        self.record_response(kvpick_core::ResponseClass::Reset);
    }

    fn record_response(&self, class: kvpick_core::ResponseClass) {
        let (_, facts) =
            self.core
                .core
                .record_response(&self.selection.booking_id, self.own(), class, now());
        self.core.record(facts);
    }

    /// The response ended after `output_tokens` tokens (before the booking is freed).
    pub fn decode_complete(&self, output_tokens: u64) {
        let (_, facts) = self.core.core.decode_complete(
            &self.selection.booking_id,
            self.own(),
            output_tokens,
            now(),
        );
        self.core.record(facts);
    }

    /// Moves the booking to the endpoint that served the request.
    pub fn served_by(&self, endpoint: SocketAddr) -> bool {
        self.core
            .move_booking(&self.selection.booking_id, self.own(), endpoint)
    }

    /// Frees the booking now.
    pub fn free(mut self) {
        self.armed = false;
        self.core
            .free_claimed(&self.selection.booking_id, self.own());
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
            self.core.free_claimed(
                &self.selection.booking_id,
                Claim::Generation(self.selection.generation),
            );
        }
    }
}

/// Saturation at one active request per rank: the second request waits (tests of queueing).
#[cfg(test)]
pub(crate) const ONE_SLOT: kvpick_core::SaturationLimits = kvpick_core::SaturationLimits {
    max_wait_seconds: None,
    max_active_requests: Some(1),
    engine_waiting: None,
    engine_kv_usage: None,
};

/// A core over one worker `a` of model `m` with one rank (port 8000), for tests.
#[cfg(test)]
pub(crate) fn one_rank_core(config: CoreConfig) -> Arc<SelectionCore> {
    let core = SelectionCore::new(config, Metrics::new());
    core.apply_snapshot(vec![kvpick_core::catalog::WorkerSpec::for_test(
        "a",
        "m",
        kvpick_core::catalog::RankLayout::PerPort(vec![8000]),
    )])
    .unwrap_or_else(|e| panic!("{e}"));
    core
}

#[cfg(test)]
mod tests;
