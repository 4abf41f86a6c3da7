//! Cache-view accuracy: per response, the prompt tokens kvpick predicted cached on the rank it
//! picked (its overlap times the block size, at pick time) against the cached tokens the engine
//! reported in the response's `usage.prompt_tokens_details.cached_tokens`.
//!
//! Agreement is exact when kvpick's view of the engine's cache is right (tokenizer, block size
//! and KV events as the engine's): the histogram's zero bucket holds nearly every response. Each
//! silent misconfiguration moves it: a tokenizer that renders other ids (kvpick predicts 0 where
//! the engine hits: negative), a block size not the engine's (off by part of a block), an engine
//! whose KV events do not arrive (kvpick predicts from its own picks what the engine evicted:
//! positive; or the engine caches what kvpick never learnt: negative).
//!
//! Owns the two series and the per-rank drift's state. It only records; the stream decides which
//! responses are comparable ([`crate::hosts::extproc::stream`]: a tokenized prompt, one rank, a
//! reported count).

// Static metric definitions: an error is a programming error every test run hits at start-up.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use prometheus::{GaugeVec, Histogram, HistogramOpts, Opts, Registry};

/// Weight of the newest response in a rank's drift (an exponentially weighted mean): after `n`
/// responses off by `e`, the drift is `e * (1 - (7/8)^n)` (about `e` after 24 responses), and
/// one odd response moves it by an eighth.
pub const DRIFT_WEIGHT: f64 = 0.125;

/// The error histogram's bucket bounds, tokens (predicted - reported). Integer counts, so
/// `le="0"` minus `le="-1"` is the exact agreements; the others step by 4x from a block.
pub const ERROR_BUCKETS: [f64; 14] = [
    -16384.0, -4096.0, -1024.0, -256.0, -64.0, -16.0, -1.0, 0.0, 15.0, 63.0, 255.0, 1023.0, 4095.0,
    16383.0,
];

/// kvpick's predicted cached tokens against the engine's reported ones.
#[derive(Clone)]
pub struct CacheViewMetrics {
    /// Predicted minus reported cached tokens, per response (the pool: no rank label).
    pub error: Histogram,
    /// Per rank, the weighted mean of predicted minus reported (tokens).
    pub drift: GaugeVec,
    drifts: Arc<Mutex<Drifts>>,
}

/// Each rank's drift, by (worker, rank).
type Drifts = HashMap<(Arc<str>, u32), f64>;

impl CacheViewMetrics {
    pub fn register(registry: &Registry) -> Self {
        let error = Histogram::with_opts(
            HistogramOpts::new(
                "kvpick_cache_prediction_error_tokens",
                "Per response: prompt tokens kvpick predicted cached on the picked rank minus the \
                 cached tokens the engine reported (usage.prompt_tokens_details.cached_tokens); \
                 0 = agreement",
            )
            .buckets(ERROR_BUCKETS.to_vec()),
        )
        .unwrap();
        let drift = GaugeVec::new(
            Opts::new(
                "kvpick_cache_prediction_drift_tokens",
                "Per rank, the exponentially weighted mean (weight 1/8 per response) of predicted \
                 minus engine-reported cached prompt tokens: 0 when kvpick's view of the rank's \
                 cache is right, < 0 the engine caches what kvpick does not know, > 0 kvpick \
                 believes what the engine does not have",
            ),
            &["worker", "rank"],
        )
        .unwrap();
        registry.register(Box::new(error.clone())).unwrap();
        registry.register(Box::new(drift.clone())).unwrap();
        CacheViewMetrics {
            error,
            drift,
            drifts: Arc::default(),
        }
    }

    /// One response of `worker`'s rank `rank`: kvpick predicted `predicted` cached prompt
    /// tokens, the engine reported `reported`.
    pub fn observe(&self, worker: &str, rank: u32, predicted: u64, reported: u64) {
        let error = predicted as f64 - reported as f64;
        self.error.observe(error);
        let mut drifts = self.drifts.lock().unwrap_or_else(|e| e.into_inner());
        let drift = drifts.entry((Arc::from(worker), rank)).or_insert(0.0);
        *drift += DRIFT_WEIGHT * (error - *drift);
        self.drift
            .with_label_values(&[worker, &rank.to_string()])
            .set(*drift);
    }

    /// The rank left the catalog: its drift goes.
    pub fn rank_gone(&self, worker: &str, rank: u32) {
        let mut drifts = self.drifts.lock().unwrap_or_else(|e| e.into_inner());
        drifts.remove(&(Arc::from(worker), rank));
        let _ = self.drift.remove_label_values(&[worker, &rank.to_string()]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn drift(m: &CacheViewMetrics, worker: &str, rank: u32) -> f64 {
        m.drift
            .with_label_values(&[worker, &rank.to_string()])
            .get()
    }

    #[test]
    fn agreement_leaves_no_drift_and_lands_in_the_zero_bucket() {
        let m = CacheViewMetrics::register(&Registry::new());
        for _ in 0..10 {
            m.observe("w", 0, 992, 992);
        }
        assert_eq!(drift(&m, "w", 0), 0.0);
        assert_eq!(m.error.get_sample_count(), 10);
        assert_eq!(m.error.get_sample_sum(), 0.0);
    }

    #[test]
    fn the_drift_follows_a_persistent_error_and_forgets_an_odd_one() {
        let m = CacheViewMetrics::register(&Registry::new());
        m.observe("w", 1, 0, 800);
        assert_eq!(
            drift(&m, "w", 1),
            -100.0,
            "one response moves it by an eighth"
        );
        for _ in 0..40 {
            m.observe("w", 1, 0, 800);
        }
        assert!(drift(&m, "w", 1) < -790.0, "{}", drift(&m, "w", 1));
        for _ in 0..40 {
            m.observe("w", 1, 640, 640);
        }
        assert!(drift(&m, "w", 1).abs() < 5.0, "{}", drift(&m, "w", 1));
        // Ranks are apart.
        assert_eq!(drift(&m, "w", 0), 0.0);
    }

    /// The alert and the dashboard count exact agreements as `le="0"` minus `le="-1"`.
    #[test]
    fn the_exposition_has_the_buckets_the_alert_reads() {
        let m = crate::observability::metrics::Metrics::new();
        m.cache_view.observe("w", 0, 64, 64);
        m.cache_view.observe("w", 0, 0, 64);
        let text = m.render();
        for line in [
            "kvpick_cache_prediction_error_tokens_bucket{le=\"-1\"} 1",
            "kvpick_cache_prediction_error_tokens_bucket{le=\"0\"} 2",
            "kvpick_cache_prediction_error_tokens_count 2",
            "kvpick_cache_prediction_drift_tokens{rank=\"0\",worker=\"w\"} -8",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
    }

    #[test]
    fn a_gone_rank_takes_its_drift_with_it() {
        let registry = Registry::new();
        let m = CacheViewMetrics::register(&registry);
        m.observe("w", 0, 32, 0);
        m.rank_gone("w", 0);
        let families = registry.gather();
        let drift = families
            .iter()
            .find(|f| f.name() == "kvpick_cache_prediction_drift_tokens");
        assert!(drift.is_none_or(|f| f.get_metric().is_empty()));
        // Back with a fresh engine: it starts from 0 again.
        m.observe("w", 0, 0, 0);
        assert_eq!(m.drift.with_label_values(&["w", "0"]).get(), 0.0);
    }
}
