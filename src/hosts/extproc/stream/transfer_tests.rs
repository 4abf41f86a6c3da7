//! KV transfer hints through the ext_proc stream: the header and the body's
//! `kv_transfer_params.remote_kv_source` appear only with `--kv-transfer-hints` on and a pick
//! that is not the holder (the body only with `--kv-transfer-p2p-port`); client-sent copies of
//! the header never pass.

use super::super::tests::*;
use super::super::*;
use super::*;
use crate::observability::metrics::Metrics;
use crate::selection::CoreConfig;
use crate::sources::catalog::{RankLayout, WorkerSpec};

/// A long completion prompt (pseudo-tokens of its JSON: many blocks).
fn long_body() -> Vec<u8> {
    format!(
        r#"{{"model":"m","prompt":"{}","max_tokens":4}}"#,
        "word ".repeat(400)
    )
    .into_bytes()
}

fn core(hints: bool) -> Arc<SelectionCore> {
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(1),
            kv_transfer_hints: hints,
            ..Default::default()
        },
        Metrics::new(),
    );
    let pool: Vec<WorkerSpec> = vec![
        worker("a", "m", RankLayout::PerPort(vec![8000])),
        worker("b", "m", RankLayout::PerPort(vec![9000])),
    ];
    core.apply_snapshot(pool).unwrap();
    core
}

/// Sends `body` on a new stream (with `extra` headers); the step answering its end.
fn send(
    core: &Arc<SelectionCore>,
    settings: &Arc<ExtProcSettings>,
    body_bytes: &[u8],
    extra: &[(&str, &str)],
) -> (StreamMachine, Step) {
    let mut m = StreamMachine::new(Arc::clone(core), Arc::clone(settings));
    let mut pairs = vec![
        (":method", "POST"),
        (":path", "/v1/completions"),
        ("content-type", "application/json"),
    ];
    pairs.extend_from_slice(extra);
    m.handle(headers(&pairs, false)).unwrap();
    let step = m.handle(body(body_bytes, true)).unwrap();
    (m, step)
}

fn echoed(step: &Step) -> Vec<u8> {
    step.responses[1..]
        .iter()
        .flat_map(|r| streamed(r).0.to_vec())
        .collect()
}

/// The first stream's pick holds the prompt (approximate mode) and stays busy with it; the
/// second, with the same prompt, goes to the idle rank: the holder is the other rank.
fn holder_busy(
    hints: bool,
    p2p: Option<u16>,
) -> (StreamMachine, Step, StreamMachine, Step, String) {
    let core = core(hints);
    let settings = Arc::new(ExtProcSettings {
        kv_transfer_p2p_port: p2p,
        ..Default::default()
    });
    let (first_m, first) = send(&core, &settings, &long_body(), &[]);
    let holder = set_value(header_mutation(&first.responses[0]), DESTINATION_HEADER).unwrap();
    let spoof = [(KV_CACHE_SOURCE_HEADER, "6.6.6.6:1")];
    let (second_m, second) = send(&core, &settings, &long_body(), &spoof);
    let picked = set_value(header_mutation(&second.responses[0]), DESTINATION_HEADER).unwrap();
    assert_ne!(picked, holder, "the second pick avoids the busy holder");
    (first_m, first, second_m, second, holder)
}

#[test]
fn a_pick_away_from_the_holder_names_it_in_the_header_and_the_body() {
    let (_a, first, _b, second, holder) = holder_busy(true, Some(5710));
    // The first pick found nothing cached anywhere: no hint, body as sent.
    assert_eq!(
        set_value(header_mutation(&first.responses[0]), KV_CACHE_SOURCE_HEADER),
        None
    );
    assert_eq!(echoed(&first), long_body());
    let mutation = header_mutation(&second.responses[0]);
    assert_eq!(
        set_value(mutation, KV_CACHE_SOURCE_HEADER).as_deref(),
        Some(holder.as_str()),
        "kvpick's value, not the client's"
    );
    let body: serde_json::Value = serde_json::from_slice(&echoed(&second)).unwrap();
    let source = &body["kv_transfer_params"]["remote_kv_source"];
    assert_eq!(source["remote_host"], "127.0.0.1");
    assert_eq!(source["remote_port"], 5710, "the P2P port + DP rank 0");
    assert!(source["kv_request_id"]
        .as_str()
        .is_some_and(|s| !s.is_empty()));
    assert_eq!(
        body["prompt"],
        "word ".repeat(400),
        "the rest of the body is kept"
    );
    assert_eq!(body["max_tokens"], 4);
}

#[test]
fn without_the_p2p_port_only_the_header_names_the_holder() {
    let (_a, _, _b, second, holder) = holder_busy(true, None);
    let mutation = header_mutation(&second.responses[0]);
    assert_eq!(set_value(mutation, KV_CACHE_SOURCE_HEADER), Some(holder));
    assert_eq!(echoed(&second), long_body(), "the body passes as sent");
}

#[test]
fn with_hints_off_nothing_is_added_and_a_client_header_is_removed() {
    let (_a, _, _b, second, _) = holder_busy(false, Some(5710));
    let mutation = header_mutation(&second.responses[0]);
    assert_eq!(set_value(mutation, KV_CACHE_SOURCE_HEADER), None);
    assert!(mutation
        .remove_headers
        .iter()
        .any(|h| h == KV_CACHE_SOURCE_HEADER));
    assert_eq!(echoed(&second), long_body());
}

fn source() -> serde_json::Value {
    serde_json::json!({"kv_request_id": "r", "remote_host": "10.0.0.1", "remote_port": 5710})
}

#[test]
fn remote_kv_source_is_inserted_first_or_merged_and_never_breaks_a_body() {
    let out = with_remote_kv_source(br#" {"model":"m"}"#, source()).unwrap();
    assert_eq!(
        std::str::from_utf8(&out).unwrap(),
        r#" {"kv_transfer_params":{"remote_kv_source":{"kv_request_id":"r","remote_host":"10.0.0.1","remote_port":5710}},"model":"m"}"#
    );
    let empty = with_remote_kv_source(b"{ }", source()).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&empty).unwrap();
    assert_eq!(
        v["kv_transfer_params"]["remote_kv_source"]["remote_port"],
        5710
    );
    let merged = with_remote_kv_source(
        br#"{"kv_transfer_params":{"do_remote_decode":true}}"#,
        source(),
    )
    .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&merged).unwrap();
    assert_eq!(v["kv_transfer_params"]["do_remote_decode"], true);
    assert_eq!(
        v["kv_transfer_params"]["remote_kv_source"]["remote_host"],
        "10.0.0.1"
    );
    for bad in [
        &b"[1]"[..],
        b"not json",
        b"",
        br#"{"kv_transfer_params":7}"#,
    ] {
        assert_eq!(with_remote_kv_source(bad, source()), None);
    }
}
