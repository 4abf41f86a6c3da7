//! Each header `classify` reads, under its current name and its deprecated aliases (issue 46):
//! a request with only the current name, only an alias, and both (the current name wins, wherever
//! it stands in the request).

use super::*;

fn policy() -> FlowPolicy {
    FlowPolicy::new(
        [Objective {
            name: "interactive".into(),
            priority: 100,
            pool: None,
            origin: Origin::File,
        }],
        [RewriteRule {
            source: "r0".into(),
            matches: vec!["ruled".into()],
            targets: vec![WeightedModel {
                model: "ruled-v1".into(),
                weight: 1,
            }],
        }],
    )
}

fn classify_pairs(headers: &[(&str, &str)]) -> Classification {
    classify(
        headers.iter().map(|(k, v)| (*k, v.as_bytes())),
        &policy(),
        &FlowSettings::default(),
    )
    .unwrap()
}

/// For one header's names (current first): the value read from a request with only the current
/// name, with each alias alone, and with every name at once (aliases first in the request).
fn check_names(
    names: &[&str],
    read: impl Fn(&Classification) -> Option<String>,
    values: [&str; 4],
) {
    let current = names[0];
    assert_eq!(
        read(&classify_pairs(&[(current, values[0])])).as_deref(),
        Some(values[0]),
        "{current} alone"
    );
    for (i, alias) in names.iter().enumerate().skip(1) {
        assert_eq!(
            read(&classify_pairs(&[(alias, values[i])])).as_deref(),
            Some(values[i]),
            "{alias} alone"
        );
    }
    let mut all: Vec<(&str, &str)> = names
        .iter()
        .zip(values)
        .skip(1)
        .map(|(n, v)| (*n, v))
        .collect();
    all.push((current, values[0]));
    assert_eq!(
        read(&classify_pairs(&all)).as_deref(),
        Some(values[0]),
        "{current} wins over {:?}",
        &names[1..]
    );
    // Of the aliases, the earlier listed wins too.
    if names.len() > 2 {
        let aliases: Vec<(&str, &str)> = names
            .iter()
            .zip(values)
            .skip(1)
            .rev()
            .map(|(n, v)| (*n, v))
            .collect();
        assert_eq!(read(&classify_pairs(&aliases)).as_deref(), Some(values[1]));
    }
}

#[test]
fn the_fairness_id_under_llm_d_s_name_its_alias_and_kvpick_s_old_name() {
    assert_eq!(
        FAIRNESS_HEADERS,
        [
            "x-llm-d-inference-fairness-id",
            "x-gateway-inference-fairness-id",
            "x-llm-d-fairness-id"
        ]
    );
    check_names(
        FAIRNESS_HEADERS,
        |c| Some(c.fairness_key.clone()),
        ["tenant-new", "tenant-gie", "tenant-kvpick", ""],
    );
}

#[test]
fn the_objective_under_llm_d_s_name_and_its_alias() {
    assert_eq!(
        OBJECTIVE_HEADERS,
        [
            "x-llm-d-inference-objective",
            "x-gateway-inference-objective"
        ]
    );
    // The objective must be known to be carried: both values name one, told apart by case.
    let read = |c: &Classification| c.objective.clone();
    assert_eq!(
        read(&classify_pairs(&[(
            "x-llm-d-inference-objective",
            "interactive"
        )]))
        .as_deref(),
        Some("interactive")
    );
    assert_eq!(
        read(&classify_pairs(&[(
            "x-gateway-inference-objective",
            "interactive"
        )]))
        .as_deref(),
        Some("interactive")
    );
    let both = classify_pairs(&[
        ("x-gateway-inference-objective", "interactive"),
        ("x-llm-d-inference-objective", "unknown"),
    ]);
    assert_eq!(
        (both.objective, both.priority),
        (None, 0),
        "the current name's (unknown) objective wins over the alias's"
    );
}

#[test]
fn the_slos_under_llm_d_s_names_and_their_aliases() {
    assert_eq!(SLO_TTFT_HEADERS, ["x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"]);
    assert_eq!(SLO_TPOT_HEADERS, ["x-llm-d-slo-tpot-ms", "x-slo-tpot-ms"]);
    check_names(
        SLO_TTFT_HEADERS,
        |c| c.slo_ttft_ms.map(|v| v.to_string()),
        ["200", "300", "", ""],
    );
    check_names(
        SLO_TPOT_HEADERS,
        |c| c.slo_tpot_ms.map(|v| v.to_string()),
        ["20", "30", "", ""],
    );
    // A malformed alias names itself in the error.
    let err = classify(
        [("x-slo-ttft-ms", &b"soon"[..])],
        &policy(),
        &FlowSettings::default(),
    )
    .unwrap_err();
    assert!(err.to_string().starts_with("x-slo-ttft-ms "), "{err}");
}

#[test]
fn the_model_rewrite_under_llm_d_s_name_and_its_alias() {
    assert_eq!(
        MODEL_REWRITE_HEADERS,
        ["x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite"]
    );
    check_names(
        MODEL_REWRITE_HEADERS,
        |c| c.model_rewrite.clone(),
        ["target-new", "target-gie", "", ""],
    );
    let long = "m".repeat(MAX_MODEL_LEN + 1);
    let err = classify(
        [("x-llm-d-model-name-rewrite", long.as_bytes())],
        &policy(),
        &FlowSettings::default(),
    )
    .unwrap_err();
    assert!(err.to_string().contains("longer than 256 bytes"), "{err}");
}

/// llm-d-router's order (`Director.modelRewriteIfNeeded`): the header's target replaces the body's
/// model; a rule matching the body's model chooses instead; a target equal to the body's model
/// changes nothing.
#[test]
fn the_header_s_target_rewrites_the_body_unless_a_rule_matches() {
    let p = policy();
    let r = rewrite_request_body(&p, br#"{"model":"m","prompt":"x"}"#, 0, Some("m-v2")).unwrap();
    assert_eq!((r.from.as_str(), r.to.as_str()), ("m", "m-v2"));
    assert_eq!(r.body, br#"{"model":"m-v2","prompt":"x"}"#);
    let r = rewrite_request_body(&p, br#"{"model":"ruled"}"#, 0, Some("m-v2")).unwrap();
    assert_eq!(r.to, "ruled-v1", "the rule wins over the header");
    assert_eq!(
        rewrite_request_body(&p, br#"{"model":"m"}"#, 0, Some("m")),
        None
    );
    // No rules, no header: nothing to do (the body is not even parsed).
    assert_eq!(
        rewrite_request_body(&FlowPolicy::default(), br#"{"model":"m"}"#, 0, None),
        None
    );
    let r =
        rewrite_request_body(&FlowPolicy::default(), br#"{"model":"m"}"#, 0, Some("t")).unwrap();
    assert_eq!(r.to, "t", "a header target needs no policy");
}
