use super::*;
use crate::prefix_cache::testutil;
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

/// Differential test over every covered shape: random texts (whitespace runs, line ends, CJK,
/// accents, emoji, digits, punctuation) encode to `tokenizers`' ids, with spans inside the text
/// and in order.
#[test]
fn equals_tokenizers_for_every_covered_shape() {
    for (seed, (name, json)) in crate::test_shapes::covered().into_iter().enumerate() {
        let tokenizer: Arc<Tokenizer> = Arc::new(json.parse().unwrap());
        let fast = FastEncoder::new(Arc::clone(&tokenizer), &json)
            .unwrap_or_else(|e| panic!("{name}: not covered: {e}"));
        assert!(agrees(&fast, &tokenizer), "{name}: disagrees on the probes");
        let mut rng = StdRng::seed_from_u64(seed as u64);
        for _ in 0..300 {
            let n = rng.random_range(0..60);
            let text = random_text(&mut rng, n);
            let reference = tokenizer.encode(text.as_str(), false).unwrap();
            let got = fast.encode(&text).unwrap();
            assert_eq!(got.ids, reference.get_ids(), "{name} on {text:?}");
            let mut at = 0;
            for (s, e) in got.starts.iter().zip(&got.ends) {
                assert!(
                    *s as usize >= at && e >= s && *e as usize <= text.len(),
                    "{name} on {text:?}"
                );
                at = *s as usize;
            }
        }
    }
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
    let mut json: serde_json::Value = serde_json::from_str(&testutil::tokenizer_json()).unwrap();
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
    // The shape is read from the file and from the tokenizer loaded from it: both edited.
    let refused = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut json = base.clone();
        edit(&mut json);
        let tokenizer: Arc<Tokenizer> = Arc::new(json.to_string().parse().unwrap());
        FastEncoder::new(tokenizer, &json.to_string()).err()
    };
    assert!(refused(&|j| j["normalizer"] = serde_json::json!({"type": "NFC"})).is_some());
    assert!(refused(&|j| j["added_tokens"][0]["lstrip"] = true.into()).is_some());
    assert!(refused(&|j| j["pre_tokenizer"]["add_prefix_space"] = true.into()).is_some());
    assert!(refused(&|j| j["truncation"] = serde_json::json!({"max_length": 8, "strategy": "LongestFirst", "stride": 0, "direction": "Right"})).is_some());
    assert!(
        refused(&|j| j["pre_tokenizer"] = serde_json::json!({"type": "UnicodeScripts"})).is_some()
    );
    assert!(refused(&|_| {}).is_none());
}
