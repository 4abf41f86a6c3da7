//! Cache-view accuracy through the stream machine: each test routes requests with token-id
//! prompts, answers them with simulated engine responses whose `usage` reports cached tokens,
//! and reads what `kvpick_cache_prediction_error_tokens` and the per-rank drift say. Healthy
//! agreement, and the three silent failures the metric exists for: a tokenizer that is not the
//! engine's, a block size that is not the engine's, an engine whose KV events do not arrive.

use super::*;
use crate::observability::metrics::cache_view::CacheViewMetrics;
use crate::observability::metrics::Metrics;
use crate::selection::{CoreConfig, RankKey};
use crate::sources::catalog::{RankLayout, WorkerSpec};
use envoy_types::pb::envoy::config::core::v3::{HeaderMap, HeaderValue};
use envoy_types::pb::envoy::service::ext_proc::v3::{HttpBody, HttpHeaders, ProcessingRequest};
use kvpick_core::event::{KvEvent, Medium};

const BS: u32 = 16;

/// One worker `a`, one rank, block size 16 declared, KV events configured.
fn setup() -> (Arc<SelectionCore>, RankKey) {
    let core = SelectionCore::new(
        CoreConfig {
            seed: Some(1),
            kv_events: true,
            ..Default::default()
        },
        Metrics::new(),
    );
    let spec = WorkerSpec {
        block_size: Some(BS),
        kv_events: Some("tcp://127.0.0.1:5557".into()),
        ..WorkerSpec::for_test("a", "m", RankLayout::PerPort(vec![8000]))
    };
    let rank = RankKey {
        worker_id: spec.worker_id(),
        dp_rank: 0,
    };
    core.apply_snapshot(vec![spec]).unwrap();
    (core, rank)
}

/// The engine's KV events: it stored `tokens`' complete blocks of `block_size`.
fn stored(core: &SelectionCore, rank: RankKey, tokens: &[u32], block_size: u32) {
    let blocks = tokens.len() / block_size as usize;
    let event = KvEvent::BlockStored {
        block_hashes: (0..blocks as u64).map(|i| 7_000 + i).collect(),
        parent_block_hash: None,
        token_ids: tokens[..blocks * block_size as usize].to_vec(),
        block_size,
        lora_id: None,
        medium: Medium::Gpu,
        lora_name: None,
        cache_salt: None,
        group_idx: None,
        media: Vec::new(),
    };
    core.apply_kv_events(rank, &[event]);
}

fn message(request: processing_request::Request) -> ProcessingRequest {
    ProcessingRequest {
        request: Some(request),
        ..Default::default()
    }
}

fn headers(pairs: &[(&str, &str)], end_of_stream: bool) -> HttpHeaders {
    HttpHeaders {
        headers: Some(HeaderMap {
            headers: pairs
                .iter()
                .map(|(k, v)| HeaderValue {
                    key: k.to_string(),
                    value: String::new(),
                    raw_value: v.as_bytes().to_vec(),
                })
                .collect(),
        }),
        end_of_stream,
        ..Default::default()
    }
}

/// One exchange: a completions request whose prompt is `body`'s, routed, then a 200 whose JSON
/// body carries `usage` (`cached`: the engine's `cached_tokens`, `None`: no details).
fn exchange(core: &Arc<SelectionCore>, body: &str, cached: Option<u64>) {
    let mut m = StreamMachine::new(Arc::clone(core), Arc::new(ExtProcSettings::default()));
    let request = [(":method", "POST"), (":path", "/v1/completions")];
    m.handle(message(processing_request::Request::RequestHeaders(
        headers(&request, false),
    )))
    .unwrap();
    let step = m
        .handle(message(processing_request::Request::RequestBody(
            HttpBody {
                body: body.as_bytes().to_vec(),
                end_of_stream: true,
                ..Default::default()
            },
        )))
        .unwrap();
    assert!(!step.finished, "routed");
    let response = [(":status", "200"), ("content-type", "application/json")];
    m.handle(message(processing_request::Request::ResponseHeaders(
        headers(&response, false),
    )))
    .unwrap();
    let details = cached.map_or(String::new(), |c| {
        format!(r#","prompt_tokens_details":{{"cached_tokens":{c}}}"#)
    });
    let usage = format!(r#"{{"usage":{{"prompt_tokens":1,"completion_tokens":1{details}}}}}"#);
    m.handle(message(processing_request::Request::ResponseBody(
        HttpBody {
            body: usage.into_bytes(),
            end_of_stream: true,
            ..Default::default()
        },
    )))
    .unwrap();
    assert!(m.is_complete());
}

fn ids(tokens: &[u32]) -> String {
    let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
    format!(r#"{{"model":"m","prompt":[{}]}}"#, list.join(","))
}

/// Responses observed, and how many agreed exactly, were under (engine cached more) or over.
fn outcomes(view: &CacheViewMetrics) -> (u64, u64, u64, u64) {
    use prometheus::core::Metric;
    let metric = view.error.metric();
    let buckets = metric.get_histogram().get_bucket();
    let at = |bound: f64| {
        buckets
            .iter()
            .find(|b| b.upper_bound() == bound)
            .map_or(0, |b| b.cumulative_count())
    };
    let total = view.error.get_sample_count();
    let under = at(-1.0);
    let exact = at(0.0) - under;
    (total, exact, under, total - under - exact)
}

fn drift(core: &SelectionCore) -> f64 {
    core.metrics()
        .cache_view
        .drift
        .with_label_values(&["a", "0"])
        .get()
}

/// A prompt of `blocks` complete blocks of its own (`tag`) and one token more.
fn prompt(tag: u32, blocks: u32) -> Vec<u32> {
    (tag * 10_000..tag * 10_000 + blocks * BS + 1).collect()
}

#[test]
fn a_right_view_agrees_with_every_response() {
    let (core, rank) = setup();
    for tag in 1..=5 {
        let p = prompt(tag, 4);
        stored(&core, rank, &p, BS);
        // The same prompt again: the engine reuses its four blocks, as kvpick predicts.
        exchange(&core, &ids(&p), Some(64));
    }
    // A block-aligned prompt: the engine computes its last token, so 3 of its 4 blocks.
    let aligned: Vec<u32> = (90_000..90_000 + 4 * BS).collect();
    stored(&core, rank, &aligned, BS);
    exchange(&core, &ids(&aligned), Some(48));
    assert_eq!(outcomes(&core.metrics().cache_view), (6, 6, 0, 0));
    assert_eq!(drift(&core), 0.0);
}

/// kvpick renders other token ids than the engine (a chat template without `bos_token`): it
/// never matches what the engine announced, so it predicts nothing while the engine hits.
#[test]
fn a_tokenizer_that_is_not_the_engines_shows_as_hits_kvpick_never_predicted() {
    let (core, rank) = setup();
    for tag in 1..=8 {
        let engine = prompt(tag, 4);
        stored(&core, rank, &engine, BS);
        // kvpick's ids lack the engine's first token.
        exchange(&core, &ids(&engine[1..]), Some(64));
    }
    let (total, exact, under, over) = outcomes(&core.metrics().cache_view);
    assert_eq!((total, exact, under, over), (8, 0, 8, 0));
    // -64 * (1 - (7/8)^8) = -42.
    assert!(drift(&core) < -35.0, "{}", drift(&core));
}

/// The worker declares 16-token blocks, the engine uses 32: its stores are dropped (counted as
/// mismatches), the rank stays approximate, and kvpick's own picks predict in 16-token blocks
/// what the engine reuses in 32-token ones.
#[test]
fn a_block_size_that_is_not_the_engines_shows_as_predictions_off_by_part_of_a_block() {
    let (core, rank) = setup();
    for tag in 1..=4 {
        // 89 tokens: the engine reuses 2 blocks of 32 (64 tokens); kvpick's 5 of 16 (80).
        let p: Vec<u32> = (tag * 10_000..tag * 10_000 + 90).collect();
        exchange(&core, &ids(&p), Some(0));
        stored(&core, rank, &p, 2 * BS);
        exchange(&core, &ids(&p), Some(64));
    }
    assert_eq!(
        core.metrics().events.block_size_mismatches.get(),
        4,
        "the engine's stores were dropped"
    );
    let (total, exact, under, over) = outcomes(&core.metrics().cache_view);
    assert_eq!((total, exact, under, over), (8, 4, 0, 4));
    assert!(drift(&core) > 0.0, "{}", drift(&core));
}

/// KV events configured, none ever arrives: kvpick routes on its own picks (approximate), and
/// believes cached what the engine has since evicted (here: every prompt).
#[test]
fn an_engine_that_never_publishes_shows_as_hits_the_engine_does_not_report() {
    let (core, _) = setup();
    for tag in 1..=6 {
        let p = prompt(tag, 4);
        exchange(&core, &ids(&p), Some(0));
        exchange(&core, &ids(&p), Some(0));
    }
    let (total, exact, under, over) = outcomes(&core.metrics().cache_view);
    assert_eq!((total, exact, under, over), (12, 6, 0, 6));
    assert!(drift(&core) > 20.0, "{}", drift(&core));
}

/// The engine's events flowed once (the rank is precise) and then stopped: what the engine
/// caches since is unknown to kvpick, whose predictions end with their requests.
/// Each repeat comes past the end grace (a second after the first request ended, when its
/// store event would long have arrived).
#[tokio::test(start_paused = true)]
async fn an_engine_that_stopped_publishing_shows_as_hits_kvpick_never_predicted() {
    let (core, rank) = setup();
    stored(&core, rank, &prompt(99, 1), BS);
    for tag in 1..=6 {
        let p = prompt(tag, 4);
        exchange(&core, &ids(&p), Some(0));
        tokio::time::advance(std::time::Duration::from_millis(1_001)).await;
        exchange(&core, &ids(&p), Some(64));
    }
    let (total, exact, under, over) = outcomes(&core.metrics().cache_view);
    assert_eq!((total, exact, under, over), (12, 6, 6, 0));
    assert!(drift(&core) < -20.0, "{}", drift(&core));
}

/// Only comparable responses count: the engine reported its cached tokens, and kvpick routed on
/// the prompt's engine token ids (a text prompt's pseudo-tokens are not the engine's).
#[test]
fn responses_without_a_comparable_count_are_not_observed() {
    let (core, rank) = setup();
    let p = prompt(1, 4);
    stored(&core, rank, &p, BS);
    exchange(&core, &ids(&p), None);
    exchange(&core, r#"{"model":"m","prompt":"some text"}"#, Some(0));
    assert_eq!(core.metrics().cache_view.error.get_sample_count(), 0);
    exchange(&core, &ids(&p), Some(64));
    assert_eq!(core.metrics().cache_view.error.get_sample_count(), 1);
}
