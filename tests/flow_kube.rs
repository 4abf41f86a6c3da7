//! The Kubernetes flow-policy source (`kvpick::sources::flow::kube`) end to end without a cluster: a fake
//! Kubernetes API server on 127.0.0.1 serving InferenceObjective (`llm-d.ai/v1`, `llm-d.ai/v1alpha2`,
//! `inference.networking.x-k8s.io/v1alpha2`), InferenceModelRewrite (`llm-d.ai/v1alpha2`,
//! `inference.networking.x-k8s.io/v1alpha2`) and the InferencePool (`inference.networking.k8s.io/v1`,
//! with a `metadata.name` field selector) — LIST with resourceVersion, streaming WATCH, 410 Gone
//! forcing a relist, 404 for a CRD that is not installed — the real `kube::Client`, and assertions
//! on the published policy, each awaited on the policy channel within a bounded time (no sleeps as
//! synchronisation).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test harness: a panic is a failure report

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use common::{watch_gone as gone, watch_line as line};
use kvpick::sources::flow::kube::{ClusterContent, FlowKubeConfig};
use kvpick::sources::flow::{FlowPolicy, FlowSourceConfig, Origin};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

const NS: &str = "ns";
const POOL: &str = "pool";
const WAIT: Duration = Duration::from_secs(30);
/// `group/version` of the legacy GIE resources.
const GIE: &str = "inference.networking.x-k8s.io/v1alpha2";
/// `group/version` of llm-d's v1alpha2 resources.
const LLMD: &str = "llm-d.ai/v1alpha2";
const LLMD_V1: &str = "llm-d.ai/v1";
const POOLS_GV: &str = "inference.networking.k8s.io/v1";
const OBJECTIVES: &str = "inferenceobjectives";
const REWRITES: &str = "inferencemodelrewrites";
const POOLS: &str = "inferencepools";

/// (group/version, plural)
type Res = (String, String);

fn res(gv: &str, plural: &str) -> Res {
    (gv.to_string(), plural.to_string())
}

/// Every llm-d.ai resource.
fn llmd_all() -> [Res; 3] {
    [
        res(LLMD_V1, OBJECTIVES),
        res(LLMD, OBJECTIVES),
        res(LLMD, REWRITES),
    ]
}

/// Whether a watch (by its field selector) sees an object.
type Selected = Box<dyn Fn(&Value) -> bool + Send>;

struct Change {
    rv: u64,
    res: Res,
    kind: &'static str,
    obj: Value,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    compacted: u64,
    objects: BTreeMap<Res, BTreeMap<String, Value>>,
    history: Vec<Change>,
    watchers: Vec<(Res, mpsc::UnboundedSender<Bytes>, Selected)>,
    /// Resources whose CRD is not installed: every request gets 404.
    missing: BTreeSet<Res>,
    lists: BTreeMap<Res, usize>,
}

#[derive(Clone)]
struct Fake {
    inner: Arc<Mutex<Inner>>,
    /// Requests answered 404 so far.
    not_found: watch::Sender<usize>,
    url: String,
}

impl Fake {
    async fn start() -> Fake {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let fake = Fake {
            inner: Arc::default(),
            not_found: watch::channel(0).0,
            url: format!("http://{}", listener.local_addr().unwrap()),
        };
        let routes = axum::Router::new().route(
            "/apis/{group}/{version}/namespaces/{ns}/{plural}",
            get(handler),
        );
        common::serve_fake_apiserver(listener, routes, fake.clone());
        fake
    }

    fn client(&self) -> kube::Client {
        let mut config = kube::Config::new(self.url.parse().unwrap());
        config.accept_invalid_certs = true;
        kube::Client::try_from(config).unwrap()
    }

    fn set_missing(&self, r: Res, missing: bool) {
        let mut inner = self.inner.lock().unwrap();
        if missing {
            // A CRD deleted: its objects and open watches go (the client's rewatch gets 404).
            inner.watchers.retain(|(wr, _, _)| *wr != r);
            inner.objects.remove(&r);
            inner.missing.insert(r);
        } else {
            inner.missing.remove(&r);
        }
    }

    fn record(inner: &mut Inner, r: Res, kind: &'static str, obj: Value) {
        let change = Change {
            rv: inner.rv,
            res: r.clone(),
            kind,
            obj,
        };
        inner.watchers.retain(|(wr, tx, selected)| {
            *wr != r
                || !selected(&change.obj)
                || tx
                    .send(line(json!({"type": change.kind, "object": change.obj})))
                    .is_ok()
        });
        inner.history.push(change);
    }

    fn put(&self, group: &str, plural: &str, mut obj: Value) {
        let r = res(group, plural);
        let mut inner = self.inner.lock().unwrap();
        inner.rv += 1;
        obj["metadata"]["resourceVersion"] = inner.rv.to_string().into();
        let name = obj["metadata"]["name"].as_str().unwrap().to_string();
        let old = inner
            .objects
            .entry(r.clone())
            .or_default()
            .insert(name, obj.clone());
        let kind = if old.is_some() { "MODIFIED" } else { "ADDED" };
        Fake::record(&mut inner, r, kind, obj);
    }

    fn delete(&self, group: &str, plural: &str, name: &str) {
        let r = res(group, plural);
        let mut inner = self.inner.lock().unwrap();
        inner.rv += 1;
        let mut obj = inner.objects.get_mut(&r).unwrap().remove(name).unwrap();
        obj["metadata"]["resourceVersion"] = inner.rv.to_string().into();
        Fake::record(&mut inner, r, "DELETED", obj);
    }

    /// Removes an object without any watch event: only a relist reveals it.
    fn remove_silently(&self, group: &str, plural: &str, name: &str) {
        let mut inner = self.inner.lock().unwrap();
        inner.rv += 1;
        inner
            .objects
            .get_mut(&res(group, plural))
            .unwrap()
            .remove(name)
            .unwrap();
    }

    /// Compaction: every open watch gets 410 Gone and closes, as does any resumed older watch.
    fn expire_watches(&self) {
        let mut inner = self.inner.lock().unwrap();
        inner.compacted = inner.rv;
        for (_, tx, _) in inner.watchers.drain(..) {
            let _ = tx.send(line(gone()));
        }
    }

    fn lists(&self, group: &str, plural: &str) -> usize {
        let inner = self.inner.lock().unwrap();
        inner.lists.get(&res(group, plural)).copied().unwrap_or(0)
    }
}

async fn handler(
    State(fake): State<Fake>,
    Path((group, version, _ns, plural)): Path<(String, String, String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let gv = format!("{group}/{version}");
    let r = (gv.clone(), plural.clone());
    // `metadata.name=X` (the pool watch), the only field selector kvpick sends.
    let name_is = q
        .get("fieldSelector")
        .and_then(|f| f.strip_prefix("metadata.name="))
        .map(str::to_string);
    let selected = move |o: &Value| {
        name_is
            .as_deref()
            .is_none_or(|n| o["metadata"]["name"] == n)
    };
    let mut inner = fake.inner.lock().unwrap();
    if inner.missing.contains(&r) {
        drop(inner);
        fake.not_found.send_modify(|n| *n += 1);
        return (
            StatusCode::NOT_FOUND,
            [(axum::http::header::CONTENT_TYPE, "application/json")],
            json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "NotFound", "code": 404, "message": "the server could not find the requested resource"})
            .to_string(),
        )
            .into_response();
    }
    if q.get("watch").map(String::as_str) == Some("true") {
        let from: u64 = q
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let (tx, rx) = mpsc::unbounded_channel();
        if from < inner.compacted {
            let _ = tx.send(line(gone()));
        } else {
            for c in inner
                .history
                .iter()
                .filter(|c| c.rv > from && c.res == r && selected(&c.obj))
            {
                let _ = tx.send(line(json!({"type": c.kind, "object": c.obj})));
            }
            inner.watchers.push((r, tx, Box::new(selected)));
        }
        return common::watch_response(rx);
    }
    *inner.lists.entry(r.clone()).or_default() += 1;
    let items: Vec<Value> = inner
        .objects
        .get(&r)
        .map(|m| m.values().filter(|o| selected(o)).cloned().collect())
        .unwrap_or_default();
    let kind = match plural.as_str() {
        OBJECTIVES => "InferenceObjectiveList",
        REWRITES => "InferenceModelRewriteList",
        _ => "InferencePoolList",
    };
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        json!({"apiVersion": gv, "kind": kind,
            "metadata": {"resourceVersion": inner.rv.to_string()}, "items": items})
        .to_string(),
    )
        .into_response()
}

fn objective(gv: &str, name: &str, priority: i32, pool: &str) -> Value {
    json!({"apiVersion": gv, "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NS, "uid": uuid::Uuid::new_v4().to_string(),
                     "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
        "spec": {"priority": priority, "poolRef": {"name": pool}}})
}

fn rewrite(gv: &str, name: &str, created: &str, from: &str, to: &[(&str, i32)]) -> Value {
    json!({"apiVersion": gv, "kind": "InferenceModelRewrite",
        "metadata": {"name": name, "namespace": NS, "creationTimestamp": created},
        "spec": {"poolRef": {"group": "inference.networking.k8s.io", "name": POOL},
                 "rules": [{"matches": [{"model": {"type": "Exact", "value": from}}],
                            "targets": to.iter().map(|(m, w)| json!({"modelRewrite": m, "weight": w})).collect::<Vec<_>>()}]}})
}

/// `name=priority` of every objective, sorted.
fn priorities(c: &ClusterContent) -> Vec<String> {
    let mut v: Vec<String> = c
        .objectives
        .iter()
        .map(|o| format!("{}={}", o.name, o.priority))
        .collect();
    v.sort();
    v
}

async fn expect(
    rx: &mut watch::Receiver<ClusterContent>,
    what: &str,
    want: impl Fn(&ClusterContent) -> bool,
) {
    if tokio::time::timeout(WAIT, rx.wait_for(|c| want(c)))
        .await
        .is_err()
    {
        panic!("{what}: never published; last {:?}", *rx.borrow());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn objectives_and_rewrites_list_watch_relist_and_a_missing_crd() {
    let fake = Fake::start().await;
    for r in llmd_all() {
        fake.set_missing(r, true);
    }
    fake.put(GIE, OBJECTIVES, objective(GIE, "interactive", 100, POOL));
    fake.put(GIE, OBJECTIVES, objective(GIE, "batch", -10, POOL));
    fake.put(
        GIE,
        OBJECTIVES,
        objective(GIE, "elsewhere", 5, "other-pool"),
    );
    fake.put(
        GIE,
        REWRITES,
        rewrite(
            GIE,
            "canary",
            "2025-01-02T00:00:00Z",
            "llama",
            &[("llama-v1", 1), ("llama-v2", 1)],
        ),
    );

    let (tx, mut rx) = watch::channel(ClusterContent::default());
    let task = tokio::spawn(kvpick::sources::flow::kube::run(
        fake.client(),
        FlowKubeConfig::new(NS, POOL),
        tx,
    ));

    // LIST: only our pool's objectives; the missing llm-d CRDs do not hold the GIE ones back.
    expect(&mut rx, "first list", |c| {
        priorities(c) == ["batch=-10", "interactive=100"] && c.rules.len() == 1
    })
    .await;
    assert_eq!(rx.borrow().rules[0].source, "ns/canary#0");

    // WATCH: add, modify, delete.
    fake.put(GIE, OBJECTIVES, objective(GIE, "bulk", -1, POOL));
    expect(&mut rx, "added", |c| {
        priorities(c).contains(&"bulk=-1".into())
    })
    .await;
    fake.put(GIE, OBJECTIVES, objective(GIE, "bulk", -2, POOL));
    expect(&mut rx, "modified", |c| {
        priorities(c).contains(&"bulk=-2".into())
    })
    .await;
    fake.delete(GIE, OBJECTIVES, "bulk");
    expect(&mut rx, "deleted", |c| {
        priorities(c) == ["batch=-10", "interactive=100"]
    })
    .await;
    // An objective moved to another pool drops out.
    fake.put(GIE, OBJECTIVES, objective(GIE, "batch", -10, "other-pool"));
    expect(&mut rx, "moved away", |c| {
        priorities(c) == ["interactive=100"]
    })
    .await;

    // 410 Gone: an object removed without a watch event stays until the relist reveals it.
    let lists = fake.lists(GIE, OBJECTIVES);
    fake.remove_silently(GIE, OBJECTIVES, "interactive");
    fake.put(GIE, OBJECTIVES, objective(GIE, "late", 3, POOL));
    expect(&mut rx, "still believed", |c| {
        priorities(c) == ["interactive=100", "late=3"]
    })
    .await;
    fake.expire_watches();
    expect(&mut rx, "relist after 410", |c| priorities(c) == ["late=3"]).await;
    assert!(fake.lists(GIE, OBJECTIVES) > lists, "a relist happened");

    // The missing CRDs were retried (with backoff) and nothing crashed; once llm-d's are
    // installed, only llm-d.ai objects count (llm-d's rule): the legacy objective and rule go.
    let mut not_found = fake.not_found.subscribe();
    tokio::time::timeout(WAIT, not_found.wait_for(|n| *n >= 6))
        .await
        .expect("the missing CRDs are retried")
        .unwrap();
    assert!(!task.is_finished());
    fake.set_missing(res(LLMD, OBJECTIVES), false);
    fake.set_missing(res(LLMD, REWRITES), false);
    fake.put(LLMD, OBJECTIVES, objective(LLMD, "late", 30, POOL));
    fake.put(LLMD, OBJECTIVES, objective(LLMD, "fresh", 7, POOL));
    fake.put(
        LLMD,
        REWRITES,
        rewrite(
            LLMD,
            "newer",
            "2025-03-01T00:00:00Z",
            "llama",
            &[("llama-llmd", 1)],
        ),
    );
    expect(&mut rx, "llm-d.ai CRDs installed later", |c| {
        priorities(c) == ["fresh=7", "late=30"]
            && c.rules.len() == 1
            && c.rules[0].source == "ns/newer#0"
    })
    .await;
    let c = rx.borrow().clone();
    assert!(c.objectives.iter().all(|o| o.origin == Origin::LlmD));
    let policy = FlowPolicy::new(c.objectives.clone(), c.rules.clone());
    assert_eq!(
        policy.rewrite("llama", 0).as_deref(),
        Some("llama-llmd"),
        "the older legacy rule no longer counts"
    );

    // llm-d.ai's objective CRD removed again: the legacy objectives count once more.
    fake.set_missing(res(LLMD, OBJECTIVES), true);
    expect(&mut rx, "llm-d.ai objectives gone", |c| {
        priorities(c) == ["late=3"] && c.rules.len() == 1 && c.rules[0].source == "ns/newer#0"
    })
    .await;

    drop(rx);
    tokio::time::timeout(WAIT, task)
        .await
        .expect("source ends with its receivers")
        .unwrap();
}

fn pool_object(labels: Value) -> Value {
    json!({"apiVersion": POOLS_GV, "kind": "InferencePool",
        "metadata": {"name": POOL, "namespace": NS, "labels": labels},
        "spec": {"selector": {"matchLabels": {"app": "vllm"}}, "targetPorts": [{"number": 8000}]}})
}

fn objective_spec(gv: &str, name: &str, spec: Value) -> Value {
    json!({"apiVersion": gv, "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NS}, "spec": spec})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_version_parses_selectors_follow_pool_labels_and_only_llm_d_counts() {
    let fake = Fake::start().await;
    // Both groups installed; another pool's object must not leak through the field selector.
    fake.put(POOLS_GV, POOLS, pool_object(json!({"tier": "gold"})));
    fake.put(
        POOLS_GV,
        POOLS,
        json!({"apiVersion": POOLS_GV, "kind": "InferencePool",
               "metadata": {"name": "other-pool", "namespace": NS, "labels": {"tier": "silver"}}}),
    );
    fake.put(
        LLMD_V1,
        OBJECTIVES,
        objective_spec(
            LLMD_V1,
            "gold",
            json!({"priority": 50, "poolSelector": {"matchLabels": {"tier": "gold"}}}),
        ),
    );
    fake.put(
        LLMD_V1,
        OBJECTIVES,
        objective_spec(
            LLMD_V1,
            "multi",
            json!({"priority": 20, "poolRefs": [{"name": "x"}, {"name": POOL}]}),
        ),
    );
    fake.put(
        LLMD_V1,
        OBJECTIVES,
        objective_spec(
            LLMD_V1,
            "expr",
            json!({"priority": -5, "poolSelector": {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["silver"]}]}}),
        ),
    );
    fake.put(LLMD, OBJECTIVES, objective(LLMD, "alpha", 10, POOL));
    fake.put(GIE, OBJECTIVES, objective(GIE, "legacy", 99, POOL));
    fake.put(
        GIE,
        REWRITES,
        rewrite(
            GIE,
            "legacy-rw",
            "2024-01-01T00:00:00Z",
            "m",
            &[("legacy", 1)],
        ),
    );
    fake.put(
        LLMD,
        REWRITES,
        rewrite(LLMD, "llmd-rw", "2025-01-01T00:00:00Z", "m", &[("llmd", 1)]),
    );

    let registry = prometheus::Registry::new();
    let gauge = prometheus::IntGaugeVec::new(
        prometheus::Opts::new("in_use", "test"),
        &["kind", "api_version"],
    )
    .unwrap();
    registry.register(Box::new(gauge.clone())).unwrap();
    let (tx, mut rx) = watch::channel(ClusterContent::default());
    let task = tokio::spawn(kvpick::sources::flow::kube::run(
        fake.client(),
        FlowKubeConfig::new(NS, POOL).with_in_use_gauge(gauge.clone()),
        tx,
    ));
    // v1 (poolRefs, poolSelector) and v1alpha2 (poolRef) parse; the legacy group's objective and
    // rule are ignored although installed; the silver selector does not match the gold pool.
    expect(&mut rx, "first list", |c| {
        priorities(c) == ["alpha=10", "gold=50", "multi=20"] && c.rules.len() == 1
    })
    .await;
    let c = rx.borrow().clone();
    let policy = FlowPolicy::new(c.objectives.clone(), c.rules.clone());
    assert_eq!(policy.rewrite("m", 0).as_deref(), Some("llmd"));
    let used = |kind: &str, gv: &str| gauge.with_label_values(&[kind, gv]).get();
    assert_eq!(used("InferenceObjective", LLMD_V1), 1);
    assert_eq!(used("InferenceObjective", LLMD), 1);
    assert_eq!(used("InferenceObjective", GIE), 0);
    assert_eq!(used("InferenceModelRewrite", LLMD), 1);
    assert_eq!(used("InferenceModelRewrite", GIE), 0);

    // The pool's labels change: the selectors are re-evaluated.
    fake.put(POOLS_GV, POOLS, pool_object(json!({"tier": "silver"})));
    expect(&mut rx, "relabelled pool", |c| {
        priorities(c) == ["alpha=10", "expr=-5", "multi=20"]
    })
    .await;
    // The pool deleted: selectors fail closed, references still count.
    fake.delete(POOLS_GV, POOLS, POOL);
    expect(&mut rx, "pool gone", |c| {
        priorities(c) == ["alpha=10", "multi=20"]
    })
    .await;
    drop(rx);
    tokio::time::timeout(WAIT, task).await.unwrap().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merged_receiver_combines_the_file_and_the_cluster() {
    let fake = Fake::start().await;
    for r in llmd_all() {
        fake.set_missing(r, true);
    }
    let dir = std::env::temp_dir().join(format!("kvpick-flowkube-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("flow.yaml");
    std::fs::write(
        &path,
        "objectives: [{name: interactive, priority: 1}, {name: batch, priority: -5}]\nrewrites: [{targets: [{model: default-model}]}]",
    )
    .unwrap();
    let mut rx = kvpick::sources::flow::start(FlowSourceConfig {
        file: Some(path),
        poll: Duration::from_millis(50),
        kube: Some((fake.client(), FlowKubeConfig::new(NS, POOL))),
    })
    .unwrap();
    // The file's policy is there at once. The cluster has no objective yet, so nothing the
    // source tasks do (list, watch, merge) can change it: the sources are ordered by the test,
    // not by which task runs first. Only then does the cluster's objective arrive and override it.
    assert_eq!(rx.borrow().objective("interactive").unwrap().priority, 1);
    fake.put(GIE, OBJECTIVES, objective(GIE, "interactive", 100, POOL));
    let ok = tokio::time::timeout(
        WAIT,
        rx.wait_for(|p| {
            p.objective("interactive")
                .is_some_and(|o| o.priority == 100)
        }),
    )
    .await
    .map(|p| p.is_ok());
    assert_eq!(
        ok,
        Ok(true),
        "cluster objective never merged: {:?}",
        *rx.borrow()
    );
    let p = rx.borrow().clone();
    assert_eq!(p.objective("batch").unwrap().priority, -5);
    assert_eq!(p.rewrite("anything", 7).as_deref(), Some("default-model"));
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn serve_refuses_an_invalid_flow_config_at_start_up() {
    let dir = std::env::temp_dir().join(format!("kvpick-flowcfg-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let catalog = dir.join("catalog.yaml");
    std::fs::write(&catalog, "workers: []").unwrap();
    let flow = dir.join("flow.yaml");
    std::fs::write(
        &flow,
        "objectives: [{name: a, priority: 1}, {name: a, priority: 2}]",
    )
    .unwrap();
    let out = common::serve_command()
        .args(["--secure-serving=false", "--kv-events", "off"])
        .arg("--config")
        .arg(&catalog)
        .arg("--flow-config")
        .arg(&flow)
        .env_remove("KVPICK_CONFIG")
        .env_remove("KVPICK_FLOW_CONFIG")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("flow-config file") && stderr.contains("objectives[1] (a): duplicate"),
        "{stderr}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
