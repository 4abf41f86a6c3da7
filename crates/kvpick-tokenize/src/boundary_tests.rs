use super::*;

use std::sync::Arc;

use rand::{rngs::StdRng, Rng, SeedableRng};

use crate::fast::FastEncoder;
use crate::prefix_cache::testutil::WORDS;
use crate::prefix_cache::{IncrementalTokenizer, Path};
use crate::test_shapes;

/// Random text of about `bytes` bytes; `lines` says whether it has line ends.
fn random_text(rng: &mut StdRng, bytes: usize, lines: bool) -> String {
    let mut s = String::new();
    while s.len() < bytes {
        let w = WORDS[rng.random_range(0..WORDS.len())];
        if lines || !w.contains(['\n', '\r']) {
            s.push_str(w);
        }
        if rng.random_bool(0.6) {
            s.push(' ');
        }
        if lines && rng.random_bool(0.08) {
            s.push('\n');
        }
    }
    s
}

#[test]
fn checkpoints_are_prefix_stable_for_every_rule_set() {
    let mut rng = StdRng::seed_from_u64(7);
    let a = random_text(&mut rng, 20_000, true);
    let b = format!("{a}{}", random_text(&mut rng, 5_000, true));
    for rules in [
        Rules::default().with(Rule::LineStart),
        Rules::default().with(Rule::WordStart),
        Rules::default().with(Rule::SpaceStart),
        Rules::default()
            .with(Rule::LineStart)
            .with(Rule::SpaceStart),
    ] {
        let (ca, cb) = (checkpoints(&a, rules), checkpoints(&b, rules));
        assert!(ca.len() > 3, "{rules:?}");
        // The last checkpoint of `a` may depend on the byte after it, which `b` has.
        assert_eq!(&cb[..ca.len()], &ca[..], "{rules:?}");
        let mut last = 0;
        for &(len, _) in &ca {
            assert!(len >= last + CHUNK);
            assert!(rules.iter().any(|r| r.cuts(a.as_bytes(), len)));
            last = len;
        }
    }
    assert!(checkpoints(&a, Rules::default()).is_empty());
}

fn incremental(json: &str, fast: bool) -> (Arc<tokenizers::Tokenizer>, IncrementalTokenizer) {
    let tokenizer: Arc<tokenizers::Tokenizer> = Arc::new(json.parse().unwrap());
    let encoder = fast.then(|| FastEncoder::new(Arc::clone(&tokenizer), json).unwrap());
    let inc = IncrementalTokenizer::with_fast(Arc::clone(&tokenizer), encoder, 60_000);
    (tokenizer, inc)
}

/// The rule each family of pre-tokenizers needs is the one found, through the direct encoder and
/// through the general pipeline alike.
#[test]
fn every_covered_shape_gets_a_prefix_cache_with_the_expected_rules() {
    for (name, json) in test_shapes::covered() {
        for fast in [true, false] {
            let (_, inc) = incremental(&json, fast);
            let rules = inc.restart_rules();
            assert!(inc.cache_enabled(), "{name} (fast {fast}): no rule holds");
            let expected = if name.starts_with("byte-level") {
                Some(Rule::LineStart)
            } else if name.contains("MergedWithPrevious")
                || name.contains("Whitespace")
                || name.contains("Bert")
            {
                Some(Rule::WordStart)
            } else if name.contains("Metaspace(always") || name.contains("Metaspace(first") {
                Some(Rule::SpaceStart)
            } else {
                None
            };
            if let Some(rule) = expected {
                assert!(
                    rules.contains(rule),
                    "{name} (fast {fast}): {:?}",
                    rules.names()
                );
            }
        }
    }
}

/// A tokenizer with no pre-tokenizer splits nowhere (a WordLevel model sees the whole text as
/// one word): no boundary passes, and an empty check is not a pass.
#[test]
fn a_tokenizer_that_splits_nowhere_runs_cold() {
    let mut json: serde_json::Value = serde_json::from_str(
        &test_shapes::covered()
            .into_iter()
            .find(|(n, _)| n.contains("WhitespaceSplit"))
            .unwrap()
            .1,
    )
    .unwrap();
    json["pre_tokenizer"] = serde_json::Value::Null;
    let (_, inc) = incremental(&json.to_string(), true);
    assert!(inc.restart_rules().is_empty());
    assert!(!inc.cache_enabled());
}

/// Differential test over every covered shape: growing, edited and branching texts, with and
/// without line ends, through the prefix cache equal the cold tokenization id for id.
#[test]
fn cached_tokenization_equals_cold_for_every_covered_shape() {
    for (seed, (name, json)) in test_shapes::covered().into_iter().enumerate() {
        let (tokenizer, inc) = incremental(&json, true);
        let mut rng = StdRng::seed_from_u64(100 + seed as u64);
        let lines = seed % 2 == 0;
        let mut texts: Vec<String> = (0..2)
            .map(|_| random_text(&mut rng, 3_000, lines))
            .collect();
        let mut hits = 0;
        for _ in 0..24 {
            let i = rng.random_range(0..texts.len());
            match rng.random_range(0..6) {
                0..=3 => {
                    let n = rng.random_range(1..2_500);
                    let extra = random_text(&mut rng, n, lines);
                    texts[i].push_str(&extra);
                }
                4 => {
                    let mut cut = rng.random_range(0..texts[i].len());
                    while !texts[i].is_char_boundary(cut) {
                        cut -= 1;
                    }
                    texts[i].truncate(cut);
                    let extra = random_text(&mut rng, 400, lines);
                    texts[i].push_str(&extra);
                }
                _ => {
                    let mut cut = rng.random_range(0..texts[i].len());
                    while !texts[i].is_char_boundary(cut) {
                        cut -= 1;
                    }
                    let branch =
                        format!("{}{}", &texts[i][..cut], random_text(&mut rng, 600, lines));
                    texts.push(branch);
                }
            }
            let text = texts[i].clone();
            let (ids, path) = inc.tokenize(&text).unwrap();
            let cold = tokenizer.encode(text.as_str(), false).unwrap();
            assert_eq!(ids, cold.get_ids(), "{name}: mismatch on path {path:?}");
            hits += usize::from(matches!(path, Path::Cached { .. }));
        }
        assert!(hits >= 6, "{name}: cache used {hits} of 24 times");
    }
}
