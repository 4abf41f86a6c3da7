//! kvpick-testkit: what kvpick's integration tests and benchmarks drive the real binary with,
//! kept out of the production crates (only kvpick's dev-dependencies name it).
//!
//! # Layout
//! - [`apiserver`]: a fake Kubernetes API server (LIST, WATCH, 410 Gone, outages, the
//!   InferencePool and its pods) and the pod / pool objects it serves.
//! - [`engine`]: one vLLM-like engine's ports (KV-event PUB, replay ROUTER, HTTP) that can be
//!   stopped and restarted on the same ports, for ingestion and engine-loss tests.
//! - [`publishers`]: simulated KV-event publishers, one PUB endpoint per engine rank, vLLM's wire.
//! - [`zmtp`]: those PUB endpoints, speaking ZMTP 3.0 themselves (`zeromq`'s `PubSocket` costs
//!   ~4 MB each, too much for 8,000 of them).
//! - [`workload`]: the prompt families both the publishers and the picks derive tokens from.
//! - [`churn`]: pod changes at a fixed rate, in a realistic mix.
//! - [`picks`]: an open-loop ext_proc client doing what Envoy does per request.
//! - [`process`]: the `kvpick serve` child process (ports, readiness, `/metrics`, RSS, CPU).
//! - [`prom`]: the Prometheus text format, as much as reading kvpick's own page needs.
//! - [`args`]: the scale benchmark's parameters, shared by the scenario and its report.
//! - [`scale`], [`report`]: the scale benchmark (`cargo bench --bench scale`) and its report.
//!
//! It must not depend on the `kvpick` crate itself: it talks to the binary over its ports.

#![forbid(unsafe_code)]
// A test and benchmark harness, never in a request path: a broken invariant of the fake should
// stop the run loudly.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod apiserver;
pub mod args;
pub mod churn;
pub mod engine;
pub mod picks;
pub mod process;
pub mod prom;
pub mod publishers;
pub mod report;
pub mod scale;
pub mod workload;
pub mod zmtp;
