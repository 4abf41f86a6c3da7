//! Prometheus metrics: one registry per process, owned here and handed to the parts that record.
//! This module only defines and exposes metrics; it never makes routing decisions.

// Static metric definitions and registration: an error is a programming error (a bad name or a
// duplicate) that every test run hits at start-up, never something input can cause.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub use crate::observability::epp_metrics::BoundedLabel;
pub use bookings::BookingBoundMetrics;
pub use cache_view::CacheViewMetrics;
pub use conn::ConnMetrics;
pub use grace::GraceMetrics;
use kvpick_core::Facts;
pub use memory::MemoryMetrics;
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
pub use ranks::RankMetrics;

mod apply;
mod bookings;
pub mod cache_view;
mod conn;
mod grace;
pub mod kv_remote;
mod memory;
mod ranks;
mod tiers;

/// Every metric kvpick exports, registered per area on one registry. Cheap to clone (all
/// handles are reference-counted). Tokenization registers its own (`tokenize::TokenizeMetrics`).
#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    pub extproc: ExtProcMetrics,
    pub selection: SelectionMetrics,
    pub events: EventMetrics,
    pub catalog: CatalogMetrics,
    pub engine: EngineScrapeMetrics,
    pub flow: FlowMetrics,
    pub outlier: OutlierMetrics,
    pub conn: ConnMetrics,
    /// The memory account (`crate::transport::memory_account`).
    pub memory: MemoryMetrics,
    /// The engines' standing per rank (reachability, block-size mismatch).
    pub ranks: RankMetrics,
    /// Cache-view accuracy: predicted against engine-reported cached tokens.
    pub cache_view: CacheViewMetrics,
    /// Held bookings decayed or reconciled.
    pub bookings: BookingBoundMetrics,
    /// How long predictions outlive their request, per partition.
    pub grace: GraceMetrics,
    /// The shared KV tier and KV transfer hints.
    pub tiers: tiers::TierMetrics,
    /// The EPP contract's series (`llm_d_epp_*`, ...), as `--metrics-families` chose.
    pub epp: crate::observability::epp_metrics::EppMetrics,
    /// Pool and queue gauges computed at each scrape (autoscaling signals).
    pub pool: crate::observability::epp_metrics::pool::PoolTracker,
    families: crate::observability::epp_metrics::Families,
    /// Read at each scrape: what the selection core reports as it is now (index sizes).
    scrape_facts: std::sync::Arc<std::sync::OnceLock<ScrapeFacts>>,
}

/// Facts a scrape asks for ([`Metrics::on_scrape`]).
type ScrapeFacts = Box<dyn Fn() -> Facts + Send + Sync>;

/// How picked ranks answer, and outlier detection (ARCHITECTURE.md §3b).
#[derive(Clone)]
pub struct OutlierMetrics {
    /// Responses per worker rank and status class (2xx, 4xx, 5xx, reset).
    pub responses: IntCounterVec,
    /// Ejections per worker (a probe's failure counts again).
    pub ejections: IntCounterVec,
    /// Ranks out of picks now (ejected, or with their half-open probe in flight).
    pub ejected_ranks: IntGauge,
}

impl OutlierMetrics {
    fn register(registry: &Registry) -> Self {
        OutlierMetrics {
            responses: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_upstream_responses_total",
                        "Responses of picked ranks by worker, rank and status class (2xx, 4xx, 5xx, reset)",
                    ),
                    &["worker", "rank", "class"],
                )
                .unwrap(),
            ),
            ejections: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_outlier_ejections_total",
                        "Ranks ejected from picks after consecutive 5xx / connect failures, by worker",
                    ),
                    &["worker"],
                )
                .unwrap(),
            ),
            ejected_ranks: register(
                registry,
                IntGauge::new(
                    "kvpick_outlier_ejected_ranks",
                    "Ranks out of picks now (ejected, or probing)",
                )
                .unwrap(),
            ),
        }
    }
}

/// Flow control (ARCHITECTURE.md §12): the queue per priority band and fairness key, its exits,
/// SLO attainment. Priority and fairness-key labels are bounded ([`BoundedLabel`]: 16 priorities,
/// 32 fairness keys, the rest `other`); an absent fairness key is `default`.
#[derive(Clone)]
pub struct FlowMetrics {
    pub queue_depth: IntGaugeVec,
    pub queue_wait: HistogramVec,
    pub queue_exits: IntCounterVec,
    pub slo_ttft: IntCounterVec,
    pub slo_tpot: IntCounterVec,
    /// 1 for each InferenceObjective / InferenceModelRewrite group/version whose objects count.
    pub crd_in_use: IntGaugeVec,
    priorities: std::sync::Arc<BoundedLabel>,
    fairness_keys: std::sync::Arc<BoundedLabel>,
}

impl FlowMetrics {
    fn register(registry: &Registry) -> Self {
        FlowMetrics {
            queue_depth: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "kvpick_queue_depth",
                        "Requests waiting in kvpick's queue for capacity, per priority band",
                    ),
                    &["priority"],
                )
                .unwrap(),
            ),
            queue_wait: register(
                registry,
                HistogramVec::new(
                    HistogramOpts::new(
                        "kvpick_queue_wait_seconds",
                        "Time dispatched requests waited in the queue, per band and fairness key",
                    )
                    .buckets(vec![
                        0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                        60.0,
                    ]),
                    &["priority", "fairness"],
                )
                .unwrap(),
            ),
            queue_exits: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_queue_rejected_total",
                        "Requests that left (or could not join) the queue without a booking, by \
                         reason: timeout, slo, full, cancelled, refused",
                    ),
                    &["priority", "reason"],
                )
                .unwrap(),
            ),
            slo_ttft: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_slo_ttft_total",
                        "Requests with a TTFT SLO (x-llm-d-slo-ttft-ms) by outcome at their first \
                         token: met or missed (refused ones are in kvpick_queue_rejected_total)",
                    ),
                    &["priority", "outcome"],
                )
                .unwrap(),
            ),
            slo_tpot: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_slo_tpot_total",
                        "Requests with a TPOT SLO (x-llm-d-slo-tpot-ms) by outcome at their end \
                         (decode time over output tokens, from the response usage): met or missed",
                    ),
                    &["priority", "outcome"],
                )
                .unwrap(),
            ),
            crd_in_use: register(
                registry,
                IntGaugeVec::new(
                    Opts::new(
                        "kvpick_flow_crd_in_use",
                        "1 for each InferenceObjective / InferenceModelRewrite group/version whose \
                         objects count (llm-d.ai wins over inference.networking.x-k8s.io), 0 for \
                         the others watched",
                    ),
                    &["kind", "api_version"],
                )
                .unwrap(),
            ),
            priorities: std::sync::Arc::new(BoundedLabel::new(16)),
            fairness_keys: std::sync::Arc::new(BoundedLabel::new(32)),
        }
    }

    /// Counts one SLO outcome (`met` / `missed`) of a band in `counter`.
    fn slo_outcome(&self, counter: &IntCounterVec, priority: i32, met: bool) {
        let outcome = if met { "met" } else { "missed" };
        counter
            .with_label_values(&[&self.priority_label(priority), outcome])
            .inc();
    }

    pub fn priority_label(&self, priority: i32) -> String {
        self.priorities.label(&priority.to_string())
    }

    pub fn fairness_label(&self, key: &str) -> String {
        if key.is_empty() {
            return "default".into();
        }
        self.fairness_keys.label(key)
    }
}

/// The ext_proc host: pick outcomes and latency, streams, response usage, the body budget.
#[derive(Clone)]
pub struct ExtProcMetrics {
    /// Pick outcomes by status ("200" for a successful pick, else the error status).
    pub requests: IntCounterVec,
    /// Time spent inside the selection core per pick.
    pub pick_latency: Histogram,
    /// ext_proc streams by how they ended.
    pub streams: IntCounterVec,
    /// Response time from pick to first response byte, by worker.
    pub time_to_first_byte: HistogramVec,
    /// Token usage reported by the engines in responses (prompt, completion, cached).
    pub usage_tokens: IntCounterVec,
    /// Request-body bytes currently buffered by ext_proc streams (the global body budget in use).
    pub body_bytes_buffered: IntGauge,
    /// Requests answered 503 because the global body budget could not hold their body.
    pub body_budget_rejected: IntCounter,
    /// ext_proc streams open now (`--max-ext-proc-streams` in use).
    pub streams_open: IntGauge,
}

impl ExtProcMetrics {
    fn register(registry: &Registry) -> Self {
        let requests = register(
            registry,
            IntCounterVec::new(
                Opts::new("kvpick_requests_total", "Pick outcomes by HTTP status"),
                &["status"],
            )
            .unwrap(),
        );
        let pick_latency = register(
            registry,
            Histogram::with_opts(
                HistogramOpts::new(
                    "kvpick_pick_latency_seconds",
                    "Time spent parsing and selecting per request, from body end to routing answer",
                )
                .buckets(vec![
                    5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                    5e-2, 0.1,
                ]),
            )
            .unwrap(),
        );
        let streams = register(
            registry,
            IntCounterVec::new(
                Opts::new("kvpick_extproc_streams_total", "ext_proc streams by ending"),
                &["end"],
            )
            .unwrap(),
        );
        let time_to_first_byte = register(
            registry,
            HistogramVec::new(
                HistogramOpts::new(
                    "kvpick_time_to_first_byte_seconds",
                    "From pick to the first response body byte, per worker",
                )
                .buckets(prometheus::exponential_buckets(0.001, 2.0, 16).unwrap()),
                &["worker"],
            )
            .unwrap(),
        );
        let usage_tokens = register(
            registry,
            IntCounterVec::new(
                Opts::new(
                    "kvpick_usage_tokens_total",
                    "Tokens reported in response usage (kind: prompt, completion, cached)",
                ),
                &["kind"],
            )
            .unwrap(),
        );
        let body_bytes_buffered = register(
            registry,
            IntGauge::new(
                "kvpick_body_bytes_buffered",
                "Request-body bytes buffered by ext_proc streams (--max-buffered-body-bytes in use)",
            )
            .unwrap(),
        );
        let body_budget_rejected = register(
            registry,
            IntCounter::new(
                "kvpick_body_budget_rejected_total",
                "Requests answered 503 because --max-buffered-body-bytes was exhausted",
            )
            .unwrap(),
        );
        let streams_open = register(
            registry,
            IntGauge::new(
                "kvpick_extproc_streams_open",
                "ext_proc streams open now (--max-ext-proc-streams in use)",
            )
            .unwrap(),
        );
        ExtProcMetrics {
            streams_open,
            requests,
            pick_latency,
            streams,
            time_to_first_byte,
            usage_tokens,
            body_bytes_buffered,
            body_budget_rejected,
        }
    }
}

/// The selection core (recorded from its facts): per-rank load, bookings, sessions, the KV index.
#[derive(Clone)]
pub struct SelectionMetrics {
    /// In-flight requests per (worker, rank).
    pub inflight: IntGaugeVec,
    /// Sum of `inflight` over every rank.
    pub inflight_total: IntGauge,
    /// Queued prefill tokens per rank (bookings whose prefill is not complete).
    pub active_prefill_tokens: IntGaugeVec,
    /// KV blocks of active requests per rank.
    pub active_decode_blocks: IntGaugeVec,
    /// Share of the prompt's blocks already cached on the picked rank (0..1), per pick.
    pub predicted_overlap: Histogram,
    /// Bookings reaped because they outlived `booking_ttl`.
    pub bookings_expired: IntCounter,
    /// Live session bindings.
    pub sessions_live: IntGauge,
    /// Session outcomes: created, reused, table_full, released, expired, parent_followed,
    /// parent_declined.
    pub session_events: IntCounterVec,
    /// Session bindings dropped, by reason.
    pub session_invalidated: IntCounterVec,
    /// Blocks in the KV index per partition (model).
    pub index_blocks: IntGaugeVec,
    /// Heap bytes of the KV index plus engine-hash maps per partition.
    pub index_bytes: IntGaugeVec,
    /// |observed - predicted| TTFT of each pick, seconds (the estimator's error).
    pub ttft_prediction_error: Histogram,
    /// Observed / predicted TTFT of each pick (1 = exact; > 1: slower than predicted).
    pub ttft_prediction_ratio: Histogram,
}

impl SelectionMetrics {
    fn register(registry: &Registry) -> Self {
        let inflight = register(
            registry,
            IntGaugeVec::new(
                Opts::new(
                    "kvpick_inflight_requests",
                    "In-flight requests per worker rank",
                ),
                &["worker", "rank"],
            )
            .unwrap(),
        );
        let inflight_total = register(
            registry,
            IntGauge::new("kvpick_inflight_total", "In-flight requests over all ranks").unwrap(),
        );
        let active_prefill_tokens = register(
            registry,
            IntGaugeVec::new(
                Opts::new(
                    "kvpick_active_prefill_tokens",
                    "Prefill tokens booked and not yet prefilled, per rank",
                ),
                &["worker", "rank"],
            )
            .unwrap(),
        );
        let active_decode_blocks = register(
            registry,
            IntGaugeVec::new(
                Opts::new(
                    "kvpick_active_decode_blocks",
                    "KV blocks of active requests, per rank",
                ),
                &["worker", "rank"],
            )
            .unwrap(),
        );
        let predicted_overlap = register(
            registry,
            Histogram::with_opts(
                HistogramOpts::new(
                    "kvpick_predicted_overlap_ratio",
                    "Share of the prompt's blocks cached on the picked rank, per pick",
                )
                .buckets(vec![
                    0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0,
                ]),
            )
            .unwrap(),
        );
        let bookings_expired = register(
            registry,
            IntCounter::new(
                "kvpick_bookings_expired_total",
                "Bookings reaped after booking_ttl",
            )
            .unwrap(),
        );
        let sessions_live = register(
            registry,
            IntGauge::new("kvpick_session_bindings", "Live session bindings").unwrap(),
        );
        let session_events = register(
            registry,
            IntCounterVec::new(
                Opts::new(
                    "kvpick_session_events_total",
                    "Session affinity outcomes (created, reused, table_full, released, expired, parent_followed, parent_declined)",
                ),
                &["event"],
            )
            .unwrap(),
        );
        let session_invalidated = register(
            registry,
            IntCounterVec::new(
                Opts::new(
                    "kvpick_session_invalidated_total",
                    "Session bindings dropped, by reason",
                ),
                &["reason"],
            )
            .unwrap(),
        );
        let index_blocks = register(
            registry,
            IntGaugeVec::new(
                Opts::new(
                    "kvpick_index_blocks",
                    "Blocks in the KV index per partition",
                ),
                &["model", "routing_group"],
            )
            .unwrap(),
        );
        let index_bytes = register(
            registry,
            IntGaugeVec::new(
                Opts::new(
                    "kvpick_index_bytes",
                    "Heap bytes of the KV index and its engine-hash maps per partition \
                     (estimated from capacities, refreshed every 10 s)",
                ),
                &["model", "routing_group"],
            )
            .unwrap(),
        );
        let ttft_prediction_error = register(
            registry,
            Histogram::with_opts(
                HistogramOpts::new(
                    "kvpick_ttft_prediction_error_seconds",
                    "|observed - predicted| time to first token per pick (the TTFT estimator's error)",
                )
                .buckets(prometheus::exponential_buckets(0.001, 2.0, 16).unwrap()),
            )
            .unwrap(),
        );
        let ttft_prediction_ratio = register(
            registry,
            Histogram::with_opts(
                HistogramOpts::new(
                    "kvpick_ttft_prediction_ratio",
                    "Observed / predicted time to first token per pick (1 = exact)",
                )
                .buckets(vec![
                    0.125, 0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 8.0,
                ]),
            )
            .unwrap(),
        );
        SelectionMetrics {
            ttft_prediction_error,
            ttft_prediction_ratio,
            inflight,
            inflight_total,
            active_prefill_tokens,
            active_decode_blocks,
            predicted_overlap,
            bookings_expired,
            sessions_live,
            session_events,
            session_invalidated,
            index_blocks,
            index_bytes,
        }
    }
}

/// KV-event ingestion: events, gaps, replays, engine restarts, subscriptions.
#[derive(Clone)]
pub struct EventMetrics {
    /// KV events by result (applied, dropped, decode_error).
    pub kv_events: IntCounterVec,
    /// Stores and removes by KV-cache group kind and whether the group filter admitted them
    /// (`events::groups`).
    pub kv_events_by_kind: IntCounterVec,
    /// Sequence gaps seen on KV-event streams.
    pub kv_event_gaps: IntCounter,
    /// Replays by result (ok, incomplete, failed).
    pub kv_replays: IntCounterVec,
    /// Ranks cleared because their publisher restarted (sequence went backwards, or a
    /// resubscription's replay did not continue the run).
    pub kv_resets: IntCounter,
    /// KV-event subscriptions currently connected.
    pub kv_subscriptions: IntGauge,
    /// Per rank: 1 once its engine's KV events apply (precise), 0 while only kvpick's own picks
    /// feed its index (approximate).
    pub rank_precise: IntGaugeVec,
    /// KV stores dropped because their block size is not the partition's.
    pub block_size_mismatches: IntCounter,
    /// Per live batch: from the engine's timestamp (`ts`) to the batch applied to the index.
    pub event_lag: Histogram,
}

impl EventMetrics {
    fn register(registry: &Registry) -> Self {
        let kv_events = register(
            registry,
            IntCounterVec::new(
                Opts::new("kvpick_kv_events_total", "KV events by result"),
                &["result"],
            )
            .unwrap(),
        );
        let kv_events_by_kind = register(
            registry,
            IntCounterVec::new(
                Opts::new(
                    "kvpick_kv_events_by_kind_total",
                    "KV stores and removes by the KV-cache group kind of their group_idx (vLLM's kv_cache_spec_kind; none without a group, unclassified for a group whose kind the rank has not announced) and outcome: admitted (full, MLA or sink-full attention; groupless and legacy events) or dropped (sliding-window, Mamba and other kinds, whose blocks do not make a prefix reusable)",
                ),
                &["event", "kind", "outcome"],
            )
            .unwrap(),
        );
        let kv_event_gaps = register(
            registry,
            IntCounter::new(
                "kvpick_kv_event_gaps_total",
                "Sequence gaps on KV-event streams",
            )
            .unwrap(),
        );
        let kv_replays = register(
            registry,
            IntCounterVec::new(
                Opts::new("kvpick_kv_replays_total", "KV-event replays by result"),
                &["result"],
            )
            .unwrap(),
        );
        let kv_resets = register(
            registry,
            IntCounter::new(
                "kvpick_kv_resets_total",
                "Ranks cleared because their publisher restarted (sequence back, or a resubscription whose replay did not continue the run)",
            )
            .unwrap(),
        );
        let kv_subscriptions = register(
            registry,
            IntGauge::new(
                "kvpick_kv_subscriptions",
                "KV-event subscriptions currently connected",
            )
            .unwrap(),
        );
        let rank_precise = register(
            registry,
            IntGaugeVec::new(
                Opts::new(
                    "kvpick_rank_kv_events_precise",
                    "1 once a rank's KV events apply (precise), 0 while only kvpick's picks feed its index",
                ),
                &["worker", "rank"],
            )
            .unwrap(),
        );
        let block_size_mismatches = register(
            registry,
            IntCounter::new(
                "kvpick_kv_block_size_mismatch_total",
                "KV stores dropped because their block size is not the partition's",
            )
            .unwrap(),
        );
        let event_lag = register(
            registry,
            Histogram::with_opts(
                HistogramOpts::new(
                    "kvpick_kv_event_lag_seconds",
                    "Per live KV-event batch (replayed ones are not observed): from the engine's timestamp (ts) to the batch applied to the index (includes clock skew between hosts)",
                )
                .buckets(vec![
                    5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                    10.0,
                ]),
            )
            .unwrap(),
        );
        EventMetrics {
            rank_precise,
            block_size_mismatches,
            event_lag,
            kv_events,
            kv_events_by_kind,
            kv_event_gaps,
            kv_replays,
            kv_resets,
            kv_subscriptions,
        }
    }
}

/// Engine-metrics scraping (`engine_metrics`): outcomes, duration, stale ranks.
#[derive(Clone)]
pub struct EngineScrapeMetrics {
    /// Scrapes by outcome: ok, unreachable, timeout, http_error, invalid.
    pub scrapes: IntCounterVec,
    /// Time per scrape (request, body, parse, recording).
    pub scrape_duration: Histogram,
    /// Ranks without a good scrape within the staleness bound (their readings are ignored).
    pub stale_ranks: IntGauge,
}

impl EngineScrapeMetrics {
    fn register(registry: &Registry) -> Self {
        EngineScrapeMetrics {
            scrapes: register(
                registry,
                IntCounterVec::new(
                    Opts::new(
                        "kvpick_engine_scrapes_total",
                        "Engine /metrics scrapes by outcome (ok, unreachable, timeout, http_error, invalid)",
                    ),
                    &["outcome"],
                )
                .unwrap(),
            ),
            scrape_duration: register(
                registry,
                Histogram::with_opts(
                    HistogramOpts::new(
                        "kvpick_engine_scrape_duration_seconds",
                        "Time per engine /metrics scrape, request to recorded reading",
                    )
                    .buckets(prometheus::exponential_buckets(1e-4, 2.0, 14).unwrap()),
                )
                .unwrap(),
            ),
            stale_ranks: register(
                registry,
                IntGauge::new(
                    "kvpick_engine_stale_ranks",
                    "Ranks scraped for engine metrics without a good reading within --engine-metrics-stale-ms",
                )
                .unwrap(),
            ),
        }
    }
}

/// The catalog: workers by lifecycle, snapshots applied or rejected.
#[derive(Clone)]
pub struct CatalogMetrics {
    /// Workers in the catalog by lifecycle.
    pub catalog_workers: IntGaugeVec,
    /// Catalog snapshots applied / rejected.
    pub catalog_reloads: IntCounterVec,
}

impl CatalogMetrics {
    fn register(registry: &Registry) -> Self {
        let catalog_workers = register(
            registry,
            IntGaugeVec::new(
                Opts::new(
                    "kvpick_catalog_workers",
                    "Workers in the catalog by lifecycle",
                ),
                &["lifecycle"],
            )
            .unwrap(),
        );
        let catalog_reloads = register(
            registry,
            IntCounterVec::new(
                Opts::new(
                    "kvpick_catalog_reloads_total",
                    "Catalog snapshots by result",
                ),
                &["result"],
            )
            .unwrap(),
        );
        CatalogMetrics {
            catalog_workers,
            catalog_reloads,
        }
    }
}

fn register<T: prometheus::core::Collector + Clone + 'static>(registry: &Registry, c: T) -> T {
    registry
        .register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

impl Metrics {
    /// Every family exported (`kvpick` and `epp`, the default of `--metrics-families`).
    pub fn new() -> Self {
        Self::with_families(crate::observability::epp_metrics::Families::default())
    }

    /// The metrics, exporting `families` on `/metrics`.
    pub fn with_families(families: crate::observability::epp_metrics::Families) -> Self {
        let registry = Registry::new();
        Metrics {
            epp: crate::observability::epp_metrics::EppMetrics::register(&registry, families),
            pool: crate::observability::epp_metrics::pool::PoolTracker::register(&registry),
            families,
            extproc: ExtProcMetrics::register(&registry),
            selection: SelectionMetrics::register(&registry),
            events: EventMetrics::register(&registry),
            catalog: CatalogMetrics::register(&registry),
            engine: EngineScrapeMetrics::register(&registry),
            flow: FlowMetrics::register(&registry),
            outlier: OutlierMetrics::register(&registry),
            conn: ConnMetrics::register(&registry),
            memory: MemoryMetrics::register(&registry),
            ranks: RankMetrics::register(&registry),
            cache_view: CacheViewMetrics::register(&registry),
            bookings: BookingBoundMetrics::register(&registry),
            grace: GraceMetrics::register(&registry),
            tiers: tiers::TierMetrics::register(&registry),
            scrape_facts: Default::default(),
            registry,
        }
    }

    /// Sets what each scrape applies first (once; the selection core sets it): gauges read at
    /// the scrape, so they are current whatever changed them.
    pub fn on_scrape(&self, facts: impl Fn() -> Facts + Send + Sync + 'static) {
        let _ = self.scrape_facts.set(Box::new(facts));
    }

    /// The Prometheus text exposition of every metric of the exported families (the pool
    /// gauges computed now).
    pub fn render(&self) -> String {
        if let Some(facts) = self.scrape_facts.get() {
            self.apply(&facts());
        }
        self.pool.refresh(&self.epp, crate::clock::now());
        let families: Vec<_> = self
            .registry
            .gather()
            .into_iter()
            .filter(|f| self.families.exports(f.name()))
            .collect();
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&families, &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is utf-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
