//! The subscription plan follows the catalog per worker: only endpoint or rank changes start or
//! stop subscriptions, and an unchanged rank keeps its subscription.

use super::*;
use crate::observability::metrics::Metrics;
use crate::selection::CoreConfig;
use crate::sources::catalog::{RankLayout, WorkerSpec};

fn spec(name: &str, ports: &[u16], events: Option<&str>) -> WorkerSpec {
    let mut spec = WorkerSpec::for_test(name, "m", RankLayout::PerPort(ports.to_vec()));
    spec.kv_events = events.map(str::to_string);
    spec
}

fn update(core: &SelectionCore, plan: &mut Plan, specs: Vec<WorkerSpec>) -> PlanChange {
    core.apply_snapshot(specs).unwrap();
    core.inner().with_records(|records| plan.update(records))
}

fn ranks(subs: &[Subscription]) -> Vec<(String, u32, String)> {
    subs.iter()
        .map(|(k, e, _)| {
            let name = if k.worker_id == crate::sources::catalog::worker_id("static", "a") {
                "a"
            } else {
                "b"
            };
            (name.to_string(), k.dp_rank, e.clone())
        })
        .collect()
}

#[test]
fn only_endpoint_and_rank_changes_start_or_stop_subscriptions() {
    let core = SelectionCore::new(CoreConfig::default(), Metrics::new());
    let mut plan = Plan::default();
    let a = |ports: &[u16], events: &str| spec("a", ports, Some(events));
    let first = update(
        &core,
        &mut plan,
        vec![a(&[1, 2], "tcp://h:10"), spec("b", &[3], None)],
    );
    assert!(first.stop.is_empty());
    assert_eq!(
        ranks(&first.start),
        [
            ("a".into(), 0, "tcp://h:10".into()),
            ("a".into(), 1, "tcp://h:11".into())
        ],
        "b declares no endpoint"
    );
    assert_eq!(
        first.start,
        core.kv_event_endpoints(),
        "the same as deriving them all"
    );

    assert_eq!(
        update(
            &core,
            &mut plan,
            vec![a(&[1, 2], "tcp://h:10"), spec("b", &[3], None)]
        ),
        PlanChange::default()
    );
    let mut restarted = a(&[1, 2], "tcp://h:10");
    restarted.draining = true;
    restarted.incarnation = 7;
    assert_eq!(
        update(&core, &mut plan, vec![restarted]),
        PlanChange::default(),
        "draining, restarted, and b (no endpoint) gone: nothing to do"
    );

    let grown = update(&core, &mut plan, vec![a(&[1, 2, 4], "tcp://h:10")]);
    assert!(grown.stop.is_empty(), "ranks 0 and 1 keep theirs");
    assert_eq!(ranks(&grown.start), [("a".into(), 2, "tcp://h:12".into())]);

    let moved = update(&core, &mut plan, vec![a(&[1, 2, 4], "tcp://h:20")]);
    assert_eq!(moved.stop.len(), 3);
    assert_eq!(ranks(&moved.start)[0], ("a".into(), 0, "tcp://h:20".into()));

    let gone = update(&core, &mut plan, vec![]);
    assert_eq!(gone.stop.len(), 3);
    assert!(gone.start.is_empty());
}
