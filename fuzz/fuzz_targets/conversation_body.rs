//! The one body parser as a property (`crates/kvpick-tokenize/src/body/`, read by
//! `conversation.rs`): for any bytes, fed to the streaming scanner in chunks, nothing panics; a
//! layout the scanner records equals serde's (`BodyLayout::from_serde`, the oracle); and the
//! prompt the tokenizer reads through the layout — with the conversation cache holding an
//! earlier body that shares the first bytes, so its items are reused — equals the prompt of
//! serde_json's generic parse of the whole body (the same prompt, or an error for both).
//!
//! Input layout: `[cut: u8][split: u8][bytes...]`. The bytes split at `split`/255 of their length
//! into A and X; body B is A's first `cut`/255 followed by X. A, B and B again go through one
//! cache with an 8-byte stride, so small inputs reach the reuse; each body is fed to the scanner
//! in chunks of `split + 1` bytes.

#![no_main]

use bytes::Bytes;
use kvpick::tokenize::body::layout::BodyLayout;
use kvpick::tokenize::body::scan::BodyScanner;
use kvpick::tokenize::conversation::ConversationCache;
use kvpick::tokenize::json::Json;
use kvpick::tokenize::prompt::{prompt_spec_for, prompt_spec_parsed, ContentFormat, Endpoint};
use libfuzzer_sys::fuzz_target;

/// serde_json's generic parse of the whole body, then the prompt read from it.
fn oracle(body: &[u8], endpoint: Endpoint) -> Option<String> {
    let json: Json = serde_json::from_slice(body).ok()?;
    let spec = prompt_spec_for(endpoint, &json, ContentFormat::String).ok()?;
    Some(format!("{spec:?}"))
}

/// The scanner's layout (checked against serde's), else serde's, read through the cache.
fn one_parser(
    cache: &ConversationCache,
    body: &Bytes,
    endpoint: Endpoint,
    chunk: usize,
) -> Option<String> {
    let chunks: Vec<&[u8]> = body.chunks(chunk).collect();
    let mut scanner = BodyScanner::new(endpoint, None);
    for c in &chunks {
        scanner.feed(c);
    }
    let (_, scanned) = scanner.finish_layout(&chunks);
    if let Some(layout) = &scanned {
        assert_eq!(
            Ok(layout),
            BodyLayout::from_serde(endpoint, body).as_ref(),
            "layouts differ"
        );
    }
    let layout = scanned.or_else(|| BodyLayout::from_serde(endpoint, body).ok())?;
    let parsed = cache
        .read(body, &layout, endpoint, ContentFormat::String)
        .ok()?;
    let spec =
        prompt_spec_parsed(endpoint, &parsed.top, parsed.items, ContentFormat::String).ok()?;
    Some(format!("{spec:?}"))
}

fuzz_target!(|data: &[u8]| {
    let [cut, split, rest @ ..] = data else {
        return;
    };
    let at = rest.len() * *split as usize / 255;
    let (a, x) = rest.split_at(at);
    let keep = a.len() * *cut as usize / 255;
    let b = [&a[..keep], x].concat();
    let cache = ConversationCache::with_stride(1 << 16, 8);
    let endpoint = match cut & 3 {
        0 => Endpoint::Generate,
        1 => Endpoint::Embeddings,
        2 => Endpoint::Messages,
        _ => Endpoint::SglangGenerate,
    };
    for body in [a, &b[..], &b[..]] {
        let body = Bytes::copy_from_slice(body);
        let read = one_parser(&cache, &body, endpoint, *split as usize + 1);
        assert_eq!(read, oracle(&body, endpoint));
    }
});
