use super::*;

struct Dir(PathBuf);

impl Drop for Dir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn dir(files: &[(&str, &str)]) -> Dir {
    let d = std::env::temp_dir().join(format!("kvpick-model-dir-{}", uuid::Uuid::new_v4()));
    for (name, text) in files {
        let path = d.join(name);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, text).unwrap();
    }
    std::fs::create_dir_all(&d).unwrap();
    Dir(d)
}

fn value<'a>(specials: &'a SpecialTokens, name: &str) -> Option<&'a str> {
    specials.get(name).map(|t| t.value.as_str())
}

#[test]
fn tokens_as_strings_or_added_token_objects_flags_and_nulls_skipped() {
    let d = dir(&[(
        "tokenizer_config.json",
        r#"{"bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": false},
            "eos_token": "</s>", "pad_token": null, "add_bos_token": true,
            "image_token": "<img>", "chat_template": "{{ bos_token }}x"}"#,
    )]);
    let files = read_dir(&d.0).unwrap();
    assert_eq!(value(&files.specials, "bos_token"), Some("<s>"));
    assert_eq!(value(&files.specials, "eos_token"), Some("</s>"));
    assert_eq!(value(&files.specials, "image_token"), Some("<img>"));
    assert!(!files.specials.contains_key("pad_token"));
    assert!(!files.specials.contains_key("add_bos_token"));
    let t = files.templates.default.unwrap();
    assert_eq!(t.value, "{{ bos_token }}x");
    assert!(
        t.origin.ends_with("tokenizer_config.json (chat_template)"),
        "{}",
        t.origin
    );
    assert_eq!(
        files.tokenizer_json, None,
        "no tokenizer.json in this directory"
    );
}

/// As transformers 5: special_tokens_map.json overrides the config's tokens unless the config
/// has `added_tokens_decoder` (then it is ignored).
#[test]
fn special_tokens_map_wins_only_in_the_legacy_layout() {
    let map = r#"{"bos_token": {"content": "<BOS>"}, "unk_token": "<unk>"}"#;
    let legacy = dir(&[
        ("tokenizer_config.json", r#"{"bos_token": "<s>"}"#),
        ("special_tokens_map.json", map),
    ]);
    let files = read_dir(&legacy.0).unwrap();
    assert_eq!(value(&files.specials, "bos_token"), Some("<BOS>"));
    assert_eq!(value(&files.specials, "unk_token"), Some("<unk>"));
    assert!(files.specials["bos_token"]
        .origin
        .ends_with("special_tokens_map.json"));
    let modern = dir(&[
        (
            "tokenizer_config.json",
            r#"{"bos_token": "<s>", "added_tokens_decoder": {}}"#,
        ),
        ("special_tokens_map.json", map),
    ]);
    let files = read_dir(&modern.0).unwrap();
    assert_eq!(value(&files.specials, "bos_token"), Some("<s>"));
    assert!(!files.specials.contains_key("unk_token"));
}

#[test]
fn template_files_win_over_the_config_in_transformers_order() {
    let config = ("tokenizer_config.json", r#"{"chat_template": "config"}"#);
    let json = ("chat_template.json", r#"{"chat_template": "processor"}"#);
    let jinja = ("chat_template.jinja", "jinja");
    let tool = ("additional_chat_templates/tool_use.jinja", "tools");
    let of = |files: &[(&str, &str)]| {
        let d = dir(files);
        let t = read_dir(&d.0).unwrap().templates;
        (t.default.map(|s| s.value), t.tool_use.map(|s| s.value))
    };
    let s = |v: &str| Some(v.to_string());
    assert_eq!(of(&[config]), (s("config"), None));
    assert_eq!(of(&[config, json]), (s("processor"), None));
    assert_eq!(of(&[config, json, jinja]), (s("jinja"), None));
    assert_eq!(of(&[config, jinja, tool]), (s("jinja"), s("tools")));
    // Template files replace the config's templates entirely (transformers does the same).
    assert_eq!(of(&[config, tool]), (None, s("tools")));
    assert_eq!(of(&[]), (None, None));
}

#[test]
fn named_template_lists_give_default_and_tool_use() {
    let d = dir(&[(
        "tokenizer_config.json",
        r#"{"chat_template": [{"name": "default", "template": "d"},
            {"name": "tool_use", "template": "t"}, {"name": "rag", "template": "r"}]}"#,
    )]);
    let t = read_dir(&d.0).unwrap().templates;
    assert_eq!(t.default.unwrap().value, "d");
    let tool = t.tool_use.unwrap();
    assert_eq!(tool.value, "t");
    assert!(
        tool.origin.ends_with("(chat_template tool_use)"),
        "{}",
        tool.origin
    );
}

#[test]
fn a_json_template_file_brings_its_special_tokens() {
    let d = dir(&[(
        "tokenizer_config.json",
        r#"{"bos_token": "<s>", "eos_token": {"content": "</s>"}, "chat_template": "t"}"#,
    )]);
    let (templates, specials) = read_template_file(&d.0.join("tokenizer_config.json")).unwrap();
    assert_eq!(templates.default.unwrap().value, "t");
    assert_eq!(value(&specials, "bos_token"), Some("<s>"));
    assert_eq!(value(&specials, "eos_token"), Some("</s>"));
    let d = dir(&[("t.jinja", "{{ bos_token }}")]);
    let (templates, specials) = read_template_file(&d.0.join("t.jinja")).unwrap();
    assert_eq!(templates.default.unwrap().value, "{{ bos_token }}");
    assert!(specials.is_empty());
}

#[test]
fn malformed_files_are_errors_naming_the_file_and_key() {
    let cases: [(&str, &str, &str); 5] = [
        (
            "tokenizer_config.json",
            r#"{"bos_token": 5}"#,
            "`bos_token`",
        ),
        (
            "tokenizer_config.json",
            r#"{"eos_token": {"id": 2}}"#,
            "`eos_token`",
        ),
        (
            "tokenizer_config.json",
            r#"{"chat_template": 3}"#,
            "`chat_template`",
        ),
        (
            "tokenizer_config.json",
            r#"{"chat_template": [{"name": "default"}]}"#,
            "`chat_template`",
        ),
        ("special_tokens_map.json", "[1]", "not a JSON object"),
    ];
    for (name, text, expect) in cases {
        let d = dir(&[(name, text)]);
        let err = read_dir(&d.0).unwrap_err();
        assert!(err.contains(name) && err.contains(expect), "{text}: {err}");
    }
    let d = dir(&[("tokenizer_config.json", "{")]);
    assert!(read_dir(&d.0)
        .unwrap_err()
        .contains("tokenizer_config.json"));
    let err = read_dir(Path::new("/nonexistent/kvpick-model")).unwrap_err();
    assert!(err.contains("not a directory"), "{err}");
    let d = dir(&[("t.json", r#"{"bos_token": "<s>"}"#)]);
    let err = read_template_file(&d.0.join("t.json")).unwrap_err();
    assert!(err.contains("no `chat_template`"), "{err}");
}
