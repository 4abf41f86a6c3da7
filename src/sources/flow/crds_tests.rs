use super::*;
use serde_json::json;

pub(crate) fn obj(resource: Resource, name: &str, spec: serde_json::Value) -> DynamicObject {
    let ar = resource.api_resource();
    serde_json::from_value(json!({
        "apiVersion": ar.api_version, "kind": ar.kind,
        "metadata": {"name": name, "namespace": "ns"},
        "spec": spec,
    }))
    .unwrap()
}

fn candidate(
    resource: Resource,
    spec: serde_json::Value,
) -> Result<Option<ObjectiveCandidate>, String> {
    objective_from(resource, &obj(resource, "o", spec), "pool")
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn every_resource_has_its_group_version_and_plural() {
    let described: Vec<String> = Resource::ALL.iter().map(|r| r.to_string()).collect();
    assert_eq!(
        described,
        [
            "inferenceobjectives.llm-d.ai/v1",
            "inferenceobjectives.llm-d.ai/v1alpha2",
            "inferenceobjectives.inference.networking.x-k8s.io/v1alpha2",
            "inferencemodelrewrites.llm-d.ai/v1alpha2",
            "inferencemodelrewrites.inference.networking.x-k8s.io/v1alpha2",
        ]
    );
    assert_eq!(
        Kind::Objective.resources().collect::<Vec<_>>(),
        [
            Resource::LlmdObjectiveV1,
            Resource::LlmdObjectiveV1alpha2,
            Resource::GieObjective
        ],
        "llm-d first, its newer version first"
    );
    assert_eq!(
        Resource::LlmdObjectiveV1.api_resource().kind,
        "InferenceObjective"
    );
    assert_eq!(
        pool_api_resource().api_version,
        "inference.networking.k8s.io/v1"
    );
}

#[test]
fn each_version_parses_its_pool_reference_shape() {
    // GIE v1alpha2: poolRef.
    let o = candidate(
        Resource::GieObjective,
        json!({"priority": 7, "poolRef": {"name": "pool"}}),
    )
    .unwrap()
    .unwrap();
    assert_eq!((o.priority, o.origin, o.by_ref), (7, Origin::Gie, true));
    assert_eq!(o.objective("pool").pool.as_deref(), Some("pool"));
    // llm-d v1alpha2: poolRef, the CRD's default group llm-d.ai.
    let o = candidate(
        Resource::LlmdObjectiveV1alpha2,
        json!({"poolRef": {"group": "llm-d.ai", "kind": "InferencePool", "name": "pool"}}),
    )
    .unwrap()
    .unwrap();
    assert_eq!(
        (o.priority, o.origin),
        (0, Origin::LlmD),
        "unset priority is 0"
    );
    // llm-d v1: poolRefs (any entry).
    let o = candidate(
        Resource::LlmdObjectiveV1,
        json!({"priority": -1, "poolRefs": [{"name": "x"}, {"name": "pool", "group": "inference.networking.k8s.io"}]}),
    )
    .unwrap()
    .unwrap();
    assert_eq!((o.priority, o.by_ref, o.selector), (-1, true, None));
    // Other pools, other kinds, other groups: not ours.
    for spec in [
        json!({"priority": 7, "poolRef": {"name": "other"}}),
        json!({"poolRef": {"name": "pool", "kind": "Service"}}),
        json!({"poolRefs": [{"name": "pool", "group": "example.com"}]}),
        json!({"priority": 1}),
    ] {
        assert_eq!(
            candidate(Resource::LlmdObjectiveV1, spec.clone()).unwrap(),
            None,
            "{spec}"
        );
    }
    // Bad values are errors (the object is skipped), never a panic.
    assert!(candidate(
        Resource::GieObjective,
        json!({"priority": "high", "poolRef": {"name": "pool"}})
    )
    .is_err());
    assert!(candidate(
        Resource::GieObjective,
        json!({"priority": 3000000000i64, "poolRef": {"name": "pool"}})
    )
    .is_err());
    // Old GIE fields (criticality, modelName) are ignored.
    assert!(candidate(
        Resource::GieObjective,
        json!({"criticality": "Critical", "modelName": "m", "poolRef": {"name": "pool"}})
    )
    .unwrap()
    .is_some());
}

#[test]
fn pool_refs_beyond_the_limit_are_ignored() {
    let refs = |n: usize| -> Vec<serde_json::Value> {
        let mut v: Vec<_> = (0..n - 1)
            .map(|i| json!({"name": format!("p{i}")}))
            .collect();
        v.push(json!({"name": "pool"}));
        v
    };
    let at = candidate(
        Resource::LlmdObjectiveV1,
        json!({"poolRefs": refs(MAX_POOL_REFS)}),
    )
    .unwrap();
    assert!(at.is_some_and(|o| o.by_ref));
    let over = candidate(
        Resource::LlmdObjectiveV1,
        json!({"poolRefs": refs(MAX_POOL_REFS + 1)}),
    )
    .unwrap();
    assert_eq!(over, None, "the 17th entry is not read");
}

#[test]
fn pool_selectors_match_the_pool_labels_or_fail_closed() {
    let sel = |selector: serde_json::Value| {
        candidate(
            Resource::LlmdObjectiveV1,
            json!({"priority": 5, "poolSelector": selector}),
        )
        .unwrap()
        .unwrap()
    };
    let tier = sel(json!({"matchLabels": {"tier": "gold"}}));
    assert!(!tier.by_ref);
    assert!(tier.applies(Some(&labels(&[("tier", "gold"), ("x", "y")]))));
    assert!(!tier.applies(Some(&labels(&[("tier", "silver")]))));
    assert!(!tier.applies(Some(&labels(&[]))));
    assert!(!tier.applies(None), "no pool: fails closed");
    let exprs = sel(json!({"matchExpressions": [
        {"key": "tier", "operator": "In", "values": ["gold", "silver"]},
        {"key": "region", "operator": "NotIn", "values": ["eu"]},
        {"key": "gpu", "operator": "Exists"},
        {"key": "spot", "operator": "DoesNotExist"},
    ]}));
    assert!(exprs.applies(Some(&labels(&[("tier", "silver"), ("gpu", "h100")]))));
    assert!(!exprs.applies(Some(&labels(&[
        ("tier", "silver"),
        ("gpu", "h100"),
        ("region", "eu")
    ]))));
    assert!(!exprs.applies(Some(&labels(&[
        ("tier", "silver"),
        ("gpu", "h100"),
        ("spot", "")
    ]))));
    assert!(!exprs.applies(Some(&labels(&[("tier", "bronze"), ("gpu", "h100")]))));
    // A reference wins without labels; a selector alongside a matching ref still applies.
    let both = candidate(
        Resource::LlmdObjectiveV1,
        json!({"poolRefs": [{"name": "pool"}], "poolSelector": {"matchLabels": {"a": "b"}}}),
    )
    .unwrap()
    .unwrap();
    assert!(both.applies(None));
    // An invalid selector skips the object.
    let bad = candidate(
        Resource::LlmdObjectiveV1,
        json!({"poolSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}}),
    );
    assert!(bad.unwrap_err().contains("poolSelector"));
    let bad = candidate(
        Resource::LlmdObjectiveV1alpha2,
        json!({"poolSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}),
    );
    assert!(bad.is_err(), "In without values");
}

#[test]
fn rewrite_rules_parse_and_skip_what_they_cannot_honour() {
    let rw = |spec| rules_from(&obj(Resource::GieRewrite, "rw", spec), "pool");
    let rules = rw(json!({
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
    assert!(rw(
        json!({"poolRef": {"name": "other"}, "rules": [{"targets": [{"modelRewrite": "x"}]}]})
    )
    .unwrap()
    .is_empty());
    assert!(
        rw(json!({"rules": [{"targets": [{"modelRewrite": "x"}]}]}))
            .unwrap()
            .is_empty(),
        "no poolRef: not ours"
    );
    let llmd = rules_from(
        &obj(
            Resource::LlmdRewrite,
            "rw",
            json!({"poolRef": {"group": "llm-d.ai", "name": "pool"}, "rules": [{"targets": [{"modelRewrite": "x"}]}]}),
        ),
        "pool",
    )
    .unwrap();
    assert_eq!(llmd.len(), 1, "llm-d.ai's default poolRef group");
}
