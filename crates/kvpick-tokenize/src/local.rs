//! A model's in-process tokenizer (ARCHITECTURE.md §8): its `tokenizer.json`, chat templates and
//! special tokens resolved from a tokenizer-config entry (explicit values over the model
//! directory's files), the chat prompt rendered with them, and text tokenized with or without
//! the post-processor's special tokens. It also says what it resolved (`Resolved`), for the
//! start-up log and `kvpick tokenize`, and which special tokens its templates use but nobody
//! defined. It never parses request bodies and never chooses a source (that is `tokenize`).

use std::path::Path;
use std::sync::Arc;

use super::config::{ModelEntry, Source};
use super::fast;
use super::json::Json;
use super::model_dir::{self, Sourced, SpecialTokens, Templates, SPECIAL_TOKEN_NAMES};
use super::prefix_cache::{self, IncrementalTokenizer};
use super::prompt::{ChatPrompt, ContentFormat, PromptSpec};
use super::template::ChatTemplate;

/// A compiled template and where it came from.
struct Compiled {
    template: ChatTemplate,
    origin: String,
}

/// A model's in-process tokenizer and templates.
pub struct LocalTokenizer {
    pub(super) tokenizer: IncrementalTokenizer,
    default_template: Option<Compiled>,
    tool_template: Option<Compiled>,
    /// Every special token the templates see, by name.
    specials: SpecialTokens,
    pub(super) add_special_tokens: bool,
    pub(super) content_format: ContentFormat,
    /// Ids the post-processor adds around a sequence (BOS/EOS), if it only wraps.
    wrap: Option<(Vec<u32>, Vec<u32>)>,
    resolved: Resolved,
}

/// What a model's tokenizer was resolved to, each part with its origin.
#[derive(Debug, Clone)]
pub struct Resolved {
    pub tokenizer_json: String,
    /// The template used without tools (`None`: chat requests cannot be tokenized).
    pub template: Option<String>,
    /// The template used for requests with tools, when it is another one.
    pub tool_template: Option<String>,
    pub specials: SpecialTokens,
    /// The completions default (`add_special_tokens`; a body's own value wins).
    pub add_special_tokens: bool,
    /// What the post-processor adds with special tokens on: ids before and after the text
    /// (`None`: more than a wrap, tokenized through the full post-processor).
    pub wrap: Option<(Vec<u32>, Vec<u32>)>,
    /// Special tokens a template refers to that no file or setting defines: they render as
    /// empty text, so the prompt differs from the engine's (warned at load).
    pub missing: Vec<&'static str>,
}

impl LocalTokenizer {
    /// Builds a model's in-process tokenizer from its entry (paths relative to `base`); errors
    /// name the field. `Ok(None)`: the entry has no in-process tokenizer (render only).
    ///
    /// Precedence, highest first: the entry's `tokenizer_json`, `chat_template` /
    /// `chat_template_file`, `bos_token` / `eos_token`; then the special tokens of a JSON
    /// `chat_template_file`; then `tokenizer_dir`'s files (`model_dir::read_dir`).
    pub fn from_entry(entry: &ModelEntry, base: &Path) -> Result<Option<Self>, String> {
        let dir = entry
            .tokenizer_dir
            .as_ref()
            .map(|d| model_dir::read_dir(&base.join(d)))
            .transpose()?
            .unwrap_or_default();
        let path = match (&entry.tokenizer_json, &dir.tokenizer_json) {
            (Some(p), _) => base.join(p),
            (None, Some(p)) => p.clone(),
            (None, None) => {
                if let Some(d) = &entry.tokenizer_dir {
                    return Err(format!(
                        "tokenizer_dir {}: no tokenizer.json",
                        base.join(d).display()
                    ));
                }
                if entry.chat_template.is_some() || entry.chat_template_file.is_some() {
                    return Err("chat_template needs tokenizer_json or tokenizer_dir".into());
                }
                return Ok(None);
            }
        };
        let (templates, mut specials) = match (&entry.chat_template, &entry.chat_template_file) {
            (Some(_), Some(_)) => {
                return Err("set chat_template or chat_template_file, not both".into())
            }
            (Some(t), None) => (model_dir::inline_template(t), SpecialTokens::new()),
            (None, Some(file)) => model_dir::read_template_file(&base.join(file))?,
            (None, None) => (dir.templates, SpecialTokens::new()),
        };
        // Lower layers first: the directory, then the template file, then the entry.
        let mut all = dir.specials;
        all.append(&mut specials);
        for (name, value) in [
            ("bos_token", &entry.bos_token),
            ("eos_token", &entry.eos_token),
        ] {
            if let Some(v) = value {
                let origin = "tokenizer config entry".to_string();
                all.insert(
                    name.into(),
                    Sourced {
                        value: v.clone(),
                        origin,
                    },
                );
            }
        }
        Self::build(entry, &path, templates, all).map(Some)
    }

    fn build(
        entry: &ModelEntry,
        path: &Path,
        templates: Templates,
        specials: SpecialTokens,
    ) -> Result<Self, String> {
        let json = std::fs::read_to_string(path)
            .map_err(|e| format!("tokenizer_json {}: {e}", path.display()))?;
        let tokenizer: tokenizers::Tokenizer = json
            .parse()
            .map_err(|e| format!("tokenizer_json {}: {e}", path.display()))?;
        let tokenizer = Arc::new(tokenizer);
        let fast = match fast::FastEncoder::new(Arc::clone(&tokenizer), &json) {
            Ok(fast) if fast::agrees(&fast, &tokenizer) => Some(fast),
            Ok(_) => {
                tracing::warn!(path = %path.display(), "direct encoder disagrees with the tokenizer on the probe texts: using the general pipeline");
                None
            }
            Err(why) => {
                tracing::info!(path = %path.display(), why, "tokenizer shape not covered by the direct encoder: using the general pipeline");
                None
            }
        };
        let compile = |t: Option<Sourced>| {
            t.map(|s| {
                ChatTemplate::new(&s.value)
                    .map(|template| Compiled {
                        template,
                        origin: s.origin.clone(),
                    })
                    .map_err(|e| format!("chat_template {}: {e:#}", s.origin))
            })
            .transpose()
        };
        let default_template = compile(templates.default)?;
        let tool_template = compile(templates.tool_use)?;
        let missing = missing_specials(
            [&default_template, &tool_template].into_iter().flatten(),
            &specials,
        );
        let wrap = special_wrap(&tokenizer);
        let resolved = Resolved {
            tokenizer_json: path.display().to_string(),
            template: default_template.as_ref().map(|c| c.origin.clone()),
            tool_template: tool_template.as_ref().map(|c| c.origin.clone()),
            specials: specials.clone(),
            add_special_tokens: entry.add_special_tokens,
            wrap: wrap.clone(),
            missing,
        };
        Ok(LocalTokenizer {
            tokenizer: IncrementalTokenizer::with_fast(tokenizer, fast, entry.prefix_cache_tokens),
            default_template,
            tool_template,
            specials,
            add_special_tokens: entry.add_special_tokens,
            content_format: entry.content_format,
            wrap,
            resolved,
        })
    }

    pub fn incremental(&self) -> &IncrementalTokenizer {
        &self.tokenizer
    }

    /// What this tokenizer was resolved to (files, templates, special tokens).
    pub fn resolved(&self) -> &Resolved {
        &self.resolved
    }

    pub fn has_template(&self) -> bool {
        self.default_template.is_some() || self.tool_template.is_some()
    }

    /// The template a chat prompt renders with: `tool_use` when the request has tools and the
    /// model has one, else the default (transformers' `get_chat_template`).
    fn template_for(&self, chat: &ChatPrompt) -> Result<&Compiled, String> {
        let tools = chat
            .tools
            .as_ref()
            .is_some_and(|t| !matches!(t, Json::Null));
        let chosen = match (&self.tool_template, tools) {
            (Some(t), true) => Some(t),
            _ => self.default_template.as_ref(),
        };
        chosen.ok_or_else(|| "no chat template configured".to_string())
    }

    /// Where the template a chat prompt renders with came from.
    pub fn template_origin(&self, chat: &ChatPrompt) -> Option<&str> {
        self.template_for(chat).ok().map(|c| c.origin.as_str())
    }

    /// Renders a chat prompt to the text the engine tokenizes.
    pub fn render_chat(&self, chat: &ChatPrompt) -> Result<String, String> {
        let template = &self.template_for(chat)?.template;
        let messages: Vec<minijinja::Value> = chat.messages.iter().map(|m| m.value()).collect();
        let mut context: Vec<(String, minijinja::Value)> = vec![
            ("messages".into(), minijinja::Value::from(messages)),
            (
                "tools".into(),
                chat.tools.as_ref().unwrap_or(&Json::Null).to_value(),
            ),
            (
                "add_generation_prompt".into(),
                minijinja::Value::from(chat.add_generation_prompt),
            ),
        ];
        for (name, token) in &self.specials {
            context.push((name.clone(), minijinja::Value::from(token.value.as_str())));
        }
        for (k, v) in &chat.kwargs {
            if k == "messages" || k == "tools" {
                continue;
            }
            match context.iter_mut().find(|(name, _)| name == k) {
                Some((_, old)) => *old = v.to_value(),
                None => context.push((k.clone(), v.to_value())),
            }
        }
        let ctx = minijinja::Value::from_pairs(context);
        let mut text = template.render(ctx).map_err(|e| format!("{e:#}"))?;
        if chat.continue_final_message {
            let last = chat
                .messages
                .last()
                .and_then(|m| m.get("content"))
                .and_then(Json::as_str)
                .map(str::trim)
                .ok_or_else(|| "continue_final_message without final text".to_string())?;
            let at = text
                .rfind(last)
                .ok_or_else(|| "final message not found in the rendered prompt".to_string())?;
            text.truncate(at + last.len());
        }
        Ok(text)
    }

    /// Whether a text prompt is tokenized with the post-processor's special tokens.
    pub fn adds_special_tokens(&self, spec: &PromptSpec) -> bool {
        match spec {
            PromptSpec::Chat(chat) => chat.add_special_tokens,
            PromptSpec::Text {
                add_special_tokens, ..
            } => add_special_tokens.unwrap_or(self.add_special_tokens),
            PromptSpec::Ids(_) | PromptSpec::None => false,
        }
    }

    /// Token ids of a prompt (CPU-bound: call off the async reactor).
    pub fn tokenize(&self, spec: &PromptSpec) -> Result<(Vec<u32>, Source), String> {
        let add_special = self.adds_special_tokens(spec);
        let text = match spec {
            PromptSpec::Chat(chat) => self.render_chat(chat)?,
            PromptSpec::Text { text, .. } => text.clone(),
            PromptSpec::Ids(ids) => return Ok((ids.clone(), Source::Body)),
            PromptSpec::None => return Ok((Vec::new(), Source::Body)),
        };
        self.tokenize_text(&text, add_special)
    }

    /// Token ids of rendered text, with the post-processor's special tokens when asked.
    pub fn tokenize_text(
        &self,
        text: &str,
        add_special: bool,
    ) -> Result<(Vec<u32>, Source), String> {
        if add_special {
            let Some((before, after)) = &self.wrap else {
                // A post-processor that does more than wrap: tokenize cold with it.
                let enc = self
                    .tokenizer
                    .tokenizer()
                    .encode_fast(text, true)
                    .map_err(|e| e.to_string())?;
                return Ok((enc.get_ids().to_vec(), Source::Local));
            };
            let (body, path) = self.tokenizer.tokenize(text).map_err(|e| e.to_string())?;
            let mut ids = before.clone();
            ids.extend_from_slice(&body);
            ids.extend_from_slice(after);
            return Ok((ids, source_of(path)));
        }
        let (ids, path) = self.tokenizer.tokenize(text).map_err(|e| e.to_string())?;
        Ok((ids, source_of(path)))
    }
}

fn source_of(path: prefix_cache::Path) -> Source {
    match path {
        prefix_cache::Path::Cold => Source::Local,
        prefix_cache::Path::Cached { .. } => Source::Cached,
    }
}

/// The standard special tokens some template refers to that `specials` lacks.
fn missing_specials<'a>(
    templates: impl Iterator<Item = &'a Compiled>,
    specials: &SpecialTokens,
) -> Vec<&'static str> {
    let mut used = std::collections::HashSet::new();
    for c in templates {
        used.extend(c.template.variables());
    }
    SPECIAL_TOKEN_NAMES
        .into_iter()
        .filter(|name| used.contains(*name) && !specials.contains_key(*name))
        .collect()
}

/// The ids a tokenizer's post-processor puts before and after a sequence, if it only wraps.
fn special_wrap(tokenizer: &tokenizers::Tokenizer) -> Option<(Vec<u32>, Vec<u32>)> {
    let probe = "hello world\nprobe";
    let with = tokenizer.encode(probe, true).ok()?;
    let without = tokenizer.encode(probe, false).ok()?;
    let (with, without) = (with.get_ids(), without.get_ids());
    let at = (0..=with.len().checked_sub(without.len())?)
        .find(|&i| with[i..i + without.len()] == *without)?;
    let wrap = (with[..at].to_vec(), with[at + without.len()..].to_vec());
    // Check on a second probe that wrapping is all it does.
    let probe2 = "second\n probe 123";
    let a = tokenizer.encode(probe2, true).ok()?;
    let b = tokenizer.encode(probe2, false).ok()?;
    let mut expect = wrap.0.clone();
    expect.extend_from_slice(b.get_ids());
    expect.extend_from_slice(&wrap.1);
    (a.get_ids() == expect.as_slice()).then_some(wrap)
}
