//! KV events from the engines (vLLM, SGLang, TensorRT-LLM) over ZeroMQ.
//!
//! `decode` owns the wire format (ARCHITECTURE.md §7): the `[topic, seq, payload]` frames and every
//! msgpack encoding of an `EventBatch`, decoded into the core's block events
//! (`kvpick_core::event`). `ingest` owns the sockets: one SUB per rank, sequence tracking, replay
//! over DEALER, restarts. Neither touches the KV index directly: decoded events go to the
//! selection core, which owns the index. Which endpoints to subscribe to is derived here from the
//! catalog ([`subscriptions`]): the port arithmetic is a transport concern, not the core's.

pub mod decode;
pub mod ingest;

use kvpick_core::{RankKey, WorkerRecord};

use crate::selection::SelectionCore;

impl SelectionCore {
    /// KV-event subscriptions the catalog asks for: one per rank of every worker that declares
    /// an endpoint, `(rank, events endpoint, replay endpoint)`. Defined here, not in `selection`,
    /// so that `selection` does not import `events`.
    pub fn kv_event_endpoints(&self) -> Vec<(RankKey, String, Option<String>)> {
        subscriptions(&self.inner().records())
    }
}

/// `tcp://host:port` for rank 0 becomes `tcp://host:(port + rank)` (vLLM and SGLang offset their
/// KV-event ports by data-parallel rank).
pub fn offset_endpoint(base: &str, rank: u32) -> Option<String> {
    let (head, port) = base.rsplit_once(':')?;
    let port: u32 = port.parse().ok()?;
    let port = u16::try_from(port.checked_add(rank)?).ok()?;
    Some(format!("{head}:{port}"))
}

/// KV-event subscriptions the catalog asks for: one per rank of every worker (schedulable or
/// not) that declares an endpoint, `(rank, events endpoint, replay endpoint)`, sorted.
pub fn subscriptions(records: &[WorkerRecord]) -> Vec<(RankKey, String, Option<String>)> {
    let mut out = Vec::new();
    for record in records {
        let Some(base) = &record.spec.kv_events else {
            continue;
        };
        for rank in &record.ranks {
            let Some(events) = offset_endpoint(base, rank.dp_rank) else {
                continue;
            };
            let replay = record
                .spec
                .kv_replay
                .as_deref()
                .and_then(|r| offset_endpoint(r, rank.dp_rank));
            out.push((
                RankKey {
                    worker_id: record.id,
                    dp_rank: rank.dp_rank,
                },
                events,
                replay,
            ));
        }
    }
    out.sort();
    out
}
