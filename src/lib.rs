//! kvpick: a KV-cache-aware endpoint picker for LLM inference behind Envoy. This crate holds the
//! hosts, the sources and the process wiring around the selection core (`kvpick_core`, no I/O);
//! the simulator and the replay are `kvpick_sim` (its binary is `kvpick-lab`; neither this crate nor
//! the `kvpick` binary links it). See `docs/ARCHITECTURE.md` for the whole map.
//!
//! # Layout
//! - [`selection`]: the core bound to this process (clock, metrics from the core's facts,
//!   readiness channels, the RAII reservation) and the catalog reconciler loop.
//! - Hosts, which only translate protocols: [`extproc`] (Envoy ext_proc), [`api`] (gRPC
//!   selection API). [`usage`] reads response bodies; [`tokenize`] (the `kvpick-tokenize` crate)
//!   reads request bodies (`tokenize::body`) and turns prompts into engine token ids.
//! - Sources: [`catalog`] (static file, Kubernetes reflector) produce complete worker snapshots;
//!   [`events`] decodes KV events off ZeroMQ and feeds them to the core.
//! - [`flow`]: flow-control classification policy (objectives, fairness keys, SLO headers,
//!   model rewrites) from `--flow-config` and InferenceObjective / InferenceModelRewrite.
//! - [`shared`]: sessions and load shared by replicas on Redis (`--shared-state`).
//! - [`telemetry`]: OpenTelemetry spans of the request path, exported over OTLP/gRPC.
//! - Process: [`server`] (flags, ports, wiring, shutdown), [`tls`], [`health`], [`net`],
//!   [`memory_account`] (the bytes clients make kvpick hold, against one limit),
//!   [`metrics`] (one registry, per-area metric sets), [`epp_metrics`] (the llm-d EPP metric
//!   contract and the pool / queue gauges for autoscaling).

#![forbid(unsafe_code)]

pub mod api;
pub mod catalog;
pub mod clock;
pub mod engine_metrics;
pub mod epp_metrics;
pub mod events;
pub mod extproc;
pub mod flow;
pub mod h2_authority;
pub mod health;
pub mod kv_remote;
pub mod lanes;
pub mod memory_account;
pub mod metrics;
pub mod net;
pub mod proto;
pub mod selection;
pub mod server;
pub mod shared;
pub mod telemetry;
pub mod tls;
/// Prompts -> engine token ids: the `kvpick-tokenize` crate, under its old path.
pub use kvpick_tokenize as tokenize;
pub mod usage;
