use super::request::{pick_reason, MAX_TRACEPARENT_BYTES, MAX_TRACESTATE_BYTES};
use super::*;
use std::collections::HashMap;

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |name| map.get(name).cloned()
}

fn resolve(args: &TraceArgs, pairs: &[(&str, &str)]) -> anyhow::Result<Option<TraceConfig>> {
    TraceConfig::resolve(args, env(pairs))
}

fn with_endpoint(endpoint: &str) -> TraceArgs {
    TraceArgs {
        otlp_endpoint: Some(endpoint.into()),
        ..Default::default()
    }
}

#[test]
fn off_without_an_endpoint() {
    assert_eq!(resolve(&TraceArgs::default(), &[]).unwrap(), None);
    // A sampler alone does not turn tracing on.
    let args = TraceArgs {
        trace_sampling_ratio: Some(0.5),
        ..Default::default()
    };
    assert_eq!(
        resolve(&args, &[("OTEL_TRACES_SAMPLER", "always_on")]).unwrap(),
        None
    );
}

#[test]
fn the_endpoint_comes_from_the_flag_then_the_traces_variable_then_the_generic_one() {
    let generic = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://generic:4317")];
    let both = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://generic:4317"),
        ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://traces:4317"),
    ];
    let ep =
        |args: &TraceArgs, pairs: &[(&str, &str)]| resolve(args, pairs).unwrap().unwrap().endpoint;
    assert_eq!(ep(&TraceArgs::default(), &generic), "http://generic:4317");
    assert_eq!(ep(&TraceArgs::default(), &both), "http://traces:4317");
    assert_eq!(
        ep(&with_endpoint("http://flag:4317"), &both),
        "http://flag:4317"
    );
}

#[test]
fn defaults_are_parent_based_always_on_and_service_kvpick() {
    let config = resolve(&with_endpoint("http://c:4317"), &[])
        .unwrap()
        .unwrap();
    assert_eq!(
        config.sampler,
        SamplerConfig {
            parent_based: true,
            ratio: 1.0
        }
    );
    assert_eq!(config.service_name, "kvpick");
}

#[test]
fn flags_override_the_sampler_and_service_variables() {
    let vars = [
        ("OTEL_TRACES_SAMPLER", "always_off"),
        ("OTEL_SERVICE_NAME", "from-env"),
    ];
    let from_env = resolve(&with_endpoint("http://c:4317"), &vars)
        .unwrap()
        .unwrap();
    assert_eq!(
        from_env.sampler,
        SamplerConfig {
            parent_based: false,
            ratio: 0.0
        }
    );
    assert_eq!(from_env.service_name, "from-env");
    let args = TraceArgs {
        otlp_endpoint: Some("http://c:4317".into()),
        trace_sampling_ratio: Some(0.1),
        otel_service_name: Some("from-flag".into()),
    };
    let flagged = resolve(&args, &vars).unwrap().unwrap();
    assert_eq!(
        flagged.sampler,
        SamplerConfig {
            parent_based: true,
            ratio: 0.1
        }
    );
    assert_eq!(flagged.service_name, "from-flag");
}

#[test]
fn every_specified_sampler_name_is_read() {
    let cases = [
        ("always_on", None, false, 1.0),
        ("always_off", None, false, 0.0),
        ("traceidratio", Some("0.25"), false, 0.25),
        ("parentbased_always_on", None, true, 1.0),
        ("parentbased_always_off", None, true, 0.0),
        ("parentbased_traceidratio", Some("0.1"), true, 0.1),
        ("parentbased_traceidratio", None, true, 1.0),
    ];
    for (name, arg, parent_based, ratio) in cases {
        let mut vars = vec![("OTEL_TRACES_SAMPLER", name)];
        if let Some(arg) = arg {
            vars.push(("OTEL_TRACES_SAMPLER_ARG", arg));
        }
        let config = resolve(&with_endpoint("http://c:4317"), &vars)
            .unwrap()
            .unwrap();
        assert_eq!(
            config.sampler,
            SamplerConfig {
                parent_based,
                ratio
            },
            "{name}"
        );
    }
}

#[test]
fn a_ratio_just_over_one_or_under_zero_is_refused() {
    for bad in [1.000_001, -0.000_001, f64::NAN] {
        let args = TraceArgs {
            otlp_endpoint: Some("http://c:4317".into()),
            trace_sampling_ratio: Some(bad),
            ..Default::default()
        };
        let err = resolve(&args, &[]).unwrap_err().to_string();
        assert!(err.contains("--trace-sampling-ratio"), "{err}");
    }
    for bad in ["1.000001", "-0.1", "half"] {
        let vars = [
            ("OTEL_TRACES_SAMPLER", "traceidratio"),
            ("OTEL_TRACES_SAMPLER_ARG", bad),
        ];
        let err = resolve(&with_endpoint("http://c:4317"), &vars)
            .unwrap_err()
            .to_string();
        assert!(err.contains("OTEL_TRACES_SAMPLER_ARG"), "{err}");
    }
    let edge = TraceArgs {
        otlp_endpoint: Some("http://c:4317".into()),
        trace_sampling_ratio: Some(1.0),
        ..Default::default()
    };
    assert!(resolve(&edge, &[]).is_ok());
}

#[test]
fn an_unknown_sampler_is_an_error_not_a_silent_fallback() {
    let vars = [("OTEL_TRACES_SAMPLER", "jaeger_remote")];
    let err = resolve(&with_endpoint("http://c:4317"), &vars)
        .unwrap_err()
        .to_string();
    assert!(err.contains("jaeger_remote"), "{err}");
}

#[test]
fn the_sdk_can_be_disabled_from_the_environment_unless_the_flag_asks() {
    let endpoint = ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317");
    for off in [
        ("OTEL_SDK_DISABLED", "true"),
        ("OTEL_TRACES_EXPORTER", "none"),
    ] {
        assert_eq!(
            resolve(&TraceArgs::default(), &[endpoint, off]).unwrap(),
            None
        );
        assert!(resolve(&with_endpoint("http://c:4317"), &[off])
            .unwrap()
            .is_some());
    }
}

#[test]
fn only_plaintext_grpc_endpoints_are_accepted() {
    for bad in ["https://c:4317", "c:4317", "not a url", "http://"] {
        assert!(resolve(&with_endpoint(bad), &[]).is_err(), "{bad}");
    }
    let http = [("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")];
    let err = resolve(&with_endpoint("http://c:4317"), &http)
        .unwrap_err()
        .to_string();
    assert!(err.contains("gRPC"), "{err}");
    let grpc = [("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")];
    assert!(resolve(&with_endpoint("http://c:4317"), &grpc).is_ok());
}

#[test]
fn trace_headers_over_their_limit_are_ignored() {
    let mut h = TraceHeaders::default();
    h.offer("traceparent", &[b'a'; MAX_TRACEPARENT_BYTES + 1]);
    h.offer("tracestate", &vec![b'a'; MAX_TRACESTATE_BYTES + 1]);
    assert_eq!(h, TraceHeaders::default());
    h.offer("traceparent", &[b'a'; MAX_TRACEPARENT_BYTES]);
    h.offer("tracestate", &vec![b'a'; MAX_TRACESTATE_BYTES]);
    assert_eq!(
        h.traceparent.as_deref().map(str::len),
        Some(MAX_TRACEPARENT_BYTES)
    );
    assert_eq!(
        h.tracestate.as_deref().map(str::len),
        Some(MAX_TRACESTATE_BYTES)
    );
    h.offer("x-other", b"ignored");
    h.offer("traceparent", &[0xff, 0xfe]); // not UTF-8: the last good value stays
    assert_eq!(
        h.traceparent.as_deref().map(str::len),
        Some(MAX_TRACEPARENT_BYTES)
    );
}

#[test]
fn the_reason_is_the_first_rule_that_decided() {
    use kvpick_core::{PartitionKey, PickedRank, RankKey, Selection, SessionOutcome};
    let rank = PickedRank {
        key: RankKey {
            worker_id: 1,
            dp_rank: 0,
        },
        worker_name: "w".into(),
        endpoint: "10.0.0.1:8000".parse().unwrap(),
        multiplexed: false,
    };
    let base = Selection {
        booking_id: "b".into(),
        generation: 1,
        partition: PartitionKey {
            model: "m".into(),
            routing_group: String::new(),
        },
        primary: rank.clone(),
        fallbacks: vec![],
        prefill: None,
        overlap_blocks: 0,
        predicted_cached_tokens: 0,
        prompt_blocks: 4,
        prompt_tokens: 64,
        cost: 1.0,
        session: None,
        candidates: 2,
        predicted_ttft_seconds: 0.05,
        scores: vec![],
        shared_blocks: 0,
        transfer: None,
    };
    assert_eq!(pick_reason(&base, false), "load");
    let cached = Selection {
        overlap_blocks: 3,
        ..base.clone()
    };
    assert_eq!(pick_reason(&cached, false), "cache");
    let pair = Selection {
        prefill: Some(rank),
        ..cached.clone()
    };
    assert_eq!(pick_reason(&pair, false), "pd_pair");
    let session = Selection {
        session: Some(SessionOutcome::Reused),
        ..pair.clone()
    };
    assert_eq!(pick_reason(&session, false), "session");
    assert_eq!(pick_reason(&session, true), "pin");
    let created = Selection {
        session: Some(SessionOutcome::Created),
        ..base
    };
    assert_eq!(pick_reason(&created, false), "load");
}
