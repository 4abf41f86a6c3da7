//! A direct encoder for the common byte-level BPE `tokenizer.json` shape (DeepSeek, Llama 3,
//! GPT-2 and similar): added tokens, then `Split` regexes (isolated), then `ByteLevel`, then the
//! BPE model. It does what `Tokenizer::encode(text, false)` does for that shape without the
//! general pipeline's per-byte alignment bookkeeping, which was most of a tokenization's cost:
//! the same regexes (`fancy-regex`, as `tokenizers` uses), the same leftmost-longest added-token
//! matching, and the `tokenizers` BPE model itself for each piece.
//!
//! It is used only when the file has exactly that shape and, at load, its ids equal
//! `Tokenizer::encode` on a probe corpus; otherwise the caller keeps the general pipeline. Token
//! spans are byte ranges of the input, always contiguous. This module owns only that encoder.

use std::sync::Arc;

use aho_corasick::{AhoCorasick, AhoCorasickBuilder, MatchKind};
use fancy_regex::Regex;
use serde::Deserialize;
use tokenizers::{Model, Tokenizer};

/// GPT-2's pre-tokenization regex, which `ByteLevel { use_regex: true }` applies.
const BYTE_LEVEL_REGEX: &str =
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+";

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
    splits: Vec<Regex>,
    byte_chars: [char; 256],
}

#[derive(Deserialize)]
struct FileShape {
    #[serde(default)]
    added_tokens: Vec<AddedTokenShape>,
    normalizer: Option<serde_json::Value>,
    pre_tokenizer: Option<serde_json::Value>,
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
}

impl FastEncoder {
    /// The encoder for `tokenizer` loaded from `json` (the file's text), or why not.
    pub fn new(tokenizer: Arc<Tokenizer>, json: &str) -> Result<Self, String> {
        let shape: FileShape = serde_json::from_str(json).map_err(|e| e.to_string())?;
        if shape.model.kind.as_deref() != Some("BPE") {
            return Err("model is not BPE".into());
        }
        if shape.truncation.is_some_and(|v| !v.is_null())
            || shape.padding.is_some_and(|v| !v.is_null())
        {
            return Err("truncation or padding configured".into());
        }
        if !is_identity_normalizer(shape.normalizer.as_ref()) {
            return Err("has a normalizer".into());
        }
        let splits = split_regexes(shape.pre_tokenizer.as_ref())?;
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
            splits,
            byte_chars: bytes_to_unicode(),
        })
    }

    /// Ids and spans of `text` (no special tokens added), as `Tokenizer::encode(text, false)`.
    pub fn encode(&self, text: &str) -> Result<Encoded, String> {
        let mut out = Encoded::default();
        let mut mapped = String::new();
        let mut pieces = Vec::new();
        let mut next = Vec::new();
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
                        pieces.clear();
                        pieces.push((at, at + gap.len()));
                        for regex in &self.splits {
                            next.clear();
                            for &(start, end) in &pieces {
                                split_isolated(regex, text, start, end, &mut next);
                            }
                            std::mem::swap(&mut pieces, &mut next);
                        }
                        for &(start, end) in &pieces {
                            self.encode_piece(
                                &text.as_bytes()[start..end],
                                start,
                                &mut mapped,
                                out,
                            )?;
                        }
                        Ok(())
                    },
                )
            },
        )?;
        Ok(out)
    }

    fn encode_piece(
        &self,
        piece: &[u8],
        at: usize,
        mapped: &mut String,
        out: &mut Encoded,
    ) -> Result<(), String> {
        mapped.clear();
        mapped.extend(piece.iter().map(|&b| self.byte_chars[b as usize]));
        let tokens = self
            .tokenizer
            .get_model()
            .tokenize(mapped)
            .map_err(|e| e.to_string())?;
        let mut pos = at as u32;
        for token in tokens {
            // Each mapped char stands for one input byte.
            let len = token.value.chars().count() as u32;
            out.ids.push(token.id);
            out.starts.push(pos);
            pos += len;
            out.ends.push(pos);
        }
        Ok(())
    }
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

/// `Split { behavior: Isolated, invert: false }` on `text[start..end]`: matches and the text
/// between them, empty pieces dropped. Like `tokenizers`, a regex error ends the matching.
fn split_isolated(
    regex: &Regex,
    text: &str,
    start: usize,
    end: usize,
    out: &mut Vec<(usize, usize)>,
) {
    let inside = &text[start..end];
    let mut prev = 0;
    for m in regex.find_iter(inside) {
        let Ok(m) = m else { break };
        if m.start() > prev {
            out.push((start + prev, start + m.start()));
        }
        if m.end() > m.start() {
            out.push((start + m.start(), start + m.end()));
        }
        prev = m.end();
    }
    if prev < inside.len() {
        out.push((start + prev, end));
    }
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

/// The regexes of a `Sequence` of isolated `Split`s ending in a plain `ByteLevel` (or a lone
/// `ByteLevel`), in order.
fn split_regexes(pre: Option<&serde_json::Value>) -> Result<Vec<Regex>, String> {
    let steps: Vec<&serde_json::Value> = match pre {
        Some(v) if v.get("type").and_then(|t| t.as_str()) == Some("Sequence") => v
            .get("pretokenizers")
            .and_then(|p| p.as_array())
            .ok_or("pre_tokenizer sequence without steps")?
            .iter()
            .collect(),
        Some(v) if !v.is_null() => vec![v],
        _ => return Err("no pre_tokenizer".into()),
    };
    let Some((last, splits)) = steps.split_last() else {
        return Err("empty pre_tokenizer".into());
    };
    if last.get("type").and_then(|t| t.as_str()) != Some("ByteLevel") {
        return Err("pre_tokenizer does not end in ByteLevel".into());
    }
    if last.get("add_prefix_space").and_then(|v| v.as_bool()) != Some(false) {
        return Err("ByteLevel adds a prefix space".into());
    }
    let mut regexes = Vec::new();
    for step in splits {
        if step.get("type").and_then(|t| t.as_str()) != Some("Split")
            || step.get("behavior").and_then(|b| b.as_str()) != Some("Isolated")
            || step.get("invert").and_then(|b| b.as_bool()) != Some(false)
        {
            return Err(format!("unsupported pre_tokenizer step {step}"));
        }
        let pattern = step.get("pattern").ok_or("Split without pattern")?;
        let source = if let Some(r) = pattern.get("Regex").and_then(|r| r.as_str()) {
            r.to_string()
        } else if let Some(s) = pattern.get("String").and_then(|s| s.as_str()) {
            fancy_regex::escape(s).into_owned()
        } else {
            return Err("Split pattern is neither Regex nor String".into());
        };
        regexes.push(Regex::new(&source).map_err(|e| e.to_string())?);
    }
    if last
        .get("use_regex")
        .and_then(|v| v.as_bool())
        .unwrap_or(true)
    {
        regexes.push(Regex::new(BYTE_LEVEL_REGEX).map_err(|e| e.to_string())?);
    }
    Ok(regexes)
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
mod tests {
    use super::*;
    use crate::tokenize::prefix_cache::testutil;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    use testutil::WORDS;

    fn random_text(rng: &mut StdRng, words: usize) -> String {
        let mut s = String::new();
        for _ in 0..words {
            s.push_str(WORDS[rng.random_range(0..WORDS.len())]);
            if rng.random_bool(0.5) {
                s.push(' ');
            }
        }
        s
    }

    fn encoder(json: &str) -> (Arc<Tokenizer>, FastEncoder) {
        let tokenizer: Arc<Tokenizer> = Arc::new(json.parse().unwrap());
        let fast = FastEncoder::new(Arc::clone(&tokenizer), json).unwrap();
        (tokenizer, fast)
    }

    fn check_equal(tokenizer: &Tokenizer, fast: &FastEncoder, seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        for _ in 0..400 {
            let n = rng.random_range(0..60);
            let text = random_text(&mut rng, n);
            let reference = tokenizer.encode(text.as_str(), false).unwrap();
            let got = fast.encode(&text).unwrap();
            assert_eq!(got.ids, reference.get_ids(), "on {text:?}");
            // Spans tile the text.
            let mut at = 0;
            for (s, e) in got.starts.iter().zip(&got.ends) {
                assert_eq!(*s as usize, at, "on {text:?}");
                assert!(e > s);
                at = *e as usize;
            }
            assert_eq!(at, text.len());
        }
    }

    /// ByteLevel with GPT-2's regex and an added token.
    #[test]
    fn equals_tokenizers_for_byte_level_with_regex() {
        let (tokenizer, fast) = encoder(&testutil::tokenizer_json());
        assert!(agrees(&fast, &tokenizer));
        check_equal(&tokenizer, &fast, 1);
    }

    /// A `Sequence` of isolated `Split`s (DeepSeek's) then ByteLevel without its regex, with a
    /// normalized added token next to a raw one.
    #[test]
    fn equals_tokenizers_for_split_sequence() {
        let mut json: serde_json::Value =
            serde_json::from_str(&testutil::tokenizer_json()).unwrap();
        json["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": false},
            {"type": "Split", "pattern": {"Regex": "[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+"}, "behavior": "Isolated", "invert": false},
            {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
            {"type": "Split", "pattern": {"String": "_"}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}
        ]});
        json["normalizer"] = serde_json::json!({"type": "Sequence", "normalizers": []});
        let mut added = json["added_tokens"][0].clone();
        added["id"] = serde_json::json!(added["id"].as_u64().unwrap() + 1);
        added["content"] = serde_json::json!("assistant");
        added["normalized"] = serde_json::json!(true);
        json["added_tokens"].as_array_mut().unwrap().push(added);
        let text = json.to_string();
        let (tokenizer, fast) = encoder(&text);
        assert!(agrees(&fast, &tokenizer));
        check_equal(&tokenizer, &fast, 2);
    }

    #[test]
    fn other_shapes_are_left_to_the_general_pipeline() {
        let base: serde_json::Value = serde_json::from_str(&testutil::tokenizer_json()).unwrap();
        let tokenizer: Arc<Tokenizer> = Arc::new(base.to_string().parse().unwrap());
        let refused = |edit: &dyn Fn(&mut serde_json::Value)| {
            let mut json = base.clone();
            edit(&mut json);
            FastEncoder::new(Arc::clone(&tokenizer), &json.to_string()).err()
        };
        assert!(refused(&|j| j["normalizer"] = serde_json::json!({"type": "NFC"})).is_some());
        assert!(refused(&|j| j["added_tokens"][0]["lstrip"] = true.into()).is_some());
        assert!(refused(&|j| j["pre_tokenizer"]["add_prefix_space"] = true.into()).is_some());
        assert!(refused(&|j| j["truncation"] = serde_json::json!({"max_length": 8})).is_some());
        assert!(
            refused(&|j| j["pre_tokenizer"] = serde_json::json!({"type": "Whitespace"})).is_some()
        );
        assert!(refused(&|_| {}).is_none());
    }
}
