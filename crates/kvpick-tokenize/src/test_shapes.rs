//! `tokenizer.json` files of every model type and the common pre-tokenizers, built in code for
//! the differential tests of the direct encoder and the prefix cache (no files, no downloads).
//! Test-only; owns nothing the service uses.

use std::collections::BTreeMap;

use serde_json::{json, Value};

use super::prefix_cache::testutil::{self, WORDS};

/// Words and characters the vocabularies know, from the test word list.
fn pieces() -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for w in WORDS {
        for part in w.split_whitespace() {
            out.push(part.to_string());
        }
        for c in w.chars() {
            out.push(c.to_string());
        }
    }
    for w in [
        "the",
        "answer",
        "assistant",
        "don",
        "t",
        "ll",
        "café",
        "x",
        "a",
        "b",
        "1",
        "2",
    ] {
        out.push(w.to_string());
    }
    out.sort();
    out.dedup();
    out
}

fn file(pre_tokenizer: Value, model: Value) -> String {
    json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": pre_tokenizer, "post_processor": null,
        "decoder": null, "model": model})
    .to_string()
}

fn word_level(extra_suffix: &str) -> Value {
    let mut vocab = BTreeMap::new();
    vocab.insert("[UNK]".to_string(), 0u32);
    for p in pieces() {
        let next = vocab.len() as u32;
        vocab.entry(p.clone()).or_insert(next);
        let next = vocab.len() as u32;
        vocab.entry(format!("{p}{extra_suffix}")).or_insert(next);
    }
    json!({"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"})
}

fn word_piece() -> Value {
    let mut vocab = BTreeMap::new();
    vocab.insert("[UNK]".to_string(), 0u32);
    for p in pieces() {
        for v in [p.clone(), format!("##{p}")] {
            let next = vocab.len() as u32;
            vocab.entry(v).or_insert(next);
        }
    }
    json!({"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
        "max_input_chars_per_word": 100, "vocab": vocab})
}

fn unigram() -> Value {
    let mut vocab = vec![json!(["<unk>", 0.0])];
    for (i, p) in pieces().into_iter().enumerate() {
        let score = -1.0 - (i % 7) as f64;
        vocab.push(json!([p.clone(), score]));
        vocab.push(json!([format!("▁{p}"), score + 0.5]));
    }
    vocab.push(json!(["▁", -2.0]));
    json!({"type": "Unigram", "unk_id": 0, "vocab": vocab, "byte_fallback": false})
}

fn metaspace(prepend: &str, split: bool) -> Value {
    json!({"type": "Metaspace", "replacement": "▁", "prepend_scheme": prepend, "split": split})
}

fn split(pattern: Value, behavior: &str, invert: bool) -> Value {
    json!({"type": "Split", "pattern": pattern, "behavior": behavior, "invert": invert})
}

/// (name, tokenizer.json) of each shape the direct encoder covers.
pub fn covered() -> Vec<(&'static str, String)> {
    let byte_level_bpe: Value = serde_json::from_str(&testutil::tokenizer_json()).unwrap();
    let bpe_model = byte_level_bpe["model"].clone();
    let mut shapes = vec![
        ("byte-level BPE", testutil::tokenizer_json()),
        (
            "WordLevel, Split(' ', MergedWithPrevious) (the sim's text form)",
            file(
                split(json!({"String": " "}), "MergedWithPrevious", false),
                word_level(" "),
            ),
        ),
        (
            "WordLevel, Whitespace",
            file(json!({"type": "Whitespace"}), word_level("")),
        ),
        (
            "WordLevel, WhitespaceSplit",
            file(json!({"type": "WhitespaceSplit"}), word_level("")),
        ),
        (
            "WordPiece, BertPreTokenizer",
            file(json!({"type": "BertPreTokenizer"}), word_piece()),
        ),
        (
            "WordPiece, Sequence(WhitespaceSplit, Punctuation, Digits)",
            file(
                json!({"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"},
                    {"type": "Punctuation", "behavior": "Isolated"},
                    {"type": "Digits", "individual_digits": true}]}),
                word_piece(),
            ),
        ),
        (
            "Unigram, Metaspace(always, split)",
            file(metaspace("always", true), unigram()),
        ),
        (
            "Unigram, Metaspace(first, split)",
            file(metaspace("first", true), unigram()),
        ),
        (
            "Unigram, Sequence(WhitespaceSplit, Metaspace(always))",
            file(
                json!({"type": "Sequence", "pretokenizers": [{"type": "WhitespaceSplit"},
                    metaspace("always", true)]}),
                unigram(),
            ),
        ),
        (
            "Unigram, Metaspace(never, no split)",
            file(metaspace("never", false), unigram()),
        ),
        (
            "BPE, Sequence(Digits, CharDelimiterSplit, ByteLevel)",
            file(
                json!({"type": "Sequence", "pretokenizers": [
                    {"type": "Digits", "individual_digits": false},
                    {"type": "CharDelimiterSplit", "delimiter": "-"},
                    {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true}]}),
                bpe_model.clone(),
            ),
        ),
    ];
    for behavior in [
        "Removed",
        "Isolated",
        "MergedWithPrevious",
        "MergedWithNext",
        "Contiguous",
    ] {
        for invert in [false, true] {
            let name: &'static str = Box::leak(
                format!("WordLevel, Split(regex, {behavior}, invert {invert})").into_boxed_str(),
            );
            shapes.push((
                name,
                file(
                    split(json!({"Regex": "\\s+|[0-9]"}), behavior, invert),
                    word_level(" "),
                ),
            ));
        }
    }
    shapes
}
