//! Simulated KV-event publishers: one ZeroMQ PUB endpoint per engine rank ([`crate::zmtp`]),
//! bound where kvpick subscribes (the pod's IP, the events port offset by the rank, as vLLM binds
//! them), sending
//! vLLM's msgpack `KVEventBatch` (array encoding, `kvpick_sim::sim::wire`) with `ts` = the
//! wall-clock instant of the send, so kvpick's event-lag histogram measures send -> applied.
//!
//! Each rank stores the prefix of one workload family at a time, a few blocks per batch as a
//! chain (parent = the previous block's engine hash), and when it moves on to another family
//! removes the blocks of the family before last, so the index stays bounded while it churns.
//!
//! Owns sockets and the simulated caches' bookkeeping only; it knows nothing of kvpick.

use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use kvpick_core::event::{KvEvent, Medium};
use kvpick_sim::sim::wire::{encode_batch, Encoding};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::workload::Workload;
use crate::zmtp::{encode, Publisher};

/// Families a rank keeps before it removes the oldest one's blocks.
const KEPT_FAMILIES: usize = 2;

/// The publishers of one pod: one socket per data-parallel rank.
pub struct PodPublishers {
    /// Dense index of the pod, the seed of what its ranks cache.
    pub pod: u32,
    sockets: Vec<Publisher>,
}

/// Binds `ranks` PUB endpoints on `ip`, at `port + rank`.
pub async fn bind_pod(
    pod: u32,
    ip: IpAddr,
    port: u16,
    ranks: u32,
) -> anyhow::Result<PodPublishers> {
    let mut sockets = Vec::with_capacity(ranks as usize);
    for rank in 0..ranks {
        let port = u16::try_from(u32::from(port) + rank)
            .map_err(|_| anyhow::anyhow!("events port {port} + rank {rank} is past 65535"))?;
        sockets.push(Publisher::bind(SocketAddr::new(ip, port)).await?);
    }
    Ok(PodPublishers { pod, sockets })
}

/// What the simulated engines send.
#[derive(Debug, Clone, Copy)]
pub struct PublishConfig {
    pub workload: Workload,
    /// Blocks stored per batch.
    pub blocks_per_batch: u32,
    /// Batches per second per pod (spread over its ranks in turn).
    pub batches_per_pod_second: f64,
    /// Pods in the fleet (spreads the pods' first sends over one period).
    pub pods: u32,
}

/// The running publishers: counts of what they sent, stopped on drop.
pub struct Publishers {
    /// Batches handed to at least one subscriber.
    pub sent: Arc<AtomicU64>,
    /// Batches no subscriber took (none connected yet, or every queue full).
    pub unsent: Arc<AtomicU64>,
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
}

impl Publishers {
    /// Starts one task per pod sending batches at the configured rate.
    pub fn start(pods: Vec<PodPublishers>, config: PublishConfig) -> Publishers {
        let (stop, stopped) = watch::channel(false);
        let sent = Arc::new(AtomicU64::new(0));
        let unsent = Arc::new(AtomicU64::new(0));
        let tasks = pods
            .into_iter()
            .map(|pod| {
                let counters = (Arc::clone(&sent), Arc::clone(&unsent));
                tokio::spawn(run_pod(pod, config, counters, stopped.clone()))
            })
            .collect();
        Publishers {
            sent,
            unsent,
            stop,
            tasks,
        }
    }

    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::Relaxed)
    }
}

impl Drop for Publishers {
    fn drop(&mut self) {
        self.stop.send_replace(true);
        for task in &self.tasks {
            task.abort();
        }
    }
}

async fn run_pod(
    pod: PodPublishers,
    config: PublishConfig,
    (sent, unsent): (Arc<AtomicU64>, Arc<AtomicU64>),
    mut stop: watch::Receiver<bool>,
) {
    if config.batches_per_pod_second <= 0.0 || pod.sockets.is_empty() {
        // Silent engines: the endpoints stay open for kvpick to subscribe to.
        let _ = stop.changed().await;
        return;
    }
    let period = Duration::from_secs_f64(1.0 / config.batches_per_pod_second);
    let phase = period.mul_f64(f64::from(pod.pod) / f64::from(config.pods.max(1)));
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + phase, period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let ranks = pod.sockets.len() as u32;
    let mut caches: Vec<RankCache> = (0..ranks)
        .map(|rank| RankCache::new(pod.pod.wrapping_mul(ranks).wrapping_add(rank)))
        .collect();
    let mut next = 0usize;
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            _ = stop.changed() => return,
        }
        let rank = next;
        next = (next + 1) % pod.sockets.len();
        let events = caches[rank].next_batch(&config);
        let message = caches[rank].message(&events, rank as u32);
        if pod.sockets[rank].send(message) > 0 {
            sent.fetch_add(1, Ordering::Relaxed);
        } else {
            unsent.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// What one simulated rank has cached and will store next.
#[derive(Debug)]
pub struct RankCache {
    /// Global rank index: seeds its family choices and makes its engine hashes unique.
    id: u32,
    seq: u64,
    /// Families stored (the current one last), each with its blocks' engine hashes.
    families: VecDeque<(u32, Vec<u64>)>,
    /// Blocks of the current family stored so far.
    cursor: u32,
    hashes_made: u64,
    families_started: u64,
}

impl RankCache {
    pub fn new(id: u32) -> RankCache {
        RankCache {
            id,
            seq: 0,
            families: VecDeque::new(),
            cursor: 0,
            hashes_made: 0,
            families_started: 0,
        }
    }

    /// The next batch: the current family's next blocks, or the start of another family (with
    /// the removal of the family before last).
    pub fn next_batch(&mut self, config: &PublishConfig) -> Vec<KvEvent> {
        let workload = &config.workload;
        let mut events = Vec::new();
        if self.families.is_empty() || self.cursor >= workload.family_blocks {
            let family = self.pick_family(workload.families);
            self.families.push_back((family, Vec::new()));
            self.cursor = 0;
            if self.families.len() > KEPT_FAMILIES {
                if let Some((_, gone)) = self.families.pop_front() {
                    events.push(KvEvent::BlockRemoved {
                        block_hashes: gone,
                        medium: Medium::Gpu,
                        group_idx: None,
                    });
                }
            }
        }
        let count = config
            .blocks_per_batch
            .clamp(1, workload.family_blocks.saturating_sub(self.cursor).max(1));
        let first = self.cursor;
        let hashes: Vec<u64> = (0..count).map(|_| self.engine_hash()).collect();
        let Some((family, stored)) = self.families.back_mut() else {
            return events;
        };
        let parent = stored.last().copied();
        stored.extend_from_slice(&hashes);
        events.push(KvEvent::BlockStored {
            block_hashes: hashes,
            parent_block_hash: parent,
            token_ids: workload.family_tokens(*family, first, count),
            block_size: workload.block_size,
            lora_id: None,
            medium: Medium::Gpu,
            lora_name: None,
            cache_salt: None,
            group_idx: None,
            media: Vec::new(),
        });
        self.cursor = first + count;
        events
    }

    /// `[topic, seq, payload]` with `ts` = now, as vLLM frames a batch (ZMTP-encoded).
    pub fn message(&mut self, events: &[KvEvent], dp_rank: u32) -> Bytes {
        let ts = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        let payload = encode_batch(ts, events, Some(dp_rank), Encoding::Array);
        let message = encode(&[b"", &self.seq.to_be_bytes(), &payload]);
        self.seq += 1;
        message
    }

    fn pick_family(&mut self, families: u32) -> u32 {
        self.families_started += 1;
        let mixed =
            (u64::from(self.id) << 32 | self.families_started).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        ((mixed >> 32) % u64::from(families.max(1))) as u32
    }

    fn engine_hash(&mut self) -> u64 {
        self.hashes_made += 1;
        (u64::from(self.id) << 32) | self.hashes_made
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> PublishConfig {
        PublishConfig {
            workload: Workload {
                families: 8,
                family_blocks: 4,
                block_size: 16,
                prompt_tokens: 64,
            },
            blocks_per_batch: 3,
            batches_per_pod_second: 1.0,
            pods: 1,
        }
    }

    fn stored(events: &[KvEvent]) -> (Vec<u64>, Option<u64>, usize) {
        events
            .iter()
            .find_map(|e| match e {
                KvEvent::BlockStored {
                    block_hashes,
                    parent_block_hash,
                    token_ids,
                    ..
                } => Some((block_hashes.clone(), *parent_block_hash, token_ids.len())),
                _ => None,
            })
            .unwrap()
    }

    #[test]
    fn a_family_is_stored_as_one_chain_and_the_one_before_last_is_removed() {
        let config = config();
        let mut cache = RankCache::new(7);
        let (first, parent, tokens) = stored(&cache.next_batch(&config));
        assert_eq!(
            (first.len(), parent, tokens),
            (3, None, 48),
            "a chain starts"
        );
        let (rest, parent, _) = stored(&cache.next_batch(&config));
        assert_eq!(rest.len(), 1, "the family's last block");
        assert_eq!(parent, first.last().copied(), "continues the chain");
        // Family two starts without a removal; family three removes family one's blocks.
        let second = cache.next_batch(&config);
        assert!(matches!(second[..], [KvEvent::BlockStored { .. }]));
        cache.next_batch(&config);
        let third = cache.next_batch(&config);
        let KvEvent::BlockRemoved { block_hashes, .. } = &third[0] else {
            panic!("{third:?}");
        };
        let mut family_one = first.clone();
        family_one.extend(rest);
        assert_eq!(block_hashes, &family_one);
    }

    #[test]
    fn the_stored_tokens_are_the_familys_blocks() {
        let config = config();
        let mut cache = RankCache::new(1);
        let events = cache.next_batch(&config);
        let family = cache.families.back().unwrap().0;
        let KvEvent::BlockStored { token_ids, .. } = &events[0] else {
            panic!();
        };
        assert_eq!(token_ids, &config.workload.family_tokens(family, 0, 3));
    }
}
