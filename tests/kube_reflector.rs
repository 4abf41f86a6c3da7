//! The Kubernetes source end to end without a cluster: a fake Kubernetes API server (LIST with
//! resourceVersion, streaming WATCH of newline-delimited events, 410 Gone to force a relist, the
//! InferencePool and its pods) on 127.0.0.1, the real `kvpick serve` binary talking to it with the
//! real `kube::Client`, and assertions on the catalog the core ends up with (gRPC `ListWorkers`),
//! each within a bounded wait (polling with a deadline; no sleeps as synchronisation).

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::collections::{BTreeMap, HashMap};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use common::{watch_gone as gone, watch_line as line};
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};
use tonic_health::pb::health_check_response::ServingStatus;

const NS: &str = "ns";
const POOL: &str = "pool";

// ---------------------------------------------------------------------------------------------
// Fake Kubernetes API server
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Pod,
    Pool,
}

/// What a LIST/WATCH asked for: pods by label selector, pools by `metadata.name` field selector.
#[derive(Clone, Debug)]
enum Sel {
    Labels(BTreeMap<String, String>),
    Name(Option<String>),
}

impl Sel {
    fn matches(&self, obj: &Value) -> bool {
        match self {
            Sel::Labels(want) => want
                .iter()
                .all(|(k, v)| obj["metadata"]["labels"][k].as_str() == Some(v)),
            Sel::Name(None) => true,
            Sel::Name(Some(n)) => obj["metadata"]["name"].as_str() == Some(n),
        }
    }
}

struct Change {
    rv: u64,
    kind: Kind,
    old: Option<Value>,
    new: Option<Value>,
}

struct Watcher {
    kind: Kind,
    sel: Sel,
    tx: mpsc::UnboundedSender<Bytes>,
}

#[derive(Default)]
struct Inner {
    rv: u64,
    /// Watches from a resourceVersion older than this get `410 Gone` (etcd compaction).
    compacted: u64,
    pods: BTreeMap<String, Value>,
    pool: Option<Value>,
    history: Vec<Change>,
    watchers: Vec<Watcher>,
    pod_lists: usize,
    /// While set, every request is answered 503 (the API server is unreachable for clients).
    outage: bool,
    refused: usize,
}

impl Inner {
    /// The 503 a request gets during an outage, counted.
    fn refuse(&mut self) -> Option<Response> {
        if !self.outage {
            return None;
        }
        self.refused += 1;
        Some(
            (
                StatusCode::SERVICE_UNAVAILABLE,
                json_response(json!({"kind": "Status", "apiVersion": "v1",
                    "status": "Failure", "reason": "ServiceUnavailable", "code": 503,
                    "message": "apiserver unavailable"})),
            )
                .into_response(),
        )
    }
}

/// The watch event a watcher with `sel` sees for a change (the API server turns a label change
/// that leaves the selector into DELETED and one that enters it into ADDED).
fn event_for(sel: &Sel, c: &Change) -> Option<Value> {
    let old_m = c.old.as_ref().is_some_and(|o| sel.matches(o));
    let new_m = c.new.as_ref().is_some_and(|n| sel.matches(n));
    let (kind, obj) = match (old_m, new_m) {
        (true, true) => ("MODIFIED", c.new.clone()?),
        (false, true) => ("ADDED", c.new.clone()?),
        (true, false) => {
            let mut obj = c.new.clone().or_else(|| c.old.clone())?;
            obj["metadata"]["resourceVersion"] = c.rv.to_string().into();
            ("DELETED", obj)
        }
        (false, false) => return None,
    };
    Some(json!({"type": kind, "object": obj}))
}

impl Inner {
    fn record(&mut self, kind: Kind, old: Option<Value>, new: Option<Value>) -> Instant {
        let change = Change {
            rv: self.rv,
            kind,
            old,
            new,
        };
        self.watchers.retain(|w| {
            if w.kind != kind {
                return true;
            }
            match event_for(&w.sel, &change) {
                Some(ev) => w.tx.send(line(ev)).is_ok(),
                None => !w.tx.is_closed(),
            }
        });
        let sent = Instant::now();
        self.history.push(change);
        sent
    }
}

#[derive(Clone)]
struct Fake {
    inner: Arc<Mutex<Inner>>,
    gate: watch::Sender<bool>,
    url: String,
}

impl Fake {
    /// Starts the server; LISTs wait until `open_lists` when `gated`.
    async fn start(gated: bool) -> Fake {
        let (gate, _) = watch::channel(!gated);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let fake = Fake {
            inner: Arc::default(),
            gate,
            url,
        };
        let routes = axum::Router::new()
            .route("/api/v1/namespaces/{ns}/pods", get(pods_handler))
            .route(
                "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
                get(pools_handler),
            )
            .route(
                "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools/{name}",
                get(pool_get_handler),
            );
        common::serve_fake_apiserver(listener, routes, fake.clone());
        fake
    }

    fn open_lists(&self) {
        self.gate.send_replace(true);
    }

    /// Creates or replaces a pod; returns when its watch event was handed to the open watches.
    fn put_pod(&self, mut pod: Value) -> Instant {
        let mut inner = self.inner.lock().unwrap();
        inner.rv += 1;
        pod["metadata"]["resourceVersion"] = inner.rv.to_string().into();
        let name = pod["metadata"]["name"].as_str().unwrap().to_string();
        let old = inner.pods.insert(name, pod.clone());
        inner.record(Kind::Pod, old, Some(pod))
    }

    fn delete_pod(&self, name: &str) {
        let mut inner = self.inner.lock().unwrap();
        inner.rv += 1;
        let old = inner.pods.remove(name).expect("pod exists");
        inner.record(Kind::Pod, Some(old), None);
    }

    /// Removes a pod without any watch event (a change the watch lost): only a relist reveals it.
    fn remove_pod_silently(&self, name: &str) {
        let mut inner = self.inner.lock().unwrap();
        inner.rv += 1;
        inner.pods.remove(name).expect("pod exists");
    }

    /// Compacts history: every open watch gets an ERROR event with a 410 Status and is closed, as
    /// does any watch resumed from an older resourceVersion.
    fn expire_watches(&self) {
        let mut inner = self.inner.lock().unwrap();
        inner.compacted = inner.rv;
        for w in inner.watchers.drain(..) {
            let _ = w.tx.send(line(gone()));
        }
    }

    /// Closes every open watch stream (connection cut); clients resume from their resourceVersion.
    fn cut_watches(&self) {
        self.inner.lock().unwrap().watchers.clear();
    }

    /// Starts or ends an API server outage: open watches are cut and every request is refused
    /// until it ends.
    fn set_outage(&self, on: bool) {
        let mut inner = self.inner.lock().unwrap();
        inner.outage = on;
        if on {
            inner.watchers.clear();
        }
    }

    fn refused(&self) -> usize {
        self.inner.lock().unwrap().refused
    }

    fn put_pool(&self, mut pool: Value) {
        let mut inner = self.inner.lock().unwrap();
        inner.rv += 1;
        pool["metadata"]["resourceVersion"] = inner.rv.to_string().into();
        let old = inner.pool.replace(pool.clone());
        inner.record(Kind::Pool, old, Some(pool));
    }

    fn delete_pool(&self) {
        let mut inner = self.inner.lock().unwrap();
        inner.rv += 1;
        let old = inner.pool.take().expect("pool exists");
        inner.record(Kind::Pool, Some(old), None);
    }

    fn pod_lists(&self) -> usize {
        self.inner.lock().unwrap().pod_lists
    }

    fn pod_watches(&self) -> usize {
        let inner = self.inner.lock().unwrap();
        inner
            .watchers
            .iter()
            .filter(|w| w.kind == Kind::Pod && !w.tx.is_closed())
            .count()
    }
}

fn json_response(v: Value) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

fn parse_labels(q: &HashMap<String, String>) -> BTreeMap<String, String> {
    q.get("labelSelector")
        .map(|s| {
            s.split(',')
                .filter_map(|t| t.split_once('='))
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        })
        .unwrap_or_default()
}

fn parse_name(q: &HashMap<String, String>) -> Option<String> {
    q.get("fieldSelector")
        .and_then(|s| s.strip_prefix("metadata.name="))
        .map(str::to_string)
}

async fn list_or_watch(fake: Fake, kind: Kind, sel: Sel, q: HashMap<String, String>) -> Response {
    if let Some(refused) = fake.inner.lock().unwrap().refuse() {
        return refused;
    }
    if q.get("watch").map(String::as_str) == Some("true") {
        let from: u64 = q
            .get("resourceVersion")
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let (tx, rx) = mpsc::unbounded_channel();
        {
            let mut inner = fake.inner.lock().unwrap();
            if from < inner.compacted {
                let _ = tx.send(line(gone()));
            } else {
                for c in inner
                    .history
                    .iter()
                    .filter(|c| c.rv > from && c.kind == kind)
                {
                    if let Some(ev) = event_for(&sel, c) {
                        let _ = tx.send(line(ev));
                    }
                }
                inner.watchers.push(Watcher { kind, sel, tx });
            }
        }
        return common::watch_response(rx);
    }
    let mut gate = fake.gate.subscribe();
    let _ = gate.wait_for(|open| *open).await;
    let mut inner = fake.inner.lock().unwrap();
    if let Some(refused) = inner.refuse() {
        return refused;
    }
    let (items, list_kind, api_version): (Vec<Value>, _, _) = match kind {
        Kind::Pod => {
            inner.pod_lists += 1;
            (
                inner
                    .pods
                    .values()
                    .filter(|p| sel.matches(p))
                    .cloned()
                    .collect(),
                "PodList",
                "v1",
            )
        }
        Kind::Pool => (
            inner
                .pool
                .iter()
                .filter(|p| sel.matches(p))
                .cloned()
                .collect(),
            "InferencePoolList",
            "inference.networking.k8s.io/v1",
        ),
    };
    json_response(json!({
        "apiVersion": api_version, "kind": list_kind,
        "metadata": {"resourceVersion": inner.rv.to_string()},
        "items": items,
    }))
    .into_response()
}

async fn pods_handler(
    State(fake): State<Fake>,
    Path(_ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let sel = Sel::Labels(parse_labels(&q));
    list_or_watch(fake, Kind::Pod, sel, q).await
}

async fn pools_handler(
    State(fake): State<Fake>,
    Path(_ns): Path<String>,
    Query(q): Query<HashMap<String, String>>,
) -> Response {
    let sel = Sel::Name(parse_name(&q));
    list_or_watch(fake, Kind::Pool, sel, q).await
}

async fn pool_get_handler(
    State(fake): State<Fake>,
    Path((_ns, name)): Path<(String, String)>,
) -> Response {
    let pool = {
        let mut inner = fake.inner.lock().unwrap();
        if let Some(refused) = inner.refuse() {
            return refused;
        }
        inner.pool.clone()
    };
    match pool.filter(|p| p["metadata"]["name"] == name.as_str()) {
        Some(p) => json_response(p).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            json_response(
                json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "reason": "NotFound", "code": 404, "message": "not found"}),
            ),
        )
            .into_response(),
    }
}

// ---------------------------------------------------------------------------------------------
// Objects
// ---------------------------------------------------------------------------------------------

struct PodBuilder {
    v: Value,
}

fn pod(name: &str, ip: &str) -> PodBuilder {
    PodBuilder {
        v: json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": NS, "uid": uuid::Uuid::new_v4().to_string(),
                "labels": {"app": "vllm", "kvpick.io/model": "m"},
                "annotations": {},
                "managedFields": [{"manager": "kubelet", "operation": "Update"}],
            },
            "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True"}]},
        }),
    }
}

impl PodBuilder {
    fn ready(mut self, ready: bool) -> Self {
        self.v["status"]["conditions"][0]["status"] = if ready { "True" } else { "False" }.into();
        self
    }
    fn label(mut self, k: &str, v: &str) -> Self {
        self.v["metadata"]["labels"][k] = v.into();
        self
    }
    fn annotation(mut self, k: &str, v: &str) -> Self {
        self.v["metadata"]["annotations"][k] = v.into();
        self
    }
    fn uid(mut self, uid: &str) -> Self {
        self.v["metadata"]["uid"] = uid.into();
        self
    }
    fn terminating(mut self) -> Self {
        self.v["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z".into();
        self
    }
    fn no_ip(mut self) -> Self {
        self.v["status"]
            .as_object_mut()
            .unwrap()
            .remove("podIP")
            .unwrap();
        self
    }
    fn build(self) -> Value {
        self.v
    }
}

fn pool_object(selector: Value, ports: &[u16]) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": POOL, "namespace": NS, "uid": "pool-uid"},
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
            "endpointPickerRef": {"name": "kvpick", "port": {"number": 9002}, "failureMode": "FailClose"},
        },
    })
}

// ---------------------------------------------------------------------------------------------
// kvpick process and assertions
// ---------------------------------------------------------------------------------------------

mod common;

use common::{readiness, wait_readiness, Serve};

fn start(fake: &Fake, extra: &[&str]) -> Serve {
    let url = fake.url.clone();
    common::start_with(common::temp_dir("kvpick-kube"), |c| {
        c.args(["--secure-serving=false", "--kv-events", "off"])
            .args(["--kube-api-url", &url, "--pool-namespace", NS])
            .args(extra)
            .env("RUST_LOG", "info,kvpick=debug")
            .env_remove("NAMESPACE");
    })
}

use common::Api;

async fn api(serve: &Serve) -> Api {
    common::api(serve.grpc).await
}

/// The schedulable catalog as `name addr addr...` lines (one address per rank, in rank order),
/// sorted. Draining workers (NotReady or terminating pods, kept for their in-flight load) are
/// left out; [`draining`] lists them.
async fn catalog(api: &mut Api) -> Vec<String> {
    let workers = common::list_workers(api).await;
    let mut out: Vec<String> = workers
        .iter()
        .filter(|w| w.lifecycle != "Draining")
        .map(|w| {
            assert_eq!(w.namespace, NS);
            assert_eq!(w.worker_id, kvpick::catalog::worker_id(NS, &w.name));
            let mut ranks = w.ranks.clone();
            ranks.sort_by_key(|r| r.dp_rank);
            let addrs: Vec<String> = ranks.iter().map(|r| r.address.clone()).collect();
            format!("{} {}", w.name, addrs.join(" "))
        })
        .collect();
    out.sort();
    out
}

/// Names of the draining workers, sorted.
async fn draining(api: &mut Api) -> Vec<String> {
    let mut out: Vec<String> = common::list_workers(api)
        .await
        .into_iter()
        .filter(|w| w.lifecycle == "Draining")
        .map(|w| w.name)
        .collect();
    out.sort();
    out
}

const WAIT: Duration = Duration::from_secs(20);

/// Polls `ListWorkers` until the catalog equals `want`, within [`WAIT`].
async fn expect_catalog(api: &mut Api, what: &str, want: &[&str]) -> Duration {
    let start = Instant::now();
    let mut last = Vec::new();
    while start.elapsed() < WAIT {
        last = catalog(api).await;
        if last == want {
            return start.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    panic!("{what}: catalog never became {want:?}; last seen {last:?}");
}

// ---------------------------------------------------------------------------------------------
// Cases
// ---------------------------------------------------------------------------------------------

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pool_pods_lifecycle_dp_shapes_readiness_and_latency() {
    let fake = Fake::start(true).await;
    fake.put_pool(pool_object(json!({"app": "vllm"}), &[8000, 8001]));
    fake.put_pod(pod("a", "10.0.0.1").build());
    fake.put_pod(pod("b", "10.0.0.2").ready(false).build());
    fake.put_pod(pod("other", "10.0.0.9").label("app", "other").build());
    let serve = start(&fake, &["--pool-name", POOL]);

    // Readiness: NOT_SERVING until the first full sync (the pod LIST is held back).
    assert_eq!(readiness(serve.health).await, ServingStatus::NotServing);
    let mut api = api(&serve).await;
    assert!(catalog(&mut api).await.is_empty());
    assert_eq!(readiness(serve.health).await, ServingStatus::NotServing);
    fake.open_lists();
    wait_readiness(serve.health, ServingStatus::Serving).await;
    expect_catalog(&mut api, "first sync", &["a 10.0.0.1:8000 10.0.0.1:8001"]).await;

    // Ready / NotReady.
    fake.put_pod(pod("b", "10.0.0.2").build());
    expect_catalog(
        &mut api,
        "b ready",
        &[
            "a 10.0.0.1:8000 10.0.0.1:8001",
            "b 10.0.0.2:8000 10.0.0.2:8001",
        ],
    )
    .await;
    fake.put_pod(pod("b", "10.0.0.2").ready(false).build());
    expect_catalog(&mut api, "b not ready", &["a 10.0.0.1:8000 10.0.0.1:8001"]).await;
    assert_eq!(draining(&mut api).await, ["b"], "a NotReady pod drains");

    // No IP yet, then an IP; IP change.
    fake.put_pod(pod("c", "").no_ip().build());
    fake.put_pod(pod("b", "10.0.0.2").build());
    expect_catalog(
        &mut api,
        "c without ip",
        &[
            "a 10.0.0.1:8000 10.0.0.1:8001",
            "b 10.0.0.2:8000 10.0.0.2:8001",
        ],
    )
    .await;
    fake.put_pod(pod("b", "10.0.0.22").build());
    expect_catalog(
        &mut api,
        "b ip change",
        &[
            "a 10.0.0.1:8000 10.0.0.1:8001",
            "b 10.0.0.22:8000 10.0.0.22:8001",
        ],
    )
    .await;

    // Terminating, then deleted.
    fake.put_pod(pod("b", "10.0.0.22").terminating().build());
    expect_catalog(
        &mut api,
        "b terminating",
        &["a 10.0.0.1:8000 10.0.0.1:8001"],
    )
    .await;
    fake.delete_pod("b");
    fake.delete_pod("c");
    expect_catalog(&mut api, "b deleted", &["a 10.0.0.1:8000 10.0.0.1:8001"]).await;

    // UID replacement at the same name: the old pod goes, its successor (new IP) joins when Ready.
    fake.put_pod(pod("a", "10.0.0.1").uid("uid-a1").build());
    fake.delete_pod("a");
    fake.put_pod(pod("a", "10.0.0.11").uid("uid-a2").ready(false).build());
    expect_catalog(&mut api, "a replaced, not ready", &[]).await;
    wait_readiness(serve.health, ServingStatus::NotServing).await;
    fake.put_pod(pod("a", "10.0.0.11").uid("uid-a2").build());
    expect_catalog(
        &mut api,
        "a replaced, ready",
        &["a 10.0.0.11:8000 10.0.0.11:8001"],
    )
    .await;

    // DP shapes: multiplexed ranks (annotation or label) on the first target port; active-ports.
    fake.put_pod(
        pod("mux", "10.0.1.1")
            .annotation("kvpick.io/data-parallel-size", "3")
            .build(),
    );
    fake.put_pod(
        pod("muxl", "10.0.1.2")
            .label("kvpick.io/data-parallel-size", "2")
            .build(),
    );
    fake.put_pod(
        pod("act", "10.0.1.3")
            .annotation("inference.networking.k8s.io/active-ports", "8001")
            .annotation("kvpick.io/kv-events-port", "6000")
            .build(),
    );
    expect_catalog(
        &mut api,
        "dp shapes",
        &[
            "a 10.0.0.11:8000 10.0.0.11:8001",
            "act 10.0.1.3:8001",
            "mux 10.0.1.1:8000 10.0.1.1:8000 10.0.1.1:8000",
            "muxl 10.0.1.2:8000 10.0.1.2:8000",
        ],
    )
    .await;
    // The live active port keeps its rank number (targetPorts[1] is rank 1).
    let act = common::list_workers(&mut api)
        .await
        .into_iter()
        .find(|w| w.name == "act")
        .unwrap();
    assert_eq!(act.ranks.len(), 1);
    assert_eq!(act.ranks[0].dp_rank, 1);
    let workers = common::list_workers(&mut api).await;
    let kv: BTreeMap<&str, &str> = workers
        .iter()
        .map(|w| (w.name.as_str(), w.kv_events.as_str()))
        .collect();
    assert_eq!(kv["a"], "tcp://10.0.0.11:5557");
    assert_eq!(kv["act"], "tcp://10.0.1.3:6000");
    assert_eq!(workers.iter().find(|w| w.name == "mux").unwrap().model, "m");

    // Latency: from the watch event leaving the fake server to ListWorkers showing it.
    let mut samples = Vec::new();
    for i in 0..21u32 {
        let ip = format!("10.0.2.{}", i + 1);
        let sent = fake.put_pod(
            pod("act", &ip)
                .annotation("inference.networking.k8s.io/active-ports", "8001")
                .build(),
        );
        let want = format!("act {ip}:8001");
        let deadline = sent + WAIT;
        loop {
            if catalog(&mut api).await.contains(&want) {
                samples.push(sent.elapsed());
                break;
            }
            assert!(
                Instant::now() < deadline,
                "latency sample {i} never arrived"
            );
        }
    }
    samples.sort();
    println!(
        "pod change -> catalog latency over {} changes: median {:?}, min {:?}, max {:?}",
        samples.len(),
        samples[samples.len() / 2],
        samples[0],
        samples[samples.len() - 1]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relist_watch_cut_and_pool_changes() {
    let fake = Fake::start(false).await;
    fake.put_pool(pool_object(json!({"app": "vllm"}), &[8000]));
    fake.put_pod(pod("a", "10.0.0.1").build());
    fake.put_pod(pod("b", "10.0.0.2").build());
    fake.put_pod(pod("z", "10.0.9.1").label("app", "vllm2").build());
    let serve = start(&fake, &["--pool-name", POOL]);
    let mut api = api(&serve).await;
    expect_catalog(
        &mut api,
        "first sync",
        &["a 10.0.0.1:8000", "b 10.0.0.2:8000"],
    )
    .await;

    // A pod removed without a watch event stays until a relist (410 Gone) reveals it.
    let lists = fake.pod_lists();
    fake.remove_pod_silently("b");
    fake.put_pod(pod("a", "10.0.0.11").build());
    expect_catalog(
        &mut api,
        "b still believed",
        &["a 10.0.0.11:8000", "b 10.0.0.2:8000"],
    )
    .await;
    fake.expire_watches();
    expect_catalog(&mut api, "relist after 410", &["a 10.0.0.11:8000"]).await;
    assert!(fake.pod_lists() > lists, "a relist happened");

    // Watch cut: the stream ends; changes made while disconnected arrive after the reconnect,
    // and the catalog is never wiped in between.
    let deadline = Instant::now() + WAIT;
    while fake.pod_watches() == 0 {
        assert!(Instant::now() < deadline, "pod watch never re-established");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    fake.cut_watches();
    assert_eq!(catalog(&mut api).await, ["a 10.0.0.11:8000"]);
    fake.put_pod(pod("c", "10.0.0.3").build());
    expect_catalog(
        &mut api,
        "after reconnect",
        &["a 10.0.0.11:8000", "c 10.0.0.3:8000"],
    )
    .await;

    // The pool changes its ports, then its selector (the pod watcher restarts with it).
    fake.put_pool(pool_object(json!({"app": "vllm"}), &[9000, 9001]));
    expect_catalog(
        &mut api,
        "pool ports",
        &[
            "a 10.0.0.11:9000 10.0.0.11:9001",
            "c 10.0.0.3:9000 10.0.0.3:9001",
        ],
    )
    .await;
    fake.put_pool(pool_object(json!({"app": "vllm2"}), &[9000]));
    expect_catalog(&mut api, "pool selector", &["z 10.0.9.1:9000"]).await;
    fake.put_pod(pod("a", "10.0.0.11").build());
    fake.put_pod(pod("z2", "10.0.9.2").label("app", "vllm2").build());
    expect_catalog(
        &mut api,
        "new selector watched",
        &["z 10.0.9.1:9000", "z2 10.0.9.2:9000"],
    )
    .await;

    // A pod leaving the selector (label change) drops out.
    fake.put_pod(pod("z2", "10.0.9.2").build());
    expect_catalog(&mut api, "label change", &["z 10.0.9.1:9000"]).await;

    // A deleted pool fails closed; re-creating it restores the workers.
    fake.delete_pool();
    expect_catalog(&mut api, "pool deleted", &[]).await;
    wait_readiness(serve.health, ServingStatus::NotServing).await;
    fake.put_pool(pool_object(json!({"app": "vllm"}), &[8000]));
    expect_catalog(
        &mut api,
        "pool back",
        &["a 10.0.0.11:8000", "c 10.0.0.3:8000", "z2 10.0.9.2:8000"],
    )
    .await;
    wait_readiness(serve.health, ServingStatus::Serving).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_outage_keeps_the_catalog_and_the_relist_converges() {
    let fake = Fake::start(false).await;
    fake.put_pool(pool_object(json!({"app": "vllm"}), &[8000]));
    fake.put_pod(pod("a", "10.0.0.1").build());
    fake.put_pod(pod("b", "10.0.0.2").build());
    let serve = start(&fake, &["--pool-name", POOL]);
    let mut api = api(&serve).await;
    let before = ["a 10.0.0.1:8000", "b 10.0.0.2:8000"];
    expect_catalog(&mut api, "first sync", &before).await;
    wait_readiness(serve.health, ServingStatus::Serving).await;
    let deadline = Instant::now() + WAIT;
    while fake.pod_watches() == 0 {
        assert!(Instant::now() < deadline, "pod watch never established");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }

    // The watches are cut and the API server refuses everything for a while. Meanwhile the
    // cluster changes, and history is compacted, so a resumed watch gets 410 and must relist.
    fake.set_outage(true);
    let lists = fake.pod_lists();
    fake.remove_pod_silently("b");
    fake.put_pod(pod("c", "10.0.0.3").build());
    fake.put_pod(pod("a", "10.0.0.11").build());
    fake.expire_watches();
    // Throughout the outage (several refused retries) the last known catalog is kept and
    // kvpick stays ready: a control-plane blip must not empty the pool.
    let deadline = Instant::now() + WAIT;
    while fake.refused() < 4 {
        assert!(
            Instant::now() < deadline,
            "kvpick never retried the API server"
        );
        assert_eq!(
            catalog(&mut api).await,
            before,
            "catalog kept during the outage"
        );
        assert_eq!(readiness(serve.health).await, ServingStatus::Serving);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(catalog(&mut api).await, before);

    // The API server is back: the relist converges on the cluster as it is now, including
    // the pod removed without any event.
    fake.set_outage(false);
    expect_catalog(
        &mut api,
        "relist after the outage",
        &["a 10.0.0.11:8000", "c 10.0.0.3:8000"],
    )
    .await;
    assert!(fake.pod_lists() > lists, "a relist happened");
    assert_eq!(readiness(serve.health).await, ServingStatus::Serving);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn endpoint_selector_without_the_crd() {
    let fake = Fake::start(false).await;
    fake.put_pod(
        pod("a", "10.0.0.1")
            .label("kvpick.io/model", "ignored")
            .build(),
    );
    fake.put_pod(pod("x", "10.0.0.9").label("app", "other").build());
    let serve = start(
        &fake,
        &[
            "--endpoint-selector",
            "app=vllm",
            "--target-ports",
            "8000,8001",
            "--model",
            "flag-model",
        ],
    );
    let mut api = api(&serve).await;
    expect_catalog(
        &mut api,
        "selector mode",
        &["a 10.0.0.1:8000 10.0.0.1:8001"],
    )
    .await;
    let w = common::list_workers(&mut api).await;
    assert_eq!(w[0].model, "flag-model");
    wait_readiness(serve.health, ServingStatus::Serving).await;
    fake.put_pod(pod("b", "10.0.0.2").build());
    expect_catalog(
        &mut api,
        "selector mode add",
        &[
            "a 10.0.0.1:8000 10.0.0.1:8001",
            "b 10.0.0.2:8000 10.0.0.2:8001",
        ],
    )
    .await;
}

#[test]
fn flag_errors_name_the_flag() {
    let run = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_kvpick"))
            .arg("serve")
            .args(args)
            .env_remove("NAMESPACE")
            .env_remove("KVPICK_CONFIG")
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).to_string()
    };
    assert!(run(&[]).contains("no catalog source"));
    assert!(run(&["--pool-name", "p"]).contains("--pool-namespace"));
    assert!(run(&["--pool-name", "p", "--config", "x.yaml"]).contains("choose one catalog source"));
    assert!(
        run(&["--endpoint-selector", "a=b", "--pool-namespace", "ns"]).contains("--target-ports")
    );
}
