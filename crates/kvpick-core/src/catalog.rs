//! The catalog as data: workers as sources describe them ([`WorkerSpec`]), as the core holds them
//! ([`WorkerRecord`]), and the union of every source's complete snapshot ([`Catalog`]) with the
//! diff that reconciling a new snapshot makes. No I/O: the sources (static file, Kubernetes) live
//! in the host crate and only ever hand the core complete snapshots.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};

use crate::error::CatalogError;
use crate::types::{Lifecycle, PartitionKey, Role};

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
    /// Kept in the catalog but not schedulable (e.g. its pod is NotReady or terminating): its
    /// in-flight bookings still count as load until it is deleted or ready again.
    pub draining: bool,
    /// Which run of the engine this is (e.g. a hash of the pod uid and container restart counts);
    /// when it changes, the engine's KV cache is gone and the rank's index entries are dropped.
    /// Sources that cannot tell leave it 0.
    pub incarnation: u64,
    /// Prefill/decode roles ([`Role`]): empty = every rank `Both`; one entry = every rank;
    /// otherwise one entry per rank, in rank order (a DP engine whose ranks play different roles).
    pub roles: Vec<Role>,
}

/// One schedulable endpoint of a worker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RankEndpoint {
    pub dp_rank: u32,
    pub endpoint: SocketAddr,
    pub multiplexed: bool,
    pub role: Role,
}

impl WorkerSpec {
    /// Stable 53-bit id (JSON-safe) derived from namespace/name.
    pub fn worker_id(&self) -> u64 {
        worker_id(&self.namespace, &self.name)
    }

    /// The role of the rank at `position` in rank order (see [`WorkerSpec::roles`]).
    pub fn role_at(&self, position: usize) -> Role {
        match self.roles.as_slice() {
            [] => Role::Both,
            [one] => *one,
            many => many.get(position).copied().unwrap_or_default(),
        }
    }

    /// Checks `roles` against the rank count: none, one for all, or exactly one per rank.
    pub fn validate_roles(&self) -> Result<(), crate::error::ConfigError> {
        let ranks = self.rank_endpoints().len();
        match self.roles.len() {
            0 | 1 => Ok(()),
            n if n == ranks => Ok(()),
            roles => Err(crate::error::ConfigError::RolesPerRank {
                worker: self.name.clone(),
                roles,
                ranks,
            }),
        }
    }

    pub fn rank_endpoints(&self) -> Vec<RankEndpoint> {
        let mut ranks = self.rank_endpoints_without_roles();
        for (position, rank) in ranks.iter_mut().enumerate() {
            rank.role = self.role_at(position);
        }
        ranks
    }

    fn rank_endpoints_without_roles(&self) -> Vec<RankEndpoint> {
        match &self.ranks {
            RankLayout::PerPort(ports) => ports
                .iter()
                .enumerate()
                .map(|(rank, port)| RankEndpoint {
                    dp_rank: rank as u32,
                    endpoint: SocketAddr::new(self.address, *port),
                    multiplexed: false,
                    role: Role::Both,
                })
                .collect(),
            RankLayout::Sparse(ranks) => ranks
                .iter()
                .map(|&(dp_rank, port)| RankEndpoint {
                    dp_rank,
                    endpoint: SocketAddr::new(self.address, port),
                    multiplexed: false,
                    role: Role::Both,
                })
                .collect(),
            RankLayout::Multiplexed { port, size } => (0..*size)
                .map(|rank| RankEndpoint {
                    dp_rank: rank,
                    endpoint: SocketAddr::new(self.address, *port),
                    multiplexed: true,
                    role: Role::Both,
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
    #[doc(hidden)]
    pub fn for_test(name: &str, model: &str, ranks: RankLayout) -> WorkerSpec {
        WorkerSpec {
            namespace: "static".into(),
            name: name.into(),
            model: model.into(),
            routing_group: String::new(),
            address: IpAddr::V4(std::net::Ipv4Addr::LOCALHOST),
            ranks,
            block_size: None,
            kv_events: None,
            kv_replay: None,
            lora_adapters: vec![],
            draining: false,
            incarnation: 0,
            roles: Vec::new(),
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

/// Which catalog source produced a set of workers; the catalog is the union of all sources.
pub type SourceName = &'static str;

/// A worker as the core holds it.
#[derive(Debug, Clone)]
pub struct WorkerRecord {
    pub id: u64,
    pub spec: WorkerSpec,
    pub ranks: Vec<RankEndpoint>,
    pub lifecycle: Lifecycle,
    pub reason: String,
}

impl WorkerRecord {
    fn new(id: u64, spec: WorkerSpec) -> WorkerRecord {
        let ranks = spec.rank_endpoints();
        let (lifecycle, reason) = if ranks.is_empty() {
            (Lifecycle::Incomplete, "no ranks".to_string())
        } else if let Err(reason) = spec.validate_roles() {
            (Lifecycle::Incomplete, reason.to_string())
        } else if spec.draining {
            (Lifecycle::Draining, "not ready".to_string())
        } else {
            (Lifecycle::Schedulable, String::new())
        };
        WorkerRecord {
            id,
            spec,
            ranks,
            lifecycle,
            reason,
        }
    }

    pub fn partition_key(&self) -> PartitionKey {
        PartitionKey {
            model: self.spec.model.clone(),
            routing_group: self.spec.routing_group.clone(),
        }
    }
}

/// Result of applying one catalog snapshot.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    pub added: usize,
    pub updated: usize,
    pub unchanged: usize,
    pub removed: usize,
    /// Workers kept out of scheduling (e.g. block-size conflict), with the reason.
    pub failed: Vec<(String, String)>,
    /// Partitions that received a batch (one publish each).
    pub partitions_published: usize,
    /// Whether, after this snapshot, at least one worker is schedulable.
    pub ready: bool,
}

/// What one reconcile pass changes in one partition, applied there as one batch.
#[derive(Debug, Default)]
pub struct PartitionChanges {
    /// Workers that left this partition (deleted, or moved to another partition).
    pub gone: Vec<WorkerRecord>,
    /// Workers added or changed in this partition.
    pub upserts: Vec<WorkerRecord>,
}

/// The union of every source's latest complete snapshot, and the records derived from it.
#[derive(Debug, Default)]
pub struct Catalog {
    sources: BTreeMap<SourceName, Vec<WorkerSpec>>,
    records: HashMap<u64, WorkerRecord>,
}

impl Catalog {
    /// One source's current workers.
    pub fn source(&self, name: SourceName) -> &[WorkerSpec] {
        self.sources.get(name).map_or(&[], Vec::as_slice)
    }

    pub fn records(&self) -> impl Iterator<Item = &WorkerRecord> {
        self.records.values()
    }

    pub fn record(&self, id: u64) -> Option<&WorkerRecord> {
        self.records.get(&id)
    }

    /// Keeps a worker out of scheduling, saying why (a partition refused it).
    pub fn mark_failed(&mut self, id: u64, reason: String) -> Option<String> {
        let record = self.records.get_mut(&id)?;
        record.lifecycle = Lifecycle::Unschedulable;
        record.reason = reason;
        Some(record.spec.name.clone())
    }

    pub fn any_schedulable(&self) -> bool {
        self.records
            .values()
            .any(|w| w.lifecycle == Lifecycle::Schedulable)
    }

    /// Replaces `source`'s workers with `specs` and diffs the union of all sources against the
    /// records: duplicate ids anywhere in the union are refused before anything changes;
    /// unchanged workers are skipped; changed and new ones are upserted; workers absent from every
    /// source are deleted. Returns the counts and the changes per partition, in key order. Only
    /// changed and new workers are copied: a snapshot of thousands of workers of which one changed
    /// costs a comparison per worker.
    pub fn replace_source(
        &mut self,
        source: SourceName,
        specs: Vec<WorkerSpec>,
    ) -> Result<(ApplyReport, BTreeMap<PartitionKey, PartitionChanges>), CatalogError> {
        let mut seen = HashSet::new();
        let others = self
            .sources
            .iter()
            .filter(|(name, _)| **name != source)
            .map(|(n, l)| (*n, l.as_slice()));
        for (name, list) in others.chain(std::iter::once((source, specs.as_slice()))) {
            for spec in list {
                if !seen.insert(spec.worker_id()) {
                    return Err(CatalogError::DuplicateWorker {
                        namespace: spec.namespace.clone(),
                        name: spec.name.clone(),
                        source_name: name,
                    });
                }
            }
        }
        self.sources.insert(source, specs);
        let desired: HashMap<u64, &WorkerSpec> = self
            .sources
            .values()
            .flatten()
            .map(|s| (s.worker_id(), s))
            .collect();
        Ok(diff(&mut self.records, desired))
    }
}

/// The records brought to `desired`: what changed, per partition.
fn diff(
    records: &mut HashMap<u64, WorkerRecord>,
    mut desired: HashMap<u64, &WorkerSpec>,
) -> (ApplyReport, BTreeMap<PartitionKey, PartitionChanges>) {
    let mut report = ApplyReport::default();
    let mut changes: BTreeMap<PartitionKey, PartitionChanges> = BTreeMap::new();
    let mut existing: Vec<u64> = records.keys().copied().collect();
    existing.sort_unstable();
    for id in existing {
        let Some(old) = records.get(&id) else {
            continue;
        };
        match desired.remove(&id) {
            None => {
                if let Some(old) = records.remove(&id) {
                    changes
                        .entry(old.partition_key())
                        .or_default()
                        .gone
                        .push(old);
                }
                report.removed += 1;
            }
            Some(spec) if *spec == old.spec => report.unchanged += 1,
            Some(spec) => {
                let new = WorkerRecord::new(id, spec.clone());
                let key = new.partition_key();
                if let Some(old) = records.insert(id, new.clone()) {
                    if old.partition_key() != key {
                        changes
                            .entry(old.partition_key())
                            .or_default()
                            .gone
                            .push(old);
                    }
                }
                changes.entry(key).or_default().upserts.push(new);
                report.updated += 1;
            }
        }
    }
    let mut added: Vec<(u64, &WorkerSpec)> = desired.into_iter().collect();
    added.sort_by_key(|(id, _)| *id);
    for (id, spec) in added {
        let new = WorkerRecord::new(id, spec.clone());
        changes
            .entry(new.partition_key())
            .or_default()
            .upserts
            .push(new.clone());
        records.insert(id, new);
        report.added += 1;
    }
    report.partitions_published = changes.len();
    (report, changes)
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

    fn keys(
        changes: &BTreeMap<PartitionKey, PartitionChanges>,
    ) -> Vec<(String, Vec<String>, Vec<String>)> {
        changes
            .iter()
            .map(|(k, c)| {
                let names = |rs: &[WorkerRecord]| rs.iter().map(|r| r.spec.name.clone()).collect();
                (k.model.clone(), names(&c.gone), names(&c.upserts))
            })
            .collect()
    }

    #[test]
    fn a_snapshot_changes_only_what_differs_and_a_duplicate_changes_nothing() {
        let w = |name: &str, model: &str| {
            WorkerSpec::for_test(name, model, RankLayout::PerPort(vec![1]))
        };
        let mut catalog = Catalog::default();
        let (report, changes) = catalog
            .replace_source("s", vec![w("a", "m"), w("b", "m"), w("c", "m")])
            .unwrap();
        assert_eq!((report.added, report.partitions_published), (3, 1));
        assert_eq!(
            keys(&changes),
            [("m".into(), vec![], vec!["a".into(), "b".into(), "c".into()])]
        );

        // b drains, c moves to another model, a is unchanged, d is new; then c leaves.
        let mut b = w("b", "m");
        b.draining = true;
        let (report, changes) = catalog
            .replace_source("s", vec![w("a", "m"), b, w("c", "n"), w("d", "m")])
            .unwrap();
        assert_eq!(
            (
                report.unchanged,
                report.updated,
                report.added,
                report.removed
            ),
            (1, 2, 1, 0)
        );
        let mut got = keys(&changes);
        for (_, gone, upserts) in &mut got {
            gone.sort();
            upserts.sort();
        }
        assert_eq!(
            got,
            [
                ("m".into(), vec!["c".into()], vec!["b".into(), "d".into()]),
                ("n".into(), vec![], vec!["c".into()]),
            ]
        );
        assert_eq!(
            catalog.record(worker_id("static", "b")).unwrap().lifecycle,
            Lifecycle::Draining
        );

        // Another source naming d: refused, and nothing changes.
        let err = catalog.replace_source("t", vec![w("d", "m")]).unwrap_err();
        assert!(
            matches!(err, CatalogError::DuplicateWorker { .. }),
            "{err:?}"
        );
        assert_eq!(catalog.records().count(), 4);
        assert!(catalog.source("t").is_empty());

        let (report, changes) = catalog
            .replace_source("s", vec![w("a", "m"), w("d", "m")])
            .unwrap();
        assert_eq!((report.removed, report.unchanged), (2, 2));
        assert_eq!(
            keys(&changes),
            [
                ("m".into(), vec!["b".into()], vec![]),
                ("n".into(), vec!["c".into()], vec![]),
            ]
        );
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
            draining: false,
            incarnation: 0,
            roles: Vec::new(),
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
