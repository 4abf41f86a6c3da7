//! A fake Kubernetes API server on 127.0.0.1 for kvpick's Kubernetes source: LIST with a
//! resourceVersion, streaming WATCH of newline-delimited events (resumed from a resourceVersion
//! out of the kept history), `410 Gone` to force a relist, the InferencePool and its pods, an
//! outage mode, and the instant the first pod LIST was answered (the scale benchmark's start of
//! "start-up to ready").
//!
//! It owns only the fake's objects and streams. It must not know kvpick's internals: it speaks
//! the Kubernetes wire format, and the real `kube::Client` inside the real binary talks to it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::sync::{mpsc, watch};

/// The namespace of the pods and pool the builders make.
pub const NAMESPACE: &str = "ns";
/// The InferencePool name [`pool_object`] uses.
pub const POOL: &str = "pool";

/// Serves a fake Kubernetes API server on `listener`: `routes` with `state`; any other request is
/// logged and answered 404 (a test then fails on what it did not get, with the path in its log).
pub fn serve_fake_apiserver<S: Clone + Send + Sync + 'static>(
    listener: tokio::net::TcpListener,
    routes: axum::Router<S>,
    state: S,
) {
    let app = routes
        .fallback(|uri: axum::http::Uri| async move {
            eprintln!("fake apiserver: unexpected request {uri}");
            (StatusCode::NOT_FOUND, "not found")
        })
        .with_state(state);
    tokio::spawn(async move {
        if let Err(err) = axum::serve(listener, app).await {
            eprintln!("fake apiserver stopped: {err}");
        }
    });
}

/// One event of a Kubernetes watch stream: the JSON and a newline.
pub fn watch_line(event: Value) -> Bytes {
    let mut text = event.to_string();
    text.push('\n');
    Bytes::from(text)
}

/// The watch event of a resource version the fake server no longer has (410 Expired): the
/// client must list again.
pub fn watch_gone() -> Value {
    json!({"type": "ERROR", "object": {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": "too old resource version", "reason": "Expired", "code": 410,
    }})
}

/// A Kubernetes watch response streaming the events sent into `rx` (see [`watch_line`]) for as
/// long as its sender lives.
pub fn watch_response(rx: mpsc::UnboundedReceiver<Bytes>) -> Response {
    use futures::StreamExt;
    let body = tokio_stream::wrappers::UnboundedReceiverStream::new(rx)
        .map(Ok::<Bytes, std::convert::Infallible>);
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

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
    first_pod_list: Option<Instant>,
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
                Some(ev) => w.tx.send(watch_line(ev)).is_ok(),
                None => !w.tx.is_closed(),
            }
        });
        let sent = Instant::now();
        self.history.push(change);
        sent
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

/// The fake server: cheap to clone, every clone the same server.
#[derive(Clone)]
pub struct Fake {
    inner: Arc<Mutex<Inner>>,
    gate: watch::Sender<bool>,
    /// `http://127.0.0.1:PORT`, for `--kube-api-url`.
    pub url: String,
}

impl Fake {
    /// Starts the server; LISTs wait until [`Fake::open_lists`] when `gated`.
    pub async fn start(gated: bool) -> std::io::Result<Fake> {
        let (gate, _) = watch::channel(!gated);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
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
        serve_fake_apiserver(listener, routes, fake.clone());
        Ok(fake)
    }

    pub fn open_lists(&self) {
        self.gate.send_replace(true);
    }

    /// Creates or replaces a pod; returns when its watch event was handed to the open watches.
    /// A pod without `metadata.name` is a bug of the caller: it is stored under "".
    pub fn put_pod(&self, mut pod: Value) -> Instant {
        let mut inner = self.inner.lock();
        inner.rv += 1;
        pod["metadata"]["resourceVersion"] = inner.rv.to_string().into();
        let name = pod["metadata"]["name"].as_str().unwrap_or("").to_string();
        let old = inner.pods.insert(name, pod.clone());
        inner.record(Kind::Pod, old, Some(pod))
    }

    /// The stored pod `name` (for a change that starts from its current state).
    pub fn pod(&self, name: &str) -> Option<Value> {
        self.inner.lock().pods.get(name).cloned()
    }

    /// Deletes a pod; false when there was none of that name.
    pub fn delete_pod(&self, name: &str) -> bool {
        let mut inner = self.inner.lock();
        let Some(old) = inner.pods.remove(name) else {
            return false;
        };
        inner.rv += 1;
        inner.record(Kind::Pod, Some(old), None);
        true
    }

    /// Removes a pod without any watch event (a change the watch lost): only a relist reveals it.
    pub fn remove_pod_silently(&self, name: &str) -> bool {
        let mut inner = self.inner.lock();
        inner.rv += 1;
        inner.pods.remove(name).is_some()
    }

    /// Compacts history: every open watch gets an ERROR event with a 410 Status and is closed, as
    /// does any watch resumed from an older resourceVersion.
    pub fn expire_watches(&self) {
        let mut inner = self.inner.lock();
        inner.compacted = inner.rv;
        for w in inner.watchers.drain(..) {
            let _ = w.tx.send(watch_line(watch_gone()));
        }
    }

    /// Closes every open watch stream (connection cut); clients resume from their resourceVersion.
    pub fn cut_watches(&self) {
        self.inner.lock().watchers.clear();
    }

    /// Starts or ends an API server outage: open watches are cut and every request is refused
    /// until it ends.
    pub fn set_outage(&self, on: bool) {
        let mut inner = self.inner.lock();
        inner.outage = on;
        if on {
            inner.watchers.clear();
        }
    }

    pub fn refused(&self) -> usize {
        self.inner.lock().refused
    }

    pub fn put_pool(&self, mut pool: Value) {
        let mut inner = self.inner.lock();
        inner.rv += 1;
        pool["metadata"]["resourceVersion"] = inner.rv.to_string().into();
        let old = inner.pool.replace(pool.clone());
        inner.record(Kind::Pool, old, Some(pool));
    }

    /// Deletes the pool; false when there was none.
    pub fn delete_pool(&self) -> bool {
        let mut inner = self.inner.lock();
        let Some(old) = inner.pool.take() else {
            return false;
        };
        inner.rv += 1;
        inner.record(Kind::Pool, Some(old), None);
        true
    }

    pub fn pod_lists(&self) -> usize {
        self.inner.lock().pod_lists
    }

    /// When the first pod LIST was answered (its body built), if one was.
    pub fn first_pod_list(&self) -> Option<Instant> {
        self.inner.lock().first_pod_list
    }

    pub fn pod_watches(&self) -> usize {
        let inner = self.inner.lock();
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

/// A WATCH from the query's resourceVersion: the kept history after it, then live changes.
fn watch(fake: &Fake, kind: Kind, sel: Sel, q: &HashMap<String, String>) -> Response {
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let (tx, rx) = mpsc::unbounded_channel();
    {
        let mut inner = fake.inner.lock();
        if from < inner.compacted {
            let _ = tx.send(watch_line(watch_gone()));
        } else {
            for c in inner
                .history
                .iter()
                .filter(|c| c.rv > from && c.kind == kind)
            {
                if let Some(ev) = event_for(&sel, c) {
                    let _ = tx.send(watch_line(ev));
                }
            }
            inner.watchers.push(Watcher { kind, sel, tx });
        }
    }
    watch_response(rx)
}

async fn list_or_watch(fake: Fake, kind: Kind, sel: Sel, q: HashMap<String, String>) -> Response {
    if let Some(refused) = fake.inner.lock().refuse() {
        return refused;
    }
    if q.get("watch").map(String::as_str) == Some("true") {
        return watch(&fake, kind, sel, &q);
    }
    let mut gate = fake.gate.subscribe();
    let _ = gate.wait_for(|open| *open).await;
    let mut inner = fake.inner.lock();
    if let Some(refused) = inner.refuse() {
        return refused;
    }
    let (items, list_kind, api_version): (Vec<Value>, _, _) = match kind {
        Kind::Pod => {
            inner.pod_lists += 1;
            let items = inner
                .pods
                .values()
                .filter(|p| sel.matches(p))
                .cloned()
                .collect();
            (items, "PodList", "v1")
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
    let response = json_response(json!({
        "apiVersion": api_version, "kind": list_kind,
        "metadata": {"resourceVersion": inner.rv.to_string()},
        "items": items,
    }));
    if kind == Kind::Pod && inner.first_pod_list.is_none() {
        inner.first_pod_list = Some(Instant::now());
    }
    response
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
        let mut inner = fake.inner.lock();
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

/// A pod as the kubelet reports it, built step by step.
pub struct PodBuilder {
    v: Value,
}

/// A Ready pod `name` in [`NAMESPACE`] with `podIP` `ip`, labelled `app=vllm` and
/// `kvpick.io/model=m`, with one container `vllm` and a managed-fields entry (which kvpick drops).
pub fn pod(name: &str, ip: &str) -> PodBuilder {
    PodBuilder {
        v: json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "name": name, "namespace": NAMESPACE, "uid": uuid::Uuid::new_v4().to_string(),
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
    pub fn ready(mut self, ready: bool) -> Self {
        set_ready(&mut self.v, ready);
        self
    }
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.v["metadata"]["labels"][k] = v.into();
        self
    }
    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.v["metadata"]["annotations"][k] = v.into();
        self
    }
    pub fn uid(mut self, uid: &str) -> Self {
        self.v["metadata"]["uid"] = uid.into();
        self
    }
    pub fn terminating(mut self) -> Self {
        self.v["metadata"]["deletionTimestamp"] = "2025-01-01T00:00:00Z".into();
        self
    }
    pub fn no_ip(mut self) -> Self {
        if let Some(status) = self.v["status"].as_object_mut() {
            status.remove("podIP");
        }
        self
    }
    pub fn build(self) -> Value {
        self.v
    }
}

/// Sets a pod's Ready condition.
pub fn set_ready(pod: &mut Value, ready: bool) {
    pod["status"]["conditions"] =
        json!([{"type": "Ready", "status": if ready { "True" } else { "False" }}]);
}

/// An InferencePool [`POOL`] in [`NAMESPACE`] selecting `selector` on `ports`.
pub fn pool_object(selector: Value, ports: &[u16]) -> Value {
    json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": POOL, "namespace": NAMESPACE, "uid": "pool-uid"},
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": ports.iter().map(|p| json!({"number": p})).collect::<Vec<_>>(),
            "endpointPickerRef": {"name": "kvpick", "port": {"number": 9002}, "failureMode": "FailClose"},
        },
    })
}
