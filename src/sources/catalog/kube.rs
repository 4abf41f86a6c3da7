//! The Kubernetes catalog source: watches one `InferencePool` (`inference.networking.k8s.io/v1`)
//! — or, without the CRD, a fixed label selector and target ports — and the pods it selects, and
//! publishes complete desired snapshots (`Vec<WorkerSpec>`) into a `watch` channel for the
//! CatalogReconciler (ARCHITECTURE.md §5, §9).
//!
//! It owns: the InferencePool type, the pod reflector (kube-rs `watcher` + `reflector`,
//! server-side label selector, `managed_fields` dropped, default backoff, relist on 410), and the
//! pure (pool, pods) → snapshot conversion with both data-parallel shapes. It must not touch the
//! selection core, bookings, KV events or scheduling state: it only ever sends snapshots.
//!
//! Guarantees: nothing (`None`) is published until the pool and the pods have completed their
//! first full list, so readiness waits for the first sync; watch failures keep the last good
//! state (the reflector store keeps it while kube-rs retries with backoff); a deleted or missing
//! pool fails closed (`Some(vec![])`); a selector change restarts the pod watcher with the new
//! server-side selector (the old state stays published until the new list completes).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use anyhow::{bail, Context};
use futures::stream::BoxStream;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use kvpick_core::Role;

use super::{RankLayout, WorkerSpec, MAX_DP_RANKS};

/// Pod annotation restricting the live ranks to some of the pool's target ports.
pub const ACTIVE_PORTS_ANNOTATION: &str = "inference.networking.k8s.io/active-ports";
/// Pod annotation or label: number of data-parallel ranks multiplexed behind the first target port.
pub const DP_SIZE_KEY: &str = "kvpick.io/data-parallel-size";
/// Pod annotation (or label) naming the served model when `--model` is not given. The annotation
/// comes first: model names such as `meta-llama/Llama-3.1-8B` contain `/`, which a label value
/// cannot hold; the label still works for names that fit.
pub const MODEL_LABEL: &str = "kvpick.io/model";
/// Pod annotation overriding the KV-event port of rank 0 (`off` or `0` disables KV events).
pub const KV_EVENTS_PORT_ANNOTATION: &str = "kvpick.io/kv-events-port";
/// Pod annotation setting the replay (ROUTER) port of rank 0.
pub const KV_REPLAY_PORT_ANNOTATION: &str = "kvpick.io/kv-replay-port";
/// Pod annotation: the engine's KV block size in tokens (vLLM `--block-size`). Without it the
/// partition learns the size from the engine's KV events.
pub const BLOCK_SIZE_ANNOTATION: &str = "kvpick.io/block-size";
/// Default pod label naming a pod's prefill/decode role (llm-d's; `--role-label` changes it):
/// `prefill`, `decode`, `both` (or llm-d's `prefill-decode`); absent = both.
pub const DEFAULT_ROLE_LABEL: &str = "llm-d.ai/role";
/// Pod annotation: one role per data-parallel rank, comma-separated (`prefill,prefill,decode,
/// decode`); a label value cannot hold commas. It wins over the role label.
pub const DP_ROLES_ANNOTATION: &str = "kvpick.io/data-parallel-roles";
/// Default KV-event port of rank 0 (vLLM's default).
pub const DEFAULT_KV_EVENTS_PORT: u16 = 5557;
/// Most target ports an InferencePool may list.
pub const MAX_TARGET_PORTS: usize = 8;

/// `inference.networking.k8s.io/v1` InferencePool (only the fields kvpick reads; unknown fields
/// are ignored so newer servers still parse).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct InferencePool {
    #[serde(default)]
    pub metadata: ObjectMeta,
    #[serde(default)]
    pub spec: InferencePoolSpec,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    #[serde(default)]
    pub selector: PoolSelector,
    #[serde(default)]
    pub target_ports: Vec<PortNumber>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct PoolSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct PortNumber {
    pub number: i32,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kind: Option<String>,
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<PortNumber>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failure_mode: Option<String>,
}

impl kube::Resource for InferencePool {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "InferencePool".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "inference.networking.k8s.io".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "inferencepools".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// What selects the workers: the pool's selector and ports, or the flag-given equivalents.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolView {
    pub selector: BTreeMap<String, String>,
    pub target_ports: Vec<u16>,
    /// The pod label carrying the prefill/decode role ([`DEFAULT_ROLE_LABEL`]).
    pub role_label: String,
}

impl PoolView {
    /// Validates a pool's spec (1–8 target ports in 1..=65535).
    pub fn from_pool(pool: &InferencePool) -> anyhow::Result<PoolView> {
        let ports = pool
            .spec
            .target_ports
            .iter()
            .map(|p| {
                u16::try_from(p.number)
                    .ok()
                    .filter(|n| *n != 0)
                    .with_context(|| format!("targetPorts: {} is not a port number", p.number))
            })
            .collect::<anyhow::Result<Vec<u16>>>()?;
        PoolView::new(pool.spec.selector.match_labels.clone(), ports)
    }

    pub fn new(selector: BTreeMap<String, String>, target_ports: Vec<u16>) -> anyhow::Result<Self> {
        if target_ports.is_empty() || target_ports.len() > MAX_TARGET_PORTS {
            bail!("targetPorts must list 1..={MAX_TARGET_PORTS} ports");
        }
        if target_ports.contains(&0) {
            bail!("targetPorts must not contain 0");
        }
        Ok(PoolView {
            selector,
            target_ports,
            role_label: DEFAULT_ROLE_LABEL.to_string(),
        })
    }

    /// The same view reading roles from `label`.
    pub fn with_role_label(self, label: &str) -> Self {
        PoolView {
            role_label: label.to_string(),
            ..self
        }
    }

    /// The server-side label selector (`k=v,k2=v2`).
    pub fn label_selector(&self) -> String {
        self.selector
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    }

    fn matches(&self, pod: &Pod) -> bool {
        let labels = pod.labels();
        self.selector
            .iter()
            .all(|(k, v)| labels.get(k).is_some_and(|l| l == v))
    }
}

/// Parses `k=v,k2=v2` (the `--endpoint-selector` flag).
pub fn parse_selector(text: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=') else {
            bail!("selector term {part:?} is not key=value");
        };
        let (k, v) = (k.trim(), v.trim());
        if k.is_empty() {
            bail!("selector term {part:?} has an empty key");
        }
        out.insert(k.to_string(), v.to_string());
    }
    if out.is_empty() {
        bail!("the selector must have at least one key=value term");
    }
    Ok(out)
}

/// Which run of the pod's engine this is: the pod uid and its containers' restart counts. A
/// container restarted (an OOM, a crash) has an empty KV cache, so the core forgets the rank's
/// blocks when this changes.
fn incarnation(pod: &Pod) -> u64 {
    let mut key = pod.metadata.uid.clone().unwrap_or_default().into_bytes();
    for c in pod
        .status
        .iter()
        .flat_map(|s| s.container_statuses.iter().flatten())
    {
        key.extend_from_slice(c.name.as_bytes());
        key.extend_from_slice(&c.restart_count.to_le_bytes());
    }
    xxhash_rust::xxh3::xxh3_64(&key)
}

/// Why a pod is not a worker (`Ok(None)` = not selected or without an IP, silently skipped). A
/// pod that is not Ready, or is terminating, is a *draining* worker: not schedulable, but its
/// in-flight bookings keep counting until it is Ready again or deleted.
fn pod_to_spec(
    pool: &PoolView,
    pod: &Pod,
    model: Option<&str>,
) -> anyhow::Result<Option<WorkerSpec>> {
    if !pool.matches(pod) {
        return Ok(None);
    }
    let Some(status) = &pod.status else {
        return Ok(None);
    };
    let ready = status
        .conditions
        .iter()
        .flatten()
        .any(|c| c.type_ == "Ready" && c.status == "True");
    let draining = !ready || pod.metadata.deletion_timestamp.is_some();
    let Some(ip) = status.pod_ip.as_deref().filter(|ip| !ip.is_empty()) else {
        return Ok(None);
    };
    let address: IpAddr = ip
        .parse()
        .with_context(|| format!("podIP {ip:?} is not an IP address"))?;
    let labels = pod.labels();
    let annotations = pod.annotations();
    let model = pod_model(model, annotations, labels)?;
    let Some(ranks) = pod_ranks(pool, annotations, labels)? else {
        return Ok(None);
    };
    let roles = pod_roles(pool, annotations, labels)?;
    let KvAnnotations {
        block_size,
        kv_events,
        kv_replay,
    } = kv_annotations(annotations, address)?;

    let spec = WorkerSpec {
        namespace: pod.namespace().unwrap_or_default(),
        name: pod.name_any(),
        model,
        routing_group: String::new(),
        address,
        ranks,
        block_size,
        kv_events,
        kv_replay,
        lora_adapters: Vec::new(),
        draining,
        incarnation: incarnation(pod),
        roles,
    };
    spec.validate_roles().map_err(|e| anyhow::anyhow!(e))?;
    Ok(Some(spec))
}

/// A pod's annotations or labels.
type PodMap = std::collections::BTreeMap<String, String>;

/// The pod's model: `--model`, else its annotation or label.
fn pod_model(model: Option<&str>, annotations: &PodMap, labels: &PodMap) -> anyhow::Result<String> {
    Ok(match model {
        Some(m) => m.to_string(),
        None => match annotations
            .get(MODEL_LABEL)
            .filter(|m| !m.trim().is_empty())
            .or_else(|| labels.get(MODEL_LABEL).filter(|m| !m.is_empty()))
        {
            Some(m) => m.trim().to_string(),
            None => bail!("no model: pass --model or annotate the pod {MODEL_LABEL}"),
        },
    })
}

/// The pod's ranks: a data-parallel size (one multiplexed port), else the pool's target ports
/// the pod serves; `None` when it serves none of them.
fn pod_ranks(
    pool: &PoolView,
    annotations: &PodMap,
    labels: &PodMap,
) -> anyhow::Result<Option<RankLayout>> {
    let dp_size = annotations
        .get(DP_SIZE_KEY)
        .or_else(|| labels.get(DP_SIZE_KEY));
    let layout = if let Some(size) = dp_size {
        let size: u32 = size
            .trim()
            .parse()
            .ok()
            .filter(|n| (1..=MAX_DP_RANKS).contains(n))
            .with_context(|| format!("{DP_SIZE_KEY} must be 1..={MAX_DP_RANKS}, got {size:?}"))?;
        let port = pool.target_ports[0];
        if size == 1 {
            RankLayout::PerPort(vec![port])
        } else {
            RankLayout::Multiplexed { port, size }
        }
    } else {
        match annotations.get(ACTIVE_PORTS_ANNOTATION) {
            None => RankLayout::PerPort(pool.target_ports.clone()),
            Some(active) => {
                let active = active
                    .split(',')
                    .map(str::trim)
                    .filter(|p| !p.is_empty())
                    .map(|p| p.parse::<u16>())
                    .collect::<Result<Vec<u16>, _>>()
                    .with_context(|| {
                        format!("{ACTIVE_PORTS_ANNOTATION} must list port numbers, got {active:?}")
                    })?;
                // Rank i stays rank i (targetPorts[i]) when other ranks are inactive.
                let live: Vec<(u32, u16)> = pool
                    .target_ports
                    .iter()
                    .enumerate()
                    .filter(|(_, p)| active.contains(p))
                    .map(|(i, p)| (i as u32, *p))
                    .collect();
                if live.is_empty() {
                    return Ok(None);
                }
                if live.len() == pool.target_ports.len() {
                    RankLayout::PerPort(pool.target_ports.clone())
                } else {
                    RankLayout::Sparse(live)
                }
            }
        }
    };
    Ok(Some(layout))
}

/// The pod's disaggregation roles (annotation, else the pool's role label); empty = both.
fn pod_roles(pool: &PoolView, annotations: &PodMap, labels: &PodMap) -> anyhow::Result<Vec<Role>> {
    Ok(
        match annotations
            .get(DP_ROLES_ANNOTATION)
            .map(|v| (DP_ROLES_ANNOTATION, v))
            .or_else(|| {
                labels
                    .get(&pool.role_label)
                    .map(|v| (pool.role_label.as_str(), v))
            }) {
            None => Vec::new(),
            Some((key, value)) => value
                .split(',')
                .map(|r| {
                    Role::parse(r).with_context(|| {
                        format!("{key} must be prefill, decode or both, got {value:?}")
                    })
                })
                .collect::<anyhow::Result<Vec<Role>>>()?,
        },
    )
}

/// What the pod's annotations say of its KV cache: block size and KV-event endpoints.
struct KvAnnotations {
    block_size: Option<u32>,
    kv_events: Option<String>,
    kv_replay: Option<String>,
}

fn kv_annotations(annotations: &PodMap, address: IpAddr) -> anyhow::Result<KvAnnotations> {
    let port_annotation = |key: &str| -> anyhow::Result<Option<u16>> {
        match annotations.get(key).map(|v| v.trim()) {
            None => Ok(None),
            Some("off") | Some("0") => Ok(Some(0)),
            Some(v) => v
                .parse::<u16>()
                .map(Some)
                .with_context(|| format!("{key} must be a port number, got {v:?}")),
        }
    };
    let block_size = match annotations.get(BLOCK_SIZE_ANNOTATION).map(|v| v.trim()) {
        None => None,
        Some(v) => Some(
            v.parse::<u32>()
                .ok()
                .filter(|n| (1..=1 << 16).contains(n))
                .with_context(|| {
                    format!("{BLOCK_SIZE_ANNOTATION} must be a block size in tokens, got {v:?}")
                })?,
        ),
    };
    let endpoint = |port: u16| format!("tcp://{}", SocketAddr::new(address, port));
    let kv_events = match port_annotation(KV_EVENTS_PORT_ANNOTATION)? {
        None => Some(endpoint(DEFAULT_KV_EVENTS_PORT)),
        Some(0) => None,
        Some(p) => Some(endpoint(p)),
    };
    let kv_replay = port_annotation(KV_REPLAY_PORT_ANNOTATION)?
        .filter(|p| *p != 0)
        .map(endpoint);
    Ok(KvAnnotations {
        block_size,
        kv_events,
        kv_replay,
    })
}

/// The complete desired snapshot for `pool` from the current pods, sorted by namespace/name. A
/// pod is a worker iff it matches the selector, is Ready=True, is not terminating and has an IP;
/// a pod with invalid kvpick annotations is skipped with a warning.
pub fn snapshot<'a>(
    pool: &PoolView,
    pods: impl IntoIterator<Item = &'a Pod>,
    model: Option<&str>,
) -> Vec<WorkerSpec> {
    let mut workers = Workers::default();
    workers.rebuild(pool, pods, model);
    workers.snapshot()
}

/// A pod's worker, or `None` (not a worker; an invalid one is logged).
fn worker_of(pool: &PoolView, pod: &Pod, model: Option<&str>) -> Option<WorkerSpec> {
    match pod_to_spec(pool, pod, model) {
        Ok(spec) => spec,
        Err(err) => {
            tracing::warn!(pod = %pod.name_any(), err = format!("{err:#}"), "pod is not a worker");
            None
        }
    }
}

/// The workers of the pods seen so far, one entry per pod that is a worker, in (namespace, name)
/// order. A pod event converts only that pod, so a status-only change of one pod among thousands
/// costs one conversion and publishes nothing; a relist, a new pool view and the resync convert
/// every pod again.
#[derive(Debug, Default)]
pub struct Workers {
    by_pod: BTreeMap<(String, String), WorkerSpec>,
}

impl Workers {
    /// Converts every pod again; true when the workers changed.
    pub fn rebuild<'a>(
        &mut self,
        pool: &PoolView,
        pods: impl IntoIterator<Item = &'a Pod>,
        model: Option<&str>,
    ) -> bool {
        let by_pod: BTreeMap<(String, String), WorkerSpec> = pods
            .into_iter()
            .filter_map(|pod| Some((pod_key(pod), worker_of(pool, pod, model)?)))
            .collect();
        let changed = by_pod != self.by_pod;
        self.by_pod = by_pod;
        changed
    }

    /// One pod was added or changed, or (`deleted`) is gone; true when its worker changed.
    pub fn apply(
        &mut self,
        pool: &PoolView,
        pod: &Pod,
        deleted: bool,
        model: Option<&str>,
    ) -> bool {
        let key = pod_key(pod);
        let worker = if deleted {
            None
        } else {
            worker_of(pool, pod, model)
        };
        match worker {
            Some(spec) if self.by_pod.get(&key) == Some(&spec) => false,
            Some(spec) => {
                self.by_pod.insert(key, spec);
                true
            }
            None => self.by_pod.remove(&key).is_some(),
        }
    }

    /// The complete snapshot, sorted by namespace/name.
    pub fn snapshot(&self) -> Vec<WorkerSpec> {
        self.by_pod.values().cloned().collect()
    }
}

fn pod_key(pod: &Pod) -> (String, String) {
    (pod.namespace().unwrap_or_default(), pod.name_any())
}

/// Which pods to watch.
#[derive(Debug, Clone)]
pub enum Target {
    /// Follow one InferencePool's selector and target ports.
    Pool { name: String },
    /// No CRD: a fixed selector and ports from flags.
    Selector(PoolView),
}

#[derive(Debug, Clone)]
pub struct KubeSourceConfig {
    pub namespace: String,
    pub target: Target,
    /// Model served by every selected pod; `None` = pod label `kvpick.io/model`.
    pub model: Option<String>,
    /// Period of the forced re-publication of the current state.
    pub resync: Duration,
    /// Pod label naming the prefill/decode role ([`DEFAULT_ROLE_LABEL`]).
    pub role_label: String,
}

type PodEvents = BoxStream<'static, Result<Event<Pod>, watcher::Error>>;
type PoolEvents = BoxStream<'static, Result<Event<InferencePool>, watcher::Error>>;

struct PodWatch {
    selector: BTreeMap<String, String>,
    store: Store<Pod>,
    events: PodEvents,
    synced: bool,
    workers: Workers,
}

fn pod_watch(api: &Api<Pod>, view: &PoolView) -> PodWatch {
    let (store, writer) = reflector::store();
    let config = watcher::Config::default().labels(&view.label_selector());
    let events = watcher::watcher(api.clone(), config)
        .default_backoff()
        .modify(|pod: &mut Pod| pod.managed_fields_mut().clear())
        .reflect(writer)
        .boxed();
    PodWatch {
        selector: view.selector.clone(),
        store,
        events,
        synced: false,
        workers: Workers::default(),
    }
}

/// Publishes `snapshot` if it differs from the current one (or always, when `force`).
fn publish(tx: &watch::Sender<Option<Vec<WorkerSpec>>>, snapshot: Vec<WorkerSpec>, force: bool) {
    tx.send_if_modified(|current| {
        if !force && current.as_ref() == Some(&snapshot) {
            return false;
        }
        tracing::debug!(workers = snapshot.len(), "kubernetes snapshot published");
        *current = Some(snapshot);
        true
    });
}

/// Whether the loop goes on after an event.
enum Flow {
    Publish,
    /// A failed watch: keep what is published, publish nothing now.
    Skip,
    Stop,
}

/// The source between events: the pool, the view it gives, the pod watch and its workers.
struct Source {
    pod_api: Api<Pod>,
    namespace: String,
    pool_name: String,
    role_label: String,
    model: Option<String>,
    pool_synced: bool,
    pool_buffer: Option<InferencePool>,
    pool: Option<InferencePool>,
    view: Option<PoolView>,
    pods: Option<PodWatch>,
    /// The workers changed since the last publication.
    dirty: bool,
}

impl Source {
    fn on_pool_event(
        &mut self,
        event: Option<Result<Event<InferencePool>, watcher::Error>>,
    ) -> Flow {
        match event {
            Some(Ok(Event::Init)) => self.pool_buffer = None,
            Some(Ok(Event::InitApply(p))) => self.pool_buffer = Some(p),
            Some(Ok(Event::InitDone)) => {
                self.pool = self.pool_buffer.take();
                self.pool_synced = true;
                self.pool_changed();
            }
            Some(Ok(Event::Apply(p))) => {
                self.pool = Some(p);
                self.pool_changed();
            }
            Some(Ok(Event::Delete(_))) => {
                self.pool = None;
                self.pool_changed();
            }
            Some(Err(err)) => {
                tracing::warn!(pool = %self.pool_name, %err, "InferencePool watch failed; keeping the last state, retrying");
            }
            None => return Flow::Stop,
        }
        Flow::Publish
    }

    /// The pool changed: a new view; a new selector restarts the pod watch, other changes (ports,
    /// role label) convert the pods already listed again.
    fn pool_changed(&mut self) {
        let new_view = match &self.pool {
            None => {
                tracing::warn!(pool = %self.pool_name, namespace = %self.namespace, "InferencePool not found: failing closed (empty catalog)");
                None
            }
            Some(p) => match PoolView::from_pool(p).map(|v| v.with_role_label(&self.role_label)) {
                Ok(v) => Some(v),
                Err(err) => {
                    tracing::error!(pool = %self.pool_name, err = format!("{err:#}"), "invalid InferencePool: failing closed (empty catalog)");
                    None
                }
            },
        };
        if new_view == self.view {
            return;
        }
        tracing::info!(pool = %self.pool_name, ?new_view, "InferencePool selection changed");
        self.view = new_view;
        match &self.view {
            None => self.pods = None,
            Some(v) => match &mut self.pods {
                Some(p) if p.selector == v.selector => {
                    if p.synced {
                        let state = p.store.state();
                        p.workers
                            .rebuild(v, state.iter().map(|p| &**p), self.model.as_deref());
                    }
                    self.dirty = true;
                }
                _ => self.pods = Some(pod_watch(&self.pod_api, v)),
            },
        }
    }

    fn on_pod_event(&mut self, event: Option<Result<Event<Pod>, watcher::Error>>) -> Flow {
        let (Some(view), Some(pods)) = (&self.view, &mut self.pods) else {
            return Flow::Publish;
        };
        let model = self.model.as_deref();
        match event {
            Some(Ok(Event::InitDone)) => {
                pods.synced = true;
                let state = pods.store.state();
                pods.workers
                    .rebuild(view, state.iter().map(|p| &**p), model);
                self.dirty = true;
            }
            Some(Ok(Event::Apply(pod))) if pods.synced => {
                self.dirty |= pods.workers.apply(view, &pod, false, model);
            }
            Some(Ok(Event::Delete(pod))) if pods.synced => {
                self.dirty |= pods.workers.apply(view, &pod, true, model);
            }
            // A relist in progress: the store swaps in the new list at InitDone.
            Some(Ok(_)) => {}
            Some(Err(err)) => {
                tracing::warn!(%err, "pod watch failed; keeping the last state, retrying");
                return Flow::Skip;
            }
            None => return Flow::Stop,
        }
        Flow::Publish
    }

    /// The resync: every pod converted again from the store, and the result published as is.
    fn resync(&mut self) {
        if let (Some(view), Some(pods)) = (&self.view, &mut self.pods) {
            if pods.synced {
                let state = pods.store.state();
                pods.workers
                    .rebuild(view, state.iter().map(|p| &**p), self.model.as_deref());
            }
        }
    }

    /// Publishes the workers when they changed (or always, when `force`).
    fn publish(&mut self, tx: &watch::Sender<Option<Vec<WorkerSpec>>>, force: bool) {
        if !self.pool_synced {
            return;
        }
        match (&self.view, &self.pods) {
            (None, _) => publish(tx, Vec::new(), force),
            (Some(_), Some(p)) if p.synced && (self.dirty || force) => {
                publish(tx, p.workers.snapshot(), force);
                self.dirty = false;
            }
            // Unchanged, or the pod list for a new selector is not complete yet: keep what is
            // published.
            _ => {}
        }
    }
}

/// Runs the source until every receiver of `tx` is gone.
// The `select!` branches unwrap a stream only under their own `is_some()` precondition.
#[allow(clippy::unwrap_used)]
pub async fn run(
    client: Client,
    config: KubeSourceConfig,
    tx: watch::Sender<Option<Vec<WorkerSpec>>>,
) {
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), &config.namespace);
    // The pool side: either a fixed view, or a watcher on the named pool.
    let (view, mut pool_events): (Option<PoolView>, Option<PoolEvents>) = match &config.target {
        Target::Selector(view) => (Some(view.clone().with_role_label(&config.role_label)), None),
        Target::Pool { name } => {
            let api: Api<InferencePool> = Api::namespaced(client.clone(), &config.namespace);
            let wc = watcher::Config::default().fields(&format!("metadata.name={name}"));
            let events = watcher::watcher(api, wc)
                .default_backoff()
                .modify(|p: &mut InferencePool| p.managed_fields_mut().clear())
                .boxed();
            (None, Some(events))
        }
    };
    let mut source = Source {
        pods: view.as_ref().map(|v| pod_watch(&pod_api, v)),
        pod_api,
        namespace: config.namespace.clone(),
        pool_name: match &config.target {
            Target::Pool { name } => name.clone(),
            Target::Selector(_) => String::new(),
        },
        role_label: config.role_label.clone(),
        model: config.model.clone(),
        pool_synced: pool_events.is_none(),
        pool_buffer: None,
        pool: None,
        view,
        dirty: false,
    };
    let mut resync = tokio::time::interval(config.resync);
    resync.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    resync.tick().await;
    loop {
        let mut force = false;
        let flow = tokio::select! {
            event = async { pool_events.as_mut().unwrap().next().await }, if pool_events.is_some() => {
                source.on_pool_event(event)
            }
            event = async { source.pods.as_mut().unwrap().events.next().await }, if source.pods.is_some() => {
                source.on_pod_event(event)
            }
            _ = resync.tick() => {
                force = true;
                source.resync();
                Flow::Publish
            }
            _ = tx.closed() => Flow::Stop,
        };
        match flow {
            Flow::Publish => source.publish(&tx, force),
            Flow::Skip => {}
            Flow::Stop => return,
        }
    }
}

#[cfg(test)]
#[path = "kube_tests.rs"]
mod tests;
