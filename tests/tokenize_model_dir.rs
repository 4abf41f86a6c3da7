//! kvpick's token ids for a real model directory equal vLLM's: the tokenizer files of the
//! real-engine tier's model (`tests/fixtures/vllm-model/`, bos `<s>`, eos `</s>`, a Llama-style
//! chat template starting with `{{ bos_token }}`, a post-processor adding `<s>`) and the ids
//! transformers 5.19 gives for chat and completions bodies (`reference.json`; regenerate with
//! `.vllm-venv/bin/python e2e/vllm/tokenizer_fixture.py`). Checked for the directory as is
//! (`--tokenizer-dir`), for transformers' other layouts of the same files, for the config that
//! used to drop bos/eos (`tokenizer_json` + `chat_template_file: tokenizer_config.json`), and
//! through `kvpick tokenize`, which says what it used.

#![allow(clippy::unwrap_used, clippy::expect_used)] // a test harness: a panic is a failure report

use std::path::{Path, PathBuf};

use bytes::Bytes;
use kvpick::tokenize::{ModelEntry, TokenizeOutcome, Tokenizers};
use prometheus::Registry;
use serde_json::{json, Value};

const BOS: u32 = 1;
const EOS: u32 = 2;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm-model")
}

/// (body, reference ids) per case.
fn cases() -> Vec<(Value, Vec<u32>)> {
    let text = std::fs::read_to_string(fixture().join("reference.json")).unwrap();
    let reference: Value = serde_json::from_str(&text).unwrap();
    reference["cases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| {
            let ids = c["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|i| u32::try_from(i.as_u64().unwrap()).unwrap())
                .collect();
            (c["body"].clone(), ids)
        })
        .collect()
}

async fn ids(t: &Tokenizers, body: &Value) -> Vec<u32> {
    let model = body["model"].as_str().unwrap();
    match t.tokenize(model, Bytes::from(body.to_string())).await {
        TokenizeOutcome::Tokens { ids, .. } => ids,
        other => panic!("{body}: not tokenized: {other:?}"),
    }
}

/// Every case's ids equal the reference, naming the first difference.
async fn assert_reference(t: &Tokenizers, what: &str) {
    let cases = cases();
    assert!(cases.len() >= 10);
    for (body, expect) in &cases {
        let got = ids(t, body).await;
        if got != *expect {
            let at = got.iter().zip(expect).take_while(|(a, b)| a == b).count();
            panic!(
                "{what}: {body}\nfirst difference at token {at}: kvpick {:?} vs transformers {:?} ({} vs {} tokens)",
                &got[at..got.len().min(at + 6)],
                &expect[at..expect.len().min(at + 6)],
                got.len(),
                expect.len()
            );
        }
    }
}

fn copy_fixture(files: &[&str]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvpick-model-dir-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    for f in files {
        std::fs::copy(fixture().join(f), dir.join(f)).unwrap();
    }
    dir
}

fn entries(yaml: &str) -> Vec<ModelEntry> {
    serde_yaml::from_str(yaml).unwrap()
}

#[tokio::test]
async fn the_model_directory_as_is_gives_transformers_ids() {
    let arg = format!("tiny={}", fixture().display());
    let t = Tokenizers::load_sources(None, &[arg], &Registry::new())
        .unwrap()
        .unwrap();
    assert_reference(&t, "--tokenizer-dir").await;
    // What the bug report saw: chat prompts start with bos and close assistant turns with eos.
    let (chat, _) = &cases()[1];
    let got = ids(&t, chat).await;
    assert_eq!(got[0], BOS);
    assert!(got.contains(&EOS), "the assistant turn ends with eos");
    let resolved = t.model("tiny").unwrap().local.as_ref().unwrap().resolved();
    assert!(resolved.missing.is_empty());
    assert_eq!(resolved.specials["bos_token"].value, "<s>");
    assert_eq!(resolved.wrap, Some((vec![BOS], vec![])));
}

/// transformers' newer layout: the template in chat_template.jinja, bos/eos as AddedToken
/// objects, no special_tokens_map.json. Same ids.
#[tokio::test]
async fn the_jinja_layout_with_added_token_objects_gives_the_same_ids() {
    let dir = copy_fixture(&["tokenizer.json"]);
    let config: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture().join("tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    std::fs::write(
        dir.join("chat_template.jinja"),
        config["chat_template"].as_str().unwrap(),
    )
    .unwrap();
    let added = |s: &str| json!({"__type": "AddedToken", "content": s, "lstrip": false, "normalized": false, "rstrip": false, "single_word": false, "special": true});
    let mut config = config.clone();
    config["chat_template"] = Value::Null;
    config["bos_token"] = added("<s>");
    config["eos_token"] = added("</s>");
    config["added_tokens_decoder"] = json!({});
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    let t = Tokenizers::from_entries(
        &entries(&format!(
            "- model: tiny\n  tokenizer_dir: {}\n",
            dir.display()
        )),
        Path::new("."),
        &Registry::new(),
    )
    .unwrap();
    let resolved = t.model("tiny").unwrap().local.as_ref().unwrap().resolved();
    assert!(resolved
        .template
        .as_deref()
        .unwrap()
        .ends_with("chat_template.jinja"));
    assert_reference(&t, "chat_template.jinja layout").await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The configuration of the bug report (tokenizer_json + chat_template_file naming the model's
/// tokenizer_config.json, no bos/eos given) now takes bos/eos from that file.
#[tokio::test]
async fn a_chat_template_file_naming_tokenizer_config_brings_its_bos_and_eos() {
    let yaml = "- model: tiny\n  tokenizer_json: tokenizer.json\n  chat_template_file: tokenizer_config.json\n";
    let t = Tokenizers::from_entries(&entries(yaml), &fixture(), &Registry::new()).unwrap();
    assert_reference(&t, "tokenizer_json + chat_template_file").await;
}

/// Explicit settings win over the directory's files.
#[tokio::test]
async fn explicit_bos_token_overrides_the_directory() {
    let yaml = format!(
        "- model: tiny\n  tokenizer_dir: {}\n  bos_token: \"<|user|>\"\n",
        fixture().display()
    );
    let t = Tokenizers::from_entries(&entries(&yaml), Path::new("."), &Registry::new()).unwrap();
    let (chat, expect) = &cases()[0];
    let got = ids(&t, chat).await;
    assert_eq!(
        got[0], 4,
        "<|user|> replaces <s> as the template's bos_token"
    );
    assert_eq!(got[1..], expect[1..]);
    let resolved = t.model("tiny").unwrap().local.as_ref().unwrap().resolved();
    assert_eq!(
        resolved.specials["bos_token"].origin,
        "tokenizer config entry"
    );
}

/// A template that uses bos_token/eos_token with neither defined renders them empty: a WARN at
/// load and `kvpick_tokenize_template_undefined_tokens{model,token} 1`, never silent.
#[tokio::test]
async fn a_template_using_undefined_special_tokens_is_reported_at_load() {
    let yaml = "- model: tiny\n  tokenizer_json: tokenizer.json\n  chat_template: \"{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}{% endfor %}\"\n";
    let registry = Registry::new();
    let t = Tokenizers::from_entries(&entries(yaml), &fixture(), &registry).unwrap();
    let resolved = t.model("tiny").unwrap().local.as_ref().unwrap().resolved();
    assert_eq!(resolved.missing, ["bos_token", "eos_token"]);
    let gauge = &t.metrics().undefined_tokens;
    assert_eq!(gauge.with_label_values(&["tiny", "bos_token"]).get(), 1);
    assert_eq!(gauge.with_label_values(&["tiny", "eos_token"]).get(), 1);
    let (chat, expect) = &cases()[0];
    assert_ne!(ids(&t, chat).await[0], expect[0], "the prompt lost its bos");
    // The model directory defines both: nothing reported.
    let arg = format!("tiny={}", fixture().display());
    let registry = Registry::new();
    Tokenizers::load_sources(None, &[arg], &registry).unwrap();
    let text = prometheus::TextEncoder::new()
        .encode_to_string(&registry.gather())
        .unwrap();
    assert!(
        !text.contains("kvpick_tokenize_template_undefined_tokens{"),
        "{text}"
    );
}

#[test]
fn tokenizer_dir_arguments_are_checked() {
    let registry = Registry::new();
    let err = |arg: &str| {
        Tokenizers::load_sources(None, &[arg.to_string()], &registry)
            .unwrap_err()
            .to_string()
    };
    assert!(err("tiny=").contains("[MODEL=]DIR"));
    assert!(err("tiny=/nonexistent/dir").contains("not a directory"));
    let empty = copy_fixture(&["tokenizer_config.json"]);
    let e = err(&format!("tiny={}", empty.display()));
    assert!(
        e.contains("no tokenizer.json") && e.contains("--tokenizer-dir"),
        "{e}"
    );
    std::fs::remove_dir_all(&empty).unwrap();
    let twice = format!("tiny={}", fixture().display());
    let e = Tokenizers::load_sources(None, &[twice.clone(), twice], &registry)
        .unwrap_err()
        .to_string();
    assert!(e.contains("listed twice"), "{e}");
    // Without MODEL=, the model is DIR as written (vLLM's default served model name).
    let bare = fixture().display().to_string();
    let t = Tokenizers::load_sources(None, std::slice::from_ref(&bare), &registry)
        .unwrap()
        .unwrap();
    assert!(t.has(&bare));
}

/// `kvpick tokenize --tokenizer-dir`: the reference ids on stdout, each chat answer naming its
/// template and add_special_tokens; stderr says which files, template and special tokens.
#[test]
fn kvpick_tokenize_says_which_template_and_special_tokens_it_used() {
    let cases = cases();
    let stdin: String = cases.iter().map(|(b, _)| format!("{b}\n")).collect();
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_kvpick"))
        .args(["tokenize", "--tokenizer-dir"])
        .arg(format!("tiny={}", fixture().display()))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(stdin.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let config = fixture()
        .join("tokenizer_config.json")
        .display()
        .to_string();
    let map = fixture()
        .join("special_tokens_map.json")
        .display()
        .to_string();
    assert!(
        stderr.contains(&format!("chat template: {config} (chat_template)")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("bos_token: \"<s>\" (from {map})")),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!("eos_token: \"</s>\" (from {map})")),
        "{stderr}"
    );
    assert!(
        stderr.contains("add_special_tokens: true for completions"),
        "{stderr}"
    );
    assert!(stderr.contains("adds [1] before and [] after"), "{stderr}");
    let answers: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(answers.len(), cases.len());
    for ((body, expect), answer) in cases.iter().zip(&answers) {
        let got: Vec<u32> = serde_json::from_value(answer["ids"].clone()).unwrap();
        assert_eq!(&got, expect, "{body}");
        if body.get("messages").is_some() {
            assert_eq!(answer["template"], format!("{config} (chat_template)"));
            assert_eq!(answer["add_special_tokens"], false);
        } else {
            assert!(answer.get("template").is_none());
            let add = body
                .get("add_special_tokens")
                .and_then(Value::as_bool)
                .unwrap_or(true);
            assert_eq!(answer["add_special_tokens"], add, "{body}");
        }
    }
}
