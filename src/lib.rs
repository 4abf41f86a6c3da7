//! kvpick: a KV-cache-aware endpoint picker for LLM inference behind Envoy. This crate holds the
//! hosts, the sources and the process wiring around the selection core (`kvpick_core`,
//! no I/O); the simulator and the replay are `kvpick_sim` (its binary is `kvpick-lab`; neither this
//! crate nor the `kvpick` binary links it). See `docs/ARCHITECTURE.md` for the whole map; the
//! folders follow it:
//!
//! - [`hosts`]: Envoy ext_proc ([`hosts::extproc`]) and the gRPC selection API ([`hosts::api`]);
//!   they only translate protocols. Request bodies are read once, by the tokenizer crate's body
//!   scanner ([`tokenize`] = `kvpick_tokenize`: routing fields, the prompt's layout, the chat
//!   template, token ids).
//! - Leaves every module may read: [`clock`] (the process clock), [`proto`] (the generated code
//!   of `proto/kvpick/v1`), [`usage`] (an engine's response `usage`, read as it streams).
//! - [`selection`]: the core bound to this process (clock, metrics from the core's facts,
//!   readiness channels, the RAII reservation) and the catalog reconciler loop.
//! - [`sources`]: what feeds the core — [`sources::catalog`] (static file, Kubernetes reflector),
//!   [`sources::events`] (KV events off ZeroMQ), [`sources::engine_metrics`] (scraped engine load),
//!   [`sources::flow`] (flow-control policy), [`sources::shared`] (replicas' shared state on Redis),
//!   [`sources::kv_remote`] (an indexer's KV view, `--kv-index-remote`).
//! - [`observability`]: [`observability::metrics`], [`observability::epp_metrics`] (the llm-d EPP
//!   contract) and [`observability::telemetry`] (OpenTelemetry spans).
//! - [`transport`]: [`transport::net`], [`transport::tls`], the HTTP/2 front
//!   ([`transport::h2_authority`]), [`transport::lanes`], [`transport::health`] and
//!   [`transport::memory_account`] (the bytes clients make kvpick hold, against one limit).
//! - [`server`]: the process — flags, ports, wiring, shutdown; `server::entry::run` is callable
//!   from a test.

#![forbid(unsafe_code)]

pub mod clock;
pub mod hosts;
pub mod observability;
pub mod proto;
pub mod selection;
pub mod server;
pub mod sources;
pub mod transport;
pub mod usage;
/// Prompts -> engine token ids: the `kvpick-tokenize` crate, under its old path.
pub use kvpick_tokenize as tokenize;
