//! Worker catalog records and the sources that produce them (static YAML file, Kubernetes
//! InferencePool/pod reflector). A source only ever produces *complete desired snapshots*; applying them is the
//! selection core's job, so this module never touches bookings, load or scheduling state.

pub mod kube;
pub mod static_file;

use std::net::{IpAddr, SocketAddr};

/// Largest number of data-parallel ranks one worker may declare.
pub const MAX_DP_RANKS: u32 = 64;

/// How a worker exposes its data-parallel ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RankLayout {
    /// Rank `i` listens on `ports[i]` (GIE `targetPorts`).
    PerPort(Vec<u16>),
    /// Every rank shares one port; the pick names the rank in `X-data-parallel-rank`.
    Multiplexed { port: u16, size: u32 },
    /// Rank per port with only some ranks live (GIE `active-ports`): `(dp_rank, port)` pairs, so
    /// a rank keeps its number (and its KV-event port offset) when others are inactive.
    Sparse(Vec<(u32, u16)>),
}

/// One model server (pod) as a catalog source describes it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerSpec {
    pub namespace: String,
    pub name: String,
    pub model: String,
    pub routing_group: String,
    pub address: IpAddr,
    pub ranks: RankLayout,
    pub block_size: Option<u32>,
    pub kv_events: Option<String>,
    /// Replay (ROUTER) endpoint of rank 0, offset by rank like `kv_events`.
    pub kv_replay: Option<String>,
    pub lora_adapters: Vec<String>,
}

/// One schedulable endpoint of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankEndpoint {
    pub dp_rank: u32,
    pub endpoint: SocketAddr,
    pub multiplexed: bool,
}

impl WorkerSpec {
    /// Stable 53-bit id (JSON-safe) derived from namespace/name.
    pub fn worker_id(&self) -> u64 {
        worker_id(&self.namespace, &self.name)
    }

    pub fn rank_endpoints(&self) -> Vec<RankEndpoint> {
        match &self.ranks {
            RankLayout::PerPort(ports) => ports
                .iter()
                .enumerate()
                .map(|(rank, port)| RankEndpoint {
                    dp_rank: rank as u32,
                    endpoint: SocketAddr::new(self.address, *port),
                    multiplexed: false,
                })
                .collect(),
            RankLayout::Sparse(ranks) => ranks
                .iter()
                .map(|&(dp_rank, port)| RankEndpoint {
                    dp_rank,
                    endpoint: SocketAddr::new(self.address, port),
                    multiplexed: false,
                })
                .collect(),
            RankLayout::Multiplexed { port, size } => (0..*size)
                .map(|rank| RankEndpoint {
                    dp_rank: rank,
                    endpoint: SocketAddr::new(self.address, *port),
                    multiplexed: true,
                })
                .collect(),
        }
    }

    /// Whether this worker can serve `model` (its base model or one of its LoRA adapters).
    pub fn serves(&self, model: &str) -> bool {
        self.model == model || self.lora_adapters.iter().any(|a| a == model)
    }
}

impl WorkerSpec {
    /// A static worker on 127.0.0.1 with nothing optional set, for tests.
    #[cfg(test)]
    pub(crate) fn for_test(name: &str, model: &str, ranks: RankLayout) -> WorkerSpec {
        WorkerSpec {
            namespace: "static".into(),
            name: name.into(),
            model: model.into(),
            routing_group: String::new(),
            address: "127.0.0.1".parse().unwrap(),
            ranks,
            block_size: None,
            kv_events: None,
            kv_replay: None,
            lora_adapters: vec![],
        }
    }
}

/// A stable 53-bit hash of `namespace/name`, so ids survive restarts and fit a JSON number.
pub fn worker_id(namespace: &str, name: &str) -> u64 {
    let mut key = Vec::with_capacity(namespace.len() + name.len() + 1);
    key.extend_from_slice(namespace.as_bytes());
    key.push(b'/');
    key.extend_from_slice(name.as_bytes());
    xxhash_rust::xxh3::xxh3_64(&key) & ((1u64 << 53) - 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_id_is_stable_and_json_safe() {
        let a = worker_id("ns", "pod-a");
        assert_eq!(a, worker_id("ns", "pod-a"));
        assert_ne!(a, worker_id("ns", "pod-b"));
        assert_ne!(a, worker_id("other", "pod-a"));
        assert!(a < (1u64 << 53));
    }

    #[test]
    fn multiplexed_ranks_share_one_endpoint() {
        let spec = WorkerSpec {
            namespace: "static".into(),
            name: "w".into(),
            model: "m".into(),
            routing_group: String::new(),
            address: "10.0.0.1".parse().unwrap(),
            ranks: RankLayout::Multiplexed {
                port: 8000,
                size: 3,
            },
            block_size: None,
            kv_events: None,
            kv_replay: None,
            lora_adapters: vec!["lora-a".into()],
        };
        let ranks = spec.rank_endpoints();
        assert_eq!(ranks.len(), 3);
        assert!(ranks
            .iter()
            .all(|r| r.multiplexed && r.endpoint.port() == 8000));
        assert_eq!(ranks[2].dp_rank, 2);
        assert!(spec.serves("m") && spec.serves("lora-a") && !spec.serves("x"));
    }
}
