use super::*;
use crate::catalog::RankLayout;

fn spec(name: &str, model: &str, layout: RankLayout) -> WorkerSpec {
    WorkerSpec {
        namespace: "static".into(),
        name: name.into(),
        model: model.into(),
        routing_group: String::new(),
        address: "127.0.0.1".parse().unwrap(),
        ranks: layout,
        block_size: None,
        kv_events: None,
        lora_adapters: vec![],
    }
}

fn core() -> Arc<SelectionCore> {
    SelectionCore::new(
        CoreConfig {
            seed: Some(7),
            ..CoreConfig::default()
        },
        Metrics::new(),
    )
}

fn request(id: &str, model: Option<&str>) -> SelectionRequest {
    SelectionRequest {
        request_id: id.into(),
        model: model.map(str::to_string),
        subset: None,
        fallbacks: 0,
        on_duplicate: DuplicateId::Suffix,
    }
}

#[test]
fn not_synced_is_unavailable() {
    let core = core();
    let err = core
        .select_and_reserve(&request("r", Some("m")))
        .err()
        .unwrap();
    assert_eq!(err.http_status(), 503);
    assert!(!*core.readiness().borrow());
}

#[test]
fn least_loaded_rank_wins_and_bookings_free_on_drop() {
    let core = core();
    core.apply_snapshot(vec![spec("a", "m", RankLayout::PerPort(vec![1, 2]))])
        .unwrap();
    assert!(*core.readiness().borrow());
    let first = core.select_and_reserve(&request("r1", Some("m"))).unwrap();
    let second = core.select_and_reserve(&request("r2", Some("m"))).unwrap();
    assert_ne!(
        first.selection().primary.endpoint,
        second.selection().primary.endpoint,
        "second request avoids the busy rank"
    );
    assert_eq!(core.live_bookings(), 2);
    assert_eq!(core.metrics().inflight_total.get(), 2);
    drop(first);
    second.free();
    assert_eq!(core.live_bookings(), 0);
    assert_eq!(core.metrics().inflight_total.get(), 0);
    assert!(!core.free("r1"), "repeated free is a no-op");
}

#[test]
fn model_and_subset_filter_with_clear_errors() {
    let core = core();
    core.apply_snapshot(vec![
        spec("a", "m", RankLayout::PerPort(vec![1])),
        spec("b", "other", RankLayout::PerPort(vec![2])),
    ])
    .unwrap();
    let err = core
        .select_and_reserve(&request("r", Some("nope")))
        .err()
        .unwrap();
    assert_eq!(
        err,
        SelectError::Unavailable("no ready worker serves model nope".into())
    );
    let mut req = request("r", Some("m"));
    req.subset = Some(EndpointFilter::parse(["127.0.0.1:2"]));
    let err = core.select_and_reserve(&req).err().unwrap();
    assert_eq!(err.http_status(), 503);
    req.subset = Some(EndpointFilter::parse(["127.0.0.1", "garbage"]));
    let pick = core.select_and_reserve(&req).unwrap();
    assert_eq!(pick.selection().primary.endpoint.port(), 1);
}

#[test]
fn duplicate_ids_are_suffixed_or_rejected() {
    let core = core();
    core.apply_snapshot(vec![spec("a", "m", RankLayout::PerPort(vec![1]))])
        .unwrap();
    let a = core
        .select_and_reserve(&request("same", Some("m")))
        .unwrap();
    let b = core
        .select_and_reserve(&request("same", Some("m")))
        .unwrap();
    assert_eq!(a.booking_id(), "same");
    assert_eq!(b.booking_id(), "same#2");
    let mut reject = request("same", Some("m"));
    reject.on_duplicate = DuplicateId::Reject;
    assert_eq!(
        core.select_and_reserve(&reject)
            .err()
            .unwrap()
            .http_status(),
        409
    );
}

#[test]
fn fallbacks_are_distinct_endpoints() {
    let core = core();
    core.apply_snapshot(vec![
        spec("a", "m", RankLayout::Multiplexed { port: 1, size: 4 }),
        spec("b", "m", RankLayout::PerPort(vec![2])),
    ])
    .unwrap();
    let mut req = request("r", Some("m"));
    req.fallbacks = 3;
    let pick = core.select_and_reserve(&req).unwrap();
    let sel = pick.selection();
    let mut endpoints: Vec<_> = sel.fallbacks.iter().map(|f| f.endpoint).collect();
    endpoints.push(sel.primary.endpoint);
    endpoints.sort();
    endpoints.dedup();
    assert_eq!(endpoints.len(), 2);
    assert_eq!(sel.fallbacks.len(), 1);
}

#[test]
fn snapshot_rules() {
    let core = core();
    let a = spec("a", "m", RankLayout::PerPort(vec![1, 2]));
    let b = spec("b", "m", RankLayout::PerPort(vec![3]));
    assert_eq!(
        core.apply_snapshot(vec![a.clone(), b.clone()]).unwrap(),
        ApplyReport {
            added: 2,
            ..Default::default()
        }
    );
    // Duplicates are rejected before anything changes.
    assert!(core.apply_snapshot(vec![a.clone(), a.clone()]).is_err());
    assert_eq!(core.list_workers(None).len(), 2);

    let mut req = request("r", Some("m"));
    req.subset = Some(EndpointFilter::parse(["127.0.0.1:1"]));
    let held = core.select_and_reserve(&req).unwrap();
    // Metadata change that keeps rank 0 keeps its booking.
    let mut a2 = a.clone();
    a2.lora_adapters = vec!["l".into()];
    let report = core.apply_snapshot(vec![a2.clone(), b.clone()]).unwrap();
    assert_eq!(
        report,
        ApplyReport {
            updated: 1,
            unchanged: 1,
            ..Default::default()
        }
    );
    assert_eq!(core.live_bookings(), 1);
    // Removing the worker drops its bookings; the guard's later free is a no-op.
    let report = core.apply_snapshot(vec![b.clone()]).unwrap();
    assert_eq!(report.removed, 1);
    assert_eq!(core.live_bookings(), 0);
    assert_eq!(core.metrics().inflight_total.get(), 0);
    drop(held);
    assert_eq!(core.metrics().inflight_total.get(), 0);
    // Empty snapshot: not ready, 503.
    core.apply_snapshot(vec![]).unwrap();
    assert!(!*core.readiness().borrow());
    assert_eq!(
        core.select_and_reserve(&request("r", None))
            .err()
            .unwrap()
            .http_status(),
        503
    );
}

#[test]
fn served_endpoint_moves_the_booking() {
    let core = core();
    core.apply_snapshot(vec![spec("a", "m", RankLayout::PerPort(vec![1, 2]))])
        .unwrap();
    let mut req = request("r", Some("m"));
    req.subset = Some(EndpointFilter::parse(["127.0.0.1:1"]));
    let pick = core.select_and_reserve(&req).unwrap();
    assert!(pick.served_by("127.0.0.1:2".parse().unwrap()));
    let loads: Vec<u64> = core.list_workers(None)[0].active_requests.clone();
    assert_eq!(loads, vec![0, 1]);
    assert!(!pick.served_by("127.0.0.1:2".parse().unwrap()));
    drop(pick);
    assert_eq!(core.list_workers(None)[0].active_requests, vec![0, 0]);
}

#[test]
fn expired_bookings_are_reaped() {
    let core = core();
    core.apply_snapshot(vec![spec("a", "m", RankLayout::PerPort(vec![1]))])
        .unwrap();
    let pick = core.select_and_reserve(&request("r", Some("m"))).unwrap();
    assert_eq!(core.reap_expired(Instant::now()), 0);
    assert_eq!(
        core.reap_expired(Instant::now() + Duration::from_secs(301)),
        1
    );
    assert_eq!(core.live_bookings(), 0);
    assert_eq!(core.metrics().inflight_total.get(), 0);
    drop(pick);
    assert_eq!(core.metrics().inflight_total.get(), 0);
}

#[test]
fn clip_keeps_messages_short() {
    let long = "é".repeat(200);
    assert!(clip(&long).len() <= 131);
    assert_eq!(clip("short"), "short");
}
