//! The one body parser as a property, shared by the `conversation_body` fuzz target
//! (`fuzz/fuzz_targets/conversation_body.rs`) and the test that runs its committed seeds under
//! `cargo test`: for any bytes, fed to the streaming scanner in chunks, nothing panics; a layout
//! the scanner records equals serde's (`BodyLayout::from_serde`, the oracle); and the prompt the
//! tokenizer reads through the layout, with the conversation cache holding an earlier body that
//! shares the first bytes (so its items are reused), equals the prompt of serde_json's generic
//! parse of the whole body (the same prompt, or an error for both). Reads the body, layout,
//! conversation and prompt modules; owns nothing they use.

use bytes::Bytes;

use crate::body::layout::BodyLayout;
use crate::body::scan::BodyScanner;
use crate::conversation::ConversationCache;
use crate::json::Json;
use crate::prompt::{prompt_spec_for, prompt_spec_parsed, ContentFormat, Endpoint};

/// Checks the property on one fuzz input, panicking where the parsers disagree; returns how many
/// of its bodies read as prompts.
///
/// Input layout: `[cut: u8][split: u8][bytes...]`. The bytes split at `split`/255 of their length
/// into A and X; body B is A's first `cut`/255 followed by X. A, B and B again go through one
/// cache with an 8-byte stride, so small inputs reach the reuse; each body is fed to the scanner
/// in chunks of `split + 1` bytes; `cut`'s low two bits pick the endpoint.
pub fn one_parser_reads_as_serde(data: &[u8]) -> usize {
    let [cut, split, rest @ ..] = data else {
        return 0;
    };
    let at = rest.len() * *split as usize / 255;
    let (a, x) = rest.split_at(at);
    let keep = a.len() * *cut as usize / 255;
    let b = [&a[..keep], x].concat();
    let cache = ConversationCache::with_stride(1 << 16, 8);
    let endpoint = [
        Endpoint::Generate,
        Endpoint::Embeddings,
        Endpoint::Messages,
        Endpoint::SglangGenerate,
    ][usize::from(cut & 3)];
    let mut read = 0;
    for body in [a, &b[..], &b[..]] {
        let body = Bytes::copy_from_slice(body);
        let got = one_parser(&cache, &body, endpoint, *split as usize + 1);
        read += usize::from(got.is_some());
        assert_eq!(got, oracle(&body, endpoint), "the prompts differ");
    }
    read
}

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
            "the layouts differ"
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The fuzz target's committed seeds, so `cargo test` checks the property without a nightly
    /// toolchain.
    #[test]
    fn the_fuzz_seeds_read_as_serde_reads_them() {
        let dir = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../fuzz/seeds/conversation_body"
        );
        let (mut seen, mut read) = (0, 0);
        for entry in std::fs::read_dir(dir).unwrap() {
            let data = std::fs::read(entry.unwrap().path()).unwrap();
            read += one_parser_reads_as_serde(&data);
            seen += 1;
        }
        assert!(seen >= 50, "the corpus is there ({seen} seeds)");
        assert!(read > 0, "some seeds are prompts");
    }

    #[test]
    fn an_input_too_short_to_split_reads_nothing() {
        assert_eq!(one_parser_reads_as_serde(&[7]), 0);
    }
}
