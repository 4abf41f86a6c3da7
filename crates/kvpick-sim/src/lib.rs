//! kvpick-sim: everything kvpick needs to measure routing without GPUs, kept out of the
//! production library and binary. Its binary is `kvpick-lab` (crates/kvpick-lab), which
//! `kvpick sim|replay|workload|report-html` hand over to.
//!
//! # Layout
//! - [`sim`]: the vLLM-like simulator: [`sim::engine`] (one rank, pure and clock-agnostic),
//!   [`sim::server`] (the real-time HTTP + ZeroMQ fleet behind `kvpick sim`), [`sim::wire`] (its
//!   KV-event encoder), [`sim::pd`] (a decode worker's prefill fetch, prefill/decode mode).
//! - [`replay`]: `kvpick replay`, the virtual-clock replay of a trace through every routing
//!   policy ([`replay::policy`]), the kvpick one being [`kvpick_core::Core`] itself; its
//!   prefill/decode mode is [`replay::pd`].
//! - [`charts`]: the HTML report of a run (inline-SVG CDFs, per-rank bars, load and queue over
//!   time): `kvpick replay --report-html`, `kvpick report-html`.
//! - [`workload`]: `kvpick workload`, seeded generators of Mooncake traces in five workload
//!   families (chat, agentic, shared-docs, small-families, no-reuse) and their statistics.

#![forbid(unsafe_code)]
// A benchmark and test tool, never in a request path: a broken invariant of the simulated engine
// should stop the run loudly rather than produce numbers.
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod charts;
pub mod replay;
pub mod sim;
pub mod workload;
