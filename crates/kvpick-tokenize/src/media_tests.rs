use super::*;

const FIXTURES: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../tests/fixtures/kv_events/multimodal"
);

/// `identifiers.json`, written by vLLM's own hasher (make_fixtures.py): (base64 text, model id,
/// vLLM's identifier).
fn vllm_identifiers() -> Vec<(String, String, String)> {
    let text = std::fs::read_to_string(format!("{FIXTURES}/identifiers.json")).unwrap();
    let list: serde_json::Value = serde_json::from_str(&text).unwrap();
    list.as_array()
        .unwrap()
        .iter()
        .map(|e| {
            let file = e["file"].as_str().unwrap();
            let b64 = std::fs::read_to_string(format!("{FIXTURES}/{file}")).unwrap();
            (
                b64,
                e["model_id"].as_str().unwrap().to_string(),
                e["identifier"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn json(s: &str) -> Json {
    serde_json::from_str(s).unwrap()
}

#[test]
fn data_url_images_get_vllms_own_identifier() {
    let ids = vllm_identifiers();
    assert_eq!(ids.len(), 2);
    for (b64, model_id, expected) in &ids {
        let url = format!("data:image/png;base64,{b64}");
        assert_eq!(&data_url_identifier(&url, model_id).unwrap(), expected);
        // Media type parameters before `;base64` do not matter to vLLM.
        let url = format!("data:image/png;name=x.png;base64,{b64}");
        assert_eq!(&data_url_identifier(&url, model_id).unwrap(), expected);
        // Another engine `--model` is another hash.
        assert_ne!(&data_url_identifier(&url, "other").unwrap(), expected);
    }
    assert_ne!(ids[0].2, ids[1].2);
}

#[test]
fn every_body_shape_finds_the_same_image_identifier() {
    let (b64, model, expected) = vllm_identifiers().remove(0);
    let chat = json(&format!(
        r#"{{"messages":[{{"role":"user","content":[{{"type":"text","text":"what"}},
        {{"type":"image_url","image_url":{{"url":"data:image/png;base64,{b64}"}}}}]}}]}}"#
    ));
    let responses = json(&format!(
        r#"{{"input":[{{"role":"user","content":[{{"type":"input_text","text":"what"}},
        {{"type":"input_image","image_url":"data:image/png;base64,{b64}"}}]}}]}}"#
    ));
    let anthropic = json(&format!(
        r#"{{"messages":[{{"role":"user","content":[{{"type":"image","source":{{"type":"base64",
        "media_type":"image/png","data":"{b64}"}}}},{{"type":"text","text":"what"}}]}}]}}"#
    ));
    let exact = |id: &str| MediaItem {
        identifier: id.into(),
        exact: true,
    };
    assert_eq!(
        items(Endpoint::Generate, &chat, &model),
        vec![exact(&expected)]
    );
    assert_eq!(
        items(Endpoint::Generate, &responses, &model),
        vec![exact(&expected)]
    );
    assert_eq!(
        items(Endpoint::Messages, &anthropic, &model),
        vec![exact(&expected)]
    );
}

#[test]
fn anthropic_tool_result_images_come_before_the_turns_own_as_vllm_orders_them() {
    let body = json(
        r#"{"messages":[
        {"role":"system","content":[{"type":"image","source":{"type":"url","url":"https://s"}}]},
        {"role":"user","content":[
            {"type":"image","source":{"type":"url","url":"https://a"}},
            {"type":"tool_result","tool_use_id":"t","content":[
                {"type":"image","source":{"type":"url","url":"https://b"}}]}]},
        {"role":"assistant","content":[{"type":"tool_result","tool_use_id":"t","content":[
            {"type":"image","source":{"type":"url","url":"https://c"}}]}]}]}"#,
    );
    let url = |u: &str| identify(Some(u), None, "m");
    assert_eq!(
        items(Endpoint::Messages, &body, "m"),
        vec![url("https://b"), url("https://a")]
    );
}

#[test]
fn a_client_uuid_is_the_identifier_unless_processor_kwargs_change_the_hash() {
    let body = json(
        r#"{"messages":[{"role":"user","content":[
        {"type":"image_url","image_url":{"url":"https://x/a.png"},"uuid":"img-1"},
        {"type":"image_url","image_url":{"url":"https://x/a.png"},"uuid":7}]}]}"#,
    );
    let found = items(Endpoint::Generate, &body, "m");
    assert_eq!(found[0].identifier, "img-1");
    assert_eq!(found[1].identifier, "7");
    assert!(found.iter().all(|i| i.exact));
    let mut with_kwargs = body.clone();
    with_kwargs.set("mm_processor_kwargs", json(r#"{"max_pixels": 1000}"#));
    let found = items(Endpoint::Generate, &with_kwargs, "m");
    assert!(found.iter().all(|i| !i.exact));
    assert!(found[0].identifier.starts_with(APPROX_PREFIX));
    assert_ne!(found[0].identifier, found[1].identifier);
}

#[test]
fn http_urls_are_keyed_approximately_by_their_url() {
    let a = identify(Some("https://x/a.png"), None, "m");
    let b = identify(Some("https://x/b.png"), None, "m");
    assert!(!a.exact && a.identifier.starts_with(APPROX_PREFIX));
    assert_eq!(a, identify(Some("https://x/a.png"), None, "m"));
    assert_ne!(a.identifier, b.identifier);
    // Anthropic url sources the same way.
    let block = json(r#"{"type":"image","source":{"type":"url","url":"https://x/a.png"}}"#);
    assert_eq!(anthropic_item(&block, "m"), Some(a));
    // No source: vLLM drops the block.
    assert_eq!(
        anthropic_item(&json(r#"{"type":"image","source":{}}"#), "m"),
        None
    );
}

#[test]
fn malformed_data_urls_are_approximate_and_distinct() {
    let bad = [
        "data:image/png;base64,QUJ",    // length not a multiple of 4
        "data:image/png;base64,QU=J",   // padding inside
        "data:image/png;base64,Q===",   // three pad characters
        "data:image/png;base64,QU J",   // not in the alphabet
        "data:image/png,QUJD",          // not base64
        "data:image/png;base64",        // no comma
        "image/png;base64,QUJD",        // not a data URL
        "data:image/png;base64,QUJD\n", // vLLM validates: no whitespace
    ];
    let mut seen = std::collections::HashSet::new();
    for url in bad {
        assert!(data_url_identifier(url, "m").is_err(), "{url}");
        let item = identify(Some(url), None, "m");
        assert!(!item.exact, "{url}");
        assert!(seen.insert(item.identifier), "{url}");
    }
    // pybase64 (validate=True) accepts non-zero trailing bits, and so does kvpick.
    assert_eq!(
        data_url_identifier("data:x;base64,QR==", "m"),
        data_url_identifier("data:x;base64,QQ==", "m")
    );
}

#[test]
fn streamed_decoding_equals_decoding_at_once() {
    // Lengths around the decode chunk, every padding.
    for len in [0usize, 1, 2, 3, 3071, 3072, 3073, 6144, 10_000] {
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 256) as u8).collect();
        let b64 = encode(&bytes);
        let mut h = blake3::Hasher::new();
        let padding = b64.bytes().rev().take_while(|&c| c == b'=').count();
        decode_into(b64.as_bytes(), padding, &mut h).unwrap();
        assert_eq!(h.finalize(), blake3::hash(&bytes), "{len}");
    }
}

/// Standard base64 with padding (test helper).
pub(crate) fn encode(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let w = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(w >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[test]
fn arbitrary_bodies_and_urls_never_panic() {
    // A deterministic stream of hostile shapes: any JSON value where a part, a source, a url or
    // a uuid is expected, and random text after `data:...;base64,`.
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let values = [
        "null",
        "1",
        "\"s\"",
        "[]",
        "{}",
        "[1,{}]",
        r#"{"url":5}"#,
        r#"{"url":null}"#,
        r#"{"type":5}"#,
        r#"{"type":"base64","data":7}"#,
        r#"{"type":"url"}"#,
    ];
    for _ in 0..2_000 {
        let v = values[(next() % values.len() as u64) as usize];
        let w = values[(next() % values.len() as u64) as usize];
        let bodies = [
            format!(
                r#"{{"messages":[{{"role":"user","content":[{{"type":"image_url","image_url":{v},"uuid":{w}}}]}}]}}"#
            ),
            format!(
                r#"{{"messages":[{{"role":"user","content":[{{"type":"image","source":{v}}}]}}]}}"#
            ),
            format!(r#"{{"messages":{v},"input":{w}}}"#),
            format!(r#"{{"input":[{{"content":[{{"type":"input_image","image_url":{v}}}]}}]}}"#),
        ];
        for body in &bodies {
            let body = json(body);
            let _ = items(Endpoint::Generate, &body, "m");
            let _ = items(Endpoint::Messages, &body, "m");
        }
        let len = (next() % 40) as usize;
        let text: String = (0..len)
            .map(|_| char::from(b"AZaz09+/=,;: \n\x00"[(next() % 15) as usize]))
            .collect();
        let _ = identify(Some(&format!("data:image/png;base64,{text}")), None, "m");
    }
}

fn config() -> MediaConfig {
    MediaConfig {
        image_token: 9,
        placeholder: "<image>".into(),
        tokens_per_image: 4,
        model_id: "m".into(),
    }
}

#[test]
fn placeholders_expand_to_the_models_count_with_one_span_each() {
    let a = identify(None, Some("a"), "m");
    let b = identify(None, Some("b"), "m");
    let (ids, spans) = expand(&[1, 9, 2, 9, 3], &config(), &[a, b]).unwrap();
    assert_eq!(ids, vec![1, 9, 9, 9, 9, 2, 9, 9, 9, 9, 3]);
    let got: Vec<(u64, u64, u64)> = spans.iter().map(|s| (s.id, s.offset, s.length)).collect();
    assert_eq!(got, vec![(media_id("a"), 1, 4), (media_id("b"), 6, 4)]);
    // One placeholder short or over: an error, never a wrong key.
    let one = [identify(None, Some("a"), "m")];
    assert!(expand(&[1, 9, 9], &config(), &one).is_err());
    assert!(expand(&[1, 2], &config(), &one).is_err());
}

#[test]
fn image_tokens_are_bounded_per_prompt() {
    // 4 tokens per image: exactly the bound expands, one image more does not.
    let at = MAX_IMAGE_TOKENS / 4;
    let items: Vec<MediaItem> = (0..at + 1)
        .map(|_| identify(None, Some("a"), "m"))
        .collect();
    let ids = vec![9u32; at + 1];
    let (out, spans) = expand(&ids[..at], &config(), &items[..at]).unwrap();
    assert_eq!((out.len(), spans.len()), (MAX_IMAGE_TOKENS, at));
    let err = expand(&ids, &config(), &items).unwrap_err();
    assert!(err.contains("image tokens"), "{err}");
}

#[test]
fn the_model_directory_gives_the_image_layout() {
    let dir = std::env::temp_dir().join(format!("kvpick-media-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let text = |id: u32| (id == 32000).then(|| "<image>".to_string());
    // LLaVA-1.5: 336 / 14 = 24 patches a side, CLS dropped by the default strategy.
    std::fs::write(
        dir.join("config.json"),
        r#"{"image_token_index":32000,"vision_feature_select_strategy":"default",
        "vision_config":{"image_size":336,"patch_size":14}}"#,
    )
    .unwrap();
    let c = MediaConfig::from_dir(&dir, text, "llava").unwrap();
    assert_eq!(
        (c.image_token, c.placeholder.as_str(), c.tokens_per_image),
        (32000, "<image>", 576)
    );
    // The processor's count wins.
    std::fs::write(
        dir.join("processor_config.json"),
        r#"{"image_seq_length":256}"#,
    )
    .unwrap();
    let c = MediaConfig::from_dir(&dir, text, "llava").unwrap();
    assert_eq!((c.tokens_per_image, c.model_id.as_str()), (256, "llava"));
    // No image token: no layout (images then route on load alone).
    std::fs::write(dir.join("config.json"), r#"{"vocab_size":10}"#).unwrap();
    assert_eq!(MediaConfig::from_dir(&dir, text, "llava"), None);
    std::fs::remove_dir_all(&dir).unwrap();
}
