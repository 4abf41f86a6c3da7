//! kvpick-peers: real peer routers as policies of kvpick's offline replay (`kvpick replay`), so
//! kvpick is compared with their own code, not only with re-implementations.
//!
//! - [`dynamo`]: NVIDIA Dynamo's KV router, from its published crates (`dynamo-kv-router`'s
//!   radix-tree indexer and active-sequence tracking, `dynamo-custom-policy-builtin`'s default
//!   worker selector and cost function), with its default `KvRouterConfig`.
//!
//! This crate is its own Cargo workspace with its own lockfile: Dynamo's crates pin an exact tokio
//! (and build libzmq), which must not reach kvpick's own build or CI. It owns the translation from
//! the replay's events and requests to the peer's types; it must not change how the replay, the
//! simulated engines or kvpick's core behave.

#![forbid(unsafe_code)]

pub mod dynamo;

use kvpick_sim::replay::policy::{Policy, PolicyOptions};
use kvpick_sim::sim::engine::EngineConfig;

/// The replay's peer-policy builder: the names in `kvpick_sim::replay::policy::PEERS`, for a
/// fleet of engines configured as `engine`.
pub fn build_peer(
    name: &str,
    ranks: usize,
    options: &PolicyOptions,
    engine: &EngineConfig,
) -> Option<anyhow::Result<Box<dyn Policy>>> {
    match name {
        "dynamo" => Some(
            dynamo::DynamoRouter::new(ranks, options, engine)
                .map(|policy| Box::new(policy) as Box<dyn Policy>),
        ),
        _ => None,
    }
}
