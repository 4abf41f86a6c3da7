//! Multimodal cache keys end to end without an engine: KV events carrying vLLM's multimodal
//! `extra_keys` (written by vLLM's own code, `tests/fixtures/kv_events/multimodal/`) and requests
//! carrying the same images key the same blocks; another image, or the same image behind other
//! tokens, shares nothing from the image's block on (docs/kv-events.md "Multimodal").

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test harness: a panic is a failure report

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use kvpick::observability::metrics::Metrics;
use kvpick::selection::{CoreConfig, RankKey, SelectionCore};
use kvpick::sources::catalog::{RankLayout, WorkerSpec};
use kvpick::sources::events::decode::decode_batch;
use kvpick::tokenize::media::base64_identifier;
use kvpick::tokenize::{ModelEntry, TokenizeOutcome, Tokenizers};
use kvpick_core::hash::{media_id, MediaSpan};
use kvpick_core::request::{PromptInput, SelectionRequest};
use prometheus::Registry;
use serde_json::Value;

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/kv_events/multimodal"
);

fn layout() -> Value {
    serde_json::from_str(&std::fs::read_to_string(format!("{FIXTURES}/layout.json")).unwrap())
        .unwrap()
}

fn b64(name: &str) -> String {
    std::fs::read_to_string(format!("{FIXTURES}/{name}.b64")).unwrap()
}

fn core(block: u32) -> (Arc<SelectionCore>, RankKey) {
    let core = SelectionCore::new(CoreConfig::default(), Metrics::new());
    core.apply_snapshot(vec![WorkerSpec {
        block_size: Some(block),
        ..WorkerSpec::for_test("w", "m", RankLayout::PerPort(vec![8000]))
    }])
    .unwrap();
    let id = core.list_workers(None)[0].record.id;
    (
        core,
        RankKey {
            worker_id: id,
            dp_rank: 0,
        },
    )
}

/// Blocks of `prompt` the rank holds (asked with one token more: an engine computes a prompt's
/// last token, so only then are all of its blocks reusable).
fn overlap(core: &SelectionCore, rank: RankKey, tokens: &[u32], media: &[MediaSpan]) -> u32 {
    let request = SelectionRequest {
        request_id: "q".into(),
        model: Some("m".into()),
        prompt: PromptInput::MediaTokens {
            tokens: [tokens, &[u32::MAX]].concat(),
            media: media.to_vec(),
        },
        cache_salt: Some("tenant-a".into()),
        ..Default::default()
    };
    let (_, scores) = core.overlap_scores(&request).unwrap();
    scores
        .into_iter()
        .find(|(p, _)| p.key == rank)
        .map_or(0, |(_, d)| d.gpu)
}

/// The fixture's request as kvpick sees it: its tokens and its images' spans, the data-URL image
/// identified by kvpick from its bytes (not copied from the events).
fn fixture_request(image: &str) -> (Vec<u32>, Vec<MediaSpan>) {
    let layout = layout();
    let tokens: Vec<u32> = layout["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_u64().unwrap() as u32)
        .collect();
    let model_id = layout["model_id"].as_str().unwrap();
    let f = &layout["features"];
    let red = base64_identifier(&b64(image), model_id).unwrap();
    let spans = vec![
        MediaSpan {
            id: media_id(&red),
            offset: f[0]["offset"].as_u64().unwrap(),
            length: f[0]["length"].as_u64().unwrap(),
        },
        MediaSpan {
            id: media_id("client-uuid-7"),
            offset: f[1]["offset"].as_u64().unwrap(),
            length: f[1]["length"].as_u64().unwrap(),
        },
    ];
    (tokens, spans)
}

#[test]
fn a_request_with_the_image_matches_every_block_the_events_stored() {
    let (core, rank) = core(16);
    let batch =
        decode_batch(&std::fs::read(format!("{FIXTURES}/stored.msgpack")).unwrap()).unwrap();
    let stats = core.apply_kv_events(rank, &batch.events);
    assert_eq!((stats.applied, stats.dropped), (2, 0));
    let (tokens, spans) = fixture_request("red");
    assert_eq!(tokens.len(), 96);
    assert_eq!(overlap(&core, rank, &tokens, &spans), 6);
    // The same tokens keyed as text (the images ignored) match nothing: the events' image
    // blocks carry the image, and block 0 holds the first one.
    assert_eq!(overlap(&core, rank, &tokens, &[]), 0);
}

#[test]
fn another_image_or_the_same_image_behind_other_tokens_shares_nothing_from_its_block_on() {
    let (core, rank) = core(16);
    let batch =
        decode_batch(&std::fs::read(format!("{FIXTURES}/stored.msgpack")).unwrap()).unwrap();
    core.apply_kv_events(rank, &batch.events);
    // Another picture in the same place: block 0 holds its start, so nothing is shared.
    let (tokens, blue) = fixture_request("blue");
    assert_eq!(overlap(&core, rank, &tokens, &blue), 0);
    // The second image (a client uuid, from token 55 in block 3) changed: blocks 0-2 still match.
    let (tokens, mut spans) = fixture_request("red");
    spans[1].id = media_id("client-uuid-8");
    assert_eq!(overlap(&core, rank, &tokens, &spans), 3);
    // The same images, one text token before the first changed: nothing (prefix semantics).
    let (mut tokens, spans) = fixture_request("red");
    tokens[0] += 1;
    assert_eq!(overlap(&core, rank, &tokens, &spans), 0);
    // Same images and prefix, text changed after the second image (block 4): blocks 0-3 match.
    let (mut tokens, spans) = fixture_request("red");
    tokens[70] += 1;
    assert_eq!(overlap(&core, rank, &tokens, &spans), 4);
}

/// The tiny LLaVA directory `e2e/vllm/tiny_llava.py` writes for vLLM, as far as kvpick reads it:
/// the e2e model's tokenizer with `<image>` added as token 4096, and a LLaVA `config.json` whose
/// 112 px CLIP tower with 14 px patches gives 64 placeholder tokens per image.
fn llava_dir(name: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm-model");
    let dir = std::env::temp_dir().join(format!("kvpick-llava-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut tok: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("tokenizer.json")).unwrap())
            .unwrap();
    tok["added_tokens"]
        .as_array_mut()
        .unwrap()
        .push(serde_json::json!({"id": 4096,
        "content": "<image>", "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": true}));
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).unwrap();
    std::fs::copy(
        src.join("tokenizer_config.json"),
        dir.join("tokenizer_config.json"),
    )
    .unwrap();
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "llava", "image_token_index": 4096,
        "vision_feature_select_strategy": "default",
        "vision_config": {"image_size": 112, "patch_size": 14}}"#,
    )
    .unwrap();
    dir
}

fn tokenizers(dir: &Path) -> Tokenizers {
    let mut entry = ModelEntry::for_dir(&format!("llava={}", dir.display())).unwrap();
    entry.engine_model = Some("kvpick-test/tiny-llava".into());
    Tokenizers::from_entries(&[entry], Path::new("."), &Registry::new()).unwrap()
}

async fn tokenize(t: &Tokenizers, body: Value) -> (Vec<u32>, Vec<MediaSpan>) {
    match t.tokenize("llava", Bytes::from(body.to_string())).await {
        TokenizeOutcome::Tokens { ids, media, .. } => (ids, media),
        other => panic!("{body}: {other:?}"),
    }
}

fn chat(text: &str, images: &[&str]) -> Value {
    let mut content = vec![serde_json::json!({"type": "text", "text": text})];
    for b64 in images {
        content.push(serde_json::json!({"type": "image_url",
            "image_url": {"url": format!("data:image/png;base64,{b64}")}}));
    }
    serde_json::json!({"model": "llava", "messages": [{"role": "user", "content": content}]})
}

#[tokio::test]
async fn chat_images_tokenize_to_expanded_placeholders_with_the_images_identifiers() {
    let dir = llava_dir("chat");
    let t = tokenizers(&dir);
    let (red, blue) = (b64("red"), b64("blue"));
    let (ids, media) = tokenize(&t, chat("what is this?", &[&red])).await;
    // vLLM's string format: `<image>\nwhat is this?`; the placeholder expanded to 64 tokens.
    assert_eq!(media.len(), 1);
    let span = media[0];
    assert_eq!(span.length, 64);
    let at = span.offset as usize;
    assert!(ids[at..at + 64].iter().all(|&t| t == 4096));
    assert_eq!(ids.iter().filter(|&&t| t == 4096).count(), 64);
    let expected = layout()["features"][0]["identifier"]
        .as_str()
        .unwrap()
        .to_string();
    assert_eq!(span.id, media_id(&expected));
    // Another image: the same tokens, another identifier.
    let (ids2, media2) = tokenize(&t, chat("what is this?", &[&blue])).await;
    assert_eq!(ids2, ids);
    assert_ne!(media2[0].id, span.id);
    // Anthropic's base64 source: the same identifier and tokens.
    let anthropic = serde_json::json!({"model": "llava", "max_tokens": 1, "messages": [{"role": "user",
        "content": [{"type": "text", "text": "what is this?"}, {"type": "image", "source":
        {"type": "base64", "media_type": "image/png", "data": red}}]}]});
    let out = t
        .tokenize_request(
            kvpick::tokenize::body::Endpoint::Messages,
            "llava",
            Bytes::from(anthropic.to_string()),
        )
        .await;
    let TokenizeOutcome::Tokens {
        ids: a_ids,
        media: a_media,
        ..
    } = out
    else {
        panic!("{out:?}")
    };
    assert_eq!((&a_ids, &a_media), (&ids, &media));
    // Responses' `input_image`: the same.
    let responses = serde_json::json!({"model": "llava", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is this?"},
        {"type": "input_image", "image_url": format!("data:image/png;base64,{red}")}]}]});
    assert_eq!(tokenize(&t, responses).await, (ids.clone(), media.clone()));
    // An http URL: the same tokens, an approximate identifier (not vLLM's), stable per URL.
    let url = |u: &str| {
        serde_json::json!({"model": "llava", "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": u}}]}]})
    };
    let (h_ids, h_media) = tokenize(&t, url("https://example.com/a.png")).await;
    assert_eq!(h_ids, ids);
    assert_ne!(h_media[0].id, media[0].id);
    assert_eq!(
        tokenize(&t, url("https://example.com/a.png")).await.1,
        h_media
    );
    assert_ne!(
        tokenize(&t, url("https://example.com/b.png")).await.1,
        h_media
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[tokio::test]
async fn a_model_without_an_image_layout_routes_image_requests_on_load_alone() {
    let text_model = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm-model");
    let entry = ModelEntry::for_dir(&format!("m={}", text_model.display())).unwrap();
    let t = Tokenizers::from_entries(&[entry], Path::new("."), &Registry::new()).unwrap();
    let mut body = chat("hi", &[&b64("red")]);
    body["model"] = "m".into();
    let out = t.tokenize("m", Bytes::from(body.to_string())).await;
    assert!(
        matches!(&out, TokenizeOutcome::Fallback { reason } if reason.contains("image")),
        "{out:?}"
    );
}

/// `engine.json`: what a real vLLM 0.32 serving the tiny LLaVA (`e2e/vllm/tiny_llava.py`,
/// `--load-format dummy`, block size 32) published for four chat requests with images
/// (`e2e/vllm/record_multimodal.py`): each body, its prompt token count and the KV-event payloads.
struct EngineCase {
    name: String,
    body: Value,
    prompt_tokens: usize,
    events: Vec<kvpick::sources::events::decode::KvEvent>,
}

fn engine_cases() -> (String, Vec<EngineCase>) {
    let text = std::fs::read_to_string(format!("{FIXTURES}/engine.json")).unwrap();
    let recorded: Value = serde_json::from_str(&text).unwrap();
    let cases = recorded["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| EngineCase {
            name: c["name"].as_str().unwrap().to_string(),
            body: c["body"].clone(),
            prompt_tokens: c["prompt_tokens"].as_u64().unwrap() as usize,
            events: c["payloads"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|p| {
                    let hex = p.as_str().unwrap().as_bytes();
                    let bytes: Vec<u8> = hex
                        .chunks(2)
                        .map(|b| u8::from_str_radix(std::str::from_utf8(b).unwrap(), 16).unwrap())
                        .collect();
                    decode_batch(&bytes).unwrap().events
                })
                .collect(),
        })
        .collect();
    (recorded["model_id"].as_str().unwrap().to_string(), cases)
}

#[tokio::test]
async fn kvpicks_tokens_and_keys_equal_a_real_vllms_for_the_same_image_requests() {
    let (model_id, cases) = engine_cases();
    let dir = llava_dir("engine");
    let mut entry = ModelEntry::for_dir(&format!("llava={}", dir.display())).unwrap();
    entry.engine_model = Some(model_id);
    let t = Tokenizers::from_entries(&[entry], Path::new("."), &Registry::new()).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    let mut requests = Vec::new();
    for case in &cases {
        let (ids, media) = tokenize(&t, case.body.clone()).await;
        // The engine's prompt: its token count, and every stored block's tokens are ours.
        assert_eq!(ids.len(), case.prompt_tokens, "{}", case.name);
        let stored: Vec<u32> = case
            .events
            .iter()
            .flat_map(|e| match e {
                kvpick::sources::events::decode::KvEvent::BlockStored { token_ids, .. } => {
                    token_ids.clone()
                }
                _ => Vec::new(),
            })
            .collect();
        // A store continuing a cached prefix (vLLM reuses the blocks it holds) holds the trailing
        // full blocks of the prompt.
        let skipped = (ids.len() / 32) * 32 - stored.len();
        assert_eq!(
            &ids[skipped..skipped + stored.len()],
            &stored[..],
            "{}",
            case.name
        );
        requests.push((ids, media));
    }
    // The engine's state after the four requests, on one rank: each request matches every block
    // of its prompt (101 tokens: 3 blocks of 32; "two", 153 tokens: 4, the first of them stored
    // by "red" and reused by the engine, so kvpick's key for it agrees across the two requests).
    let (core, rank) = core(32);
    for case in &cases {
        let stats = core.apply_kv_events(rank, &case.events);
        assert_eq!(stats.dropped, 0, "{}", case.name);
    }
    let overlap = |ids: &[u32], media: &[MediaSpan]| {
        let request = SelectionRequest {
            request_id: "q".into(),
            model: Some("m".into()),
            prompt: PromptInput::MediaTokens {
                tokens: [ids, &[u32::MAX]].concat(),
                media: media.to_vec(),
            },
            ..Default::default()
        };
        let (_, scores) = core.overlap_scores(&request).unwrap();
        scores
            .into_iter()
            .find(|(p, _)| p.key == rank)
            .map_or(0, |(_, d)| d.gpu)
    };
    for (case, (ids, media)) in cases.iter().zip(&requests) {
        assert_eq!(
            overlap(ids, media) as usize,
            case.prompt_tokens / 32,
            "{}",
            case.name
        );
    }
    // The same tokens with an image the engine never saw: nothing, the image starts in block 0.
    let (ids, mut media) = requests[0].clone();
    media[0].id = media_id("never-seen");
    assert_eq!(overlap(&ids, &media), 0);
    // The same request keyed as text only: nothing either.
    assert_eq!(overlap(&ids, &[]), 0);
}
