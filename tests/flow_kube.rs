//! The Kubernetes flow-policy source (`kvpick::flow::kube`) end to end without a cluster: a fake
//! Kubernetes API server on 127.0.0.1 serving InferenceObjective and InferenceModelRewrite in the
//! `inference.networking.x-k8s.io` and `llm-d.ai` groups (LIST with resourceVersion, streaming
//! WATCH, 410 Gone forcing a relist, 404 for a CRD that is not installed), the real
//! `kube::Client`, and assertions on the published policy, each awaited on the policy channel
//! within a bounded time (no sleeps as synchronisation).

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
use kvpick::flow::kube::{ClusterContent, FlowKubeConfig};
use kvpick::flow::{FlowPolicy, FlowSourceConfig};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

const NS: &str = "ns";
const POOL: &str = "pool";
const WAIT: Duration = Duration::from_secs(30);
const GIE: &str = "inference.networking.x-k8s.io";
const LLMD: &str = "llm-d.ai";
const OBJECTIVES: &str = "inferenceobjectives";
const REWRITES: &str = "inferencemodelrewrites";

/// (group, plural)
type Res = (String, String);

fn res(group: &str, plural: &str) -> Res {
    (group.to_string(), plural.to_string())
}

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
    watchers: Vec<(Res, mpsc::UnboundedSender<Bytes>)>,
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
            "/apis/{group}/v1alpha2/namespaces/{ns}/{plural}",
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
        inner.watchers.retain(|(wr, tx)| {
            *wr != r
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
        for (_, tx) in inner.watchers.drain(..) {
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
    Path((group, _ns, plural)): Path<(String, String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let r = (group.clone(), plural.clone());
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
            for c in inner.history.iter().filter(|c| c.rv > from && c.res == r) {
                let _ = tx.send(line(json!({"type": c.kind, "object": c.obj})));
            }
            inner.watchers.push((r, tx));
        }
        return common::watch_response(rx);
    }
    *inner.lists.entry(r.clone()).or_default() += 1;
    let items: Vec<Value> = inner
        .objects
        .get(&r)
        .map(|m| m.values().cloned().collect())
        .unwrap_or_default();
    let kind = if plural == OBJECTIVES {
        "InferenceObjectiveList"
    } else {
        "InferenceModelRewriteList"
    };
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        json!({"apiVersion": format!("{group}/v1alpha2"), "kind": kind,
            "metadata": {"resourceVersion": inner.rv.to_string()}, "items": items})
        .to_string(),
    )
        .into_response()
}

fn objective(group: &str, name: &str, priority: i32, pool: &str) -> Value {
    json!({"apiVersion": format!("{group}/v1alpha2"), "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NS, "uid": uuid::Uuid::new_v4().to_string(),
                     "managedFields": [{"manager": "kubectl", "operation": "Apply"}]},
        "spec": {"priority": priority, "poolRef": {"name": pool}}})
}

fn rewrite(group: &str, name: &str, created: &str, from: &str, to: &[(&str, i32)]) -> Value {
    json!({"apiVersion": format!("{group}/v1alpha2"), "kind": "InferenceModelRewrite",
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
    fake.set_missing(res(LLMD, OBJECTIVES), true);
    fake.set_missing(res(LLMD, REWRITES), true);
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
    let task = tokio::spawn(kvpick::flow::kube::run(
        fake.client(),
        FlowKubeConfig {
            namespace: NS.into(),
            pool: POOL.into(),
        },
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

    // The missing CRDs were retried (with backoff) and nothing crashed; once installed, their
    // objects arrive: llm-d's objective of the same name overrides the GIE one in the policy, and
    // the older rewrite resource's rule wins.
    let mut not_found = fake.not_found.subscribe();
    tokio::time::timeout(WAIT, not_found.wait_for(|n| *n >= 4))
        .await
        .expect("the missing CRDs are retried")
        .unwrap();
    assert!(!task.is_finished());
    fake.put(LLMD, OBJECTIVES, objective(LLMD, "late", 30, POOL));
    fake.put(
        LLMD,
        REWRITES,
        rewrite(
            LLMD,
            "older",
            "2025-01-01T00:00:00Z",
            "llama",
            &[("llama-old", 1)],
        ),
    );
    fake.set_missing(res(LLMD, OBJECTIVES), false);
    fake.set_missing(res(LLMD, REWRITES), false);
    expect(&mut rx, "CRDs installed", |c| {
        c.objectives.len() == 2 && c.rules.len() == 2
    })
    .await;
    let c = rx.borrow().clone();
    let policy = FlowPolicy::new(c.objectives.clone(), c.rules.clone());
    assert_eq!(policy.objective("late").unwrap().priority, 30);
    assert_eq!(policy.rewrite("llama", 0).as_deref(), Some("llama-old"));

    drop(rx);
    tokio::time::timeout(WAIT, task)
        .await
        .expect("source ends with its receivers")
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn merged_receiver_combines_the_file_and_the_cluster() {
    let fake = Fake::start().await;
    fake.set_missing(res(LLMD, OBJECTIVES), true);
    fake.set_missing(res(LLMD, REWRITES), true);
    let dir = std::env::temp_dir().join(format!("kvpick-flowkube-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("flow.yaml");
    std::fs::write(
        &path,
        "objectives: [{name: interactive, priority: 1}, {name: batch, priority: -5}]\nrewrites: [{targets: [{model: default-model}]}]",
    )
    .unwrap();
    let mut rx = kvpick::flow::start(FlowSourceConfig {
        file: Some(path),
        poll: Duration::from_millis(50),
        kube: Some((
            fake.client(),
            FlowKubeConfig {
                namespace: NS.into(),
                pool: POOL.into(),
            },
        )),
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
