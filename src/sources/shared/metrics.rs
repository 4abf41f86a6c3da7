//! Metrics of the shared state (`--shared-state`), registered on the process registry only when
//! the flag is set. This module defines and exposes them; it records nothing by itself.

// Static metric definitions: an error is a programming error (a bad or duplicate name) that
// every test run hits at start-up, never something input can cause.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use prometheus::{Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry};

#[derive(Clone)]
pub struct SharedMetrics {
    /// 1 while Redis answers, 0 during an outage.
    pub up: IntGauge,
    /// Outages (up -> down transitions).
    pub outages: IntCounter,
    /// Failed Redis calls by operation (session_lookup, session_write, load).
    pub errors: IntCounterVec,
    /// Session lookups this replica routed on local state alone, by reason (down, timeout, error).
    pub local_fallbacks: IntCounterVec,
    /// Session events: remote_hit, remote_miss, claimed, adopted, not_adopted_full, reconciled,
    /// released, dropped.
    pub sessions: IntCounterVec,
    /// Latency of the one synchronous call: the lookup of a session this replica does not know.
    pub lookup_seconds: Histogram,
    /// Live replicas seen in the last load exchange (this one included).
    pub replicas: IntGauge,
    /// Active requests other replicas booked, summed over ranks (what this replica adds).
    pub remote_requests: IntGauge,
}

impl SharedMetrics {
    pub fn register(registry: &Registry) -> Self {
        let up = IntGauge::new(
            "kvpick_shared_state_up",
            "1 while the shared state (Redis) answers, 0 while kvpick routes on local state",
        )
        .unwrap();
        let outages = IntCounter::new(
            "kvpick_shared_state_outages_total",
            "Times the shared state became unreachable or too slow",
        )
        .unwrap();
        let errors = IntCounterVec::new(
            Opts::new(
                "kvpick_shared_state_errors_total",
                "Failed or timed-out shared-state calls by operation",
            ),
            &["op"],
        )
        .unwrap();
        let local_fallbacks = IntCounterVec::new(
            Opts::new(
                "kvpick_shared_state_local_fallbacks_total",
                "Session lookups answered from local state only, by reason (down, timeout, error)",
            ),
            &["reason"],
        )
        .unwrap();
        let sessions = IntCounterVec::new(
            Opts::new(
                "kvpick_shared_state_sessions_total",
                "Shared session bindings: remote_hit, remote_miss, claimed, adopted, not_adopted_full, reconciled, released, dropped",
            ),
            &["event"],
        )
        .unwrap();
        let lookup_seconds = Histogram::with_opts(
            HistogramOpts::new(
                "kvpick_shared_state_lookup_seconds",
                "Latency of the synchronous lookup of a session this replica has no binding for",
            )
            .buckets(vec![
                5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1,
            ]),
        )
        .unwrap();
        let replicas = IntGauge::new(
            "kvpick_shared_state_replicas",
            "Live replicas in the last load exchange, this one included",
        )
        .unwrap();
        let remote_requests = IntGauge::new(
            "kvpick_shared_state_remote_requests",
            "Active requests booked by the other replicas (counted as load here)",
        )
        .unwrap();
        let metrics = SharedMetrics {
            up,
            outages,
            errors,
            local_fallbacks,
            sessions,
            lookup_seconds,
            replicas,
            remote_requests,
        };
        for c in [
            Box::new(metrics.up.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(metrics.outages.clone()),
            Box::new(metrics.errors.clone()),
            Box::new(metrics.local_fallbacks.clone()),
            Box::new(metrics.sessions.clone()),
            Box::new(metrics.lookup_seconds.clone()),
            Box::new(metrics.replicas.clone()),
            Box::new(metrics.remote_requests.clone()),
        ] {
            // Registered twice only when tests reuse one registry: the first set stays.
            let _ = registry.register(c);
        }
        metrics
    }
}
