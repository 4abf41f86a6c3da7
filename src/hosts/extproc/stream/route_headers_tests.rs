//! The routing headers: spoofed headers removed, fallbacks listed, the multiplexed rank header, a
//! prefill/decode pair's headers in both protocols.

use super::super::tests::*;
use super::super::*;
use crate::observability::metrics::Metrics;
use crate::selection::CoreConfig;
use crate::sources::catalog::{RankLayout, WorkerSpec};

#[test]
fn spoofed_headers_are_removed_and_fallbacks_listed() {
    let pool = vec![
        worker("a", "m", RankLayout::PerPort(vec![8000])),
        worker("b", "m", RankLayout::PerPort(vec![9000])),
    ];
    let (_core, mut m) = setup(
        pool,
        ExtProcSettings {
            fallbacks: 1,
            ..Default::default()
        },
    );
    m.handle(headers(
        &[
            (":method", "POST"),
            ("x-gateway-destination-endpoint", "6.6.6.6:1"),
            ("x-gateway-destination-endpoint-subset", "6.6.6.6"),
            ("X-Gateway-Inference-Objective", "x"),
            // Read (a target model, as llm-d-router reads it), then kept from the upstream.
            ("x-gateway-model-name-rewrite", "m"),
            ("x-data-parallel-rank", "7"),
        ],
        false,
    ))
    .unwrap();
    let step = m.handle(body(CHAT, true)).unwrap();
    let mutation = header_mutation(&step.responses[0]);
    let dest = set_value(mutation, DESTINATION_HEADER).unwrap();
    let parts: Vec<&str> = dest.split(',').collect();
    assert_eq!(parts.len(), 2);
    assert_ne!(parts[0], parts[1]);
    assert_eq!(metadata_destination(&step.responses[0]), dest);
    let mut removed = mutation.remove_headers.clone();
    removed.sort();
    assert_eq!(
        removed,
        vec![
            "x-data-parallel-rank",
            "x-gateway-destination-endpoint-subset",
            "x-gateway-inference-objective",
            "x-gateway-model-name-rewrite",
        ]
    );
}

#[test]
fn multiplexed_rank_header() {
    let pool = vec![worker(
        "a",
        "m",
        RankLayout::Multiplexed {
            port: 8000,
            size: 2,
        },
    )];
    let mut seen = std::collections::BTreeSet::new();
    let (core, _) = setup(pool, ExtProcSettings::default());
    let settings = Arc::new(ExtProcSettings::default());
    for _ in 0..40 {
        let mut m = StreamMachine::new(Arc::clone(&core), Arc::clone(&settings));
        m.handle(post_headers()).unwrap();
        let step = m.handle(body(CHAT, true)).unwrap();
        let mutation = header_mutation(&step.responses[0]);
        assert_eq!(
            set_value(mutation, DESTINATION_HEADER).unwrap(),
            "127.0.0.1:8000"
        );
        let rank = set_value(mutation, "x-data-parallel-rank").unwrap();
        assert_eq!(set_value(mutation, "x-dynamo-dp-rank").unwrap(), rank);
        seen.insert(rank);
    }
    assert_eq!(seen.into_iter().collect::<Vec<_>>(), vec!["0", "1"]);
}

/// A prefill rank and a decode rank; splitting ties with prefilling locally on idle ranks.
fn pd_setup(protocol: crate::hosts::extproc::PdProtocol) -> (Arc<SelectionCore>, StreamMachine) {
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(1),
            pd: kvpick_core::PdConfig {
                transfer_block_cost: 0.0,
                ..Default::default()
            },
            ..Default::default()
        },
        Metrics::new(),
    );
    let role = |name: &str, port: u16, role: kvpick_core::Role| WorkerSpec {
        roles: vec![role],
        ..worker(name, "m", RankLayout::PerPort(vec![port]))
    };
    core.apply_snapshot(vec![
        role("p", 8000, kvpick_core::Role::Prefill),
        role("d", 9000, kvpick_core::Role::Decode),
    ])
    .unwrap();
    let settings = ExtProcSettings {
        pd_protocol: protocol,
        ..Default::default()
    };
    let machine = StreamMachine::new(Arc::clone(&core), Arc::new(settings));
    (core, machine)
}

/// 8 KiB of prompt text: 2048 pseudo tokens, over the split threshold.
fn long_completion() -> Vec<u8> {
    format!(r#"{{"model":"m","prompt":"{}"}}"#, "word".repeat(2048)).into_bytes()
}

fn requests_by_worker(core: &SelectionCore) -> Vec<(String, u64)> {
    let mut loads: Vec<(String, u64)> = core
        .list_workers(None)
        .iter()
        .map(|w| (w.record.spec.name.clone(), w.loads[0].active_requests))
        .collect();
    loads.sort();
    loads
}

#[test]
fn a_split_pick_names_the_prefill_rank_in_llm_d_headers_and_frees_each_side_once() {
    let (core, mut m) = pd_setup(crate::hosts::extproc::PdProtocol::LlmD);
    m.handle(headers(
        &[
            (":method", "POST"),
            ("x-prefiller-host-port", "6.6.6.6:1"),
            ("x-dynamo-routing-mode", "aggregated"),
        ],
        false,
    ))
    .unwrap();
    let step = m.handle(body(&long_completion(), true)).unwrap();
    let mutation = header_mutation(&step.responses[0]);
    assert_eq!(
        set_value(mutation, DESTINATION_HEADER).as_deref(),
        Some("127.0.0.1:9000"),
        "the destination is the decode rank"
    );
    assert_eq!(
        set_value(mutation, "x-prefiller-host-port").as_deref(),
        Some("127.0.0.1:8000")
    );
    assert_eq!(set_value(mutation, "x-dynamo-prefill-instance-id"), None);
    assert_eq!(
        mutation.remove_headers,
        vec!["x-dynamo-routing-mode".to_string()],
        "a client-sent pair header never reaches the sidecar (the set one replaces its own)"
    );
    assert_eq!(
        requests_by_worker(&core),
        vec![("d".into(), 1), ("p".into(), 1)]
    );
    m.handle(response_headers("text/event-stream")).unwrap();
    m.handle(response_body(b"data: {}\n\n", false)).unwrap();
    assert_eq!(
        requests_by_worker(&core),
        vec![("d".into(), 1), ("p".into(), 0)],
        "the first token frees the prefill rank"
    );
    m.handle(response_body(b"data: [DONE]\n\n", true)).unwrap();
    assert_eq!(
        requests_by_worker(&core),
        vec![("d".into(), 0), ("p".into(), 0)]
    );
    drop(m);
    assert_eq!(
        requests_by_worker(&core),
        vec![("d".into(), 0), ("p".into(), 0)],
        "nothing is freed twice"
    );
}

#[test]
fn a_split_pick_speaks_dynamo_and_a_dropped_stream_frees_both_ranks() {
    let (core, mut m) = pd_setup(crate::hosts::extproc::PdProtocol::Dynamo);
    m.handle(headers(&[(":method", "POST")], false)).unwrap();
    let step = m.handle(body(&long_completion(), true)).unwrap();
    let mutation = header_mutation(&step.responses[0]);
    let prefill_id = kvpick_core::catalog::worker_id("static", "p").to_string();
    assert_eq!(
        set_value(mutation, "x-dynamo-prefill-instance-id"),
        Some(prefill_id)
    );
    assert_eq!(
        set_value(mutation, "x-dynamo-prefill-dp-rank").as_deref(),
        Some("0")
    );
    assert_eq!(
        set_value(mutation, "x-dynamo-routing-mode").as_deref(),
        Some("disaggregated")
    );
    assert_eq!(set_value(mutation, "x-prefiller-host-port"), None);
    assert_eq!(
        requests_by_worker(&core),
        vec![("d".into(), 1), ("p".into(), 1)]
    );
    drop(m);
    assert_eq!(
        requests_by_worker(&core),
        vec![("d".into(), 0), ("p".into(), 0)]
    );
    // A short prompt is served by the decode rank alone: Dynamo hears `aggregated`.
    let mut m = StreamMachine::new(
        Arc::clone(&core),
        Arc::new(ExtProcSettings {
            pd_protocol: crate::hosts::extproc::PdProtocol::Dynamo,
            ..Default::default()
        }),
    );
    m.handle(headers(&[(":method", "POST")], false)).unwrap();
    let step = m.handle(body(CHAT, true)).unwrap();
    let mutation = header_mutation(&step.responses[0]);
    assert_eq!(
        set_value(mutation, "x-dynamo-routing-mode").as_deref(),
        Some("aggregated")
    );
    assert_eq!(set_value(mutation, "x-dynamo-prefill-instance-id"), None);
}
