//! KV events from the engines (vLLM, SGLang, TensorRT-LLM) over ZeroMQ.
//!
//! `decode` owns the wire format (ARCHITECTURE.md §7): the `[topic, seq, payload]` frames and every
//! msgpack encoding of an `EventBatch`, decoded into the core's block events
//! (`kvpick_core::event`). `groups` decides which events of a hybrid model's KV-cache groups may
//! confirm a prefix (full attention only). `ingest` owns each rank's subscription task: sequence tracking
//! (`sequence`), replay over DEALER (`replay`), restarts, and the engine's reachability, on top
//! of `link` (the SUB socket and its monitor, the reconnect schedule, the endpoint probe). Neither touches the KV index directly: decoded events go to the
//! selection core, which owns the index. Which endpoints to subscribe to is derived here from the
//! catalog ([`subscriptions`]): the port arithmetic is a transport concern, not the core's.

pub mod decode;
pub mod groups;
pub mod ingest;
pub mod link;
pub mod replay;
pub mod sequence;

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

/// One rank's subscription: `(rank, events endpoint, replay endpoint)`.
pub type Subscription = (RankKey, String, Option<String>);

/// KV-event subscriptions the catalog asks for: one per rank of every worker (schedulable or
/// not) that declares an endpoint, `(rank, events endpoint, replay endpoint)`, sorted.
pub fn subscriptions(records: &[WorkerRecord]) -> Vec<Subscription> {
    let mut out: Vec<Subscription> = records.iter().flat_map(worker_subscriptions).collect();
    out.sort();
    out
}

/// The subscriptions of one worker's ranks, in rank order (none without a `kv_events` endpoint).
pub fn worker_subscriptions(record: &WorkerRecord) -> Vec<Subscription> {
    let Some(base) = &record.spec.kv_events else {
        return Vec::new();
    };
    record
        .ranks
        .iter()
        .filter_map(|rank| {
            let events = offset_endpoint(base, rank.dp_rank)?;
            let replay = record
                .spec
                .kv_replay
                .as_deref()
                .and_then(|r| offset_endpoint(r, rank.dp_rank));
            let key = RankKey {
                worker_id: record.id,
                dp_rank: rank.dp_rank,
            };
            Some((key, events, replay))
        })
        .collect()
}

/// What one worker's subscriptions were derived from: only these fields of its record matter,
/// so a readiness flip or an engine restart (a new incarnation) re-derives nothing.
#[derive(Debug, PartialEq, Eq)]
struct Derived {
    events: Option<String>,
    replay: Option<String>,
    ranks: Vec<u32>,
}

impl Derived {
    fn of(record: &WorkerRecord) -> Derived {
        Derived {
            events: record.spec.kv_events.clone(),
            replay: record.spec.kv_replay.clone(),
            ranks: record.ranks.iter().map(|r| r.dp_rank).collect(),
        }
    }

    /// Compares without allocating: the common case of a catalog change is an unchanged worker.
    fn matches(&self, record: &WorkerRecord) -> bool {
        self.events == record.spec.kv_events
            && self.replay == record.spec.kv_replay
            && self.ranks.len() == record.ranks.len()
            && self
                .ranks
                .iter()
                .zip(&record.ranks)
                .all(|(a, b)| *a == b.dp_rank)
    }
}

/// The subscriptions to start and stop after a catalog change.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct PlanChange {
    pub stop: Vec<RankKey>,
    pub start: Vec<Subscription>,
}

/// The subscriptions the catalog asks for, kept per worker so that following a catalog of
/// thousands of workers through a change costs a comparison per worker and derives endpoints
/// only for the workers whose KV-event endpoints or ranks changed. A rank whose endpoints stay
/// the same keeps its running subscription.
#[derive(Debug, Default)]
pub struct Plan {
    workers: std::collections::HashMap<u64, (Derived, Vec<Subscription>)>,
}

impl Plan {
    /// Brings the plan to `records` (the whole catalog); returns what to stop and start.
    pub fn update(&mut self, records: &mut dyn Iterator<Item = &WorkerRecord>) -> PlanChange {
        let mut change = PlanChange::default();
        let mut seen = std::collections::HashSet::new();
        for record in records {
            seen.insert(record.id);
            let old = match self.workers.get(&record.id) {
                Some((derived, _)) if derived.matches(record) => continue,
                Some(_) => self.workers.remove(&record.id).map(|(_, subs)| subs),
                None => None,
            };
            let new = worker_subscriptions(record);
            let old = old.unwrap_or_default();
            change.stop.extend(
                old.iter()
                    .filter(|s| !new.contains(s))
                    .map(|(rank, _, _)| *rank),
            );
            change
                .start
                .extend(new.iter().filter(|s| !old.contains(s)).cloned());
            self.workers.insert(record.id, (Derived::of(record), new));
        }
        self.workers.retain(|id, (_, subs)| {
            let keep = seen.contains(id);
            if !keep {
                change.stop.extend(subs.iter().map(|(rank, _, _)| *rank));
            }
            keep
        });
        change.stop.sort();
        change.start.sort();
        change
    }
}

#[cfg(test)]
#[path = "plan_tests.rs"]
mod plan_tests;
