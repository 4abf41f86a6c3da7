//! A direct encoder for the common `tokenizer.json` shapes: no normalizer, added tokens that do
//! not strip, a pre-tokenizer `tokenize::pretok` reproduces (`Split` regexes or strings, the
//! whitespace, punctuation and digit splitters, BERT's, ending in `ByteLevel`, `Metaspace` or
//! nothing), and any model (BPE, WordLevel, WordPiece, Unigram). That covers DeepSeek, Llama 3,
//! GPT-2 and Qwen (byte-level BPE), `Metaspace` Unigram / BPE files, WordPiece with a plain
//! pre-tokenizer, and the sim's WordLevel text form. It does what `Tokenizer::encode(text, false)`
//! does for those shapes without the general pipeline's per-byte alignment bookkeeping, which was
//! most of a tokenization's cost: the same regexes (`fancy-regex`, as `tokenizers` uses), the same
//! leftmost-longest added-token matching, the same split rules, and the `tokenizers` model itself
//! for each piece.
//!
//! It is used only when the file has such a shape and, at load, its ids equal `Tokenizer::encode`
//! on a probe corpus; otherwise the caller keeps the general pipeline. Token spans are byte ranges
//! of the input. This module owns only that encoder.

use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use serde::Deserialize;
use tokenizers::{Model, Tokenizer};

use super::pretok::{metaspace_map, Mapping, PreTokenizer};

/// Models whose `tokenize` sees one pre-tokenized piece at a time.
const MODELS: [&str; 4] = ["BPE", "WordLevel", "WordPiece", "Unigram"];

/// Token ids of a text with each token's byte span.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Encoded {
    pub ids: Vec<u32>,
    pub starts: Vec<u32>,
    pub ends: Vec<u32>,
}

/// Added tokens matched in one pass.
struct AddedSet {
    matcher: AhoCorasick,
    ids: Vec<u32>,
}

impl AddedSet {
    /// The set of `tokens` (none when empty).
    fn new(tokens: Vec<(String, u32)>) -> Result<Option<Self>, String> {
        if tokens.is_empty() {
            return Ok(None);
        }
        let (patterns, ids): (Vec<String>, Vec<u32>) = tokens.into_iter().unzip();
        let matcher = AhoCorasickBuilder::new()
            .match_kind(MatchKind::LeftmostLongest)
            .build(&patterns)
            .map_err(|e| format!("added tokens: {e}"))?;
        Ok(Some(AddedSet { matcher, ids }))
    }
}

/// The fast encoder for one tokenizer.
pub struct FastEncoder {
    tokenizer: Arc<Tokenizer>,
    /// Added tokens with `normalized: false`, matched first on the raw text.
    raw_added: Option<AddedSet>,
    /// Added tokens with `normalized: true`, matched next in what is left (the normalizer is
    /// the identity here).
    normalized_added: Option<AddedSet>,
    pre: PreTokenizer,
    byte_chars: [char; 256],
    /// A WordLevel model's unknown-token id (`Some(None)`: it has none), so a piece is one
    /// vocabulary look-up instead of a `Token` with an owned copy of its text.
    word_level_unk: Option<Option<u32>>,
}

#[derive(Deserialize)]
struct FileShape {
    #[serde(default)]
    added_tokens: Vec<AddedTokenShape>,
    normalizer: Option<serde_json::Value>,
    truncation: Option<serde_json::Value>,
    padding: Option<serde_json::Value>,
    model: ModelShape,
}

#[derive(Deserialize)]
struct AddedTokenShape {
    id: u32,
    content: String,
    #[serde(default)]
    single_word: bool,
    #[serde(default)]
    lstrip: bool,
    #[serde(default)]
    rstrip: bool,
    #[serde(default)]
    normalized: bool,
}

#[derive(Deserialize)]
struct ModelShape {
    #[serde(rename = "type")]
    kind: Option<String>,
    #[serde(default)]
    unk_token: Option<String>,
}

impl FastEncoder {
    /// The encoder for `tokenizer` loaded from `json` (the file's text), or why not.
    pub fn new(tokenizer: Arc<Tokenizer>, json: &str) -> Result<Self, String> {
        let shape: FileShape = serde_json::from_str(json).map_err(|e| e.to_string())?;
        if !shape
            .model
            .kind
            .as_deref()
            .is_some_and(|k| MODELS.contains(&k))
        {
            return Err(format!("model {:?} not covered", shape.model.kind));
        }
        if shape.truncation.is_some_and(|v| !v.is_null())
            || shape.padding.is_some_and(|v| !v.is_null())
        {
            return Err("truncation or padding configured".into());
        }
        if !is_identity_normalizer(shape.normalizer.as_ref()) {
            return Err("has a normalizer".into());
        }
        // The loaded pre-tokenizer as `tokenizers` serializes it: legacy fields resolved.
        let pre = serde_json::to_value(tokenizer.get_pre_tokenizer()).map_err(|e| e.to_string())?;
        let pre = PreTokenizer::from_json(Some(&pre))?;
        let word_level_unk = (shape.model.kind.as_deref() == Some("WordLevel")).then(|| {
            shape
                .model
                .unk_token
                .as_deref()
                .and_then(|unk| tokenizer.get_model().token_to_id(unk))
        });
        let mut raw = Vec::new();
        let mut normalized = Vec::new();
        for t in shape.added_tokens {
            if t.single_word || t.lstrip || t.rstrip {
                return Err(format!(
                    "added token {:?} strips or is single-word",
                    t.content
                ));
            }
            if t.content.is_empty() {
                continue;
            }
            if t.normalized {
                normalized.push((t.content, t.id));
            } else {
                raw.push((t.content, t.id));
            }
        }
        Ok(FastEncoder {
            tokenizer,
            raw_added: AddedSet::new(raw)?,
            normalized_added: AddedSet::new(normalized)?,
            pre,
            byte_chars: bytes_to_unicode(),
            word_level_unk,
        })
    }

    /// Ids and spans of `text` (no special tokens added), as `Tokenizer::encode(text, false)`.
    pub fn encode(&self, text: &str) -> Result<Encoded, String> {
        let mut out = Encoded::default();
        let mut scratch = Scratch::default();
        for_each_gap(
            self.raw_added.as_ref(),
            text,
            0,
            &mut out,
            &mut |gap, at, out| {
                for_each_gap(
                    self.normalized_added.as_ref(),
                    gap,
                    at,
                    out,
                    &mut |gap, at, out| {
                        let mut pieces = std::mem::take(&mut scratch.pieces);
                        pieces.clear();
                        self.pre
                            .split(text, (at, at + gap.len()), &mut pieces, &mut scratch.split);
                        let result = pieces.iter().try_for_each(|&piece| {
                            self.encode_piece(text, piece, &mut scratch, out)
                        });
                        scratch.pieces = pieces;
                        result
                    },
                )
            },
        )?;
        Ok(out)
    }

    /// One pre-tokenized piece through the mapping and the model.
    fn encode_piece(
        &self,
        text: &str,
        (start, end): (usize, usize),
        scratch: &mut Scratch,
        out: &mut Encoded,
    ) -> Result<(), String> {
        let model = self.tokenizer.get_model();
        match self.pre.mapping {
            Mapping::Identity if self.word_level_unk.is_some() => {
                let id = model
                    .token_to_id(&text[start..end])
                    .or(self.word_level_unk.flatten())
                    .ok_or("WordLevel: unknown word and no unk_token in the vocabulary")?;
                out.push(id, start, end);
            }
            Mapping::Identity => {
                let tokens = model
                    .tokenize(&text[start..end])
                    .map_err(|e| e.to_string())?;
                for token in tokens {
                    out.push(token.id, start + token.offsets.0, start + token.offsets.1);
                }
            }
            Mapping::ByteLevel => {
                scratch.mapped.clear();
                scratch.origin.clear();
                for (i, &b) in text.as_bytes()[start..end].iter().enumerate() {
                    let c = self.byte_chars[b as usize];
                    scratch.mapped.push(c);
                    scratch
                        .origin
                        .extend(std::iter::repeat_n((start + i) as u32, c.len_utf8()));
                }
                scratch.origin.push(end as u32);
                let tokens = model.tokenize(&scratch.mapped).map_err(|e| e.to_string())?;
                for token in tokens {
                    let (s, e) = token.offsets;
                    out.push(
                        token.id,
                        scratch.origin[s] as usize,
                        scratch.origin[e] as usize,
                    );
                }
            }
            Mapping::Metaspace {
                replacement,
                prepend,
                split,
            } => {
                metaspace_map(
                    text,
                    (start, end),
                    (replacement, prepend, split),
                    &mut scratch.mapped,
                    &mut scratch.origin,
                    &mut scratch.sub,
                );
                for &(a, b) in &scratch.sub {
                    let tokens = model
                        .tokenize(&scratch.mapped[a..b])
                        .map_err(|e| e.to_string())?;
                    for token in tokens {
                        let (s, e) = (a + token.offsets.0, a + token.offsets.1);
                        out.push(
                            token.id,
                            scratch.origin[s] as usize,
                            scratch.origin[e] as usize,
                        );
                    }
                }
            }
        }
        Ok(())
    }
}

impl Encoded {
    fn push(&mut self, id: u32, start: usize, end: usize) {
        self.ids.push(id);
        self.starts.push(start as u32);
        self.ends.push(end as u32);
    }
}

/// Buffers one encode reuses for every piece.
#[derive(Default)]
struct Scratch {
    pieces: Vec<(usize, usize)>,
    split: Vec<(usize, usize)>,
    mapped: String,
    origin: Vec<u32>,
    sub: Vec<(usize, usize)>,
}

type GapFn<'a> = dyn FnMut(&str, usize, &mut Encoded) -> Result<(), String> + 'a;

/// Emits `set`'s tokens found in `text` (at offset `at` of the whole input) and hands the text
/// between them to `gap`.
fn for_each_gap(
    set: Option<&AddedSet>,
    text: &str,
    at: usize,
    out: &mut Encoded,
    gap: &mut GapFn<'_>,
) -> Result<(), String> {
    let Some(set) = set else {
        return if text.is_empty() {
            Ok(())
        } else {
            gap(text, at, out)
        };
    };
    let mut from = 0;
    for m in set.matcher.find_iter(text) {
        if m.start() > from {
            gap(&text[from..m.start()], at + from, out)?;
        }
        out.ids.push(set.ids[m.pattern().as_usize()]);
        out.starts.push((at + m.start()) as u32);
        out.ends.push((at + m.end()) as u32);
        from = m.end();
    }
    if from < text.len() {
        gap(&text[from..], at + from, out)?;
    }
    Ok(())
}

fn is_identity_normalizer(normalizer: Option<&serde_json::Value>) -> bool {
    match normalizer {
        None | Some(serde_json::Value::Null) => true,
        Some(v) => {
            v.get("type").and_then(|t| t.as_str()) == Some("Sequence")
                && v.get("normalizers")
                    .and_then(|n| n.as_array())
                    .is_some_and(|n| n.iter().all(|n| is_identity_normalizer(Some(n))))
        }
    }
}

/// GPT-2's byte-to-character table that byte-level BPE vocabularies are written in.
pub(crate) fn bytes_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut extra = 0;
    for b in 0..256u32 {
        let printable = (b'!' as u32..=b'~' as u32).contains(&b)
            || (0xA1..=0xAC).contains(&b)
            || (0xAE..=0xFF).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap_or('\0')
        } else {
            extra += 1;
            char::from_u32(255 + extra).unwrap_or('\0')
        };
    }
    table
}

/// Texts the load-time check encodes both ways: whitespace runs, line starts, numbers, CJK,
/// accents, emoji, code, contractions and the added tokens themselves.
pub fn probe_texts(tokenizer: &Tokenizer) -> Vec<String> {
    let mut probes: Vec<String> = [
        "Hello world! It's a test, isn't it? I'll see; we've done 12345 things in 3.14159s.",
        "  leading spaces\n\n\ttabs\t and   runs   \r\n windows\r\nline ends  \n   \n",
        "数据结构と日本語のテキスト、中文标点。한국어 텍스트 ünïcödé café naïve Ω≈ç√∫",
        "emoji 😀🎉👍🏽 and flags 🇫🇷, zero-width\u{200b}joiner\u{200d}, nbsp\u{a0}here",
        "fn main() {\n    let x = vec![1, 2, 3];\n    println!(\"{:?}\", x);\n}\n# comment\n",
        "{\"key\": [1, 2.5e10, null, true], \"nested\": {\"a\": \"b\"}}\n<tag attr='v'>text</tag>",
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n",
        "1234567890 000 1,000,000 -42 +7 3/4 50% $100 #1 @user a_b-c.d",
        "    indented\n\n\n\nmany newlines   \n\t\n end",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    // Words of the vocabulary itself, so word-level models see known words, not only unknowns.
    let mut vocab: Vec<(String, u32)> = tokenizer.get_vocab(false).into_iter().collect();
    vocab.sort_by_key(|(_, id)| *id);
    let step = (vocab.len() / 200).max(1);
    let words: Vec<&str> = vocab
        .iter()
        .step_by(step)
        .map(|(w, _)| w.as_str())
        .collect();
    probes.push(words.join(" "));
    probes.push(words.join(""));
    probes.push(words.join("\n"));
    let added: Vec<String> = tokenizer
        .get_added_tokens_decoder()
        .values()
        .take(64)
        .map(|t| t.content.clone())
        .collect();
    if !added.is_empty() {
        probes.push(added.join(" x "));
        probes.push(format!("a{}b\n{}  ", added.join(""), added[0]));
    }
    probes
}

/// Whether the fast encoder gives `tokenizer`'s ids on every probe.
pub fn agrees(fast: &FastEncoder, tokenizer: &Tokenizer) -> bool {
    probe_texts(tokenizer).iter().all(|text| {
        let Ok(reference) = tokenizer.encode(text.as_str(), false) else {
            return false;
        };
        fast.encode(text)
            .is_ok_and(|e| e.ids.as_slice() == reference.get_ids())
    })
}

#[cfg(test)]
#[path = "fast_tests.rs"]
mod tests;
