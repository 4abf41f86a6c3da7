//! Pod churn at a fixed rate against the fake API server, in the mix a busy cluster shows: of
//! every 10 changes, 5 are status-only updates kvpick must see through (the kubelet rewriting a
//! condition's probe time), 3 are container restarts (a new engine incarnation: kvpick forgets
//! the pod's blocks), 1 takes a pod out of Ready and 1 brings back the pod that has been out
//! longest once [`NOT_READY_POOL`] pods are out (otherwise it is a status-only update too).
//!
//! Owns the sequence of changes only; the fake turns them into watch events.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::apiserver::{set_ready, Fake};

/// Pods kept out of Ready before the longest-out one comes back (about 1% of 1,000 pods).
pub const NOT_READY_POOL: usize = 10;

/// One change to a pod.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// A status field kvpick does not read.
    StatusOnly,
    /// A container restart (`restartCount` + 1).
    Restart,
    NotReady,
    Ready,
}

/// Which change comes `n`-th, and to which pod, over `pods` pods.
#[derive(Debug, Default)]
pub struct Plan {
    not_ready: VecDeque<usize>,
    next_pod: usize,
    /// Restarts become status-only updates (to measure the rest of the churn without the cost
    /// of forgetting restarted engines' blocks).
    pub no_restarts: bool,
}

impl Plan {
    /// The cluster mix, or with `no_restarts` the restarts' slots as status-only updates.
    pub fn new(no_restarts: bool) -> Plan {
        Plan {
            no_restarts,
            ..Plan::default()
        }
    }

    /// The `n`-th change: `(pod index, change)`.
    pub fn next(&mut self, n: u64, pods: usize) -> (usize, Change) {
        let pods = pods.max(1);
        let change = match n % 10 {
            5..=7 if self.no_restarts => Change::StatusOnly,
            5..=7 => Change::Restart,
            8 => Change::NotReady,
            9 if self.not_ready.len() >= NOT_READY_POOL.min(pods - 1) => Change::Ready,
            _ => Change::StatusOnly,
        };
        if change == Change::Ready {
            if let Some(pod) = self.not_ready.pop_front() {
                return (pod, Change::Ready);
            }
        }
        // A prime stride visits every pod, spread out, before any twice.
        let mut pod = self.next_pod;
        for _ in 0..pods {
            pod = (pod + 7919) % pods;
            if !self.not_ready.contains(&pod) {
                break;
            }
        }
        self.next_pod = pod;
        if change == Change::NotReady {
            self.not_ready.push_back(pod);
        }
        (pod, change)
    }
}

/// `pod` after `change`, `n` making a status-only update differ from the last one.
pub fn apply(mut pod: Value, change: Change, n: u64) -> Value {
    match change {
        Change::StatusOnly => {
            // A valid RFC 3339 time (kube-rs refuses the pod otherwise), different per change.
            let (h, m, s) = ((n / 3600) % 24, (n / 60) % 60, n % 60);
            pod["status"]["conditions"][0]["lastProbeTime"] =
                json!(format!("2025-01-01T{h:02}:{m:02}:{s:02}Z"));
        }
        Change::Restart => {
            let restarts = pod["status"]["containerStatuses"][0]["restartCount"]
                .as_i64()
                .unwrap_or(0);
            pod["status"]["containerStatuses"] = json!([{
                "name": "vllm", "restartCount": restarts + 1, "ready": true,
                "image": "vllm", "imageID": "", "started": true,
            }]);
        }
        Change::NotReady => set_ready(&mut pod, false),
        Change::Ready => set_ready(&mut pod, true),
    }
    pod
}

/// What the churn did.
#[derive(Debug, Default, Clone, Copy)]
pub struct ChurnTally {
    pub changes: u64,
    pub restarts: u64,
    pub readiness_flips: u64,
    /// Changes made later than their slot by more than [`crate::picks::LATE`].
    pub late: u64,
}

/// Changes `names`' pods at `rate` per second for `duration`, in `plan`'s mix.
pub async fn run(
    fake: Fake,
    names: Vec<String>,
    rate: f64,
    duration: Duration,
    mut plan: Plan,
) -> ChurnTally {
    let mut tally = ChurnTally::default();
    if rate <= 0.0 || names.is_empty() {
        return tally;
    }
    let start = Instant::now();
    loop {
        let due = start + Duration::from_secs_f64(tally.changes as f64 / rate);
        if due >= start + duration {
            return tally;
        }
        tokio::time::sleep_until(due.into()).await;
        if due.elapsed() > crate::picks::LATE {
            tally.late += 1;
        }
        let (index, change) = plan.next(tally.changes, names.len());
        if let Some(pod) = fake.pod(&names[index]) {
            fake.put_pod(apply(pod, change, tally.changes));
        }
        tally.changes += 1;
        match change {
            Change::Restart => tally.restarts += 1,
            Change::NotReady | Change::Ready => tally.readiness_flips += 1,
            Change::StatusOnly => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_mix_and_the_not_ready_pool() {
        let mut plan = Plan::default();
        let changes: Vec<(usize, Change)> = (0..2_000).map(|n| plan.next(n, 1_000)).collect();
        let count = |c: Change| changes.iter().filter(|(_, x)| *x == c).count();
        assert_eq!(count(Change::Restart), 600);
        assert_eq!(count(Change::NotReady), 200);
        // Slots 9, 19, ..., 89 come before ten pods are out; from slot 99 on each brings one back.
        assert_eq!(count(Change::Ready), 191);
        assert_eq!(plan.not_ready.len(), NOT_READY_POOL - 1);
        // A pod comes back in the order it went out.
        let out: Vec<usize> = changes
            .iter()
            .filter(|(_, c)| *c == Change::NotReady)
            .map(|(p, _)| *p)
            .collect();
        let back: Vec<usize> = changes
            .iter()
            .filter(|(_, c)| *c == Change::Ready)
            .map(|(p, _)| *p)
            .collect();
        assert_eq!(back[..], out[..back.len()]);
    }

    #[test]
    fn a_restart_counts_up_and_a_status_update_changes_only_status() {
        let pod = crate::apiserver::pod("a", "10.0.0.1").build();
        let once = apply(pod.clone(), Change::Restart, 0);
        let twice = apply(once.clone(), Change::Restart, 1);
        assert_eq!(twice["status"]["containerStatuses"][0]["restartCount"], 2);
        let touched = apply(pod.clone(), Change::StatusOnly, 3);
        assert_eq!(touched["metadata"], pod["metadata"]);
        assert_ne!(touched["status"], pod["status"]);
        let out = apply(pod, Change::NotReady, 4);
        assert_eq!(out["status"]["conditions"][0]["status"], "False");
    }

    #[test]
    fn without_restarts_their_slots_are_status_only_updates() {
        let mut plan = Plan::new(true);
        let changes: Vec<Change> = (0..100).map(|n| plan.next(n, 1_000).1).collect();
        assert!(!changes.contains(&Change::Restart));
        // 8 of every 10, and slot 9 until ten pods are out (n = 99 brings the first back).
        assert_eq!(
            changes.iter().filter(|c| **c == Change::StatusOnly).count(),
            80 + 9
        );
    }

    #[test]
    fn one_pod_never_waits_on_itself() {
        let mut plan = Plan::default();
        for n in 0..30 {
            let (pod, _) = plan.next(n, 1);
            assert_eq!(pod, 0);
        }
    }
}
