//! The remote index's metrics (`--kv-index-remote`), registered only with the flag: whether the
//! remote answers, the picks that fell back to approximate mode and why, the query latency.
//! This module defines them; `kv_remote` records.

// Static metric definitions: an error is a programming error every test run hits at start-up.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

/// Why a pick did not use the remote index.
pub const FALLBACK_REASONS: &[&str] = &["timeout", "unavailable", "rejected", "mismatch", "down"];

#[derive(Clone)]
pub struct KvRemoteMetrics {
    /// 1 while the remote index answers, 0 while picks are approximate.
    pub up: IntGauge,
    /// Picks routed without the remote's scores, by reason.
    pub fallbacks: IntCounterVec,
    /// Picks routed on the remote's scores.
    pub answered: IntCounter,
    /// Latency of one `OverlapScores` query, answered or not.
    pub query_seconds: Histogram,
}

impl KvRemoteMetrics {
    pub fn register(registry: &Registry) -> Self {
        let up = IntGauge::new(
            "kvpick_kv_index_remote_up",
            "1 while the remote KV index (--kv-index-remote) answers, 0 while picks fall back to approximate mode",
        )
        .unwrap();
        let fallbacks = IntCounterVec::new(
            Opts::new(
                "kvpick_kv_index_remote_fallbacks_total",
                "Picks routed in approximate mode without the remote KV index's scores, by reason (timeout, unavailable, rejected, mismatch, down)",
            ),
            &["reason"],
        )
        .unwrap();
        let answered = IntCounter::new(
            "kvpick_kv_index_remote_answers_total",
            "Picks routed on the remote KV index's overlap scores",
        )
        .unwrap();
        let query_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvpick_kv_index_remote_query_seconds",
                "Latency of one OverlapScores query to the remote KV index, answered or not",
            )
            .buckets(vec![
                0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
            ]),
        )
        .unwrap();
        registry.register(Box::new(up.clone())).unwrap();
        registry.register(Box::new(fallbacks.clone())).unwrap();
        registry.register(Box::new(answered.clone())).unwrap();
        registry.register(Box::new(query_seconds.clone())).unwrap();
        for reason in FALLBACK_REASONS {
            fallbacks.with_label_values(&[reason]);
        }
        KvRemoteMetrics {
            up,
            fallbacks,
            answered,
            query_seconds,
        }
    }
}
