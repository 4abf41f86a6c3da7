//! The static catalog: a YAML file with a `workers:` list, for running without Kubernetes. It is
//! re-read when its content changes and every valid version is published as a complete snapshot;
//! an invalid edit is logged and counted and the previous catalog stays in force.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Deserialize;
use tokio::sync::watch;

use kvpick_core::Role;

use super::{RankLayout, WorkerSpec, MAX_DP_RANKS};

/// Namespace given to static workers, so their ids never collide with pod-derived ids.
pub const STATIC_NAMESPACE: &str = "static";

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StaticFile {
    #[serde(default)]
    workers: Vec<StaticWorker>,
}

/// One worker as written in a catalog file (or sent to the API's `UpsertWorker`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StaticWorker {
    pub name: String,
    pub model: String,
    #[serde(default)]
    pub routing_group: String,
    pub address: String,
    #[serde(default)]
    pub ports: Option<Vec<u16>>,
    #[serde(default)]
    pub port: Option<u16>,
    #[serde(default)]
    pub data_parallel_size: Option<u32>,
    #[serde(default)]
    pub block_size: Option<u32>,
    #[serde(default)]
    pub kv_events: Option<String>,
    #[serde(default)]
    pub kv_replay: Option<String>,
    #[serde(default)]
    pub lora_adapters: Vec<String>,
    /// Prefill/decode role: `prefill`, `decode` or `both` (absent = `both`), or a list with one
    /// role per data-parallel rank (`[prefill, prefill, decode, decode]`).
    #[serde(default)]
    pub role: Option<RoleField>,
}

/// `role:` as written: one role for every rank, or one per rank.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum RoleField {
    One(String),
    PerRank(Vec<String>),
}

/// Parses `role:` into the core's roles, naming a bad value.
pub fn parse_roles(field: Option<&RoleField>) -> anyhow::Result<Vec<Role>> {
    let one = |v: &str| {
        Role::parse(v).with_context(|| {
            format!(
                "`role` must be prefill, decode or both, got {:?}",
                v.chars().take(64).collect::<String>()
            )
        })
    };
    match field {
        None => Ok(Vec::new()),
        Some(RoleField::One(v)) => Ok(vec![one(v)?]),
        Some(RoleField::PerRank(vs)) if vs.is_empty() => bail!("`role` must not be an empty list"),
        Some(RoleField::PerRank(vs)) => vs.iter().map(|v| one(v)).collect(),
    }
}

/// Parses the catalog YAML into worker specs, with errors that name the worker and field.
pub fn parse_catalog(text: &str) -> anyhow::Result<Vec<WorkerSpec>> {
    let file: StaticFile = serde_yaml::from_str(text).context("invalid catalog YAML")?;
    file.workers
        .into_iter()
        .enumerate()
        .map(|(i, w)| {
            let label = format!("workers[{i}] ({})", w.name);
            to_spec(w, STATIC_NAMESPACE).with_context(|| label)
        })
        .collect()
}

/// Validates one worker entry into a spec in `namespace`.
pub fn to_spec(w: StaticWorker, namespace: &str) -> anyhow::Result<WorkerSpec> {
    if w.name.is_empty() {
        bail!("`name` must not be empty");
    }
    if w.model.is_empty() {
        bail!("`model` must not be empty");
    }
    let address: IpAddr = w
        .address
        .parse()
        .with_context(|| format!("`address` must be an IP address, got {:?}", w.address))?;
    let ranks = match (w.ports, w.port, w.data_parallel_size) {
        (Some(_), Some(_), _) => bail!("set either `ports` or `port`, not both"),
        (Some(_), None, Some(_)) => {
            bail!("`data_parallel_size` goes with `port` (multiplexed ranks), not `ports`")
        }
        (Some(ports), None, None) => {
            if ports.is_empty() || ports.len() > MAX_DP_RANKS as usize {
                bail!("`ports` must list 1..={MAX_DP_RANKS} ports, one per DP rank");
            }
            if ports.contains(&0) {
                bail!("`ports` must not contain 0");
            }
            RankLayout::PerPort(ports)
        }
        (None, Some(0), _) => bail!("`port` must not be 0"),
        (None, Some(port), size) => {
            let size = size.unwrap_or(1);
            if size == 0 || size > MAX_DP_RANKS {
                bail!("`data_parallel_size` must be 1..={MAX_DP_RANKS}");
            }
            if size == 1 {
                RankLayout::PerPort(vec![port])
            } else {
                RankLayout::Multiplexed { port, size }
            }
        }
        (None, None, _) => bail!("missing `ports` (one per DP rank) or `port`"),
    };
    if w.block_size == Some(0) {
        bail!("`block_size` must be positive");
    }
    let roles = parse_roles(w.role.as_ref())?;
    let spec = WorkerSpec {
        namespace: namespace.to_string(),
        name: w.name,
        model: w.model,
        routing_group: w.routing_group,
        address,
        ranks,
        block_size: w.block_size,
        kv_events: w.kv_events,
        kv_replay: w.kv_replay,
        lora_adapters: w.lora_adapters,
        draining: false,
        incarnation: 0,
        roles,
    };
    spec.validate_roles()
        .map_err(|e| anyhow::anyhow!("`role`: {e}"))?;
    Ok(spec)
}

/// Reads and parses the catalog file once.
pub fn load_catalog(path: &Path) -> anyhow::Result<Vec<WorkerSpec>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read catalog file {}", path.display()))?;
    parse_catalog(&text).with_context(|| format!("in catalog file {}", path.display()))
}

/// Watches the catalog file and publishes each new valid version into `tx`. Polling (rather than
/// inotify) also catches Kubernetes ConfigMap symlink swaps. Returns when every receiver is gone.
pub async fn watch_catalog(
    path: PathBuf,
    initial: String,
    interval: Duration,
    tx: watch::Sender<Option<Vec<WorkerSpec>>>,
    on_invalid: impl Fn(&anyhow::Error) + Send + 'static,
) {
    let mut last_text = initial;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        if tx.is_closed() {
            return;
        }
        let text = match tokio::fs::read_to_string(&path).await {
            Ok(text) => text,
            Err(err) => {
                // A missing file mid-swap is normal for atomic renames; keep the last catalog.
                tracing::debug!(path = %path.display(), %err, "catalog file unreadable, keeping last catalog");
                continue;
            }
        };
        if text == last_text {
            continue;
        }
        match parse_catalog(&text) {
            Ok(specs) => {
                tracing::info!(path = %path.display(), workers = specs.len(), "catalog file changed");
                last_text = text;
                if tx.send(Some(specs)).is_err() {
                    return;
                }
            }
            Err(err) => {
                tracing::error!(path = %path.display(), error = format!("{err:#}"), "catalog file invalid, keeping last catalog");
                on_invalid(&err);
                last_text = text;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_both_rank_shapes() {
        let specs = parse_catalog(
            r#"
workers:
  - name: a
    model: m
    address: 10.0.0.1
    ports: [8000, 8001]
    kv_events: tcp://10.0.0.1:5557
  - name: b
    model: m
    address: "::1"
    port: 9000
    data_parallel_size: 4
    block_size: 16
    lora_adapters: [x]
"#,
        )
        .unwrap();
        assert_eq!(specs[0].ranks, RankLayout::PerPort(vec![8000, 8001]));
        assert_eq!(specs[0].kv_events.as_deref(), Some("tcp://10.0.0.1:5557"));
        assert_eq!(
            specs[1].ranks,
            RankLayout::Multiplexed {
                port: 9000,
                size: 4
            }
        );
        assert_eq!(specs[1].block_size, Some(16));
        assert_eq!(specs[1].namespace, STATIC_NAMESPACE);
    }

    #[test]
    fn roles_are_one_for_all_ranks_or_one_per_rank() {
        let specs = parse_catalog(
            r#"
workers:
  - {name: p, model: m, address: 10.0.0.1, port: 8000, role: prefill}
  - {name: d, model: m, address: 10.0.0.2, port: 8000, role: Decode}
  - {name: b, model: m, address: 10.0.0.3, port: 8000}
  - {name: dp, model: m, address: 10.0.0.4, ports: [8000, 8001], role: [prefill, decode]}
"#,
        )
        .unwrap();
        let roles: Vec<Vec<Role>> = specs.iter().map(|s| s.roles.clone()).collect();
        assert_eq!(
            roles,
            vec![
                vec![Role::Prefill],
                vec![Role::Decode],
                vec![],
                vec![Role::Prefill, Role::Decode]
            ]
        );
        let ranks = specs[3].rank_endpoints();
        assert_eq!(
            (ranks[0].role, ranks[1].role),
            (Role::Prefill, Role::Decode)
        );
        assert_eq!(specs[2].rank_endpoints()[0].role, Role::Both);
        for (yaml, expected) in [
            (
                "workers: [{name: a, model: m, address: 1.2.3.4, port: 2, role: encode}]",
                "prefill, decode or both",
            ),
            (
                "workers: [{name: a, model: m, address: 1.2.3.4, ports: [1, 2], role: [prefill, decode, decode]}]",
                "3 roles for 2 ranks",
            ),
            (
                "workers: [{name: a, model: m, address: 1.2.3.4, port: 2, role: []}]",
                "empty list",
            ),
        ] {
            let err = format!("{:#}", parse_catalog(yaml).unwrap_err());
            assert!(err.contains(expected) && err.contains("workers[0] (a)"), "{err}");
        }
    }

    #[test]
    fn empty_file_means_empty_catalog() {
        assert!(parse_catalog("workers: []").unwrap().is_empty());
        assert!(parse_catalog("{}").unwrap().is_empty());
    }

    #[test]
    fn errors_name_the_worker_and_field() {
        let cases = [
            (
                "workers: [{name: a, model: m, address: 1.2.3.4}]",
                "missing `ports`",
            ),
            (
                "workers: [{name: a, model: m, address: 1.2.3.4, ports: [1], port: 2}]",
                "not both",
            ),
            (
                "workers: [{name: a, model: m, address: host.example, port: 2}]",
                "must be an IP address",
            ),
            (
                "workers: [{name: a, model: m, address: 1.2.3.4, port: 2, data_parallel_size: 0}]",
                "data_parallel_size",
            ),
            (
                "workers: [{name: a, model: m, address: 1.2.3.4, port: 2, colour: red}]",
                "unknown field",
            ),
        ];
        for (yaml, expected) in cases {
            let err = format!("{:#}", parse_catalog(yaml).unwrap_err());
            assert!(err.contains(expected), "{yaml}: {err}");
            if !expected.contains("unknown") {
                assert!(err.contains("workers[0] (a)"), "{err}");
            }
        }
    }

    #[tokio::test(start_paused = true)]
    async fn watcher_publishes_changes_and_skips_invalid_edits() {
        let dir = std::env::temp_dir().join(format!("kvpick-cat-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("catalog.yaml");
        let v1 = "workers: [{name: a, model: m, address: 1.2.3.4, port: 1}]";
        std::fs::write(&path, v1).unwrap();
        let (tx, mut rx) = watch::channel(None);
        let invalid = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let seen = invalid.clone();
        let task = tokio::spawn(watch_catalog(
            path.clone(),
            v1.to_string(),
            Duration::from_secs(1),
            tx,
            move |_| {
                seen.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            },
        ));
        std::fs::write(&path, "workers: [{name: a}]").unwrap();
        std::fs::write(&path, "workers: []").unwrap();
        rx.changed().await.unwrap();
        assert_eq!(rx.borrow().as_ref().unwrap().len(), 0);
        std::fs::write(&path, "workers: [{name: b, model: m, address: 1.2.3.4}]").unwrap();
        while invalid.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        assert!(!rx.has_changed().unwrap());
        drop(rx);
        task.await.unwrap();
        std::fs::remove_dir_all(dir).unwrap();
    }
}
