//! Fuzzes the request-body readers (`crates/kvpick-tokenize/src/body.rs`, `body/scan.rs`) and the response
//! usage extractor (`src/usage.rs`): arbitrary bytes as a body (with and without a JSON content
//! type) and as a response split at an arbitrary point, for each API the body may be sent to.
//! Nothing may panic; a parsed body always has a model, except one sent to SGLang's `/generate`;
//! and the streaming scanner, fed the body in chunks, answers exactly as serde over the whole
//! body does (whenever it settles the body itself, and through its serde fallback when not).
//!
//! Input layout: `[flags: u8][split: u8][bytes...]` — flag bit 0 picks the content type, bit 1
//! SSE vs JSON for the usage tracker, bits 2-3 the API; `split` is where the usage response is
//! cut and how the body is chunked (one cut there, then chunks of `split + 1` bytes).

#![no_main]

use kvpick::tokenize::body::scan::{parse_chunks, BodyScanner, Scanned};
use kvpick::tokenize::body::{parse_request_body_for, Endpoint};
use kvpick::usage;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let [flags, split, body @ ..] = data else { return };
    let content_type = if flags & 1 == 0 { None } else { Some("application/json") };
    let endpoint = match (flags >> 2) & 3 {
        0 => Endpoint::Generate,
        1 => Endpoint::Embeddings,
        2 => Endpoint::Messages,
        _ => Endpoint::SglangGenerate,
    };
    let whole = parse_request_body_for(endpoint, content_type, body);
    if let Ok(Some(parsed)) = &whole {
        match &parsed.model {
            Some(model) => assert!(!model.is_empty()),
            None => assert_eq!(endpoint, Endpoint::SglangGenerate),
        }
    }
    let at = (*split as usize).min(body.len());
    let mut chunks: Vec<&[u8]> = vec![&body[..at]];
    chunks.extend(body[at..].chunks(*split as usize + 1));
    let mut scanner = BodyScanner::new(endpoint, content_type);
    for chunk in &chunks {
        scanner.feed(chunk);
    }
    if let Scanned::Parsed(scanned) = scanner.finish(&chunks) {
        assert_eq!(scanned, whole, "the scanner settled the body differently");
    }
    assert_eq!(parse_chunks(endpoint, content_type, &chunks), whole);

    let mut tracker = usage::UsageTracker::new(flags & 2 != 0);
    tracker.feed(&body[..at]);
    tracker.feed(&body[at..]);
    let _ = tracker.finish();
});
