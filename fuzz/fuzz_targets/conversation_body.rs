//! Differential fuzzing of the conversation cache (`crates/kvpick-tokenize/src/conversation.rs`): a body read
//! after a cached body that shares its first bytes must read exactly as the whole-body reader
//! reads it (the same prompt, or an error for both), and nothing may panic.
//!
//! Input layout: `[cut: u8][split: u8][bytes...]`. The bytes split at `split`/255 of their length
//! into A and X; body B is A's first `cut`/255 followed by X. A, B and B again go through one
//! cache with an 8-byte stride, so small inputs reach the splice.

#![no_main]

use bytes::Bytes;
use kvpick::tokenize::conversation::ConversationCache;
use kvpick::tokenize::json::Json;
use kvpick::tokenize::prompt::{prompt_spec_for, prompt_spec_parsed, ContentFormat, Endpoint};
use libfuzzer_sys::fuzz_target;

fn plain(body: &[u8], endpoint: Endpoint) -> Option<String> {
    let json: Json = serde_json::from_slice(body).ok()?;
    let spec = prompt_spec_for(endpoint, &json, ContentFormat::String).ok()?;
    Some(format!("{spec:?}"))
}

fn cached(cache: &ConversationCache, body: &Bytes, endpoint: Endpoint) -> Option<String> {
    let parsed = cache.parse(body, endpoint, ContentFormat::String).ok()?;
    let spec = prompt_spec_parsed(endpoint, &parsed.top, parsed.items, ContentFormat::String).ok()?;
    Some(format!("{spec:?}"))
}

fuzz_target!(|data: &[u8]| {
    let [cut, split, rest @ ..] = data else { return };
    let at = rest.len() * *split as usize / 255;
    let (a, x) = rest.split_at(at);
    let keep = a.len() * *cut as usize / 255;
    let b = [&a[..keep], x].concat();
    let cache = ConversationCache::with_stride(1 << 16, 8);
    for body in [a, &b[..], &b[..]] {
        let body = Bytes::copy_from_slice(body);
        let endpoint = match cut & 3 {
            0 => Endpoint::Generate,
            1 => Endpoint::Embeddings,
            2 => Endpoint::Messages,
            _ => Endpoint::SglangGenerate,
        };
        assert_eq!(cached(&cache, &body, endpoint), plain(&body, endpoint));
    }
});
