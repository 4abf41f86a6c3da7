//! Reading a request body on the ext_proc path: serde over the whole body once it is buffered
//! (the chunks joined first, as the stream did before the scanner) against the streaming scanner
//! (`crates/kvpick-tokenize/src/body/scan.rs`) fed the same chunks as they arrive, for the overhead benchmark's
//! bodies (`e2e/bench_overhead.py`: a token-id prompt and a chat, 1 KB / 32 KB / 220 KB) in
//! 16 KB chunks, Envoy's usual size. Then hashing a chat prompt's text without a tokenizer: first
//! copied into a list of 4-byte pseudo-tokens (as kvpick did before) against straight from the
//! bytes (`hash::salted_text_hashes`), and a token-id prompt of as many tokens. Run:
//! `cargo bench --bench body`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench harness: a panic is a failure report

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvpick::tokenize::body::scan::{BodyScanner, Scanned};
use kvpick::tokenize::body::{parse_request_body_for, Endpoint};
use kvpick_core::hash;

#[path = "../crates/kvpick-tokenize/benches/shared/overhead_bodies.rs"]
mod overhead_bodies;
use overhead_bodies::{chat_body, token_body};

const SIZES: [(&str, usize); 3] = [("1KB", 1024), ("32KB", 32 << 10), ("220KB", 220 << 10)];
const CHUNK: usize = 16 << 10;

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("request_body");
    for (name, size) in SIZES {
        for (variant, body) in [("ids", token_body(size)), ("chat", chat_body(size))] {
            let chunks: Vec<&[u8]> = body.chunks(CHUNK).collect();
            let id = format!("{variant}/{name}");
            group.throughput(Throughput::Bytes(body.len() as u64));
            group.bench_with_input(
                BenchmarkId::new("serde_whole", &id),
                &chunks,
                |b, chunks| {
                    b.iter(|| {
                        let whole = chunks.concat();
                        parse_request_body_for(Endpoint::Generate, Some("application/json"), &whole)
                            .unwrap()
                            .unwrap()
                    })
                },
            );
            group.bench_with_input(BenchmarkId::new("scanner", &id), &chunks, |b, chunks| {
                b.iter(|| {
                    let mut scanner =
                        BodyScanner::new(Endpoint::Generate, Some("application/json"));
                    for chunk in chunks {
                        scanner.feed(chunk);
                    }
                    match scanner.finish(chunks) {
                        Scanned::Parsed(parsed) => parsed.unwrap().unwrap(),
                        Scanned::Undecided(why) => panic!("left to serde: {why:?}"),
                    }
                })
            });
        }
    }
    group.finish();
    bench_text_hashing(c);
}

/// The chat bodies' text (the body itself: near enough the prompt in size and bytes), 16-token
/// blocks.
fn bench_text_hashing(c: &mut Criterion) {
    let mut group = c.benchmark_group("text_hashes");
    for (name, size) in SIZES {
        let text = chat_body(size);
        group.throughput(Throughput::Bytes(text.len() as u64));
        group.bench_with_input(
            BenchmarkId::new("via_pseudo_tokens", name),
            &text,
            |b, text| {
                b.iter(|| {
                    // As `prompt_blocks` built the list before.
                    let words = text.chunks_exact(4);
                    let tail = words.remainder();
                    let mut pseudo: Vec<u32> = Vec::with_capacity(text.len().div_ceil(4));
                    pseudo.extend(words.map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])));
                    if !tail.is_empty() {
                        let mut word = [0u8; 4];
                        word[..tail.len()].copy_from_slice(tail);
                        pseudo.push(u32::from_le_bytes(word));
                    }
                    hash::salted_prompt_hashes(&pseudo, 16, hash::BASE_SEED, None)
                })
            },
        );
        group.bench_with_input(BenchmarkId::new("from_bytes", name), &text, |b, text| {
            b.iter(|| hash::salted_text_hashes(text, 16, hash::BASE_SEED, None))
        });
        // A token-id prompt of the same length in tokens, through `block_hash`.
        let tokens: Vec<u32> = (0..text.len() as u32 / 4)
            .map(|i| 1000 + i.wrapping_mul(7919) % 120_000)
            .collect();
        group.bench_with_input(BenchmarkId::new("token_ids", name), &tokens, |b, tokens| {
            b.iter(|| hash::salted_prompt_hashes(tokens, 16, hash::BASE_SEED, None))
        });
    }
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
