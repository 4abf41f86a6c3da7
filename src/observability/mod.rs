//! What kvpick tells its operators: [`metrics`] (one Prometheus registry, per-area sets),
//! [`epp_metrics`] (the llm-d EPP metric contract, pool and queue gauges for autoscaling) and
//! [`telemetry`] (OpenTelemetry spans of the request path). They observe; they never steer.

pub mod epp_metrics;
pub mod metrics;
pub mod telemetry;
