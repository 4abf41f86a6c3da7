//! The body complete: bodies malformed or odd, the tokenize job and its resumption, the body budget
//! across tokenization and echo, the model rewrite.

use super::super::tests::*;
use super::super::*;
use crate::observability::metrics::Metrics;
use crate::selection::CoreConfig;
use crate::sources::catalog::RankLayout;
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpTrailers, ProcessingRequest};
use processing_response::Response as R;

#[test]
fn malformed_bodies_are_400() {
    let core = pool_core();
    let nested_open = {
        let mut b = br#"{"model":"m","messages":"#.to_vec();
        b.extend(std::iter::repeat_n(b'[', 100_000));
        b
    };
    let top_level_nested = vec![b'['; 100_000];
    let nested_objects = {
        let mut b = br#"{"model":"m","x":"#.to_vec();
        for _ in 0..50_000 {
            b.extend_from_slice(br#"{"a":"#);
        }
        b
    };
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        (
            "invalid UTF-8 in a string",
            b"{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}"
                .to_vec(),
            400,
        ),
        (
            "invalid UTF-8 in the model",
            b"{\"model\":\"m\xc3\x28\"}".to_vec(),
            400,
        ),
        ("binary garbage", vec![0x00, 0xff, 0x13, 0x37, 0x80], 400),
        ("NUL bytes", b"{\"model\":\"m\"}\0\0".to_vec(), 400),
        ("truncated", br#"{"model":"m","messages":[{"#.to_vec(), 400),
        ("100k unclosed [", nested_open, 400),
        ("100k [ at top level", top_level_nested, 400),
        ("50k nested objects", nested_objects, 400),
        (
            "huge exponent model",
            br#"{"model":1e999999}"#.to_vec(),
            400,
        ),
        ("model as an object", br#"{"model":{"a":1}}"#.to_vec(), 400),
        ("a JSON string", br#""model""#.to_vec(), 400),
        ("null", b"null".to_vec(), 400),
        (
            "duplicate model keys",
            br#"{"model":"m","model":"m"}"#.to_vec(),
            400,
        ),
    ];
    for (what, payload, want) in cases {
        assert_eq!(outcome(&core, post_headers(), &payload), want, "{what}");
    }
}

#[test]
fn odd_but_valid_bodies_route() {
    let core = pool_core();
    let huge_ids = br#"{"model":"m","prompt":[99999999999999999999999999,1e999,-1]}"#;
    let long_string = format!(
        r#"{{"model":"m","prompt":"{}"}}"#,
        "x".repeat(4 * 1024 * 1024)
    );
    // Well-formed but 100k deep: the prompt-bearing fields are kept as raw JSON, which serde_json
    // skips over without recursion, so this is routed (the engine judges the content).
    let nested_closed = {
        let mut b = br#"{"model":"m","messages":"#.to_vec();
        b.extend(std::iter::repeat_n(b'[', 100_000));
        b.extend(std::iter::repeat_n(b']', 100_000));
        b.extend_from_slice(br#","unknown":"#);
        b.extend(std::iter::repeat_n(b'[', 100_000));
        b.extend(std::iter::repeat_n(b']', 100_000));
        b.push(b'}');
        b
    };
    let cases: Vec<(&str, Vec<u8>)> = vec![
        (
            "100k closed [ in messages and an unknown field",
            nested_closed,
        ),
        ("token ids out of u32 range", huge_ids.to_vec()),
        (
            "huge numbers elsewhere",
            br#"{"model":"m","max_tokens":1e308,"n":123456789012345678901234567890}"#.to_vec(),
        ),
        (
            "escaped NUL and lone surrogate text",
            br#"{"model":"m","prompt":"a\u0000b\ud800"}"#.to_vec(),
        ),
        ("4 MiB prompt", long_string.into_bytes()),
        (
            "stream not a bool",
            br#"{"model":"m","stream":"yes"}"#.to_vec(),
        ),
        (
            "cache_salt not a string",
            br#"{"model":"m","cache_salt":[1,2]}"#.to_vec(),
        ),
    ];
    for (what, payload) in cases {
        assert_eq!(outcome(&core, post_headers(), &payload), 200, "{what}");
    }
    // A body that is not JSON by its content type is routed on load alone, unparsed.
    let binary = raw_headers(&[
        (":method", b"POST"),
        ("content-type", b"application/octet-stream"),
    ]);
    assert_eq!(outcome(&core, binary, &[0xff, 0x00, 0xfe]), 200);
}

fn tokenizer_settings() -> ExtProcSettings {
    tokenizer_settings_with(crate::tokenize::TokenizeLimits::default())
}

#[test]
fn text_prompt_of_a_tokenized_model_waits_for_ids_then_routes_and_echoes_the_body() {
    for outcome in [
        crate::tokenize::TokenizeOutcome::Tokens {
            ids: (0..64).collect(),
            source: crate::tokenize::Source::Local,
            media: Vec::new(),
        },
        crate::tokenize::TokenizeOutcome::Fallback {
            reason: "test".into(),
        },
    ] {
        let (_core, mut m) = setup(default_pool(), tokenizer_settings());
        assert!(m.handle(post_headers()).unwrap().responses.is_empty());
        let step = m.handle(body(CHAT, true)).unwrap();
        assert!(step.responses.is_empty());
        let job = step.tokenize.expect("a tokenization job");
        assert_eq!(job.model, "m");
        assert_eq!(&job.body[..], CHAT);
        let step = m.resume(outcome);
        assert!(!step.finished);
        assert_eq!(step.responses.len(), 2);
        let dest = set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER).unwrap();
        assert!(dest.starts_with("10.") || dest.contains(':'), "{dest}");
        assert_eq!(streamed(&step.responses[1]), (CHAT, true));
    }
}

fn post_to(path: &str) -> ProcessingRequest {
    headers(
        &[
            (":method", "POST"),
            (":path", path),
            ("content-type", "application/json"),
        ],
        false,
    )
}

#[test]
fn anthropic_messages_and_sglang_generate_are_tokenized_with_their_path() {
    // /v1/messages: a text prompt of the named model, tokenized as an Anthropic body.
    let (_core, mut m) = setup(default_pool(), tokenizer_settings());
    m.handle(post_to("/v1/messages")).unwrap();
    let anthropic =
        br#"{"model":"m","max_tokens":8,"system":"S","messages":[{"role":"user","content":"hi"}]}"#;
    let job = m
        .handle(body(anthropic, true))
        .unwrap()
        .tokenize
        .expect("a job");
    assert_eq!(
        (job.model.as_str(), job.path.as_str()),
        ("m", "/v1/messages")
    );
    // /generate names no model: the only configured tokenizer is used, any partition routes.
    let (_core, mut m) = setup(default_pool(), tokenizer_settings());
    m.handle(post_to("/generate")).unwrap();
    let job = m
        .handle(body(br#"{"text":"hello","rid":"r1"}"#, true))
        .unwrap()
        .tokenize
        .expect("a job");
    assert_eq!((job.model.as_str(), job.path.as_str()), ("m", "/generate"));
    let step = m.resume(crate::tokenize::TokenizeOutcome::Tokens {
        ids: (0..64).collect(),
        source: crate::tokenize::Source::Local,
        media: Vec::new(),
    });
    assert!(set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER).is_some());
    // /generate with `input_ids`: routed at once on the ids, no model, no tokenizer.
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(post_to("/generate")).unwrap();
    let step = m
        .handle(body(br#"{"input_ids":[1,2,3],"stream":true}"#, true))
        .unwrap();
    assert!(step.tokenize.is_none());
    assert!(set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER).is_some());
    // Elsewhere a body without a model is still a 400.
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(post_to("/v1/messages")).unwrap();
    let step = m.handle(body(br#"{"messages":[]}"#, true)).unwrap();
    assert!(step.finished);
}

#[test]
fn tokenization_with_trailers_answers_trailers_after_routing() {
    let (_core, mut m) = setup(default_pool(), tokenizer_settings());
    m.handle(post_headers()).unwrap();
    assert!(m.handle(body(CHAT, false)).unwrap().responses.is_empty());
    let trailers = ProcessingRequest {
        request: Some(processing_request::Request::RequestTrailers(
            HttpTrailers::default(),
        )),
        ..Default::default()
    };
    let step = m.handle(trailers).unwrap();
    assert!(step.tokenize.is_some());
    let step = m.resume(crate::tokenize::TokenizeOutcome::NotApplicable);
    assert_eq!(step.responses.len(), 3);
    assert!(matches!(
        step.responses[2].response,
        Some(R::RequestTrailers(_))
    ));
}

#[test]
fn models_without_a_tokenizer_and_token_id_prompts_route_at_once() {
    let (_core, mut m) = setup(
        vec![worker("b", "other", RankLayout::PerPort(vec![8000]))],
        tokenizer_settings(),
    );
    m.handle(post_headers()).unwrap();
    let step = m
        .handle(body(br#"{"model":"other","prompt":"hi"}"#, true))
        .unwrap();
    assert!(step.tokenize.is_none());
    assert_eq!(step.responses.len(), 2);
    let (_core, mut m) = setup(default_pool(), tokenizer_settings());
    m.handle(post_headers()).unwrap();
    let step = m
        .handle(body(br#"{"model":"m","prompt":[1,2,3]}"#, true))
        .unwrap();
    assert!(step.tokenize.is_none());
    assert_eq!(step.responses.len(), 2);
}

#[test]
fn body_budget_is_shared_by_streams_and_returned_at_every_exit() {
    let settings = Arc::new(budget_settings(100));
    let budget = Arc::clone(&settings.body_budget);
    let core = pool_core();
    let machine = || StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));

    // A stream mid-body holds its bytes.
    let mut a = machine();
    a.handle(post_headers()).unwrap();
    a.handle(body(&CHAT[..50], false)).unwrap();
    assert_eq!(budget.in_use(), 50);

    // Another stream whose body would go over the shared budget: 503, holding nothing.
    let mut b = machine();
    b.handle(post_headers()).unwrap();
    b.handle(body(&CHAT[..30], false)).unwrap();
    let step = b.handle(body(&CHAT[30..], true)).unwrap();
    assert_eq!(
        immediate_status(&step),
        (
            503,
            "kvpick: 503: request body budget exhausted, retry later\n".into()
        )
    );
    assert_eq!(core.metrics().extproc.body_budget_rejected.get(), 1);
    assert_eq!(core.live_bookings(), 0, "a rejected stream books nothing");
    assert_eq!(budget.in_use(), 50);

    // The client goes away mid-body: dropping the stream returns its bytes.
    drop(a);
    assert_eq!(budget.in_use(), 0);

    // Routed: the echoed body keeps its bytes until the host has sent the step.
    let mut c = machine();
    c.handle(post_headers()).unwrap();
    let step = c.handle(body(CHAT, true)).unwrap();
    assert!(!step.finished);
    assert_eq!(budget.in_use(), CHAT.len());
    drop(step);
    assert_eq!(budget.in_use(), 0);
    assert_eq!(core.live_bookings(), 1);

    // Rejected after buffering (400, 413): returned at once.
    let mut d = machine();
    d.handle(post_headers()).unwrap();
    d.handle(body(b"{not json", false)).unwrap();
    assert_eq!(budget.in_use(), 9);
    let step = d.handle(body(b"", true)).unwrap();
    assert_eq!(immediate_status(&step).0, 400);
    assert_eq!(budget.in_use(), 0);
    let small = Arc::new(ExtProcSettings {
        max_body_bytes: 40,
        ..budget_settings(100)
    });
    let mut e = StreamMachine::new(Arc::clone(&core), Arc::clone(&small));
    e.handle(post_headers()).unwrap();
    e.handle(body(&CHAT[..30], false)).unwrap();
    assert_eq!(small.body_budget.in_use(), 30);
    assert_eq!(
        immediate_status(&e.handle(body(&CHAT[30..], true)).unwrap()).0,
        413
    );
    assert_eq!(small.body_budget.in_use(), 0);
}

#[test]
fn body_budget_covers_the_tokenizer_copy_until_the_body_is_echoed() {
    let base = tokenizer_settings();
    let settings = Arc::new(ExtProcSettings {
        body_budget: crate::hosts::extproc::BodyBudget::unmetered(2 * CHAT.len()),
        ..base
    });
    let budget = Arc::clone(&settings.body_budget);
    let core = pool_core();
    let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
    m.handle(post_headers()).unwrap();
    m.handle(body(&CHAT[..20], false)).unwrap();
    let step = m.handle(body(&CHAT[20..], true)).unwrap();
    let job = step.tokenize.expect("tokenization job");
    assert_eq!(&job.body[..], CHAT);
    assert_eq!(budget.in_use(), 2 * CHAT.len(), "chunks and the job's copy");
    drop(job);
    let step = m.resume(crate::tokenize::TokenizeOutcome::NotApplicable);
    // Tiny chunks are coalesced: headers, then one body chunk.
    assert_eq!(step.responses.len(), 2);
    assert_eq!(streamed(&step.responses[1]), (CHAT, true));
    drop(step);
    assert_eq!(budget.in_use(), 0);

    // Disconnected while tokenizing.
    let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
    m.handle(post_headers()).unwrap();
    assert!(m.handle(body(CHAT, true)).unwrap().tokenize.is_some());
    assert_eq!(budget.in_use(), 2 * CHAT.len());
    drop(m);
    assert_eq!(budget.in_use(), 0);

    // No room for the copy: 503 like any body over the budget.
    let tight = Arc::new(ExtProcSettings {
        body_budget: crate::hosts::extproc::BodyBudget::unmetered(CHAT.len() + 10),
        ..tokenizer_settings()
    });
    let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&tight));
    m.handle(post_headers()).unwrap();
    assert_eq!(
        immediate_status(&m.handle(body(CHAT, true)).unwrap()).0,
        503
    );
    assert_eq!(tight.body_budget.in_use(), 0);
}

#[test]
fn echoed_body_chunks_are_the_received_buffers_not_copies() {
    let (_core, mut m) = setup(default_pool(), ExtProcSettings::default());
    m.handle(post_headers()).unwrap();
    let mut first = br#"{"model":"m","prompt":""#.to_vec();
    first.extend(std::iter::repeat_n(b'x', 40_000));
    let second = [vec![b'y'; 50_000], br#""}"#.to_vec()].concat();
    let addresses = [first.as_ptr(), second.as_ptr()];
    let expected = [first.clone(), second.clone()].concat();
    assert!(m
        .handle(body_owned(first, false))
        .unwrap()
        .responses
        .is_empty());
    let step = m.handle(body_owned(second, true)).unwrap();
    let echoed: Vec<(&[u8], bool)> = step.responses[1..].iter().map(streamed).collect();
    assert_eq!(echoed.len(), 2);
    assert_eq!(
        echoed[0].0.as_ptr(),
        addresses[0],
        "first chunk moved, not copied"
    );
    assert_eq!(
        echoed[1].0.as_ptr(),
        addresses[1],
        "second chunk moved, not copied"
    );
    assert_eq!(
        echoed.iter().map(|(_, eos)| *eos).collect::<Vec<_>>(),
        [false, true]
    );
    assert_eq!([echoed[0].0, echoed[1].0].concat(), expected);
}

fn body_owned(bytes: Vec<u8>, end_of_stream: bool) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: bytes,
            end_of_stream,
            ..Default::default()
        })),
        ..Default::default()
    }
}

#[test]
fn a_body_over_the_tokenize_cap_routes_at_once_on_load_alone() {
    let settings = tokenizer_settings_with(crate::tokenize::TokenizeLimits {
        max_body_bytes: CHAT.len() - 1,
        ..Default::default()
    });
    let tokenizers = Arc::clone(settings.tokenizers.as_ref().unwrap());
    let (_core, mut m) = setup(default_pool(), settings);
    m.handle(post_headers()).unwrap();
    let step = m.handle(body(CHAT, true)).unwrap();
    assert!(step.tokenize.is_none(), "no tokenization job");
    assert_eq!(step.responses.len(), 2, "routed and echoed at once");
    assert_eq!(streamed(&step.responses[1]), (CHAT, true));
    assert_eq!(
        tokenizers
            .metrics()
            .skipped
            .with_label_values(&["m", crate::tokenize::SKIP_BODY_TOO_LARGE])
            .get(),
        1
    );
}

#[test]
fn model_rewrite_routes_to_the_target_and_echoes_the_rewritten_body() {
    let (_core, mut m) = setup(
        vec![worker("a", "m-v2", RankLayout::PerPort(vec![8000]))],
        rewrite_settings("rewrites: [{matches: [m], targets: [{model: m-v2}]}]"),
    );
    m.handle(post_headers()).unwrap();
    let sent =
        br#"{"messages": [{"role": "user", "content": "hi"}], "model": "m", "stream": true}"#;
    m.handle(body(&sent[..20], false)).unwrap();
    let step = m.handle(body(&sent[20..], true)).unwrap();
    let dest = set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER);
    assert_eq!(dest.as_deref(), Some("127.0.0.1:8000"), "routed as m-v2");
    let echoed: Vec<u8> = step.responses[1..]
        .iter()
        .flat_map(|r| streamed(r).0.to_vec())
        .collect();
    assert_eq!(
        echoed,
        br#"{"messages": [{"role": "user", "content": "hi"}], "model": "m-v2", "stream": true}"#
    );
    assert!(streamed(step.responses.last().unwrap()).1);

    // No rule for the model: the body is echoed as sent.
    let (_core, mut m) = setup(
        default_pool(),
        rewrite_settings("rewrites: [{matches: [other], targets: [{model: m-v2}]}]"),
    );
    m.handle(post_headers()).unwrap();
    let step = m.handle(body(CHAT, true)).unwrap();
    assert_eq!(streamed(&step.responses[1]).0, CHAT);
}

#[test]
fn weighted_model_rewrite_is_sticky_per_session_and_splits_across_sessions() {
    let settings = Arc::new(rewrite_settings(
        "rewrites: [{matches: [m], targets: [{model: m-v1}, {model: m-v2}]}]",
    ));
    let core = SelectionCore::new(CoreConfig::default(), Metrics::new());
    core.apply_snapshot(vec![
        worker("a", "m-v1", RankLayout::PerPort(vec![8000])),
        worker("b", "m-v2", RankLayout::PerPort(vec![9000])),
    ])
    .unwrap();
    let route = |session: &str, request: &str| {
        let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
        m.handle(headers(
            &[
                (":method", "POST"),
                ("content-type", "application/json"),
                ("x-session-id", session),
                ("x-request-id", request),
            ],
            false,
        ))
        .unwrap();
        let step = m.handle(body(CHAT, true)).unwrap();
        let echoed = streamed(&step.responses[1]).0.to_vec();
        let dest = set_value(header_mutation(&step.responses[0]), DESTINATION_HEADER).unwrap();
        let model = if dest.ends_with(":8000") {
            "m-v1"
        } else {
            "m-v2"
        };
        assert!(
            String::from_utf8(echoed)
                .unwrap()
                .contains(&format!("\"model\":\"{model}\"")),
            "the body names the model of the rank it went to"
        );
        dest
    };
    let first = route("s-1", "r-0");
    for i in 1..8 {
        assert_eq!(
            route("s-1", &format!("r-{i}")),
            first,
            "one session, one target"
        );
    }
    let targets: std::collections::BTreeSet<String> =
        (0..64).map(|i| route(&format!("s-{i}"), "r")).collect();
    assert_eq!(targets.len(), 2, "sessions spread over both targets");
}
