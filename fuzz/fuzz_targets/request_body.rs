//! Fuzzes the request-body parser (`src/request.rs`) and the response usage extractor
//! (`src/usage.rs`): arbitrary bytes as a body (with and without a JSON content type) and as a
//! response split at an arbitrary point. Neither may panic; a parsed body always has a model.
//!
//! Input layout: `[flags: u8][split: u8][bytes...]` — flag bit 0 picks the content type, bit 1
//! SSE vs JSON for the usage tracker.

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
    if let Ok(Some(parsed)) = request::parse_request_body(content_type, body) {
        assert!(!parsed.model.is_empty());
    }
    let mut tracker = usage::UsageTracker::new(flags & 2 != 0);
    let at = (*split as usize).min(body.len());
    tracker.feed(&body[..at]);
    tracker.feed(&body[at..]);
    let _ = tracker.finish();
});
