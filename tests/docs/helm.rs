//! The Helm values table of `docs/deployment.md` names every value of
//! `charts/kvpick/values.yaml`: each leaf (a scalar, a list, an empty map, or one of the
//! free-form maps below, whose keys are the user's) must appear backticked in the first cell of a
//! table row, and every backticked name there must be a value of the chart.

use std::collections::BTreeSet;

const PAGE: &str = "docs/deployment.md";
const VALUES: &str = "charts/kvpick/values.yaml";
/// Maps whose keys are data (labels, resource names, the catalog), documented as one value.
const FREE_FORM: &[&str] = &[
    "pool.selector.matchLabels",
    "resources",
    "catalog",
    "settings",
];

fn leaves(value: &serde_yaml::Value, prefix: &str, out: &mut BTreeSet<String>) {
    match value {
        serde_yaml::Value::Mapping(map) if !map.is_empty() && !FREE_FORM.contains(&prefix) => {
            for (k, v) in map {
                let key = k.as_str().expect("values.yaml keys are strings");
                let path = if prefix.is_empty() {
                    key.to_string()
                } else {
                    format!("{prefix}.{key}")
                };
                leaves(v, &path, out);
            }
        }
        _ => {
            out.insert(prefix.to_string());
        }
    }
}

#[test]
fn the_helm_values_table_names_every_value_of_the_chart() {
    let values: serde_yaml::Value = serde_yaml::from_str(&crate::read(VALUES)).unwrap();
    let mut want = BTreeSet::new();
    leaves(&values, "", &mut want);
    let page = crate::read(PAGE);
    let documented = crate::first_cell_names(&page, "## Helm values");
    let missing: Vec<&String> = want.difference(&documented).collect();
    let extra: Vec<&String> = documented.difference(&want).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{PAGE} \"Helm values\" disagrees with {VALUES}: missing {missing:?}, not in the chart {extra:?}"
    );
}
