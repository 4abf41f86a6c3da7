//! Unit tests of classification, precedence, bounds, weighted rewrites and the body rewrite.

use super::*;

fn policy() -> FlowPolicy {
    let o = |name: &str, priority| Objective {
        name: name.into(),
        priority,
        pool: None,
        origin: Origin::File,
    };
    let t = |model: &str, weight| WeightedModel {
        model: model.into(),
        weight,
    };
    FlowPolicy::new(
        [o("interactive", 100), o("batch", -10)],
        [
            RewriteRule {
                source: "r0".into(),
                matches: vec!["llama".into(), "alias".into()],
                targets: vec![t("llama-v1", 3), t("llama-v2", 1)],
            },
            RewriteRule {
                source: "r1".into(),
                matches: vec!["llama".into()],
                targets: vec![t("shadowed", 1)],
            },
            RewriteRule {
                source: "r2".into(),
                matches: vec![],
                targets: vec![t("default-model", 1)],
            },
            RewriteRule {
                source: "r3-self".into(),
                matches: vec!["keep".into()],
                targets: vec![t("keep", 1)],
            },
        ],
    )
}

fn run(headers: &[(&str, &str)], settings: FlowSettings) -> Result<Classification, ClassifyError> {
    classify(
        headers.iter().map(|(k, v)| (*k, v.as_bytes())),
        &policy(),
        &settings,
    )
}

fn ok(headers: &[(&str, &str)]) -> Classification {
    run(headers, FlowSettings::default()).unwrap()
}

#[test]
fn no_headers_is_priority_zero_in_the_default_key() {
    assert_eq!(
        ok(&[("content-type", "application/json")]),
        Classification {
            priority: 0,
            fairness_key: "default".into(),
            objective: None,
            slo_ttft_ms: None,
            slo_tpot_ms: None,
            model_rewrite: None,
        }
    );
}

#[test]
fn objective_gives_priority_and_default_fairness_key() {
    let c = ok(&[("x-gateway-inference-objective", "batch")]);
    assert_eq!(c.priority, -10);
    assert_eq!(c.objective.as_deref(), Some("batch"));
    assert_eq!(
        c.fairness_key, "batch",
        "no fairness id: the objective's name"
    );
    // The llm-d header is preferred over the GIE one, whatever the order; names are case-insensitive.
    let c = ok(&[
        ("X-Gateway-Inference-Objective", "batch"),
        ("X-LLM-D-Inference-Objective", "interactive"),
    ]);
    assert_eq!(
        (c.priority, c.objective.as_deref()),
        (100, Some("interactive"))
    );
}

#[test]
fn unknown_objective_is_priority_zero_and_not_carried() {
    let c = ok(&[("x-llm-d-inference-objective", "nonexistent")]);
    assert_eq!(
        (c.priority, c.objective, c.fairness_key.as_str()),
        (0, None, "default")
    );
}

#[test]
fn fairness_ids_by_preference() {
    let c = ok(&[
        ("x-llm-d-fairness-id", "tenant-c"),
        ("x-gateway-inference-fairness-id", "tenant-b"),
        ("x-llm-d-inference-fairness-id", "tenant-a"),
        ("x-gateway-inference-objective", "batch"),
    ]);
    assert_eq!(c.fairness_key, "tenant-a");
    assert_eq!(
        ok(&[("x-gateway-inference-fairness-id", " t ")]).fairness_key,
        "t"
    );
    // The first occurrence of a repeated header counts; an empty value is absent.
    let c = ok(&[
        ("x-llm-d-fairness-id", ""),
        ("x-llm-d-fairness-id", "first"),
        ("x-llm-d-fairness-id", "second"),
    ]);
    assert_eq!(c.fairness_key, "first");
}

/// Clients choose among the bands the operator defined: nothing opens a band of its own or jumps
/// above every objective, and sheddable stays sheddable.
#[test]
fn client_priorities_are_clamped_to_the_policy_bands() {
    let p = policy(); // bands -10, -1, 0, 100
    for (requested, band) in [
        (i32::MAX, 100),
        (101, 100),
        (100, 100),
        (99, 0),
        (1, 0),
        (0, 0),
        (-1, -1),
        (-2, -10),
        (-10, -10),
        (-11, -10),
        (i32::MIN, -10),
    ] {
        assert_eq!(p.band_for(requested), band, "{requested}");
    }
    let empty = FlowPolicy::default();
    assert_eq!(empty.band_for(7), 0);
    assert_eq!(empty.band_for(-7), -1);
    let no_objectives = FlowPolicy::new([], []);
    assert_eq!(no_objectives.band_for(i32::MAX), 0);
    assert_eq!(no_objectives.band_for(-3), -1);
}

#[test]
fn client_priority_overrides_the_objective_unless_turned_off() {
    let headers = [
        ("x-gateway-inference-objective", "interactive"),
        ("x-dynamo-request-priority", "-5"),
    ];
    assert_eq!(
        ok(&headers).priority,
        -10,
        "the per-request header is more specific, in the band at or below it"
    );
    assert_eq!(ok(&[("x-dynamo-request-priority", " 100 ")]).priority, 100);
    assert_eq!(ok(&[("x-dynamo-request-priority", " 7 ")]).priority, 0);
    let off = FlowSettings {
        client_priority: false,
    };
    assert_eq!(
        run(&headers, off).unwrap().priority,
        100,
        "only objectives set priority"
    );
    assert_eq!(
        run(&[("x-dynamo-request-priority", "9")], off)
            .unwrap()
            .priority,
        0
    );
    assert!(
        run(&[("x-dynamo-request-priority", "garbage")], off).is_ok(),
        "an ignored header is not validated"
    );
}

#[test]
fn slos_parse_within_bounds() {
    let c = ok(&[
        ("x-llm-d-slo-ttft-ms", "250"),
        ("x-llm-d-slo-tpot-ms", " 20 "),
    ]);
    assert_eq!((c.slo_ttft_ms, c.slo_tpot_ms), (Some(250), Some(20)));
    assert_eq!(
        ok(&[("x-llm-d-slo-ttft-ms", "3600000")]).slo_ttft_ms,
        Some(3_600_000)
    );
}

#[test]
fn malformed_headers_are_client_errors_with_short_messages() {
    let long = "a".repeat(MAX_FAIRNESS_ID_LEN + 1);
    let long_objective = "o".repeat(MAX_OBJECTIVE_LEN + 1);
    let cases: [(&str, &str, &str); 13] = [
        (
            "x-dynamo-request-priority",
            "high",
            "x-dynamo-request-priority must be an integer",
        ),
        (
            "x-dynamo-request-priority",
            "2147483648",
            "must be an integer",
        ),
        ("x-dynamo-request-priority", "1.5", "must be an integer"),
        (
            "x-llm-d-slo-ttft-ms",
            "0",
            "x-llm-d-slo-ttft-ms must be whole milliseconds in 1..=3600000",
        ),
        ("x-llm-d-slo-ttft-ms", "-1", "whole milliseconds"),
        ("x-llm-d-slo-ttft-ms", "3600001", "whole milliseconds"),
        (
            "x-llm-d-slo-tpot-ms",
            "12ms",
            "x-llm-d-slo-tpot-ms must be whole",
        ),
        (
            "x-llm-d-slo-tpot-ms",
            "99999999999999999999",
            "whole milliseconds",
        ),
        (
            "x-llm-d-fairness-id",
            &long,
            "x-llm-d-fairness-id is longer than 128 bytes",
        ),
        ("x-llm-d-fairness-id", "a b", "printable ASCII"),
        (
            "x-gateway-inference-fairness-id",
            "t\u{e9}",
            "printable ASCII",
        ),
        (
            "x-gateway-inference-objective",
            &long_objective,
            "longer than 253 bytes",
        ),
        (
            "x-llm-d-inference-objective",
            "tab\there",
            "printable ASCII",
        ),
    ];
    for (name, value, want) in cases {
        let err = run(&[(name, value)], FlowSettings::default()).unwrap_err();
        assert!(err.to_string().contains(want), "{name}: {value:?}: {err}");
    }
    // Invalid UTF-8 bytes.
    let err = classify(
        [("x-llm-d-fairness-id", &b"\xff\xfe"[..])],
        &policy(),
        &FlowSettings::default(),
    )
    .unwrap_err();
    assert_eq!(
        err,
        ClassifyError::BadChars {
            header: "x-llm-d-fairness-id"
        }
    );
    // Exactly at the cap is fine.
    let at_cap = "a".repeat(MAX_FAIRNESS_ID_LEN);
    assert_eq!(ok(&[("x-llm-d-fairness-id", &at_cap)]).fairness_key, at_cap);
}

#[test]
fn rewrite_weights_split_the_pick_range_exactly() {
    let p = policy();
    // 3:1 over the u64 range: the first three quarters go to v1.
    let quarter = u64::MAX / 4 + 1;
    assert_eq!(p.rewrite("llama", 0).as_deref(), Some("llama-v1"));
    assert_eq!(
        p.rewrite("llama", 3 * quarter - 1).as_deref(),
        Some("llama-v1")
    );
    assert_eq!(p.rewrite("llama", 3 * quarter).as_deref(), Some("llama-v2"));
    assert_eq!(p.rewrite("llama", u64::MAX).as_deref(), Some("llama-v2"));
    // An evenly spaced sweep (midpoints of n equal cells) lands exactly in proportion.
    let n = 10_000u64;
    let step = u64::MAX / n;
    let v2 = (0..n)
        .filter(|i| p.rewrite("alias", i * step + step / 2).as_deref() == Some("llama-v2"))
        .count();
    assert_eq!(v2, 2_500);
}

#[test]
fn rewrite_rule_precedence_wildcard_and_identity() {
    let p = policy();
    assert_eq!(
        p.rewrite("llama", 0).as_deref(),
        Some("llama-v1"),
        "the first rule naming a model wins (r1 is shadowed)"
    );
    assert_eq!(
        p.rewrite("something-else", 12345).as_deref(),
        Some("default-model"),
        "empty matches = every model no rule names"
    );
    assert_eq!(
        p.rewrite("keep", 0),
        None,
        "a rewrite to itself is no rewrite"
    );
    let no_wildcard = FlowPolicy::new([], policy().rules()[..2].to_vec());
    assert_eq!(no_wildcard.rewrite("other", 0), None);
}

#[test]
fn policy_drops_invalid_rules() {
    let p = FlowPolicy::new(
        [],
        [RewriteRule {
            source: "bad".into(),
            matches: vec!["m".into()],
            targets: vec![WeightedModel {
                model: "x".into(),
                weight: 0,
            }],
        }],
    );
    assert!(p.rules().is_empty());
    assert_eq!(p.rewrite("m", 0), None);
}

#[test]
fn body_rewrite_changes_only_the_top_level_model() {
    let body = br#"{ "messages": [{"role": "user", "content": "hi", "model": "inner"}],
  "model" :  "llama" , "temperature": 0.10000000000000000001, "n": 12345678901234567890 }"#;
    let out = rewrite_body_model(body, "llama-v2").unwrap();
    let want = br#"{ "messages": [{"role": "user", "content": "hi", "model": "inner"}],
  "model" :  "llama-v2" , "temperature": 0.10000000000000000001, "n": 12345678901234567890 }"#;
    assert_eq!(
        String::from_utf8(out).unwrap(),
        String::from_utf8(want.to_vec()).unwrap()
    );
    // Escapes in the new name are JSON-encoded; an escaped old value is replaced whole.
    let out = rewrite_body_model(br#"{"model":"a\"b\u00e9","x":1}"#, "q\"uote/é").unwrap();
    assert_eq!(out, r#"{"model":"q\"uote/é","x":1}"#.as_bytes());
    let parsed: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(parsed["model"], "q\"uote/é");
}

#[test]
fn body_rewrite_errors() {
    let cases: [(&[u8], RewriteBodyError); 6] = [
        (br#"{"prompt": "x"}"#, RewriteBodyError::MissingModel),
        (br#"{"model": 5}"#, RewriteBodyError::NotAString),
        (
            br#"{"model": "a", "model": "b"}"#,
            RewriteBodyError::Duplicate,
        ),
        (br#"["model"]"#, RewriteBodyError::NotAnObject),
        (b"", RewriteBodyError::Malformed("empty body".into())),
        (
            br#"{"model": "a"} trailing"#,
            RewriteBodyError::Malformed(String::new()),
        ),
    ];
    for (body, want) in cases {
        let got = rewrite_body_model(body, "x").unwrap_err();
        match want {
            RewriteBodyError::Malformed(ref m) if m.is_empty() => {
                assert!(matches!(got, RewriteBodyError::Malformed(_)), "{got:?}")
            }
            want => assert_eq!(got, want),
        }
    }
    assert!(matches!(
        rewrite_body_model(b"{\"model\": \"\xff\"}", "x"),
        Err(RewriteBodyError::Malformed(_))
    ));
    assert_eq!(
        rewrite_body_model(br#"{"model":"a"}"#, ""),
        Err(RewriteBodyError::BadTarget)
    );
}

#[test]
fn request_body_rewrite_applies_rules_and_leaves_the_rest_to_the_parser() {
    let p = policy();
    let r =
        rewrite_request_body(&p, br#"{"model": "llama", "prompt": "x"}"#, u64::MAX, None).unwrap();
    assert_eq!((r.from.as_str(), r.to.as_str()), ("llama", "llama-v2"));
    assert_eq!(r.body, br#"{"model": "llama-v2", "prompt": "x"}"#);
    // An escaped model name is compared unescaped.
    let r = rewrite_request_body(&p, br#"{"model": "\u006c\u006cama"}"#, 0, None).unwrap();
    assert_eq!(r.to, "llama-v1");
    assert_eq!(
        rewrite_request_body(&p, br#"{"model": "keep"}"#, 0, None),
        None
    );
    for bad in [
        &b"not json"[..],
        br#"{"model": 1}"#,
        br#"{"prompt": "x"}"#,
        b"\xff",
    ] {
        assert_eq!(rewrite_request_body(&p, bad, 0, None), None, "{bad:?}");
    }
    let empty = FlowPolicy::default();
    assert_eq!(
        rewrite_request_body(&empty, br#"{"model": "llama"}"#, 0, None),
        None
    );
}

/// Deterministic mutations of a few bodies (a poor man's fuzz run, in the unit tests): whatever the
/// bytes, `rewrite_body_model` never panics, and whenever it succeeds the result is JSON whose
/// `model` is the target and whose other top-level values equal the input's. `classify` over the
/// same bytes as header values never panics and keeps its bounds.
#[test]
fn body_rewrite_and_classify_hold_their_invariants_on_mutated_input() {
    let seeds: [&[u8]; 4] = [
        br#"{"model":"llama","messages":[{"role":"user","content":"hi"}],"stream":true}"#,
        br#"  {"prompt": [1, 2, 3], "model" : "a\u00e9\"b", "n": 1e5, "x": {"model": 1}}  "#,
        br#"{"model":"m","model":"n"}"#,
        br#"{"input":"x","model":null}"#,
    ];
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let p = policy();
    let bytes: &[u8] = b"{}[]\":,\\ u0e9amodel-1";
    let mut successes = 0;
    for round in 0..20_000 {
        let mut body = seeds[round % seeds.len()].to_vec();
        for _ in 0..(next() % 4) {
            let at = (next() as usize) % (body.len() + 1);
            match next() % 3 {
                0 if at < body.len() => {
                    body.remove(at);
                }
                1 => body.insert(at, bytes[(next() as usize) % bytes.len()]),
                _ if at < body.len() => body[at] = next() as u8,
                _ => {}
            }
        }
        let target = if round % 2 == 0 {
            "t"
        } else {
            "long/target-é\""
        };
        if let Ok(out) = rewrite_body_model(&body, target) {
            successes += 1;
            let after: serde_json::Value = serde_json::from_slice(&out).unwrap();
            assert_eq!(after["model"], target, "{}", String::from_utf8_lossy(&body));
            let mut before: serde_json::Value = serde_json::from_slice(&body).unwrap();
            before["model"] = target.into();
            assert_eq!(before, after, "{}", String::from_utf8_lossy(&body));
        }
        let _ = rewrite_request_body(&p, &body, next(), None);
        let headers = [
            ("x-llm-d-inference-objective", &body[..body.len().min(300)]),
            ("x-llm-d-fairness-id", &body[..body.len().min(140)]),
            ("x-dynamo-request-priority", &body[..body.len().min(12)]),
            ("x-llm-d-slo-ttft-ms", &body[..body.len().min(8)]),
        ];
        if let Ok(c) = classify(headers, &p, &FlowSettings::default()) {
            assert!(!c.fairness_key.is_empty() && c.fairness_key.len() <= MAX_FAIRNESS_ID_LEN);
        }
    }
    assert!(
        successes > 1_000,
        "the mutations keep many bodies valid: {successes}"
    );
}
