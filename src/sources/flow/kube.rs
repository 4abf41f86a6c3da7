//! The Kubernetes flow-policy source: watches every served group/version of InferenceObjective
//! (`llm-d.ai/v1`, `llm-d.ai/v1alpha2`, `inference.networking.x-k8s.io/v1alpha2`) and
//! InferenceModelRewrite (`llm-d.ai/v1alpha2`, `inference.networking.x-k8s.io/v1alpha2`) in one
//! namespace, and the served InferencePool's labels (for `poolSelector`); keeps the objects that
//! target the pool, and publishes their objectives and rules ([`ClusterContent`]) into a `watch`
//! channel that [`super::source`] merges with the `--flow-config` file.
//!
//! **Which group counts** (llm-d-router's rule, `pkg/epp/server/controller_config.go`): per kind,
//! when any `llm-d.ai` version is installed, only `llm-d.ai` objects count and the legacy
//! `inference.networking.x-k8s.io` ones are ignored; otherwise the legacy group's. Within llm-d,
//! an objective's `v1` form is evaluated before its `v1alpha2` form, the first that targets the
//! pool wins (llm-d's `InferenceObjectiveReconciler`). Unlike llm-d, which decides once at start-up
//! from discovery, kvpick decides from its watches and re-decides whenever a CRD appears (its list
//! succeeds) or goes away (404): the group in use is logged on every change and exported as
//! `kvpick_flow_crd_in_use`.
//!
//! "Installed" is learnt from the watches themselves: a resource whose list succeeded is installed;
//! one answering 404 (CRD not installed) or 403 (not readable) is not. A kind publishes nothing
//! until each of its resources has answered one way or the other, so start-up never shows the
//! legacy group's objects for a moment before llm-d's replace them; objectives also wait for the
//! pool's first answer.
//!
//! Same reflector machinery as the catalog source (`catalog::kube`): kube-rs `watcher` with the
//! default backoff (0.8 s doubling to 30 s, jittered), `managed_fields` dropped, a full relist on
//! 410 Gone. Objects are read as `DynamicObject`s and parsed by [`super::crds`]; an object whose
//! spec does not parse is skipped with a warning. A failing watch never crashes anything: the first
//! failure is logged at warn, the rest at debug.
//!
//! It must not touch the selection core or the catalog; it only sends policy content.

use std::collections::BTreeMap;

use futures::stream::{self, BoxStream};
use futures::StreamExt;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::core::{ApiResource, DynamicObject};
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, ResourceExt};
use tokio::sync::watch;

use super::crds::{objective_from, pool_api_resource, rules_from, ObjectiveCandidate};
pub use super::crds::{Kind, Resource, GIE_GROUP, LLMD_GROUP, POOL_GROUPS};
use super::{Objective, RewriteRule};

/// What the source watches.
#[derive(Debug, Clone, Default)]
pub struct FlowKubeConfig {
    pub namespace: String,
    /// The InferencePool kvpick serves: only objects that target it count.
    pub pool: String,
    /// `kvpick_flow_crd_in_use{kind, api_version}`: 1 for the group/versions whose objects count.
    pub in_use: Option<prometheus::IntGaugeVec>,
}

impl FlowKubeConfig {
    pub fn new(namespace: impl Into<String>, pool: impl Into<String>) -> Self {
        FlowKubeConfig {
            namespace: namespace.into(),
            pool: pool.into(),
            in_use: None,
        }
    }

    /// The same, exporting the group/versions in use on `gauge`.
    pub fn with_in_use_gauge(self, gauge: prometheus::IntGaugeVec) -> Self {
        FlowKubeConfig {
            in_use: Some(gauge),
            ..self
        }
    }
}

/// The watched resources' contribution to the policy: objectives by name, rules oldest resource
/// first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterContent {
    pub objectives: Vec<Objective>,
    pub rules: Vec<RewriteRule>,
}

/// What one object contributes, parsed (and any problem logged) once, when it arrives.
#[derive(Debug, Clone, Default)]
struct Contribution {
    created: Option<Time>,
    objective: Option<ObjectiveCandidate>,
    rules: Vec<RewriteRule>,
}

fn contribution(resource: Resource, obj: &DynamicObject, pool: &str) -> Contribution {
    let mut out = Contribution {
        created: obj.metadata.creation_timestamp.clone(),
        ..Contribution::default()
    };
    let parsed = match resource.kind() {
        Kind::Objective => objective_from(resource, obj, pool).map(|o| out.objective = o),
        Kind::Rewrite => rules_from(obj, pool).map(|r| out.rules = r),
    };
    if let Err(err) = parsed {
        tracing::warn!(%resource, object = %obj.name_any(), %err, "invalid {} skipped", resource.kind().name());
    }
    out
}

/// The objects of one resource as last listed and watched, by name.
#[derive(Default)]
struct Store {
    synced: bool,
    /// The last list answered 404 / 403: not installed (or not readable).
    missing: bool,
    objects: BTreeMap<String, Contribution>,
    buffer: Option<BTreeMap<String, Contribution>>,
    failing: bool,
}

impl Store {
    /// Installed or known not to be.
    fn resolved(&self) -> bool {
        self.synced || self.missing
    }

    fn installed(&self) -> bool {
        self.synced && !self.missing
    }
}

/// The served pool's labels, as watched.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
struct PoolLabels {
    /// Listed once, or known missing.
    resolved: bool,
    /// `None`: the pool (or its CRD) is missing: selectors match nothing.
    labels: Option<BTreeMap<String, String>>,
}

type Stores = BTreeMap<Resource, Store>;

/// The resources of `kind` whose objects count, or `None` while one of them has not answered yet.
/// llm-d's rule: any `llm-d.ai` version installed → only `llm-d.ai`; else the legacy group.
fn in_use(stores: &Stores, kind: Kind) -> Option<Vec<Resource>> {
    let store = |r: &Resource| stores.get(r);
    if kind
        .resources()
        .any(|r| !store(&r).is_some_and(Store::resolved))
    {
        return None;
    }
    let installed: Vec<Resource> = kind
        .resources()
        .filter(|r| store(r).is_some_and(Store::installed))
        .collect();
    let llmd: Vec<Resource> = installed.iter().copied().filter(|r| r.is_llmd()).collect();
    Some(if llmd.is_empty() { installed } else { llmd })
}

/// Objectives of the resources in use: per name, the first resource (precedence order) whose form
/// of the object targets the pool wins.
fn objectives(stores: &Stores, used: &[Resource], pool: &PoolLabels, name: &str) -> Vec<Objective> {
    let mut out: BTreeMap<&str, Objective> = BTreeMap::new();
    for store in used.iter().filter_map(|r| stores.get(r)) {
        for (object, c) in &store.objects {
            if out.contains_key(object.as_str()) {
                continue;
            }
            if let Some(o) = c
                .objective
                .as_ref()
                .filter(|o| o.applies(pool.labels.as_ref()))
            {
                out.insert(object, o.objective(name));
            }
        }
    }
    out.into_values().collect()
}

/// Rules of the resources in use, oldest object first (GIE: "Timestamp Wins"); an object without
/// a timestamp sorts last.
fn rules(stores: &Stores, used: &[Resource]) -> Vec<RewriteRule> {
    let mut rules: Vec<(&Option<Time>, Resource, &str, &[RewriteRule])> = Vec::new();
    for resource in used {
        let Some(store) = stores.get(resource) else {
            continue;
        };
        for (name, c) in &store.objects {
            if !c.rules.is_empty() {
                rules.push((&c.created, *resource, name, &c.rules));
            }
        }
    }
    rules.sort_by(|a, b| (a.0.is_none(), a.0, a.1, a.2).cmp(&(b.0.is_none(), b.0, b.1, b.2)));
    rules
        .into_iter()
        .flat_map(|r| r.3.iter().cloned())
        .collect()
}

/// The content of the resources in use, and which those are per kind.
fn content(stores: &Stores, pool: &PoolLabels, pool_name: &str) -> (ClusterContent, InUse) {
    let mut used: InUse = BTreeMap::new();
    let mut out = ClusterContent::default();
    if let Some(r) = in_use(stores, Kind::Objective).filter(|_| pool.resolved) {
        out.objectives = objectives(stores, &r, pool, pool_name);
        used.insert(Kind::Objective, r);
    }
    if let Some(r) = in_use(stores, Kind::Rewrite) {
        out.rules = rules(stores, &r);
        used.insert(Kind::Rewrite, r);
    }
    (out, used)
}

/// Per decided kind, the resources whose objects count.
type InUse = BTreeMap<Kind, Vec<Resource>>;

/// Logs and exports a change of the resources in use.
fn report_in_use(previous: &InUse, now: &InUse, gauge: Option<&prometheus::IntGaugeVec>) {
    for kind in Kind::ALL {
        let Some(used) = now.get(&kind).filter(|u| previous.get(&kind) != Some(*u)) else {
            continue;
        };
        let names: Vec<String> = used.iter().map(|r| r.api_version()).collect();
        let ignored: Vec<String> = kind
            .resources()
            .filter(|r| !used.contains(r))
            .map(|r| r.api_version())
            .collect();
        tracing::info!(kind = kind.name(), in_use = ?names, not_used = ?ignored, "flow-policy CRD versions in use (llm-d.ai wins over inference.networking.x-k8s.io when both are installed)");
        if let Some(g) = gauge {
            for r in kind.resources() {
                g.with_label_values(&[kind.name(), &r.api_version()])
                    .set(i64::from(used.contains(&r)));
            }
        }
    }
}

/// The status code of an API error answer, if the failure was one.
fn api_code(err: &watcher::Error) -> Option<u16> {
    match err {
        watcher::Error::InitialListFailed(kube::Error::Api(s))
        | watcher::Error::WatchStartFailed(kube::Error::Api(s))
        | watcher::Error::WatchFailed(kube::Error::Api(s)) => Some(s.code),
        watcher::Error::WatchError(s) => Some(s.code),
        _ => None,
    }
}

/// 404 (the CRD is not installed) or 403 (no RBAC to read it).
fn means_missing(err: &watcher::Error) -> bool {
    matches!(api_code(err), Some(404 | 403))
}

/// Where an event came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Crd(Resource),
    Pool,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Crd(r) => r.fmt(f),
            Source::Pool => f.write_str("inferencepools.inference.networking.k8s.io/v1"),
        }
    }
}

type Events = BoxStream<'static, (Source, Result<Event<DynamicObject>, watcher::Error>)>;

fn events(api: Api<DynamicObject>, config: watcher::Config, source: Source) -> Events {
    watcher::watcher(api, config)
        .default_backoff()
        .modify(|o: &mut DynamicObject| o.managed_fields_mut().clear())
        .map(move |e| (source, e))
        .boxed()
}

fn api(client: &Client, namespace: &str, ar: &ApiResource) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), namespace, ar)
}

/// Applies one event to a resource's store; whether the store's visible state changed.
fn apply_crd(
    store: &mut Store,
    resource: Resource,
    event: Event<DynamicObject>,
    pool: &str,
) -> bool {
    match event {
        Event::Init => {
            store.buffer = Some(BTreeMap::new());
            false
        }
        Event::InitApply(o) => {
            let c = contribution(resource, &o, pool);
            store
                .buffer
                .get_or_insert_with(BTreeMap::new)
                .insert(o.name_any(), c);
            false
        }
        Event::InitDone => {
            store.objects = store.buffer.take().unwrap_or_default();
            store.synced = true;
            store.missing = false;
            true
        }
        Event::Apply(o) => {
            let c = contribution(resource, &o, pool);
            store.objects.insert(o.name_any(), c);
            store.synced || reappeared(store)
        }
        Event::Delete(o) => {
            store.objects.remove(&o.name_any());
            store.synced || reappeared(store)
        }
    }
}

/// A watch resumed after a 404 delivers events again: the CRD is back (its objects arrive as
/// events from the resumed resourceVersion, all of them created after it).
fn reappeared(store: &mut Store) -> bool {
    if !store.missing {
        return false;
    }
    store.missing = false;
    store.synced = true;
    true
}

/// Applies one event to the pool's labels; whether they changed.
fn apply_pool(
    pool: &mut PoolLabels,
    buffer: &mut Option<DynamicObject>,
    event: Event<DynamicObject>,
) -> bool {
    let before = pool.clone();
    match event {
        Event::Init => *buffer = None,
        Event::InitApply(o) => *buffer = Some(o),
        Event::InitDone => {
            pool.labels = buffer.take().map(|o| o.labels().clone());
            pool.resolved = true;
        }
        Event::Apply(o) => pool.labels = Some(o.labels().clone()),
        Event::Delete(_) => pool.labels = None,
    }
    *pool != before
}

/// Records a failed watch: logs it (warn once, then debug) and, on 404 / 403, marks the source
/// missing. Whether the visible state changed.
fn failed(state: &mut State, source: Source, err: &watcher::Error, namespace: &str) -> bool {
    let missing = means_missing(err);
    let failing = match source {
        Source::Crd(r) => state.stores.get_mut(&r).map(|s| &mut s.failing),
        Source::Pool => Some(&mut state.pool_failing),
    };
    if let Some(failing) = failing {
        if *failing {
            tracing::debug!(%source, %err, "flow-policy watch still failing; retrying");
        } else {
            tracing::warn!(%source, %err, %namespace, missing, "flow-policy watch failed (CRD not installed, or no RBAC?); retrying with backoff");
            *failing = true;
        }
    }
    if !missing {
        return false;
    }
    match source {
        Source::Crd(r) => {
            let Some(store) = state.stores.get_mut(&r) else {
                return false;
            };
            let was = (store.missing, store.synced, store.objects.is_empty());
            store.missing = true;
            store.synced = false;
            store.buffer = None;
            store.objects.clear();
            was != (true, false, true)
        }
        Source::Pool => {
            let before = state.pool.clone();
            state.pool = PoolLabels {
                resolved: true,
                labels: None,
            };
            state.pool != before
        }
    }
}

#[derive(Default)]
struct State {
    stores: Stores,
    pool: PoolLabels,
    pool_buffer: Option<DynamicObject>,
    pool_failing: bool,
    in_use: InUse,
}

/// Runs the source until every receiver of `tx` is gone.
pub async fn run(client: Client, config: FlowKubeConfig, tx: watch::Sender<ClusterContent>) {
    let ns = config.namespace.as_str();
    let pool_watch = watcher::Config::default().fields(&format!("metadata.name={}", config.pool));
    let mut all = stream::select_all(
        Resource::ALL
            .into_iter()
            .map(|r| {
                events(
                    api(&client, ns, &r.api_resource()),
                    watcher::Config::default(),
                    Source::Crd(r),
                )
            })
            .chain([events(
                api(&client, ns, &pool_api_resource()),
                pool_watch,
                Source::Pool,
            )]),
    );
    let mut state = State {
        stores: Resource::ALL
            .into_iter()
            .map(|r| (r, Store::default()))
            .collect(),
        ..State::default()
    };
    loop {
        let (source, event) = tokio::select! {
            next = all.next() => match next {
                Some(e) => e,
                None => return,
            },
            _ = tx.closed() => return,
        };
        let changed = match event {
            Err(err) => failed(&mut state, source, &err, ns),
            Ok(event) => {
                let failing = match source {
                    Source::Crd(r) => state.stores.get_mut(&r).map(|s| &mut s.failing),
                    Source::Pool => Some(&mut state.pool_failing),
                };
                if failing.is_some_and(std::mem::take) {
                    tracing::info!(%source, "flow-policy watch recovered");
                }
                match source {
                    Source::Crd(r) => state
                        .stores
                        .get_mut(&r)
                        .is_some_and(|s| apply_crd(s, r, event, &config.pool)),
                    Source::Pool => apply_pool(&mut state.pool, &mut state.pool_buffer, event),
                }
            }
        };
        if changed {
            publish(&mut state, &config, &tx);
        }
    }
}

fn publish(state: &mut State, config: &FlowKubeConfig, tx: &watch::Sender<ClusterContent>) {
    let (next, used) = content(&state.stores, &state.pool, &config.pool);
    report_in_use(&state.in_use, &used, config.in_use.as_ref());
    state.in_use = used;
    tx.send_if_modified(|current| {
        if *current == next {
            return false;
        }
        tracing::info!(
            objectives = next.objectives.len(),
            rewrite_rules = next.rules.len(),
            "flow policy from Kubernetes changed"
        );
        *current = next;
        true
    });
}

#[cfg(test)]
#[path = "kube_tests.rs"]
mod tests;
