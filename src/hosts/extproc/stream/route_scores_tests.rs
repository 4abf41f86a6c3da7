//! `--emit-endpoint-scores` through the stream machine: the request-headers answer's `envoy.lb`
//! metadata carries `x-gateway-destination-endpoint-scores` (address -> score) from the pick's own
//! decision, bounded, and nothing at all when the flag is off.

use super::*;
use crate::observability::metrics::Metrics;
use crate::selection::CoreConfig;
use crate::sources::catalog::{RankLayout, WorkerSpec};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest};
use envoy_types::pb::google::protobuf::{value::Kind, Struct};

/// `ranks` single-rank workers on ports 8001.., and a machine with `endpoint_scores`.
fn setup(ranks: u16, endpoint_scores: usize, fallbacks: usize) -> StreamMachine {
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(1),
            ..Default::default()
        },
        Metrics::new(),
    );
    core.apply_snapshot(
        (1..=ranks)
            .map(|i| {
                WorkerSpec::for_test(&format!("w{i}"), "m", RankLayout::PerPort(vec![8000 + i]))
            })
            .collect(),
    )
    .unwrap();
    StreamMachine::new(
        core,
        Arc::new(ExtProcSettings {
            endpoint_scores,
            fallbacks,
            ..Default::default()
        }),
    )
}

/// Routes one chat request; the `envoy.lb` struct of the answer.
fn route(m: &mut StreamMachine) -> Struct {
    let headers = ProcessingRequest {
        request: Some(processing_request::Request::RequestHeaders(HttpHeaders {
            headers: Some(HeaderMap {
                headers: [(":method", "POST"), (":path", "/v1/chat/completions")]
                    .iter()
                    .map(|(k, v)| HeaderValue {
                        key: k.to_string(),
                        raw_value: v.as_bytes().to_vec(),
                        ..Default::default()
                    })
                    .collect(),
            }),
            ..Default::default()
        })),
        ..Default::default()
    };
    m.handle(headers).unwrap();
    let body = ProcessingRequest {
        request: Some(processing_request::Request::RequestBody(HttpBody {
            body: br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#.to_vec(),
            end_of_stream: true,
            ..Default::default()
        })),
        ..Default::default()
    };
    let step = m.handle(body).unwrap();
    let md = step.responses[0].dynamic_metadata.clone().unwrap();
    match md.fields[LB_NAMESPACE].kind.clone() {
        Some(Kind::StructValue(lb)) => lb,
        other => panic!("envoy.lb: {other:?}"),
    }
}

fn scores(lb: &Struct) -> Vec<(String, f64)> {
    let Some(Kind::StructValue(s)) = &lb.fields[SCORES_KEY].kind else {
        panic!("{SCORES_KEY} is not a struct: {lb:?}")
    };
    s.fields
        .iter()
        .map(|(k, v)| match v.kind {
            Some(Kind::NumberValue(n)) => (k.clone(), n),
            ref other => panic!("{k}: {other:?}"),
        })
        .collect()
}

fn destination(lb: &Struct) -> Vec<String> {
    match &lb.fields[DESTINATION_HEADER].kind {
        Some(Kind::StringValue(s)) => s.split(',').map(str::to_string).collect(),
        other => panic!("{other:?}"),
    }
}

/// 17 candidates, the default bound of 16: exactly 16 scores, every destination among them, each
/// an `ip:port` with a number in (0, 1].
#[test]
fn n_plus_one_candidates_carry_exactly_n_scores() {
    let limit = crate::server::DEFAULT_ENDPOINT_SCORES_LIMIT;
    // Two fallbacks: the bounded search ranks 2 * 8 + 1 = 17 exactly, so all 17 are costed.
    let mut m = setup(limit as u16 + 1, limit, 2);
    let lb = route(&mut m);
    let candidates = m.reservation.as_ref().unwrap().selection().candidates;
    assert_eq!(candidates as usize, limit + 1);
    let scores = scores(&lb);
    assert_eq!(scores.len(), limit, "{scores:?}");
    for d in destination(&lb) {
        assert!(
            scores.iter().any(|(a, _)| *a == d),
            "destination {d} has a score"
        );
    }
    for (address, score) in &scores {
        assert!(address.parse::<std::net::SocketAddr>().is_ok(), "{address}");
        assert!(*score > 0.0 && *score <= 1.0, "{address}: {score}");
    }
}

/// The pick's score is its decision cost as the core computed it: 1 / (1 + cost).
#[test]
fn the_primary_s_score_is_its_decision_cost() {
    let mut m = setup(3, 16, 0);
    let lb = route(&mut m);
    let cost = m.reservation.as_ref().unwrap().selection().cost;
    let primary = destination(&lb).remove(0);
    let scores = scores(&lb);
    let (_, score) = scores.iter().find(|(a, _)| *a == primary).unwrap();
    assert_eq!(*score, 1.0 / (1.0 + cost));
    assert_eq!(scores.len(), 3);
}

/// Off (the default): the metadata is the destination alone, as before.
#[test]
fn off_there_is_no_scores_key() {
    let mut m = setup(3, 0, 1);
    let lb = route(&mut m);
    assert_eq!(lb.fields.len(), 1, "{lb:?}");
    assert!(lb.fields.contains_key(DESTINATION_HEADER));
    assert!(!lb.fields.contains_key(SCORES_KEY));
}
