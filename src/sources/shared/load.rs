//! The load exchange: every `--shared-state-interval-ms` this replica publishes its own booked
//! load per rank (`{prefix}:load:{replica}`, expiring after [`super::load_ttl`]) and registers
//! in the set `{prefix}:replicas`; then it reads every other member's entry, sums them per rank
//! and hands the sum to the core as remote load. A member whose entry expired (the replica died)
//! leaves the set; its load stops counting with the entry.
//!
//! Redis down: the last remote loads stay until they are as old as the TTL (they would have
//! expired in Redis too), then this replica routes on its own bookings alone. When Redis returns,
//! the next exchange rewrites everything: nothing to reconcile by hand.
//!
//! Must not: block picks (this runs on its own task) or keep loads of its own beyond the sum.

use std::collections::HashMap;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tokio::time::{Instant, MissedTickBehavior};

use super::{load_ttl, CallError, SharedState};
use crate::selection::{RankKey, RankLoad, SelectionCore};

/// What one replica publishes: per rank with load, `[worker_id, dp_rank, queued prefill
/// tokens, active decode blocks, active requests]`.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
struct Published {
    v: u8,
    ranks: Vec<(u64, u32, u64, u64, u64)>,
}

pub fn load_key(shared: &SharedState) -> String {
    entry_key(&shared.config.prefix, &shared.replica_id)
}

fn entry_key(prefix: &str, replica: &str) -> String {
    format!("{prefix}:load:{replica}")
}

pub fn replicas_key(shared: &SharedState) -> String {
    format!("{}:replicas", shared.config.prefix)
}

pub fn encode(loads: &[(RankKey, RankLoad)]) -> String {
    let published = Published {
        v: 1,
        ranks: loads
            .iter()
            .map(|(k, l)| {
                (
                    k.worker_id,
                    k.dp_rank,
                    l.active_prefill_tokens,
                    l.active_decode_blocks,
                    l.active_requests,
                )
            })
            .collect(),
    };
    serde_json::to_string(&published).unwrap_or_default()
}

/// Another replica's entry; `None` when it is not one (another version, another program).
pub fn decode(bytes: &[u8]) -> Option<Vec<(RankKey, RankLoad)>> {
    let published: Published = serde_json::from_slice(bytes).ok()?;
    (published.v == 1).then(|| {
        published
            .ranks
            .into_iter()
            .map(|(worker_id, dp_rank, prefill, decode, requests)| {
                (
                    RankKey { worker_id, dp_rank },
                    RankLoad {
                        active_prefill_tokens: prefill,
                        active_decode_blocks: decode,
                        active_requests: requests,
                    },
                )
            })
            .collect()
    })
}

/// Adds one replica's loads into the running sum.
pub fn add_into(total: &mut HashMap<RankKey, RankLoad>, loads: &[(RankKey, RankLoad)]) {
    for (key, load) in loads {
        let sum = total.entry(*key).or_default();
        sum.active_prefill_tokens = sum
            .active_prefill_tokens
            .saturating_add(load.active_prefill_tokens);
        sum.active_decode_blocks = sum
            .active_decode_blocks
            .saturating_add(load.active_decode_blocks);
        sum.active_requests = sum.active_requests.saturating_add(load.active_requests);
    }
}

/// One exchange: publish ours, read the others', return their sum per rank.
pub(super) async fn exchange(
    shared: &SharedState,
    core: &SelectionCore,
) -> Result<HashMap<RankKey, RankLoad>, CallError> {
    let ttl_ms = u64::try_from(load_ttl(shared.config.interval).as_millis()).unwrap_or(u64::MAX);
    let payload = encode(&core.inner().local_loads());
    let replicas = replicas_key(shared);
    let mut conn = shared.connection();
    let mut pipe = redis::pipe();
    pipe.cmd("SET")
        .arg(load_key(shared))
        .arg(payload)
        .arg("PX")
        .arg(ttl_ms)
        .ignore()
        .sadd(&replicas, &shared.replica_id)
        .ignore()
        .smembers(&replicas);
    let (members,): (Vec<String>,) = shared.call("load", pipe.query_async(&mut conn)).await?;
    let others: Vec<String> = members
        .into_iter()
        .filter(|m| *m != shared.replica_id)
        .collect();
    let mut total = HashMap::new();
    let mut live: i64 = 1;
    if !others.is_empty() {
        let keys: Vec<String> = others
            .iter()
            .map(|o| entry_key(&shared.config.prefix, o))
            .collect();
        let entries: Vec<Option<Vec<u8>>> = shared
            .call("load", redis::cmd("MGET").arg(&keys).query_async(&mut conn))
            .await?;
        let mut gone = Vec::new();
        for (replica, entry) in others.iter().zip(entries) {
            match entry.as_deref().map(decode) {
                None => gone.push(replica.as_str()),
                Some(Some(loads)) => {
                    live = live.saturating_add(1);
                    add_into(&mut total, &loads);
                }
                Some(None) => shared
                    .metrics
                    .errors
                    .with_label_values(&["load_decode"])
                    .inc(),
            }
        }
        if !gone.is_empty() {
            // Their entries expired: those replicas are dead (or cut off from Redis).
            let _: Result<(), CallError> = shared
                .call(
                    "load",
                    redis::cmd("SREM")
                        .arg(&replicas)
                        .arg(&gone)
                        .exec_async(&mut conn),
                )
                .await;
        }
    }
    shared.metrics.replicas.set(live);
    Ok(total)
}

fn remote_requests(total: &HashMap<RankKey, RankLoad>) -> i64 {
    let sum = total
        .values()
        .fold(0u64, |n, l| n.saturating_add(l.active_requests));
    i64::try_from(sum).unwrap_or(i64::MAX)
}

/// The exchange loop (runs for the life of the process).
pub(super) async fn run(shared: Arc<SharedState>, core: Arc<SelectionCore>) {
    let ttl = load_ttl(shared.config.interval);
    let mut tick = tokio::time::interval(shared.config.interval);
    tick.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut last_exchange = Instant::now();
    let mut holding_remote = false;
    loop {
        tick.tick().await;
        match exchange(&shared, &core).await {
            Ok(total) => {
                core.set_remote_loads(&total);
                shared.metrics.remote_requests.set(remote_requests(&total));
                holding_remote = !total.is_empty();
                last_exchange = Instant::now();
            }
            Err(_) if holding_remote && last_exchange.elapsed() >= ttl => {
                core.set_remote_loads(&HashMap::new());
                shared.metrics.remote_requests.set(0);
                holding_remote = false;
            }
            Err(_) => {}
        }
    }
}
