//! Fuzzes the request-body parser (`src/request.rs`) and the response usage extractor
//! (`src/usage.rs`): arbitrary bytes as a body (with and without a JSON content type) and as a
//! response split at an arbitrary point, for each API the body may be sent to. Neither may panic;
//! a parsed body always has a model, except one sent to SGLang's `/generate`.
//!
//! Input layout: `[flags: u8][split: u8][bytes...]` — flag bit 0 picks the content type, bit 1
//! SSE vs JSON for the usage tracker, bits 2-3 the API.

#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../src/request.rs"]
#[allow(dead_code)]
mod request;
#[path = "../../src/usage.rs"]
#[allow(dead_code)]
mod usage;

fuzz_target!(|data: &[u8]| {
    let [flags, split, body @ ..] = data else { return };
    let content_type = if flags & 1 == 0 { None } else { Some("application/json") };
    let endpoint = match (flags >> 2) & 3 {
        0 => request::Endpoint::Generate,
        1 => request::Endpoint::Embeddings,
        2 => request::Endpoint::Messages,
        _ => request::Endpoint::SglangGenerate,
    };
    if let Ok(Some(parsed)) = request::parse_request_body_for(endpoint, content_type, body) {
        match parsed.model {
            Some(model) => assert!(!model.is_empty()),
            None => assert_eq!(endpoint, request::Endpoint::SglangGenerate),
        }
    }
    let mut tracker = usage::UsageTracker::new(flags & 2 != 0);
    let at = (*split as usize).min(body.len());
    tracker.feed(&body[..at]);
    tracker.feed(&body[at..]);
    let _ = tracker.finish();
});
