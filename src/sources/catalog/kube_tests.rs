//! Unit tests of the pure (pool, pods) -> snapshot conversion and the per-pod worker map.

use super::*;

fn pod(name: &str, ready: bool, ip: Option<&str>, extra: serde_json::Value) -> Pod {
    let mut v = serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "ns", "labels": {"app": "vllm"}},
        "status": {
            "conditions": [{"type": "Ready", "status": if ready {"True"} else {"False"}}],
        },
    });
    if let Some(ip) = ip {
        v["status"]["podIP"] = ip.into();
    }
    if let serde_json::Value::Object(extra) = extra {
        for (k, val) in extra {
            if let serde_json::Value::Object(m) = val {
                for (k2, v2) in m {
                    v["metadata"][&k][&k2] = v2;
                }
            } else {
                v["metadata"][&k] = val;
            }
        }
    }
    serde_json::from_value(v).unwrap()
}

fn view() -> PoolView {
    PoolView::new(
        [("app".to_string(), "vllm".to_string())].into(),
        vec![8000, 8001],
    )
    .unwrap()
}

#[test]
fn workers_are_matching_pods_with_an_ip_and_not_ready_ones_drain() {
    let pods = [
        pod("a", true, Some("10.0.0.1"), serde_json::json!({})),
        pod("b", false, Some("10.0.0.2"), serde_json::json!({})),
        pod("c", true, None, serde_json::json!({})),
        pod(
            "d",
            true,
            Some("10.0.0.4"),
            serde_json::json!({"deletionTimestamp": "2025-01-01T00:00:00Z"}),
        ),
        pod(
            "e",
            true,
            Some("10.0.0.5"),
            serde_json::json!({"labels": {"app": "other"}}),
        ),
    ];
    let specs = snapshot(&view(), &pods, Some("m"));
    let summary: Vec<(&str, bool)> = specs
        .iter()
        .map(|s| (s.name.as_str(), s.draining))
        .collect();
    assert_eq!(
        summary,
        vec![("a", false), ("b", true), ("d", true)],
        "NotReady (b) and terminating (d) pods drain; c has no IP, e is not selected"
    );
    let a = &specs[0];
    assert_eq!((a.namespace.as_str(), a.name.as_str()), ("ns", "a"));
    assert_eq!(a.ranks, RankLayout::PerPort(vec![8000, 8001]));
    assert_eq!(a.kv_events.as_deref(), Some("tcp://10.0.0.1:5557"));
    assert_eq!(a.kv_replay, None);
    assert_eq!(a.worker_id(), super::super::worker_id("ns", "a"));
    assert_eq!(a.block_size, None);
}

#[test]
fn a_container_restart_is_a_new_incarnation_and_block_size_comes_from_an_annotation() {
    let with = |restarts: i32, extra: serde_json::Value| {
        let mut p = pod("a", true, Some("10.0.0.1"), extra);
        p.metadata.uid = Some("uid-1".into());
        p.status.as_mut().unwrap().container_statuses = Some(vec![serde_json::from_value(
            serde_json::json!({"name": "vllm", "restartCount": restarts, "ready": true,
                               "image": "i", "imageID": "", "started": true}),
        )
        .unwrap()]);
        snapshot(&view(), &[p], Some("m")).remove(0)
    };
    let first = with(0, serde_json::json!({}));
    assert_eq!(
        first.incarnation,
        with(0, serde_json::json!({})).incarnation
    );
    assert_ne!(
        first.incarnation,
        with(1, serde_json::json!({})).incarnation
    );
    let sized = with(
        0,
        serde_json::json!({"annotations": {"kvpick.io/block-size": "64"}}),
    );
    assert_eq!(sized.block_size, Some(64));
    let bad = pod(
        "a",
        true,
        Some("10.0.0.1"),
        serde_json::json!({"annotations": {"kvpick.io/block-size": "lots"}}),
    );
    assert!(
        snapshot(&view(), &[bad], Some("m")).is_empty(),
        "refused, with a warning"
    );
}

#[test]
fn roles_come_from_the_role_label_or_one_per_rank_from_the_annotation() {
    let labelled = |name: &str, extra: serde_json::Value| pod(name, true, Some("10.0.0.1"), extra);
    let pods = [
        labelled(
            "p",
            serde_json::json!({"labels": {"llm-d.ai/role": "prefill"}}),
        ),
        labelled(
            "d",
            serde_json::json!({"labels": {"llm-d.ai/role": "decode"}}),
        ),
        labelled(
            "pd",
            serde_json::json!({"labels": {"llm-d.ai/role": "prefill-decode"}}),
        ),
        labelled("none", serde_json::json!({})),
        labelled(
            "dp",
            serde_json::json!({"labels": {"llm-d.ai/role": "decode"},
                               "annotations": {"kvpick.io/data-parallel-roles": "prefill, decode"}}),
        ),
        labelled(
            "bad",
            serde_json::json!({"labels": {"llm-d.ai/role": "encode"}}),
        ),
        labelled(
            "short",
            serde_json::json!({"annotations": {"kvpick.io/data-parallel-roles": "prefill,decode,decode"}}),
        ),
    ];
    let specs = snapshot(&view(), &pods, Some("m"));
    let roles: Vec<(&str, Vec<Role>)> = specs
        .iter()
        .map(|s| (s.name.as_str(), s.roles.clone()))
        .collect();
    assert_eq!(
        roles,
        vec![
            ("d", vec![Role::Decode]),
            ("dp", vec![Role::Prefill, Role::Decode]),
            ("none", vec![]),
            ("p", vec![Role::Prefill]),
            ("pd", vec![Role::Both]),
        ],
        "an unknown role and three roles for two ports are refused"
    );
    // Another label key: the llm-d one means nothing then.
    let custom = view().with_role_label("example.com/role");
    let pods = [
        labelled(
            "p",
            serde_json::json!({"labels": {"llm-d.ai/role": "prefill"}}),
        ),
        labelled(
            "q",
            serde_json::json!({"labels": {"example.com/role": "prefill"}}),
        ),
    ];
    let specs = snapshot(&custom, &pods, Some("m"));
    assert_eq!(specs[0].roles, Vec::<Role>::new());
    assert_eq!(specs[1].roles, vec![Role::Prefill]);
}

#[test]
fn dp_shapes_active_ports_model_and_kv_ports() {
    let pods = [
        pod(
            "mux",
            true,
            Some("10.0.0.1"),
            serde_json::json!({"labels": {"kvpick.io/data-parallel-size": "4", "kvpick.io/model": "lm"}}),
        ),
        pod(
            "active",
            true,
            Some("10.0.0.2"),
            serde_json::json!({
                "labels": {"kvpick.io/model": "lm"},
                "annotations": {
                    "inference.networking.k8s.io/active-ports": "8001",
                    "kvpick.io/kv-events-port": "6000",
                    "kvpick.io/kv-replay-port": "6100",
                },
            }),
        ),
        pod("nomodel", true, Some("10.0.0.3"), serde_json::json!({})),
        pod(
            "v6",
            true,
            Some("fd00::1"),
            serde_json::json!({"labels": {"kvpick.io/model": "lm"}, "annotations": {"kvpick.io/kv-events-port": "off"}}),
        ),
    ];
    let specs = snapshot(&view(), &pods, None);
    let names: Vec<_> = specs.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["active", "mux", "v6"]);
    assert_eq!(specs[0].ranks, RankLayout::Sparse(vec![(1, 8001)]));
    assert_eq!(
        specs[0].rank_endpoints()[0].dp_rank,
        1,
        "rank keeps its number"
    );
    assert_eq!(specs[0].kv_events.as_deref(), Some("tcp://10.0.0.2:6000"));
    assert_eq!(specs[0].kv_replay.as_deref(), Some("tcp://10.0.0.2:6100"));
    assert_eq!(
        specs[1].ranks,
        RankLayout::Multiplexed {
            port: 8000,
            size: 4
        }
    );
    assert_eq!(specs[1].model, "lm");
    assert_eq!(specs[2].kv_events, None);
}

#[test]
fn model_from_the_annotation_holds_a_slash_and_wins_over_the_label() {
    let pods = [
        pod(
            "annotated",
            true,
            Some("10.0.0.1"),
            serde_json::json!({"annotations": {"kvpick.io/model": "meta-llama/Llama-3.1-8B"}}),
        ),
        pod(
            "both",
            true,
            Some("10.0.0.2"),
            serde_json::json!({
                "labels": {"kvpick.io/model": "old"},
                "annotations": {"kvpick.io/model": "org/new"},
            }),
        ),
        pod(
            "label",
            true,
            Some("10.0.0.3"),
            serde_json::json!({"labels": {"kvpick.io/model": "lm"}}),
        ),
    ];
    let specs = snapshot(&view(), &pods, None);
    let models: Vec<_> = specs
        .iter()
        .map(|s| (s.name.as_str(), s.model.as_str()))
        .collect();
    assert_eq!(
        models,
        [
            ("annotated", "meta-llama/Llama-3.1-8B"),
            ("both", "org/new"),
            ("label", "lm")
        ]
    );
}

#[test]
fn pool_parses_and_validates() {
    let pool: InferencePool = serde_json::from_value(serde_json::json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": "p", "namespace": "ns"},
        "spec": {
            "selector": {"matchLabels": {"app": "vllm"}},
            "targetPorts": [{"number": 8000}, {"number": 8001}],
            "endpointPickerRef": {"name": "kvpick", "port": {"number": 9002}, "failureMode": "FailClose"},
        },
    }))
    .unwrap();
    let v = PoolView::from_pool(&pool).unwrap();
    assert_eq!(v, view());
    assert_eq!(v.label_selector(), "app=vllm");
    assert_eq!(
        pool.spec
            .endpoint_picker_ref
            .unwrap()
            .failure_mode
            .as_deref(),
        Some("FailClose")
    );
    let mut bad = InferencePool::default();
    bad.spec.target_ports = vec![PortNumber { number: 70000 }];
    assert!(PoolView::from_pool(&bad).is_err());
    assert!(parse_selector("a=b, c=d").unwrap().len() == 2);
    assert!(parse_selector("a").is_err());
}

#[test]
fn a_pod_event_changes_only_its_worker_and_a_status_only_change_none() {
    let pods = [
        pod("a", true, Some("10.0.0.1"), serde_json::json!({})),
        pod("b", true, Some("10.0.0.2"), serde_json::json!({})),
    ];
    let mut workers = Workers::default();
    assert!(workers.rebuild(&view(), &pods, Some("m")));
    assert!(
        !workers.rebuild(&view(), &pods, Some("m")),
        "the same pods again"
    );
    assert_eq!(workers.snapshot(), snapshot(&view(), &pods, Some("m")));

    // A status field kvpick does not read: nothing to publish.
    let mut probed = pods[1].clone();
    probed.status.as_mut().unwrap().message = Some("probe".into());
    assert!(!workers.apply(&view(), &probed, false, Some("m")));

    // Not ready: the worker drains; a new pod joins in name order; deletion removes it.
    let not_ready = pod("b", false, Some("10.0.0.2"), serde_json::json!({}));
    assert!(workers.apply(&view(), &not_ready, false, Some("m")));
    assert!(workers.snapshot()[1].draining);
    let early = pod("0", true, Some("10.0.0.3"), serde_json::json!({}));
    assert!(workers.apply(&view(), &early, false, Some("m")));
    let names: Vec<String> = workers.snapshot().into_iter().map(|w| w.name).collect();
    assert_eq!(names, ["0", "a", "b"], "sorted as the full snapshot is");
    assert!(workers.apply(&view(), &early, true, Some("m")));
    assert!(
        !workers.apply(&view(), &early, true, Some("m")),
        "already gone"
    );

    // A pod that is no worker (no IP, another selector) changes nothing, and leaving the
    // selector removes a worker.
    let no_ip = pod("c", true, None, serde_json::json!({}));
    assert!(!workers.apply(&view(), &no_ip, false, Some("m")));
    let relabelled = pod(
        "a",
        true,
        Some("10.0.0.1"),
        serde_json::json!({"labels": {"app": "other"}}),
    );
    assert!(workers.apply(&view(), &relabelled, false, Some("m")));
    let names: Vec<String> = workers.snapshot().into_iter().map(|w| w.name).collect();
    assert_eq!(names, ["b"]);
}
