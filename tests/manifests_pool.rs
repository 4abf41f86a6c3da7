//! The example InferencePools parse into kvpick's own `InferencePool` type (the one the reflector
//! watches) with every field understood: `manifests/inferencepool.yaml` and the chart's renders,
//! checked in as `tests/fixtures/manifests/chart-inferencepool-*.yaml` (e2e/check-manifests.sh
//! fails when the chart no longer renders exactly those; `KVPICK_UPDATE_FIXTURES=1` rewrites them).
//! Reads only files in the repository, so a plain `cargo test` from a fresh clone runs it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::collections::BTreeMap;
use std::path::Path;

use kvpick::sources::catalog::kube::{InferencePool, PoolView};

/// Parses the one InferencePool document of `rel` (relative to the crate root) and checks that
/// nothing in its `spec` was ignored: the type serializes back to exactly the YAML's spec, so a
/// misspelled or unknown field (e.g. `portNumber` instead of `port`) fails here.
fn load(rel: &str) -> (InferencePool, serde_json::Value) {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(rel);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{rel}: {e}"));
    let docs: Vec<serde_yaml::Value> = serde_yaml::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap_or_else(|e| panic!("{rel}: YAML: {e}")))
        .filter(|v: &serde_yaml::Value| !v.is_null())
        .collect();
    assert_eq!(docs.len(), 1, "{rel}: want exactly one document");
    let raw: serde_json::Value = serde_json::to_value(&docs[0]).expect("YAML as JSON");
    assert_eq!(
        raw["apiVersion"], "inference.networking.k8s.io/v1",
        "{rel}: apiVersion"
    );
    assert_eq!(raw["kind"], "InferencePool", "{rel}: kind");
    let pool: InferencePool =
        serde_yaml::from_value(docs[0].clone()).unwrap_or_else(|e| panic!("{rel}: {e}"));
    let back = serde_json::to_value(&pool.spec).expect("serialize spec");
    assert_eq!(
        back, raw["spec"],
        "{rel}: spec fields kvpick's InferencePool type does not read"
    );
    (pool, raw)
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The checks shared by every example: picker is the `kvpick` Service's ext_proc port.
fn assert_picker(rel: &str, pool: &InferencePool, failure_mode: &str) {
    let r = pool
        .spec
        .endpoint_picker_ref
        .as_ref()
        .unwrap_or_else(|| panic!("{rel}: no endpointPickerRef"));
    assert_eq!(r.name, "kvpick", "{rel}: endpointPickerRef.name");
    assert_eq!(r.group.as_deref().unwrap_or(""), "", "{rel}: group");
    assert_eq!(
        r.kind.as_deref().unwrap_or("Service"),
        "Service",
        "{rel}: kind"
    );
    assert_eq!(
        r.port.map(|p| p.number),
        Some(9002),
        "{rel}: endpointPickerRef.port.number"
    );
    assert_eq!(
        r.failure_mode.as_deref(),
        Some(failure_mode),
        "{rel}: failureMode"
    );
}

#[test]
fn kustomize_example_pool_parses() {
    let rel = "manifests/inferencepool.yaml";
    let (pool, _) = load(rel);
    assert_eq!(pool.metadata.name.as_deref(), Some("vllm-llama3-8b"));
    // No namespace in the manifest: it lands in the namespace given to kubectl (the reflector's NAMESPACE).
    assert_eq!(pool.metadata.namespace, None);
    let view = PoolView::from_pool(&pool).expect("valid pool");
    assert_eq!(view.selector, labels(&[("app", "vllm-llama3-8b")]));
    assert_eq!(view.target_ports, vec![8000]);
    assert_eq!(view.label_selector(), "app=vllm-llama3-8b");
    assert_picker(rel, &pool, "FailClose");
}

#[test]
fn chart_default_pool_parses_and_matches_the_manifest() {
    let rel = "tests/fixtures/manifests/chart-inferencepool-default.yaml";
    let (pool, _) = load(rel);
    assert_eq!(pool.metadata.name.as_deref(), Some("vllm-llama3-8b"));
    assert_eq!(pool.metadata.namespace.as_deref(), Some("kvpick-check"));
    assert_picker(rel, &pool, "FailClose");
    let (manifest, _) = load("manifests/inferencepool.yaml");
    assert_eq!(
        pool.spec, manifest.spec,
        "chart default and manifests/ pools differ"
    );
}

#[test]
fn chart_data_parallel_pool_has_one_rank_per_port() {
    let rel = "tests/fixtures/manifests/chart-inferencepool-dp.yaml";
    let (pool, _) = load(rel);
    assert_eq!(pool.metadata.name.as_deref(), Some("vllm-dp4"));
    let view = PoolView::from_pool(&pool).expect("valid pool");
    assert_eq!(view.target_ports, vec![8000, 8001, 8002, 8003]);
    assert_eq!(view.selector, labels(&[("app", "vllm-llama3-8b")]));
    assert_picker(rel, &pool, "FailOpen");
}
