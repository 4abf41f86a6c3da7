//! Prometheus metrics: one registry per process, owned here and handed to the parts that record.
//! This module only defines and exposes metrics; it never makes routing decisions.

// Static metric definitions and registration: an error is a programming error (a bad name or a
// duplicate) that every test run hits at start-up, never something input can cause.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use kvpick_core::{Fact, Facts, Lifecycle};
use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};

/// Every metric kvpick exports. Cheap to clone (all handles are reference-counted).
#[derive(Clone)]
pub struct Metrics {
    pub registry: Registry,
    /// Pick outcomes by status ("200" for a successful pick, else the error status).
    pub requests: IntCounterVec,
    /// Time spent inside the selection core per pick.
    pub pick_latency: Histogram,
    /// In-flight requests per (worker, rank).
    pub inflight: IntGaugeVec,
    /// Sum of `inflight` over every rank.
    pub inflight_total: IntGauge,
    /// Workers in the catalog by lifecycle.
    pub catalog_workers: IntGaugeVec,
    /// Catalog snapshots applied / rejected.
    pub catalog_reloads: IntCounterVec,
    /// Token usage reported by the engines in responses (prompt, completion, cached).
    pub usage_tokens: IntCounterVec,
    /// ext_proc streams by how they ended.
    pub streams: IntCounterVec,
    /// Bookings reaped because they outlived `booking_ttl`.
    pub bookings_expired: IntCounter,
    /// Response time from pick to first response byte, by worker.
    pub time_to_first_byte: HistogramVec,
    /// Queued prefill tokens per rank (bookings whose prefill is not complete).
    pub active_prefill_tokens: IntGaugeVec,
    /// KV blocks of active requests per rank.
    pub active_decode_blocks: IntGaugeVec,
    /// Share of the prompt's blocks already cached on the picked rank (0..1), per pick.
    pub predicted_overlap: Histogram,
    /// Blocks in the KV index per partition (model).
    pub index_blocks: IntGaugeVec,
    /// Heap bytes of the KV index plus engine-hash maps per partition.
    pub index_bytes: IntGaugeVec,
    /// KV events by result (applied, dropped, decode_error).
    pub kv_events: IntCounterVec,
    /// Sequence gaps seen on KV-event streams.
    pub kv_event_gaps: IntCounter,
    /// Replays by result (ok, incomplete, failed).
    pub kv_replays: IntCounterVec,
    /// Ranks cleared because their publisher restarted (sequence went backwards).
    pub kv_resets: IntCounter,
    /// KV-event subscriptions currently connected.
    pub kv_subscriptions: IntGauge,
    /// Live session bindings.
    pub sessions_live: IntGauge,
    /// Session outcomes: created, reused, table_full, expired.
    pub session_events: IntCounterVec,
    /// Session bindings dropped, by reason.
    pub session_invalidated: IntCounterVec,
    /// Request-body bytes currently buffered by ext_proc streams (the global body budget in use).
    pub body_bytes_buffered: IntGauge,
    /// Requests answered 503 because the global body budget could not hold their body.
    pub body_budget_rejected: IntCounter,
}

fn register<T: prometheus::core::Collector + Clone + 'static>(registry: &Registry, c: T) -> T {
    registry
        .register(Box::new(c.clone()))
        .expect("metric names are unique");
    c
}

impl Metrics {
    /// Records what a core operation changed (the core returns facts; it records nothing).
    pub fn apply(&self, facts: &Facts) {
        for fact in facts.iter() {
            match fact {
                Fact::Load {
                    worker,
                    dp_rank,
                    load,
                } => {
                    let labels = [&**worker, &dp_rank.to_string()];
                    self.inflight
                        .with_label_values(&labels)
                        .set(load.active_requests as i64);
                    self.active_prefill_tokens
                        .with_label_values(&labels)
                        .set(load.active_prefill_tokens as i64);
                    self.active_decode_blocks
                        .with_label_values(&labels)
                        .set(load.active_decode_blocks as i64);
                }
                Fact::RankGone { worker, dp_rank } => {
                    let labels = [&**worker, &dp_rank.to_string()];
                    let _ = self.inflight.remove_label_values(&labels);
                    let _ = self.active_prefill_tokens.remove_label_values(&labels);
                    let _ = self.active_decode_blocks.remove_label_values(&labels);
                }
                Fact::Inflight(delta) => self.inflight_total.add(*delta),
                Fact::Session(outcome) => self
                    .session_events
                    .with_label_values(&[outcome.as_str()])
                    .inc(),
                Fact::SessionInvalidated(reason) => self
                    .session_invalidated
                    .with_label_values(&[reason.as_str()])
                    .inc(),
                Fact::SessionsExpired(n) => self
                    .session_events
                    .with_label_values(&["expired"])
                    .inc_by(*n),
                Fact::SessionsLive(delta) => self.sessions_live.add(*delta),
                Fact::IndexSize {
                    partition,
                    blocks,
                    bytes,
                } => {
                    let labels = [partition.model.as_str(), partition.routing_group.as_str()];
                    self.index_blocks
                        .with_label_values(&labels)
                        .set(*blocks as i64);
                    if let Some(bytes) = bytes {
                        self.index_bytes
                            .with_label_values(&labels)
                            .set(*bytes as i64);
                    }
                }
                Fact::PredictedOverlap(share) => self.predicted_overlap.observe(*share),
                Fact::KvEvents { applied, dropped } => {
                    self.kv_events
                        .with_label_values(&["applied"])
                        .inc_by(*applied);
                    self.kv_events
                        .with_label_values(&["dropped"])
                        .inc_by(*dropped);
                }
                Fact::CatalogWorkers(counts) => {
                    for (lifecycle, n) in Lifecycle::ALL.iter().zip(counts) {
                        self.catalog_workers
                            .with_label_values(&[lifecycle.as_str()])
                            .set(*n as i64);
                    }
                }
                Fact::BookingsExpired(n) => self.bookings_expired.inc_by(*n),
            }
        }
    }

    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = register(
            &registry,
            IntCounterVec::new(
                Opts::new("kvpick_requests_total", "Pick outcomes by HTTP status"),
                &["status"],
            )
            .unwrap(),
        );
        let pick_latency = register(
            &registry,
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
        let inflight = register(
            &registry,
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
            &registry,
            IntGauge::new("kvpick_inflight_total", "In-flight requests over all ranks").unwrap(),
        );
        let catalog_workers = register(
            &registry,
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
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "kvpick_catalog_reloads_total",
                    "Catalog snapshots by result",
                ),
                &["result"],
            )
            .unwrap(),
        );
        let usage_tokens = register(
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "kvpick_usage_tokens_total",
                    "Tokens reported in response usage (kind: prompt, completion, cached)",
                ),
                &["kind"],
            )
            .unwrap(),
        );
        let streams = register(
            &registry,
            IntCounterVec::new(
                Opts::new("kvpick_extproc_streams_total", "ext_proc streams by ending"),
                &["end"],
            )
            .unwrap(),
        );
        let bookings_expired = register(
            &registry,
            IntCounter::new(
                "kvpick_bookings_expired_total",
                "Bookings reaped after booking_ttl",
            )
            .unwrap(),
        );
        let time_to_first_byte = register(
            &registry,
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
        let active_prefill_tokens = register(
            &registry,
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
            &registry,
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
            &registry,
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
        let index_blocks = register(
            &registry,
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
            &registry,
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
        let kv_events = register(
            &registry,
            IntCounterVec::new(
                Opts::new("kvpick_kv_events_total", "KV events by result"),
                &["result"],
            )
            .unwrap(),
        );
        let kv_event_gaps = register(
            &registry,
            IntCounter::new(
                "kvpick_kv_event_gaps_total",
                "Sequence gaps on KV-event streams",
            )
            .unwrap(),
        );
        let kv_replays = register(
            &registry,
            IntCounterVec::new(
                Opts::new("kvpick_kv_replays_total", "KV-event replays by result"),
                &["result"],
            )
            .unwrap(),
        );
        let kv_resets = register(
            &registry,
            IntCounter::new(
                "kvpick_kv_resets_total",
                "Ranks cleared because their publisher restarted",
            )
            .unwrap(),
        );
        let kv_subscriptions = register(
            &registry,
            IntGauge::new(
                "kvpick_kv_subscriptions",
                "KV-event subscriptions currently connected",
            )
            .unwrap(),
        );
        let sessions_live = register(
            &registry,
            IntGauge::new("kvpick_session_bindings", "Live session bindings").unwrap(),
        );
        let session_events = register(
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "kvpick_session_events_total",
                    "Session affinity outcomes (created, reused, table_full, expired)",
                ),
                &["event"],
            )
            .unwrap(),
        );
        let session_invalidated = register(
            &registry,
            IntCounterVec::new(
                Opts::new(
                    "kvpick_session_invalidated_total",
                    "Session bindings dropped, by reason",
                ),
                &["reason"],
            )
            .unwrap(),
        );
        let body_bytes_buffered = register(
            &registry,
            IntGauge::new(
                "kvpick_body_bytes_buffered",
                "Request-body bytes buffered by ext_proc streams (--max-buffered-body-bytes in use)",
            )
            .unwrap(),
        );
        let body_budget_rejected = register(
            &registry,
            IntCounter::new(
                "kvpick_body_budget_rejected_total",
                "Requests answered 503 because --max-buffered-body-bytes was exhausted",
            )
            .unwrap(),
        );
        Metrics {
            body_bytes_buffered,
            body_budget_rejected,
            kv_events,
            kv_event_gaps,
            kv_replays,
            kv_resets,
            kv_subscriptions,
            sessions_live,
            session_events,
            session_invalidated,
            active_prefill_tokens,
            active_decode_blocks,
            predicted_overlap,
            index_blocks,
            index_bytes,
            registry,
            requests,
            pick_latency,
            inflight,
            inflight_total,
            catalog_workers,
            catalog_reloads,
            usage_tokens,
            streams,
            bookings_expired,
            time_to_first_byte,
        }
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        let mut buf = Vec::new();
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut buf)
            .expect("text encoding cannot fail");
        String::from_utf8(buf).expect("prometheus text is utf-8")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}
