//! A model directory's tokenizer files, read the way `transformers` 5 (what vLLM 0.32 loads)
//! reads them (ARCHITECTURE.md §8): `tokenizer.json`; the special tokens (`bos_token`,
//! `eos_token`, ...) of `tokenizer_config.json`, overridden by `special_tokens_map.json` when the
//! config has no `added_tokens_decoder`; the chat template from `chat_template.jinja` (plus
//! `additional_chat_templates/*.jinja`), else `chat_template.json`, else `tokenizer_config.json`.
//! Token values may be strings or `AddedToken` objects (`{"content": "<s>", ...}`).
//!
//! This module owns reading those files and the precedence among them, each value with where it
//! came from. It compiles no template and tokenizes nothing; `tokenize::local` applies the
//! tokenizer config's explicit values on top.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

/// The special tokens `transformers` hands every chat template (`special_tokens_map`).
pub const SPECIAL_TOKEN_NAMES: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// Files larger than this are not a tokenizer config (a guard against pointing at weights).
const MAX_CONFIG_BYTES: u64 = 64 << 20;

/// A value and where it came from (a file path, with the key when a JSON file holds it, or
/// `inline`), as `kvpick tokenize` and the start-up log report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sourced {
    pub value: String,
    pub origin: String,
}

/// The chat templates of a model: `default`, and `tool_use` for requests that carry tools
/// (`transformers`' `get_chat_template`: `tool_use` when tools are given and it exists).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Templates {
    pub default: Option<Sourced>,
    pub tool_use: Option<Sourced>,
}

impl Templates {
    pub fn is_empty(&self) -> bool {
        self.default.is_none() && self.tool_use.is_none()
    }

    fn single(value: String, origin: String) -> Self {
        Templates {
            default: Some(Sourced { value, origin }),
            tool_use: None,
        }
    }
}

/// Special tokens by name (`bos_token`, ...), each with its origin.
pub type SpecialTokens = BTreeMap<String, Sourced>;

/// What a model directory provides.
#[derive(Debug, Clone, Default)]
pub struct DirFiles {
    /// `tokenizer.json`, if present.
    pub tokenizer_json: Option<PathBuf>,
    pub templates: Templates,
    pub specials: SpecialTokens,
}

/// Reads a model directory (`tokenizer_dir`). A missing optional file is no error; an
/// unreadable or malformed one is, naming the file.
pub fn read_dir(dir: &Path) -> Result<DirFiles, String> {
    if !dir.is_dir() {
        return Err(format!("tokenizer_dir {}: not a directory", dir.display()));
    }
    let tokenizer_json = Some(dir.join("tokenizer.json")).filter(|p| p.is_file());
    let config_path = dir.join("tokenizer_config.json");
    let config = read_json_object(&config_path)?;
    let mut specials = config
        .as_ref()
        .map(|c| special_tokens(c, &config_path))
        .transpose()?
        .unwrap_or_default();
    // transformers merges special_tokens_map.json only for configs without
    // `added_tokens_decoder` (the legacy layout); its values win over the config's there.
    let legacy = config
        .as_ref()
        .is_none_or(|c| !c.contains_key("added_tokens_decoder"));
    let map_path = dir.join("special_tokens_map.json");
    if legacy {
        if let Some(map) = read_json_object(&map_path)? {
            specials.extend(special_tokens(&map, &map_path)?);
        }
    }
    let mut templates = jinja_templates(dir)?;
    if templates.is_empty() {
        let path = dir.join("chat_template.json");
        if let Some(obj) = read_json_object(&path)? {
            templates = templates_in(&obj, &path)?;
        }
    }
    if templates.is_empty() {
        if let Some(obj) = &config {
            templates = templates_in(obj, &config_path)?;
        }
    }
    Ok(DirFiles {
        tokenizer_json,
        templates,
        specials,
    })
}

/// A `chat_template_file`: Jinja source, or a JSON file (`tokenizer_config.json`,
/// `chat_template.json`) whose `chat_template` is the template; a JSON file's special tokens
/// come with it.
pub fn read_template_file(path: &Path) -> Result<(Templates, SpecialTokens), String> {
    if path.extension().is_some_and(|e| e == "json") {
        let obj = read_json_object(path)?
            .ok_or_else(|| format!("chat_template_file {}: not found", path.display()))?;
        let templates = templates_in(&obj, path)?;
        if templates.is_empty() {
            return Err(format!(
                "chat_template_file {}: no `chat_template`",
                path.display()
            ));
        }
        return Ok((templates, special_tokens(&obj, path)?));
    }
    let text = read_text(path).map_err(|e| format!("chat_template_file {e}"))?;
    Ok((
        Templates::single(text, path.display().to_string()),
        SpecialTokens::new(),
    ))
}

/// An inline `chat_template` of the tokenizer config.
pub fn inline_template(source: &str) -> Templates {
    Templates::single(source.to_string(), "inline (tokenizer config)".into())
}

/// `chat_template.jinja` and `additional_chat_templates/*.jinja`: when any exists, these are the
/// model's templates (transformers lets them replace the config's entirely).
fn jinja_templates(dir: &Path) -> Result<Templates, String> {
    let mut templates = Templates::default();
    let main = dir.join("chat_template.jinja");
    if main.is_file() {
        let text = read_text(&main)?;
        templates.default = Some(Sourced {
            value: text,
            origin: main.display().to_string(),
        });
    }
    for name in ["default", "tool_use"] {
        let path = dir
            .join("additional_chat_templates")
            .join(format!("{name}.jinja"));
        if path.is_file() {
            let slot = match name {
                "default" => &mut templates.default,
                _ => &mut templates.tool_use,
            };
            *slot = Some(Sourced {
                value: read_text(&path)?,
                origin: path.display().to_string(),
            });
        }
    }
    Ok(templates)
}

/// `chat_template` of a JSON object: a string, or a list of `{name, template}` (only `default`
/// and `tool_use` are ever chosen for a request).
fn templates_in(obj: &Map<String, Value>, path: &Path) -> Result<Templates, String> {
    let origin = |name: &str| format!("{} ({name})", path.display());
    match obj.get("chat_template") {
        None | Some(Value::Null) => Ok(Templates::default()),
        Some(Value::String(s)) => Ok(Templates::single(s.clone(), origin("chat_template"))),
        Some(Value::Array(items)) => {
            let mut templates = Templates::default();
            for item in items {
                let (Some(name), Some(text)) = (
                    item.get("name").and_then(Value::as_str),
                    item.get("template").and_then(Value::as_str),
                ) else {
                    return Err(format!(
                        "{}: `chat_template` list items need string `name` and `template`",
                        path.display()
                    ));
                };
                let sourced = Some(Sourced {
                    value: text.to_string(),
                    origin: origin(&format!("chat_template {name}")),
                });
                match name {
                    "default" => templates.default = sourced,
                    "tool_use" => templates.tool_use = sourced,
                    _ => {}
                }
            }
            Ok(templates)
        }
        Some(_) => Err(format!(
            "{}: `chat_template` must be a string or a list of {{name, template}}",
            path.display()
        )),
    }
}

/// The special tokens a JSON object defines: the standard names and any other `*_token` key
/// whose value is a token (transformers 5 hands templates those too), as strings or
/// `AddedToken` objects. Null values define nothing; a token of another shape is an error.
fn special_tokens(obj: &Map<String, Value>, path: &Path) -> Result<SpecialTokens, String> {
    let mut out = SpecialTokens::new();
    for (key, value) in obj {
        let standard = SPECIAL_TOKEN_NAMES.contains(&key.as_str());
        if !key.ends_with("_token") {
            continue;
        }
        let token = match value {
            Value::String(s) => s.clone(),
            Value::Object(o) => match o.get("content") {
                Some(Value::String(s)) => s.clone(),
                _ if standard => {
                    return Err(format!(
                        "{}: `{key}` is an object without a string `content`",
                        path.display()
                    ))
                }
                _ => continue,
            },
            Value::Null => continue,
            // Flags such as `add_bos_token: true` are not tokens.
            _ if !standard => continue,
            _ => {
                return Err(format!(
                    "{}: `{key}` must be a string or {{\"content\": ...}}",
                    path.display()
                ))
            }
        };
        out.insert(
            key.clone(),
            Sourced {
                value: token,
                origin: path.display().to_string(),
            },
        );
    }
    Ok(out)
}

/// A JSON object file, `None` when it does not exist.
fn read_json_object(path: &Path) -> Result<Option<Map<String, Value>>, String> {
    if !path.exists() {
        return Ok(None);
    }
    let text = read_text(path)?;
    match serde_json::from_str::<Value>(&text) {
        Ok(Value::Object(obj)) => Ok(Some(obj)),
        Ok(_) => Err(format!("{}: not a JSON object", path.display())),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

fn read_text(path: &Path) -> Result<String, String> {
    let len = std::fs::metadata(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if len > MAX_CONFIG_BYTES {
        return Err(format!(
            "{}: {len} bytes, over the {MAX_CONFIG_BYTES}-byte limit for a tokenizer file",
            path.display()
        ));
    }
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

#[cfg(test)]
#[path = "model_dir_tests.rs"]
mod tests;
