//! Pool-level gauges for dashboards and autoscalers (KEDA, an HPA external metric): ready
//! endpoints, average engine KV-cache use, queue and running requests, the pool's saturation, and
//! this process's flow-control queue (its length and the age of its oldest request). It keeps
//! the last value of what it is handed (rank loads from the core's facts, engine readings from
//! the scraper, waiters from admission) and computes the gauges when `/metrics` is scraped.
//!
//! It also exports each rank's last fresh engine reading as it was scraped (waiting, running, KV
//! use per `worker`, `rank`): one series per rank with a fresh reading, at most
//! [`MAX_ENGINE_RANK_SERIES`] ranks (the rest are in the averages only), removed once the
//! reading goes stale or the rank leaves.
//!
//! It must not decide anything: saturation here is a reading for operators, the core's own
//! saturation rule (`kvpick_core::flow::is_saturated`) is what flow control applies.

// Static metric definitions: an error is a programming error every test run hits at start-up.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvpick_core::{EngineMetrics, RankKey, RankLoad, SaturationLimits};
use prometheus::{Gauge, GaugeVec, IntGauge, IntGaugeVec, Opts, Registry};

use super::EppMetrics;

/// What the gauges are computed against (`--saturation-*`, `--engine-metrics-stale-ms`).
#[derive(Debug, Clone, Copy)]
pub struct PoolConfig {
    pub limits: SaturationLimits,
    /// Engine readings older than this are ignored (as the core ignores them).
    pub stale_after: Duration,
}

impl Default for PoolConfig {
    fn default() -> Self {
        PoolConfig {
            limits: SaturationLimits::default(),
            stale_after: Duration::from_secs(5),
        }
    }
}

/// Most ranks whose engine readings are exported one by one (`kvpick_engine_*{worker,rank}`):
/// three series each, so a pool of thousands of ranks does not export thousands more series
/// than its per-rank load gauges. Past it, the ranks first in (worker, rank) order are exported.
pub const MAX_ENGINE_RANK_SERIES: usize = 1_024;

/// One rank's last engine reading: waiting, running, KV use, when, and its worker's name.
type Reading = (u64, u64, f64, Instant, Arc<str>);

/// A reading as exported: worker, rank, and waiting, running, KV use.
type RankReading = (Arc<str>, u32, (u64, u64, f64));

#[derive(Default)]
struct State {
    engine: HashMap<RankKey, Reading>,
    /// The (worker, rank) labels of the per-rank engine series exported now.
    engine_labelled: std::collections::HashSet<(Arc<str>, u32)>,
    active: HashMap<(Arc<str>, u32), u64>,
    schedulable: i64,
    /// Queued requests of this process by ticket, with when they joined the queue.
    waiting: HashMap<u64, Instant>,
}

/// The pool tracker and its `kvpick_*` gauges. Cheap to clone.
#[derive(Clone)]
pub struct PoolTracker {
    state: Arc<Mutex<State>>,
    config: Arc<Mutex<PoolConfig>>,
    /// `--saturation-max-requests` is set: rank loads are kept (else they count for nothing, and
    /// the booking path takes no lock here).
    track_active: Arc<AtomicBool>,
    pub saturation: Gauge,
    pub saturated_ratio: Gauge,
    pub queue_length: IntGauge,
    pub queue_oldest_age: Gauge,
    /// Per rank, its last fresh engine reading: waiting and running requests, KV-cache use.
    pub engine_waiting: IntGaugeVec,
    pub engine_running: IntGaugeVec,
    pub engine_kv_usage: GaugeVec,
}

/// The pool's figures at one instant.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PoolFigures {
    pub ready_endpoints: i64,
    /// Ranks with a fresh engine reading.
    pub reporting: usize,
    pub average_kv: f64,
    pub average_queue: f64,
    pub average_running: f64,
    pub saturation: f64,
    pub saturated_ratio: f64,
    pub queue_length: usize,
    pub queue_oldest_age_seconds: f64,
}

impl PoolTracker {
    pub fn register(registry: &Registry) -> Self {
        let reg = |c: Box<dyn prometheus::core::Collector>| {
            registry.register(c).expect("metric names are unique")
        };
        let saturation = Gauge::new(
            "kvpick_pool_saturation",
            "Average load of the pool's ranks against the --saturation-* limits (0 = idle, 1 = at \
             the limits, > 1 over): the mean over ranks with a fresh engine reading of the larger of \
             waiting/--saturation-engine-waiting and kv use/--saturation-kv-usage, or with \
             --saturation-max-requests the mean of active/max requests when that is larger",
        )
        .unwrap();
        let saturated_ratio = Gauge::new(
            "kvpick_pool_saturated_ranks_ratio",
            "Fraction (0..1) of the pool's ranks at or over a --saturation-* limit (engine waiting, \
             KV use, or --saturation-max-requests)",
        )
        .unwrap();
        let queue_length = IntGauge::new(
            "kvpick_queue_length",
            "Requests waiting in this process's flow-control queue, every band (an autoscaling signal)",
        )
        .unwrap();
        let queue_oldest_age = Gauge::new(
            "kvpick_queue_oldest_age_seconds",
            "How long the oldest request in this process's flow-control queue has waited (0 when empty)",
        )
        .unwrap();
        let engine_waiting = IntGaugeVec::new(
            Opts::new(
                "kvpick_engine_requests_waiting",
                "Per rank, requests waiting in the engine as last scraped (vllm:num_requests_waiting; \
                 fresh readings only, at most 1,024 ranks)",
            ),
            &["worker", "rank"],
        )
        .unwrap();
        let engine_running = IntGaugeVec::new(
            Opts::new(
                "kvpick_engine_requests_running",
                "Per rank, requests running in the engine as last scraped (vllm:num_requests_running; \
                 fresh readings only, at most 1,024 ranks)",
            ),
            &["worker", "rank"],
        )
        .unwrap();
        let engine_kv_usage = GaugeVec::new(
            Opts::new(
                "kvpick_engine_kv_cache_usage_ratio",
                "Per rank, the engine's KV-cache use (0..1) as last scraped (vllm:kv_cache_usage_perc; \
                 fresh readings only, at most 1,024 ranks)",
            ),
            &["worker", "rank"],
        )
        .unwrap();
        reg(Box::new(saturation.clone()));
        reg(Box::new(saturated_ratio.clone()));
        reg(Box::new(queue_length.clone()));
        reg(Box::new(queue_oldest_age.clone()));
        reg(Box::new(engine_waiting.clone()));
        reg(Box::new(engine_running.clone()));
        reg(Box::new(engine_kv_usage.clone()));
        PoolTracker {
            state: Arc::default(),
            config: Arc::default(),
            track_active: Arc::default(),
            saturation,
            saturated_ratio,
            queue_length,
            queue_oldest_age,
            engine_waiting,
            engine_running,
            engine_kv_usage,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn configure(&self, config: PoolConfig) {
        self.track_active.store(
            config.limits.max_active_requests.is_some(),
            Ordering::Relaxed,
        );
        *self.config.lock().unwrap_or_else(|e| e.into_inner()) = config;
    }

    fn config(&self) -> PoolConfig {
        *self.config.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A rank's booked load (from [`kvpick_core::Fact::Load`]).
    pub fn load(&self, worker: &Arc<str>, dp_rank: u32, load: &RankLoad) {
        if !self.track_active.load(Ordering::Relaxed) {
            return;
        }
        self.lock()
            .active
            .insert((Arc::clone(worker), dp_rank), load.active_requests);
    }

    /// A rank left the catalog: its load and its engine reading go.
    pub fn rank_gone(&self, worker: &Arc<str>, dp_rank: u32) {
        let mut state = self.lock();
        state.active.remove(&(Arc::clone(worker), dp_rank));
        state
            .engine
            .retain(|key, r| !(key.dp_rank == dp_rank && r.4 == *worker));
    }

    /// Schedulable workers in the catalog.
    pub fn schedulable(&self, workers: i64) {
        self.lock().schedulable = workers;
    }

    /// An engine reading of `rank` (of the worker named `worker`).
    pub fn engine_reading(&self, rank: RankKey, worker: &Arc<str>, reading: &EngineMetrics) {
        self.lock().engine.insert(
            rank,
            (
                reading.waiting,
                reading.running,
                reading.kv_usage,
                reading.at,
                Arc::clone(worker),
            ),
        );
    }

    /// A request of this process joined the queue (`ticket`), or left it.
    pub fn enqueued(&self, ticket: u64, at: Instant) {
        self.lock().waiting.insert(ticket, at);
    }

    pub fn dequeued(&self, ticket: u64) {
        self.lock().waiting.remove(&ticket);
    }

    /// The figures at `now`; stale engine readings are dropped.
    pub fn figures(&self, now: Instant) -> PoolFigures {
        let config = self.config();
        let limits = config.limits;
        let mut state = self.lock();
        state
            .engine
            .retain(|_, r| now.saturating_duration_since(r.3) <= config.stale_after);
        let reporting = state.engine.len();
        let n = reporting.max(1) as f64;
        let (mut kv, mut queue, mut running, mut engine_load, mut engine_saturated) =
            (0.0, 0.0, 0.0, 0.0, 0usize);
        for (waiting, run, kv_usage, ..) in state.engine.values() {
            kv += kv_usage;
            queue += *waiting as f64;
            running += *run as f64;
            let w = limits
                .engine_waiting
                .filter(|l| *l > 0)
                .map_or(0.0, |l| *waiting as f64 / l as f64);
            let k = limits
                .engine_kv_usage
                .filter(|l| *l > 0.0)
                .map_or(0.0, |l| kv_usage / l);
            engine_load += w.max(k);
            if w >= 1.0 || k >= 1.0 {
                engine_saturated += 1;
            }
        }
        let (mut active_load, mut active_ratio) = (0.0, 0.0);
        if let Some(max) = limits.max_active_requests.filter(|m| *m > 0) {
            let ranks = state.active.len().max(1) as f64;
            active_load = state
                .active
                .values()
                .map(|a| *a as f64 / max as f64)
                .sum::<f64>()
                / ranks;
            active_ratio = state.active.values().filter(|a| **a >= max).count() as f64 / ranks;
        }
        let engine_ratio = if reporting == 0 {
            0.0
        } else {
            engine_saturated as f64 / reporting as f64
        };
        let oldest = state
            .waiting
            .values()
            .map(|at| now.saturating_duration_since(*at).as_secs_f64())
            .fold(0.0, f64::max);
        PoolFigures {
            ready_endpoints: state.schedulable,
            reporting,
            average_kv: kv / n,
            average_queue: queue / n,
            average_running: running / n,
            saturation: (engine_load / n).max(active_load),
            saturated_ratio: engine_ratio.max(active_ratio),
            queue_length: state.waiting.len(),
            queue_oldest_age_seconds: oldest,
        }
    }

    /// Sets the per-rank engine gauges to the fresh readings (after [`PoolTracker::figures`]
    /// dropped the stale ones), at most [`MAX_ENGINE_RANK_SERIES`] ranks, and removes the series
    /// of ranks no longer among them.
    fn refresh_ranks(&self) {
        let mut state = self.lock();
        let mut fresh: Vec<RankReading> = state
            .engine
            .iter()
            .map(|(key, r)| (Arc::clone(&r.4), key.dp_rank, (r.0, r.1, r.2)))
            .collect();
        fresh.sort_by(|a, b| (&a.0, a.1).cmp(&(&b.0, b.1)));
        fresh.truncate(MAX_ENGINE_RANK_SERIES);
        let mut labelled = std::collections::HashSet::with_capacity(fresh.len());
        for (worker, rank, (waiting, running, kv)) in fresh {
            let labels = [&*worker, &rank.to_string()];
            self.engine_waiting
                .with_label_values(&labels)
                .set(i64::try_from(waiting).unwrap_or(i64::MAX));
            self.engine_running
                .with_label_values(&labels)
                .set(i64::try_from(running).unwrap_or(i64::MAX));
            self.engine_kv_usage.with_label_values(&labels).set(kv);
            labelled.insert((worker, rank));
        }
        for (worker, rank) in state.engine_labelled.difference(&labelled) {
            let labels = [&**worker, &rank.to_string()];
            let _ = self.engine_waiting.remove_label_values(&labels);
            let _ = self.engine_running.remove_label_values(&labels);
            let _ = self.engine_kv_usage.remove_label_values(&labels);
        }
        state.engine_labelled = labelled;
    }

    /// Sets every pool gauge (kvpick's and the EPP ones) to the figures at `now`.
    pub fn refresh(&self, epp: &EppMetrics, now: Instant) -> PoolFigures {
        let f = self.figures(now);
        self.refresh_ranks();
        self.saturation.set(f.saturation);
        self.saturated_ratio.set(f.saturated_ratio);
        self.queue_length.set(f.queue_length as i64);
        self.queue_oldest_age.set(f.queue_oldest_age_seconds);
        let name = epp.pool_name();
        for s in epp.series() {
            let p = &s.pool;
            p.ready_endpoints
                .with_label_values(&[&name])
                .set(f.ready_endpoints);
            p.pool_saturation
                .with_label_values(&[&name])
                .set(f.saturation);
            if f.reporting > 0 {
                p.average_kv.with_label_values(&[&name]).set(f.average_kv);
                p.average_queue
                    .with_label_values(&[&name])
                    .set(f.average_queue);
                p.average_running
                    .with_label_values(&[&name])
                    .set(f.average_running);
            } else {
                // No fresh reading: no average (a 0 would read as an idle pool).
                let _ = p.average_kv.remove_label_values(&[&name]);
                let _ = p.average_queue.remove_label_values(&[&name]);
                let _ = p.average_running.remove_label_values(&[&name]);
            }
        }
        f
    }
}
