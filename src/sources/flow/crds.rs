//! The flow-policy custom resources kvpick reads, as llm-d-router and the Gateway API Inference
//! Extension serve them: which group/versions exist ([`Resource`]), how each object's `spec` parses
//! into kvpick's internal form (an [`ObjectiveCandidate`] or [`RewriteRule`]s), and how an
//! objective decides whether it targets the served pool (`poolRef`, `poolRefs` or `poolSelector`
//! against the pool's labels).
//!
//! Pure values and functions: no I/O, no watch, no choice between groups — the reflector
//! ([`super::kube`]) owns those. It must not touch the selection core or the catalog.
//!
//! Parsing is lenient, as one field set for every served version: unknown fields are ignored, so
//! `llm-d.ai/v1` (`poolRefs`, `poolSelector`), `llm-d.ai/v1alpha2` (`poolRef`, and in newer
//! llm-d-router builds also `poolRefs` / `poolSelector`) and `inference.networking.x-k8s.io/v1alpha2`
//! (`poolRef`) objects all parse with the same types.

use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use kube::core::{ApiResource, DynamicObject, Selector, SelectorExt};
use kube::ResourceExt;
use serde::Deserialize;

use super::{Objective, Origin, RewriteRule};

/// Group of the Gateway API Inference Extension's alpha resources (the legacy group).
pub const GIE_GROUP: &str = "inference.networking.x-k8s.io";
/// llm-d's group (llm-d-router `config/crd`).
pub const LLMD_GROUP: &str = "llm-d.ai";
/// The InferencePool kvpick serves (`catalog::kube`): its labels are what `poolSelector` matches.
pub const POOL_GROUP: &str = "inference.networking.k8s.io";
pub const POOL_VERSION: &str = "v1";
/// Groups a pool reference may name for the pool kvpick serves (an empty or absent group is the
/// pool's own group). llm-d compares the group with its pool's exactly; kvpick also accepts the
/// groups an older manifest may carry (the CRDs' defaults: `llm-d.ai` in llm-d's, the pool group
/// in GIE's).
pub const POOL_GROUPS: [&str; 4] = [POOL_GROUP, GIE_GROUP, LLMD_GROUP, ""];
/// Most entries of `poolRefs` read (llm-d v1: `MaxItems=16`); the rest are ignored.
pub const MAX_POOL_REFS: usize = 16;

/// Which of the two custom resources.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Objective,
    Rewrite,
}

impl Kind {
    pub const ALL: [Kind; 2] = [Kind::Objective, Kind::Rewrite];

    pub fn name(self) -> &'static str {
        match self {
            Kind::Objective => "InferenceObjective",
            Kind::Rewrite => "InferenceModelRewrite",
        }
    }

    fn plural(self) -> &'static str {
        match self {
            Kind::Objective => "inferenceobjectives",
            Kind::Rewrite => "inferencemodelrewrites",
        }
    }

    /// The resources serving this kind, in precedence order (llm-d first; within llm-d the newer
    /// version first).
    pub fn resources(self) -> impl Iterator<Item = Resource> {
        Resource::ALL.into_iter().filter(move |r| r.kind() == self)
    }
}

/// One watched group/version of one kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Resource {
    /// `llm-d.ai/v1` InferenceObjective (`poolRefs`, `poolSelector`).
    LlmdObjectiveV1,
    /// `llm-d.ai/v1alpha2` InferenceObjective (llm-d's storage version).
    LlmdObjectiveV1alpha2,
    /// `inference.networking.x-k8s.io/v1alpha2` InferenceObjective (GIE, legacy).
    GieObjective,
    /// `llm-d.ai/v1alpha2` InferenceModelRewrite.
    LlmdRewrite,
    /// `inference.networking.x-k8s.io/v1alpha2` InferenceModelRewrite (GIE, legacy).
    GieRewrite,
}

impl Resource {
    pub const ALL: [Resource; 5] = [
        Resource::LlmdObjectiveV1,
        Resource::LlmdObjectiveV1alpha2,
        Resource::GieObjective,
        Resource::LlmdRewrite,
        Resource::GieRewrite,
    ];

    pub fn kind(self) -> Kind {
        match self {
            Resource::LlmdObjectiveV1
            | Resource::LlmdObjectiveV1alpha2
            | Resource::GieObjective => Kind::Objective,
            Resource::LlmdRewrite | Resource::GieRewrite => Kind::Rewrite,
        }
    }

    pub fn group(self) -> &'static str {
        if self.is_llmd() {
            LLMD_GROUP
        } else {
            GIE_GROUP
        }
    }

    pub fn version(self) -> &'static str {
        match self {
            Resource::LlmdObjectiveV1 => "v1",
            _ => "v1alpha2",
        }
    }

    /// `group/version`.
    pub fn api_version(self) -> String {
        format!("{}/{}", self.group(), self.version())
    }

    pub fn is_llmd(self) -> bool {
        !matches!(self, Resource::GieObjective | Resource::GieRewrite)
    }

    pub fn origin(self) -> Origin {
        if self.is_llmd() {
            Origin::LlmD
        } else {
            Origin::Gie
        }
    }

    /// The kube-rs description of the resource (group, version, kind, plural).
    pub fn api_resource(self) -> ApiResource {
        ApiResource {
            group: self.group().into(),
            version: self.version().into(),
            api_version: self.api_version(),
            kind: self.kind().name().into(),
            plural: self.kind().plural().into(),
        }
    }
}

impl std::fmt::Display for Resource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}.{}/{}",
            self.kind().plural(),
            self.group(),
            self.version()
        )
    }
}

/// The InferencePool resource whose labels `poolSelector` matches.
pub fn pool_api_resource() -> ApiResource {
    ApiResource {
        group: POOL_GROUP.into(),
        version: POOL_VERSION.into(),
        api_version: format!("{POOL_GROUP}/{POOL_VERSION}"),
        kind: "InferencePool".into(),
        plural: "inferencepools".into(),
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
    #[serde(default)]
    pool_refs: Vec<PoolRef>,
    #[serde(default)]
    pool_selector: Option<LabelSelector>,
}

/// An InferenceObjective as parsed, before the pool's labels are known: whether it names the
/// served pool, and the selector it may select pools by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectiveCandidate {
    pub name: String,
    pub priority: i32,
    pub origin: Origin,
    /// `poolRef` or one of `poolRefs` names the served pool.
    pub by_ref: bool,
    /// `poolSelector`, when set (and valid).
    pub selector: Option<Selector>,
}

impl ObjectiveCandidate {
    /// Whether it applies to the served pool, whose labels are `pool_labels` (`None`: the pool is
    /// missing or not readable, and selector matching fails closed, as llm-d's does).
    pub fn applies(&self, pool_labels: Option<&BTreeMap<String, String>>) -> bool {
        self.by_ref
            || self
                .selector
                .as_ref()
                .zip(pool_labels)
                .is_some_and(|(s, labels)| s.matches(labels))
    }

    /// The objective it contributes to the policy for the pool `pool`.
    pub fn objective(&self, pool: &str) -> Objective {
        Objective {
            name: self.name.clone(),
            priority: self.priority,
            pool: Some(pool.to_string()),
            origin: self.origin,
        }
    }
}

fn spec<T: serde::de::DeserializeOwned + Default>(obj: &DynamicObject) -> Result<T, String> {
    match obj.data.get("spec") {
        None => Ok(T::default()),
        Some(v) => serde_json::from_value(v.clone()).map_err(|e| e.to_string()),
    }
}

/// What an InferenceObjective object may contribute for `pool`: `None` when it neither names the
/// pool nor carries a selector (it targets other pools). An invalid selector (an unknown
/// operator, `In` without values) is an error: the object is skipped.
pub fn objective_from(
    resource: Resource,
    obj: &DynamicObject,
    pool: &str,
) -> Result<Option<ObjectiveCandidate>, String> {
    let spec: ObjectiveSpec = spec(obj)?;
    let by_ref = spec
        .pool_ref
        .iter()
        .chain(spec.pool_refs.iter().take(MAX_POOL_REFS))
        .any(|r| r.names(pool));
    let selector = match spec.pool_selector {
        None => None,
        Some(s) => Some(Selector::try_from(s).map_err(|e| format!("poolSelector: {}", e.0))?),
    };
    if !by_ref && selector.is_none() {
        return Ok(None);
    }
    Ok(Some(ObjectiveCandidate {
        name: obj.name_any(),
        priority: spec.priority.unwrap_or(0),
        origin: resource.origin(),
        by_ref,
        selector,
    }))
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

#[cfg(test)]
#[path = "crds_tests.rs"]
mod tests;
