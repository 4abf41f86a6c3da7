//! The sources that feed the selection core: [`catalog`] (static file or the Kubernetes
//! pod reflector: complete worker snapshots), [`events`] (KV events off ZeroMQ), [`engine_metrics`]
//! (scraped engine load), [`flow`] (flow-control policy from files and CRDs), [`shared`]
//! (sessions and load shared by replicas on Redis) and [`kv_remote`] (another kvpick's KV index,
//! `--kv-index-remote`). They push facts in; none picks.

pub mod catalog;
pub mod engine_metrics;
pub mod events;
pub mod flow;
pub mod kv_remote;
pub mod shared;
