//! The Kubernetes flow-policy source: watches InferenceObjective in both groups
//! (`inference.networking.x-k8s.io/v1alpha2`, `llm-d.ai/v1alpha2`) and InferenceModelRewrite (same
//! two groups) in one namespace, keeps the objects whose pool reference names the InferencePool
//! kvpick serves, and publishes their objectives and rules ([`ClusterContent`]) into a `watch`
//! channel that [`super::source`] merges with the `--flow-config` file.
//!
//! Same reflector machinery as the catalog source (`catalog::kube`): kube-rs `watcher` with the
//! default backoff, `managed_fields` dropped, a full relist on 410 Gone (the watcher's
//! `Init`..`InitDone` replaces the resource's state at once). The objects are read as
//! `DynamicObject`s (no CRD types to register) and their `spec` parsed leniently: unknown fields are
//! ignored, an object whose spec does not parse is skipped with a warning. A resource whose CRD is
//! not installed (404) or not readable (403) never crashes anything: the watcher retries with
//! kube-rs' default backoff (0.8 s doubling to 30 s, jittered), the first failure is logged at warn and the rest at debug, and that resource simply
//! contributes nothing until it lists. Nothing is published for a resource before its first full
//! list; the others publish independently.
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
use serde::Deserialize;
use tokio::sync::watch;

use super::{Objective, Origin, RewriteRule};

/// Group of the Gateway API Inference Extension's alpha resources.
pub const GIE_GROUP: &str = "inference.networking.x-k8s.io";
/// llm-d's group.
pub const LLMD_GROUP: &str = "llm-d.ai";
/// Version watched in both groups.
pub const VERSION: &str = "v1alpha2";
/// Groups an InferencePool reference may name for the pool kvpick serves (an empty or absent group
/// defaults to `inference.networking.k8s.io`).
pub const POOL_GROUPS: [&str; 4] = [
    "inference.networking.k8s.io",
    "inference.networking.x-k8s.io",
    "llm-d.ai",
    "",
];

/// What the source watches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowKubeConfig {
    pub namespace: String,
    /// The InferencePool kvpick serves: only objects whose poolRef names it count.
    pub pool: String,
}

/// The watched resources' contribution to the policy, in precedence order: GIE objectives, then
/// llm-d objectives (a later objective of the same name wins); rules oldest resource first.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ClusterContent {
    pub objectives: Vec<Objective>,
    pub rules: Vec<RewriteRule>,
}

/// One watched resource type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Resource {
    GieObjective,
    LlmdObjective,
    GieRewrite,
    LlmdRewrite,
}

impl Resource {
    pub const ALL: [Resource; 4] = [
        Resource::GieObjective,
        Resource::LlmdObjective,
        Resource::GieRewrite,
        Resource::LlmdRewrite,
    ];

    fn group(self) -> &'static str {
        match self {
            Resource::GieObjective | Resource::GieRewrite => GIE_GROUP,
            Resource::LlmdObjective | Resource::LlmdRewrite => LLMD_GROUP,
        }
    }

    fn origin(self) -> Origin {
        match self {
            Resource::GieObjective | Resource::GieRewrite => Origin::Gie,
            Resource::LlmdObjective | Resource::LlmdRewrite => Origin::LlmD,
        }
    }

    fn is_objective(self) -> bool {
        matches!(self, Resource::GieObjective | Resource::LlmdObjective)
    }

    /// The kube-rs description of the resource (group, version, kind, plural).
    pub fn api_resource(self) -> ApiResource {
        let (kind, plural) = if self.is_objective() {
            ("InferenceObjective", "inferenceobjectives")
        } else {
            ("InferenceModelRewrite", "inferencemodelrewrites")
        };
        ApiResource {
            group: self.group().into(),
            version: VERSION.into(),
            api_version: format!("{}/{VERSION}", self.group()),
            kind: kind.into(),
            plural: plural.into(),
        }
    }
}

impl std::fmt::Display for Resource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ar = self.api_resource();
        write!(f, "{}.{}", ar.plural, ar.group)
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct PoolRef {
    #[serde(default)]
    group: Option<String>,
    #[serde(default)]
    kind: Option<String>,
    #[serde(default)]
    name: String,
}

impl PoolRef {
    fn names(&self, pool: &str) -> bool {
        self.name == pool
            && self
                .kind
                .as_deref()
                .is_none_or(|k| k.is_empty() || k == "InferencePool")
            && POOL_GROUPS.contains(&self.group.as_deref().unwrap_or(""))
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct ObjectiveSpec {
    #[serde(default)]
    priority: Option<i32>,
    #[serde(default)]
    pool_ref: Option<PoolRef>,
    /// llm-d.ai only.
    #[serde(default)]
    pool_refs: Vec<PoolRef>,
    /// llm-d.ai only; not evaluated (no pool labels here).
    #[serde(default)]
    pool_selector: Option<serde_json::Value>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct RewriteSpec {
    #[serde(default)]
    pool_ref: Option<PoolRef>,
    #[serde(default)]
    rules: Vec<RuleSpec>,
}

#[derive(Debug, Default, Deserialize)]
struct RuleSpec {
    #[serde(default)]
    matches: Vec<MatchSpec>,
    #[serde(default)]
    targets: Vec<TargetSpec>,
}

#[derive(Debug, Default, Deserialize)]
struct MatchSpec {
    #[serde(default)]
    model: Option<ModelMatch>,
}

#[derive(Debug, Default, Deserialize)]
struct ModelMatch {
    #[serde(default, rename = "type")]
    kind: Option<String>,
    value: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
struct TargetSpec {
    #[serde(default)]
    weight: Option<i64>,
    model_rewrite: String,
}

fn spec<T: serde::de::DeserializeOwned + Default>(obj: &DynamicObject) -> Result<T, String> {
    match obj.data.get("spec") {
        None => Ok(T::default()),
        Some(v) => serde_json::from_value(v.clone()).map_err(|e| e.to_string()),
    }
}

/// The objective an InferenceObjective object contributes, if it targets `pool`.
pub fn objective_from(
    resource: Resource,
    obj: &DynamicObject,
    pool: &str,
) -> Result<Option<Objective>, String> {
    let spec: ObjectiveSpec = spec(obj)?;
    let targets = spec
        .pool_ref
        .iter()
        .chain(&spec.pool_refs)
        .any(|r| r.names(pool));
    if !targets {
        if spec.pool_selector.is_some() && spec.pool_ref.is_none() && spec.pool_refs.is_empty() {
            tracing::warn!(objective = %obj.name_any(), "InferenceObjective targets pools by poolSelector only, which kvpick does not evaluate: ignored");
        }
        return Ok(None);
    }
    Ok(Some(Objective {
        name: obj.name_any(),
        priority: spec.priority.unwrap_or(0),
        pool: Some(pool.to_string()),
        origin: resource.origin(),
    }))
}

/// The rules an InferenceModelRewrite object contributes, if it targets `pool`. A rule with a
/// match type other than `Exact`, or with targets whose weights are set for some but not all,
/// is skipped (never widened to a wildcard).
pub fn rules_from(obj: &DynamicObject, pool: &str) -> Result<Vec<RewriteRule>, String> {
    let spec: RewriteSpec = spec(obj)?;
    if !spec.pool_ref.as_ref().is_some_and(|r| r.names(pool)) {
        return Ok(Vec::new());
    }
    let who = format!("{}/{}", obj.namespace().unwrap_or_default(), obj.name_any());
    let mut out = Vec::new();
    for (i, rule) in spec.rules.into_iter().enumerate() {
        let source = format!("{who}#{i}");
        let mut matches = Vec::with_capacity(rule.matches.len());
        let mut unsupported = false;
        for m in rule.matches {
            match m.model {
                Some(ModelMatch { kind, value })
                    if kind.as_deref().is_none_or(|k| k == "Exact") =>
                {
                    matches.push(value)
                }
                _ => unsupported = true,
            }
        }
        if unsupported {
            tracing::warn!(rule = %source, "rewrite rule with a match kvpick does not support (only model Exact): skipped");
            continue;
        }
        let targets = rule.targets.into_iter().map(|t| {
            let weight = t.weight.map(|w| u32::try_from(w).unwrap_or(0));
            (t.model_rewrite, weight)
        });
        match super::static_file::weights(targets) {
            Ok(targets) => out.push(RewriteRule {
                source,
                matches,
                targets,
            }),
            Err(err) => tracing::warn!(rule = %source, %err, "invalid rewrite rule skipped"),
        }
    }
    Ok(out)
}

/// What one object contributes, parsed (and any problem logged) once, when it arrives.
#[derive(Debug, Clone, Default)]
struct Contribution {
    created: Option<Time>,
    objective: Option<Objective>,
    rules: Vec<RewriteRule>,
}

fn contribution(resource: Resource, obj: &DynamicObject, pool: &str) -> Contribution {
    let mut out = Contribution {
        created: obj.metadata.creation_timestamp.clone(),
        ..Contribution::default()
    };
    if resource.is_objective() {
        match objective_from(resource, obj, pool) {
            Ok(o) => out.objective = o,
            Err(err) => {
                tracing::warn!(%resource, object = %obj.name_any(), %err, "invalid InferenceObjective skipped")
            }
        }
    } else {
        match rules_from(obj, pool) {
            Ok(r) => out.rules = r,
            Err(err) => {
                tracing::warn!(%resource, object = %obj.name_any(), %err, "invalid InferenceModelRewrite skipped")
            }
        }
    }
    out
}

/// The objects of one resource as last listed and watched, by name.
#[derive(Default)]
struct Store {
    synced: bool,
    objects: BTreeMap<String, Contribution>,
    buffer: Option<BTreeMap<String, Contribution>>,
    failing: bool,
}

/// The content of every synced store.
fn content(stores: &BTreeMap<Resource, Store>) -> ClusterContent {
    let mut out = ClusterContent::default();
    let mut rules: Vec<(&Option<Time>, Resource, &str, &[RewriteRule])> = Vec::new();
    for (resource, store) in stores.iter().filter(|(_, s)| s.synced) {
        for (name, c) in &store.objects {
            out.objectives.extend(c.objective.iter().cloned());
            if !c.rules.is_empty() {
                rules.push((&c.created, *resource, name, &c.rules));
            }
        }
    }
    // Oldest resource first (GIE: "Timestamp Wins"); an object without a timestamp sorts last.
    rules.sort_by(|a, b| (a.0.is_none(), a.0, a.1, a.2).cmp(&(b.0.is_none(), b.0, b.1, b.2)));
    out.rules = rules
        .into_iter()
        .flat_map(|r| r.3.iter().cloned())
        .collect();
    out
}

type Events = BoxStream<'static, (Resource, Result<Event<DynamicObject>, watcher::Error>)>;

fn events(client: &Client, namespace: &str, resource: Resource) -> Events {
    let api: Api<DynamicObject> =
        Api::namespaced_with(client.clone(), namespace, &resource.api_resource());
    watcher::watcher(api, watcher::Config::default())
        .default_backoff()
        .modify(|o: &mut DynamicObject| o.managed_fields_mut().clear())
        .map(move |e| (resource, e))
        .boxed()
}

/// Runs the source until every receiver of `tx` is gone.
pub async fn run(client: Client, config: FlowKubeConfig, tx: watch::Sender<ClusterContent>) {
    let mut all = stream::select_all(
        Resource::ALL
            .into_iter()
            .map(|r| events(&client, &config.namespace, r)),
    );
    let mut stores: BTreeMap<Resource, Store> = Resource::ALL
        .into_iter()
        .map(|r| (r, Store::default()))
        .collect();
    loop {
        let (resource, event) = tokio::select! {
            next = all.next() => match next {
                Some(e) => e,
                None => return,
            },
            _ = tx.closed() => return,
        };
        let Some(store) = stores.get_mut(&resource) else {
            continue;
        };
        let event = match event {
            Ok(e) => e,
            Err(err) => {
                if store.failing {
                    tracing::debug!(%resource, %err, "flow-policy watch still failing; retrying");
                } else {
                    tracing::warn!(%resource, %err, namespace = %config.namespace, "flow-policy watch failed (CRD not installed, or no RBAC?); keeping the last state, retrying with backoff");
                    store.failing = true;
                }
                continue;
            }
        };
        if std::mem::take(&mut store.failing) {
            tracing::info!(%resource, "flow-policy watch recovered");
        }
        let changed = match event {
            Event::Init => {
                store.buffer = Some(BTreeMap::new());
                false
            }
            Event::InitApply(o) => {
                let c = contribution(resource, &o, &config.pool);
                store
                    .buffer
                    .get_or_insert_with(BTreeMap::new)
                    .insert(o.name_any(), c);
                false
            }
            Event::InitDone => {
                store.objects = store.buffer.take().unwrap_or_default();
                store.synced = true;
                true
            }
            Event::Apply(o) => {
                let c = contribution(resource, &o, &config.pool);
                store.objects.insert(o.name_any(), c);
                store.synced
            }
            Event::Delete(o) => {
                store.objects.remove(&o.name_any());
                store.synced
            }
        };
        if changed {
            let next = content(&stores);
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
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(resource: Resource, name: &str, spec: serde_json::Value) -> DynamicObject {
        let ar = resource.api_resource();
        serde_json::from_value(serde_json::json!({
            "apiVersion": ar.api_version, "kind": ar.kind,
            "metadata": {"name": name, "namespace": "ns"},
            "spec": spec,
        }))
        .unwrap()
    }

    #[test]
    fn objectives_follow_pool_refs() {
        let gie = |spec| {
            objective_from(
                Resource::GieObjective,
                &obj(Resource::GieObjective, "o", spec),
                "pool",
            )
        };
        let o = gie(serde_json::json!({"priority": 7, "poolRef": {"name": "pool"}}))
            .unwrap()
            .unwrap();
        assert_eq!(
            (o.priority, o.origin, o.pool.as_deref()),
            (7, Origin::Gie, Some("pool"))
        );
        assert_eq!(
            gie(serde_json::json!({"poolRef": {"name": "pool", "group": "inference.networking.k8s.io", "kind": "InferencePool"}}))
                .unwrap()
                .unwrap()
                .priority,
            0,
            "unset priority is 0"
        );
        assert_eq!(
            gie(serde_json::json!({"priority": 7, "poolRef": {"name": "other"}})).unwrap(),
            None
        );
        assert_eq!(
            gie(serde_json::json!({"poolRef": {"name": "pool", "kind": "Service"}})).unwrap(),
            None
        );
        assert!(gie(serde_json::json!({"priority": "high", "poolRef": {"name": "pool"}})).is_err());
        assert!(
            gie(serde_json::json!({"priority": 3000000000i64, "poolRef": {"name": "pool"}}))
                .is_err()
        );
        let llmd = |spec| {
            objective_from(
                Resource::LlmdObjective,
                &obj(Resource::LlmdObjective, "o", spec),
                "pool",
            )
        };
        let o = llmd(serde_json::json!({"priority": -1, "poolRefs": [{"name": "x"}, {"name": "pool", "group": "llm-d.ai"}]}))
            .unwrap()
            .unwrap();
        assert_eq!((o.priority, o.origin), (-1, Origin::LlmD));
        assert_eq!(
            llmd(serde_json::json!({"priority": 1, "poolSelector": {"matchLabels": {"a": "b"}}}))
                .unwrap(),
            None,
            "poolSelector is not evaluated"
        );
    }

    #[test]
    fn rewrite_rules_parse_and_skip_what_they_cannot_honour() {
        let rw = |spec| rules_from(&obj(Resource::GieRewrite, "rw", spec), "pool");
        let rules = rw(serde_json::json!({
            "poolRef": {"group": "inference.networking.k8s.io", "name": "pool"},
            "rules": [
                {"matches": [{"model": {"type": "Exact", "value": "a"}}, {"model": {"value": "b"}}],
                 "targets": [{"modelRewrite": "a1", "weight": 3}, {"modelRewrite": "a2", "weight": 1}]},
                {"targets": [{"modelRewrite": "fallback"}]},
                {"matches": [{"model": {"type": "Prefix", "value": "c"}}], "targets": [{"modelRewrite": "x"}]},
                {"matches": [{"model": {"value": "d"}}], "targets": [{"modelRewrite": "x", "weight": 2}, {"modelRewrite": "y"}]},
            ],
        }))
        .unwrap();
        assert_eq!(rules.len(), 2, "{rules:?}");
        assert_eq!(rules[0].matches, ["a", "b"]);
        assert_eq!(
            rules[0]
                .targets
                .iter()
                .map(|t| t.weight)
                .collect::<Vec<_>>(),
            [3, 1]
        );
        assert_eq!(rules[0].source, "ns/rw#0");
        assert!(rules[1].matches.is_empty());
        assert_eq!(rules[1].targets[0].weight, 1);
        assert!(rw(serde_json::json!({"poolRef": {"name": "other"}, "rules": [{"targets": [{"modelRewrite": "x"}]}]}))
            .unwrap()
            .is_empty());
        assert!(
            rw(serde_json::json!({"rules": [{"targets": [{"modelRewrite": "x"}]}]}))
                .unwrap()
                .is_empty(),
            "no poolRef: not ours"
        );
    }

    #[test]
    fn content_orders_objectives_and_rules() {
        let mut stores: BTreeMap<Resource, Store> = Resource::ALL
            .into_iter()
            .map(|r| (r, Store::default()))
            .collect();
        let put = |stores: &mut BTreeMap<Resource, Store>, r: Resource, o: DynamicObject| {
            let s = stores.get_mut(&r).unwrap();
            s.synced = true;
            s.objects.insert(o.name_any(), contribution(r, &o, "pool"));
        };
        put(
            &mut stores,
            Resource::GieObjective,
            obj(
                Resource::GieObjective,
                "same",
                serde_json::json!({"priority": 1, "poolRef": {"name": "pool"}}),
            ),
        );
        put(
            &mut stores,
            Resource::LlmdObjective,
            obj(
                Resource::LlmdObjective,
                "same",
                serde_json::json!({"priority": 2, "poolRef": {"name": "pool"}}),
            ),
        );
        let mut newer = obj(
            Resource::GieRewrite,
            "newer",
            serde_json::json!({"poolRef": {"name": "pool"}, "rules": [{"matches": [{"model": {"value": "m"}}], "targets": [{"modelRewrite": "new"}]}]}),
        );
        newer.metadata.creation_timestamp =
            Some(serde_json::from_value(serde_json::json!("2025-02-01T00:00:00Z")).unwrap());
        let mut older = obj(
            Resource::LlmdRewrite,
            "older",
            serde_json::json!({"poolRef": {"name": "pool"}, "rules": [{"matches": [{"model": {"value": "m"}}], "targets": [{"modelRewrite": "old"}]}]}),
        );
        older.metadata.creation_timestamp =
            Some(serde_json::from_value(serde_json::json!("2025-01-01T00:00:00Z")).unwrap());
        put(&mut stores, Resource::GieRewrite, newer);
        put(&mut stores, Resource::LlmdRewrite, older);
        let c = content(&stores);
        let policy = super::super::FlowPolicy::new(c.objectives.clone(), c.rules.clone());
        assert_eq!(
            policy.objective("same").unwrap().priority,
            2,
            "llm-d.ai wins over the GIE group"
        );
        assert_eq!(
            policy.rewrite("m", 0).as_deref(),
            Some("old"),
            "the oldest resource's rule wins"
        );
        stores.get_mut(&Resource::LlmdRewrite).unwrap().synced = false;
        let c = content(&stores);
        assert_eq!(c.rules.len(), 1, "an unsynced resource contributes nothing");
    }
}
