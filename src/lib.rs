//! kvpick: a KV-cache-aware endpoint picker for LLM inference behind Envoy.
//!
//! Layout: [`selection`] is the one selection core; [`extproc`] (Envoy) and [`api`] (gRPC selection
//! API) are hosts that only translate protocols; [`catalog`] produces worker snapshots;
//! [`server`] wires processes, ports, TLS, health and metrics together.

pub mod api;
pub mod catalog;
pub mod events;
pub mod extproc;
pub mod health;
pub mod index;
pub mod metrics;
pub mod net;
pub mod replay;
pub mod request;
pub mod selection;
pub mod server;
pub mod sim;
pub mod tls;
pub mod tokenize;
pub mod usage;

/// Generated code for the project's own protos (`proto/kvpick/v1`).
pub mod proto {
    #![allow(clippy::all)]
    tonic::include_proto!("kvpick.v1");
}
