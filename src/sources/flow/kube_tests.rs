use super::*;
use crate::sources::flow::crds::Resource as R;
use crate::sources::flow::Origin;
use serde_json::json;

fn obj(resource: Resource, name: &str, spec: serde_json::Value) -> DynamicObject {
    let ar = resource.api_resource();
    serde_json::from_value(json!({
        "apiVersion": ar.api_version, "kind": ar.kind,
        "metadata": {"name": name, "namespace": "ns"},
        "spec": spec,
    }))
    .unwrap()
}

/// Every store resolved: `installed` ones synced, the rest missing.
fn stores(installed: &[Resource]) -> Stores {
    Resource::ALL
        .into_iter()
        .map(|r| {
            let s = Store {
                synced: installed.contains(&r),
                missing: !installed.contains(&r),
                ..Store::default()
            };
            (r, s)
        })
        .collect()
}

fn put(stores: &mut Stores, r: Resource, o: DynamicObject) {
    let s = stores.get_mut(&r).unwrap();
    s.objects.insert(o.name_any(), contribution(r, &o, "pool"));
}

fn pool(labels: &[(&str, &str)]) -> PoolLabels {
    PoolLabels {
        resolved: true,
        labels: Some(
            labels
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        ),
    }
}

fn priorities(c: &ClusterContent) -> Vec<(String, i32, Origin)> {
    c.objectives
        .iter()
        .map(|o| (o.name.clone(), o.priority, o.origin))
        .collect()
}

#[test]
fn llm_d_wins_over_the_legacy_group_per_kind() {
    let mut s = stores(&[R::LlmdObjectiveV1alpha2, R::GieObjective, R::GieRewrite]);
    put(
        &mut s,
        R::GieObjective,
        obj(
            R::GieObjective,
            "gie-only",
            json!({"priority": 1, "poolRef": {"name": "pool"}}),
        ),
    );
    put(
        &mut s,
        R::LlmdObjectiveV1alpha2,
        obj(
            R::LlmdObjectiveV1alpha2,
            "llmd",
            json!({"priority": 2, "poolRef": {"name": "pool"}}),
        ),
    );
    put(
        &mut s,
        R::GieRewrite,
        obj(
            R::GieRewrite,
            "rw",
            json!({"poolRef": {"name": "pool"}, "rules": [{"targets": [{"modelRewrite": "x"}]}]}),
        ),
    );
    let (c, used) = content(&s, &pool(&[]), "pool");
    assert_eq!(
        priorities(&c),
        [("llmd".to_string(), 2, Origin::LlmD)],
        "the legacy objective is ignored"
    );
    assert_eq!(used[&Kind::Objective], [R::LlmdObjectiveV1alpha2]);
    assert_eq!(
        c.rules.len(),
        1,
        "no llm-d.ai rewrite CRD: the legacy one counts"
    );
    assert_eq!(used[&Kind::Rewrite], [R::GieRewrite]);
    // Without any llm-d.ai objective CRD, the legacy group counts.
    s.get_mut(&R::LlmdObjectiveV1alpha2).unwrap().missing = true;
    let (c, used) = content(&s, &pool(&[]), "pool");
    assert_eq!(priorities(&c), [("gie-only".to_string(), 1, Origin::Gie)]);
    assert_eq!(used[&Kind::Objective], [R::GieObjective]);
}

#[test]
fn v1_is_evaluated_before_v1alpha2_and_selectors_use_the_pool_labels() {
    let mut s = stores(&[R::LlmdObjectiveV1, R::LlmdObjectiveV1alpha2]);
    // The same object seen through both versions: v1 targets the pool, so its form wins.
    put(
        &mut s,
        R::LlmdObjectiveV1,
        obj(
            R::LlmdObjectiveV1,
            "same",
            json!({"priority": 10, "poolRefs": [{"name": "pool"}]}),
        ),
    );
    put(
        &mut s,
        R::LlmdObjectiveV1alpha2,
        obj(
            R::LlmdObjectiveV1alpha2,
            "same",
            json!({"priority": 1, "poolRef": {"name": "pool"}}),
        ),
    );
    // v1's form (poolRef pruned away) targets nothing: v1alpha2's form counts.
    put(
        &mut s,
        R::LlmdObjectiveV1,
        obj(R::LlmdObjectiveV1, "old", json!({"priority": 3})),
    );
    put(
        &mut s,
        R::LlmdObjectiveV1alpha2,
        obj(
            R::LlmdObjectiveV1alpha2,
            "old",
            json!({"priority": 3, "poolRef": {"name": "pool"}}),
        ),
    );
    put(
        &mut s,
        R::LlmdObjectiveV1,
        obj(
            R::LlmdObjectiveV1,
            "gold",
            json!({"priority": 50, "poolSelector": {"matchLabels": {"tier": "gold"}}}),
        ),
    );
    let (c, _) = content(&s, &pool(&[("tier", "gold")]), "pool");
    let got: Vec<(String, i32)> = c
        .objectives
        .iter()
        .map(|o| (o.name.clone(), o.priority))
        .collect();
    assert_eq!(
        got,
        [("gold".into(), 50), ("old".into(), 3), ("same".into(), 10)]
    );
    let (c, _) = content(&s, &pool(&[("tier", "silver")]), "pool");
    assert!(
        !c.objectives.iter().any(|o| o.name == "gold"),
        "selector does not match"
    );
    let missing = PoolLabels {
        resolved: true,
        labels: None,
    };
    let (c, _) = content(&s, &missing, "pool");
    assert!(
        !c.objectives.iter().any(|o| o.name == "gold"),
        "no pool: fails closed"
    );
}

#[test]
fn a_kind_waits_until_every_version_has_answered() {
    let mut s = stores(&[R::GieObjective, R::GieRewrite]);
    put(
        &mut s,
        R::GieObjective,
        obj(R::GieObjective, "a", json!({"poolRef": {"name": "pool"}})),
    );
    // llm-d.ai v1alpha2 has not answered yet: objectives wait; rewrites are decided.
    s.get_mut(&R::LlmdObjectiveV1alpha2).unwrap().missing = false;
    let (c, used) = content(&s, &pool(&[]), "pool");
    assert!(c.objectives.is_empty());
    assert!(!used.contains_key(&Kind::Objective));
    assert!(used.contains_key(&Kind::Rewrite));
    s.get_mut(&R::LlmdObjectiveV1alpha2).unwrap().missing = true;
    // The pool has not answered yet: objectives wait too.
    let (c, _) = content(&s, &PoolLabels::default(), "pool");
    assert!(c.objectives.is_empty());
    let (c, _) = content(&s, &pool(&[]), "pool");
    assert_eq!(c.objectives.len(), 1);
}

#[test]
fn rules_are_ordered_oldest_object_first() {
    let mut s = stores(&[R::LlmdRewrite]);
    let rw = |name: &str, created: &str, to: &str| {
        let mut o = obj(
            R::LlmdRewrite,
            name,
            json!({"poolRef": {"name": "pool"}, "rules": [{"matches": [{"model": {"value": "m"}}], "targets": [{"modelRewrite": to}]}]}),
        );
        o.metadata.creation_timestamp = Some(serde_json::from_value(json!(created)).unwrap());
        o
    };
    put(
        &mut s,
        R::LlmdRewrite,
        rw("a-newer", "2025-02-01T00:00:00Z", "new"),
    );
    put(
        &mut s,
        R::LlmdRewrite,
        rw("b-older", "2025-01-01T00:00:00Z", "old"),
    );
    let (c, _) = content(&s, &pool(&[]), "pool");
    let policy = crate::sources::flow::FlowPolicy::new(c.objectives.clone(), c.rules.clone());
    assert_eq!(
        policy.rewrite("m", 0).as_deref(),
        Some("old"),
        "the oldest resource's rule wins"
    );
}

#[test]
fn only_404_and_403_mean_not_installed() {
    let api = |code: u16| {
        watcher::Error::InitialListFailed(kube::Error::Api(Box::new(
            serde_json::from_value(
                json!({"code": code, "message": "m", "reason": "r", "status": "Failure"}),
            )
            .unwrap(),
        )))
    };
    assert!(means_missing(&api(404)));
    assert!(means_missing(&api(403)));
    assert!(!means_missing(&api(500)));
    assert!(!means_missing(&watcher::Error::NoResourceVersion));
}

#[test]
fn a_resumed_watch_after_a_404_means_installed_again() {
    let mut store = Store {
        missing: true,
        ..Store::default()
    };
    let o = obj(
        R::LlmdObjectiveV1alpha2,
        "a",
        json!({"poolRef": {"name": "pool"}}),
    );
    assert!(apply_crd(
        &mut store,
        R::LlmdObjectiveV1alpha2,
        Event::Apply(o),
        "pool"
    ));
    assert!(store.installed());
    assert_eq!(store.objects.len(), 1);
    // An ordinary unsynced store (mid-list) does not publish on Apply.
    let mut fresh = Store::default();
    let o = obj(R::LlmdObjectiveV1alpha2, "b", json!({}));
    assert!(!apply_crd(
        &mut fresh,
        R::LlmdObjectiveV1alpha2,
        Event::Apply(o),
        "pool"
    ));
}
