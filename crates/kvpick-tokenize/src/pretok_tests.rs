use super::*;

fn pieces(pre: &Value, text: &str) -> Vec<String> {
    let pre = PreTokenizer::from_json(Some(pre)).unwrap();
    let (mut out, mut scratch) = (Vec::new(), Vec::new());
    pre.split(text, (0, text.len()), &mut out, &mut scratch);
    out.iter().map(|&(s, e)| text[s..e].to_string()).collect()
}

/// `tokenizers`' own examples of each delimiter behaviour (`pre_tokenizers/split.rs`).
#[test]
fn split_behaviours_match_the_tokenizers_examples() {
    let split = |behavior: &str| serde_json::json!({"type": "Split", "pattern": {"String": " "}, "behavior": behavior, "invert": false});
    let text = "How are you doing?";
    assert_eq!(
        pieces(&split("Removed"), text),
        ["How", "are", "you", "doing?"]
    );
    assert_eq!(
        pieces(&split("Isolated"), text),
        ["How", " ", "are", " ", "you", " ", "doing?"]
    );
    assert_eq!(
        pieces(&split("MergedWithPrevious"), text),
        ["How ", "are ", "you ", "doing?"]
    );
    assert_eq!(
        pieces(&split("MergedWithNext"), text),
        ["How", " are", " you", " doing?"]
    );
    assert_eq!(
        pieces(&split("Contiguous"), "How  are"),
        ["How", "  ", "are"]
    );
    let bert = serde_json::json!({"type": "BertPreTokenizer"});
    assert_eq!(
        pieces(&bert, "Hey friend!     How are you?!?"),
        ["Hey", "friend", "!", "How", "are", "you", "?", "!", "?"]
    );
    let ws = serde_json::json!({"type": "Whitespace"});
    assert_eq!(pieces(&ws, "Hey man!"), ["Hey", "man", "!"]);
}

#[test]
fn unsupported_steps_are_refused_by_name() {
    for bad in [
        serde_json::json!({"type": "UnicodeScripts"}),
        serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true}, {"type": "Whitespace"}]}),
        serde_json::json!({"type": "ByteLevel", "add_prefix_space": true, "use_regex": true}),
        serde_json::json!({"type": "Split", "pattern": {"Regex": "("}, "behavior": "Isolated", "invert": false}),
        serde_json::json!({"type": "Split", "pattern": {"String": " "}, "behavior": "Sideways", "invert": false}),
    ] {
        assert!(PreTokenizer::from_json(Some(&bad)).is_err(), "{bad}");
    }
}
