//! Merges the flow-policy sources (the `--flow-config` file and the Kubernetes resources) into one
//! `watch::Receiver<Arc<FlowPolicy>>`: file objectives first (cluster objectives of the same name
//! override them), cluster rules before file rules. A new snapshot is published only when the
//! merged policy differs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::kube::{ClusterContent, FlowKubeConfig};
use super::static_file::{self, FlowFileContent};
use super::{FlowPolicy, PolicyRx};

/// Where the flow policy comes from.
#[derive(Clone, Default)]
pub struct FlowSourceConfig {
    /// `--flow-config`: read now (an invalid file is an error), then polled every `poll`.
    pub file: Option<PathBuf>,
    pub poll: Duration,
    /// The Kubernetes resources, when kvpick serves an InferencePool and `--flow-watch-crds` is on.
    pub kube: Option<(kube::Client, FlowKubeConfig)>,
}

/// The merged policy.
pub fn merge(file: &FlowFileContent, cluster: &ClusterContent) -> FlowPolicy {
    FlowPolicy::new(
        file.objectives.iter().chain(&cluster.objectives).cloned(),
        cluster.rules.iter().chain(&file.rules).cloned(),
    )
}

/// Loads the file (start-up errors name it), spawns the sources and the merger, and returns the
/// policy receiver (already holding the file's policy). Every task ends once every receiver is
/// dropped. Must be called within a tokio runtime.
pub fn start(config: FlowSourceConfig) -> anyhow::Result<PolicyRx> {
    let file_content = match &config.file {
        Some(path) => {
            let (text, content) = static_file::load_flow_config(path)?;
            tracing::info!(
                path = %path.display(),
                objectives = content.objectives.len(),
                rewrites = content.rules.len(),
                "flow-config loaded"
            );
            Some((path.clone(), text, content))
        }
        None => None,
    };
    let initial_file = file_content
        .as_ref()
        .map(|(_, _, c)| c.clone())
        .unwrap_or_default();
    let (file_tx, file_rx) = watch::channel(initial_file.clone());
    let (cluster_tx, cluster_rx) = watch::channel(ClusterContent::default());
    let (policy_tx, policy_rx) =
        watch::channel(Arc::new(merge(&initial_file, &ClusterContent::default())));
    if let Some((path, text, _)) = file_content {
        tokio::spawn(static_file::watch_flow_config(
            path,
            text,
            config.poll.max(Duration::from_millis(1)),
            file_tx,
            |_| {},
        ));
    }
    if let Some((client, kube_config)) = config.kube {
        tracing::info!(namespace = %kube_config.namespace, pool = %kube_config.pool, "watching InferenceObjective / InferenceModelRewrite");
        tokio::spawn(super::kube::run(client, kube_config, cluster_tx));
    }
    tokio::spawn(run_merge(file_rx, cluster_rx, policy_tx));
    Ok(policy_rx)
}

async fn run_merge(
    mut file: watch::Receiver<FlowFileContent>,
    mut cluster: watch::Receiver<ClusterContent>,
    tx: watch::Sender<Arc<FlowPolicy>>,
) {
    let (mut file_open, mut cluster_open) = (true, true);
    loop {
        tokio::select! {
            r = file.changed(), if file_open => file_open = r.is_ok(),
            r = cluster.changed(), if cluster_open => cluster_open = r.is_ok(),
            _ = tx.closed() => return,
        }
        let next = merge(&file.borrow_and_update(), &cluster.borrow_and_update());
        tx.send_if_modified(|current| {
            if **current == next {
                return false;
            }
            *current = Arc::new(next);
            true
        });
        if !file_open && !cluster_open {
            // No source left (neither configured): the policy stays as it is.
            tx.closed().await;
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::flow::{Objective, Origin};

    #[tokio::test(start_paused = true)]
    async fn file_policy_is_there_at_once_and_edits_are_published() {
        let dir = std::env::temp_dir().join(format!("kvpick-flowsrc-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("flow.yaml");
        std::fs::write(&path, "objectives: [{name: a, priority: 5}]").unwrap();
        let mut rx = start(FlowSourceConfig {
            file: Some(path.clone()),
            poll: Duration::from_millis(100),
            kube: None,
        })
        .unwrap();
        assert_eq!(rx.borrow_and_update().objective("a").unwrap().priority, 5);
        std::fs::write(&path, "objectives: [{name: a, priority: 6}]").unwrap();
        rx.changed().await.unwrap();
        assert_eq!(rx.borrow().objective("a").unwrap().priority, 6);
        std::fs::write(&path, "objectives: [{name: a, priority: seven}]").unwrap();
        let bad = start(FlowSourceConfig {
            file: Some(path.clone()),
            ..Default::default()
        });
        let err = format!("{:#}", bad.err().unwrap());
        assert!(
            err.contains("flow-config") && err.contains("flow.yaml"),
            "{err}"
        );
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn cluster_objectives_override_the_file_and_cluster_rules_come_first() {
        let file = static_file::parse_flow_config(
            "objectives: [{name: a, priority: 1}, {name: b, priority: 2}]\nrewrites: [{matches: [m], targets: [{model: from-file}]}]",
        )
        .unwrap();
        let cluster = ClusterContent {
            objectives: vec![Objective {
                name: "a".into(),
                priority: 10,
                pool: Some("p".into()),
                origin: Origin::Gie,
            }],
            rules: static_file::parse_flow_config(
                "rewrites: [{matches: [m], targets: [{model: from-cluster}]}]",
            )
            .unwrap()
            .rules,
        };
        let p = merge(&file, &cluster);
        assert_eq!(p.objective("a").unwrap().priority, 10);
        assert_eq!(p.objective("b").unwrap().priority, 2);
        assert_eq!(p.rewrite("m", 0).as_deref(), Some("from-cluster"));
    }
}
