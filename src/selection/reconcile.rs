//! The CatalogReconciler loop: takes complete desired snapshots from a source (a `watch` channel
//! that always holds the newest one, so a burst of changes collapses into the latest) and applies
//! them to the core. A rejected snapshot is retried after [`RETRY_AFTER`] unless a newer one
//! arrives first. Sources (static file, Kubernetes reflector, tests) are interchangeable.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::{SelectionCore, SourceName};
use kvpick_core::catalog::WorkerSpec;

pub const RETRY_AFTER: Duration = Duration::from_secs(5);

/// Desired-state snapshots: `None` until the source has its first complete view.
pub type SnapshotRx = watch::Receiver<Option<Vec<WorkerSpec>>>;

/// Runs until the source's sender is dropped.
pub async fn run(core: Arc<SelectionCore>, source: SourceName, mut rx: SnapshotRx) {
    let mut retry = false;
    loop {
        let snapshot = rx.borrow_and_update().clone();
        if let Some(specs) = snapshot {
            match core.apply_source_snapshot(source, specs) {
                Ok(report) => {
                    retry = false;
                    core.metrics()
                        .catalog
                        .catalog_reloads
                        .with_label_values(&["applied"])
                        .inc();
                    for (worker, reason) in &report.failed {
                        tracing::warn!(%worker, %reason, "worker not schedulable");
                    }
                    tracing::info!(
                        source,
                        added = report.added,
                        updated = report.updated,
                        removed = report.removed,
                        unchanged = report.unchanged,
                        "catalog applied"
                    );
                }
                Err(err) => {
                    retry = true;
                    core.metrics()
                        .catalog
                        .catalog_reloads
                        .with_label_values(&["rejected"])
                        .inc();
                    tracing::error!(source, %err, "catalog snapshot rejected; retrying in 5s unless a newer one arrives");
                }
            }
        }
        tokio::select! {
            changed = rx.changed() => if changed.is_err() { return },
            _ = tokio::time::sleep(RETRY_AFTER), if retry => {},
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::observability::metrics::Metrics;
    use crate::selection::CoreConfig;
    use kvpick_core::catalog::RankLayout;

    fn spec(name: &str) -> WorkerSpec {
        WorkerSpec::for_test(name, "m", RankLayout::PerPort(vec![1]))
    }

    fn count(core: &SelectionCore, result: &str) -> u64 {
        core.metrics()
            .catalog
            .catalog_reloads
            .with_label_values(&[result])
            .get()
    }

    /// Lets the spawned reconciler run until it blocks again.
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn failed_snapshot_is_retried_after_5s_unless_a_newer_one_arrives() {
        let core = SelectionCore::new(CoreConfig::default(), Metrics::new());
        let (tx, rx) = watch::channel(Some(vec![spec("a"), spec("a")]));
        let task = tokio::spawn(run(Arc::clone(&core), "test", rx));
        settle().await;
        assert_eq!(count(&core, "rejected"), 1);
        tokio::time::advance(Duration::from_millis(4_900)).await;
        settle().await;
        assert_eq!(count(&core, "rejected"), 1, "no retry before 5 s");
        tokio::time::advance(Duration::from_millis(100)).await;
        settle().await;
        assert_eq!(count(&core, "rejected"), 2, "retried at 5 s");

        // A newer snapshot 2 s into the next wait is applied at once and cancels the retry.
        tokio::time::advance(Duration::from_secs(2)).await;
        tx.send_replace(Some(vec![spec("a"), spec("b")]));
        settle().await;
        assert_eq!(count(&core, "applied"), 1);
        assert_eq!(core.list_workers(None).len(), 2);
        tokio::time::advance(Duration::from_secs(10)).await;
        settle().await;
        assert_eq!(count(&core, "rejected"), 2);
        assert_eq!(
            count(&core, "applied"),
            1,
            "unchanged source is not re-applied"
        );

        // Bursts collapse into the newest snapshot.
        tx.send_replace(Some(vec![spec("c")]));
        tx.send_replace(Some(vec![spec("d"), spec("e"), spec("f")]));
        settle().await;
        assert_eq!(count(&core, "applied"), 2);
        assert_eq!(core.list_workers(None).len(), 3);
        drop(tx);
        task.await.unwrap();
    }
}
