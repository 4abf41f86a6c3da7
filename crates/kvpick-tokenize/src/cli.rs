//! `kvpick tokenize`: runs request bodies through the configured tokenizers and prints the ids,
//! so a tokenizer config can be checked against an engine (and parity-tested in CI). It says
//! what it used: per model on stderr (tokenizer file, chat templates, special tokens and where
//! each came from, what `add_special_tokens` adds), per answer tokenized in process the template
//! and `add_special_tokens` that body was tokenized with. It only reads stdin and writes stdout and
//! stderr; it starts no server.

use std::io::{BufRead, Write};
use std::path::PathBuf;

use bytes::Bytes;

use super::body::layout::BodyLayout;
use super::conversation;
use super::prompt::{self, Endpoint, PromptSpec};
use super::{Resolved, Source, TokenizeOutcome, Tokenizers};

#[derive(Debug, Clone, clap::Args)]
pub struct TokenizeArgs {
    /// The tokenizer config (same file as `serve --tokenizer-config`).
    #[arg(long, value_name = "FILE", env = "KVPICK_TOKENIZER_CONFIG")]
    pub tokenizer_config: Option<PathBuf>,
    /// A model directory as `[MODEL=]DIR` (same as `serve --tokenizer-dir`; repeatable):
    /// tokenizer.json, special tokens and chat template read from DIR as transformers reads them.
    #[arg(long, value_name = "[MODEL=]DIR")]
    pub tokenizer_dir: Vec<String>,
    /// The request path the bodies were sent to (`/v1/messages`, `/generate`, `/v1/embeddings`);
    /// by default chat, completions and responses bodies, told apart by their fields.
    #[arg(long, value_name = "PATH", default_value = "/v1/chat/completions")]
    pub path: String,
}

pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    let registry = prometheus::Registry::new();
    let tokenizers = Tokenizers::load_sources(
        args.tokenizer_config.as_deref(),
        &args.tokenizer_dir,
        &registry,
    )?
    .ok_or_else(|| anyhow::anyhow!("give --tokenizer-config FILE or --tokenizer-dir [MODEL=]DIR"))?
    // A checking tool tokenizes one body at a time, whatever its size: no request limits.
    .with_limits(super::TokenizeLimits::unbounded());
    {
        let mut err = std::io::stderr().lock();
        for line in describe(&tokenizers) {
            writeln!(err, "{line}")?;
        }
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let endpoint = Endpoint::from_path(&args.path);
    let stdin = std::io::stdin();
    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    for line in stdin.lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        // A body naming no model (SGLang `/generate`) uses the only configured model, if one.
        let model = serde_json::from_str::<serde_json::Value>(&line)
            .ok()
            .and_then(|v| v.get("model").and_then(|m| m.as_str()).map(String::from))
            .or_else(|| tokenizers.sole_model().map(String::from))
            .unwrap_or_default();
        let body = Bytes::from(line);
        let used = used_for(&tokenizers, endpoint, &model, &body);
        let outcome = runtime.block_on(tokenizers.tokenize_request(endpoint, &model, body));
        // What the in-process tokenizer used says nothing about ids from elsewhere.
        let in_process = matches!(
            outcome,
            TokenizeOutcome::Tokens {
                source: Source::Local | Source::Cached,
                ..
            }
        );
        let mut answer = match outcome {
            TokenizeOutcome::Tokens { ids, source, media } if media.is_empty() => {
                serde_json::json!({"ids": ids, "source": source.label()})
            }
            TokenizeOutcome::Tokens { ids, source, media } => {
                let media: Vec<_> = media
                    .iter()
                    .map(|s| serde_json::json!({"offset": s.offset, "length": s.length}))
                    .collect();
                serde_json::json!({"ids": ids, "source": source.label(), "media": media})
            }
            TokenizeOutcome::Fallback { reason } => serde_json::json!({ "fallback": reason }),
            TokenizeOutcome::Skipped { reason } => serde_json::json!({ "fallback": reason }),
            TokenizeOutcome::NotApplicable => serde_json::json!({ "fallback": "not applicable" }),
        };
        if let (true, Some(map), Some(used)) = (in_process, answer.as_object_mut(), used) {
            map.extend(used);
        }
        writeln!(out, "{answer}")?;
        out.flush()?;
    }
    Ok(())
}

/// Per model, what its tokenizer resolved to (one line each part, for stderr).
pub fn describe(tokenizers: &Tokenizers) -> Vec<String> {
    let mut models: Vec<_> = tokenizers.models.keys().collect();
    models.sort();
    let mut lines = Vec::new();
    for name in models {
        let m = &tokenizers.models[name];
        let Some(local) = &m.local else {
            lines.push(format!(
                "model {name:?}: no in-process tokenizer (render endpoint only)"
            ));
            continue;
        };
        describe_local(name, local.resolved(), &mut lines);
        if m.render.is_some() {
            lines.push("  render endpoint: the fallback when in-process tokenization fails".into());
        }
    }
    lines
}

fn describe_local(name: &str, r: &Resolved, lines: &mut Vec<String>) {
    lines.push(format!("model {name:?}: tokenizer {}", r.tokenizer_json));
    lines.push(format!(
        "  chat template: {}",
        r.template
            .as_deref()
            .unwrap_or("none (chat requests are not tokenized)")
    ));
    if let Some(tool) = &r.tool_template {
        lines.push(format!("  chat template for requests with tools: {tool}"));
    }
    if r.specials.is_empty() {
        lines.push("  special tokens: none defined".into());
    }
    for (token, s) in &r.specials {
        lines.push(format!("  {token}: {:?} (from {})", s.value, s.origin));
    }
    for token in &r.missing {
        lines.push(format!(
            "  WARNING: the chat template uses {token}, which nothing defines: it renders as empty text"
        ));
    }
    let wrap = match &r.wrap {
        Some((before, after)) => {
            format!("the post-processor adds {before:?} before and {after:?} after the text")
        }
        None => "the post-processor does more than wrap the text: applied as is".into(),
    };
    lines.push(format!(
        "  add_special_tokens: {} for completions, false for chat (a body's own value wins); {wrap}",
        r.add_special_tokens
    ));
}

/// What a body is tokenized with: `template` (chat: its origin, or null) and
/// `add_special_tokens`; `None` when the model has no in-process tokenizer or the body no
/// text prompt.
fn used_for(
    tokenizers: &Tokenizers,
    endpoint: Endpoint,
    model: &str,
    body: &Bytes,
) -> Option<serde_json::Map<String, serde_json::Value>> {
    let local = tokenizers.model(model)?.local.as_ref()?;
    let layout = BodyLayout::of(endpoint, body).ok()?;
    let parsed = conversation::read(body, &layout, endpoint, local.content_format).ok()?;
    let spec =
        prompt::prompt_spec_parsed(endpoint, &parsed.top, parsed.items, local.content_format)
            .ok()?;
    let mut used = serde_json::Map::new();
    match &spec {
        PromptSpec::Chat(chat) => {
            used.insert("template".into(), local.template_origin(chat).into());
        }
        PromptSpec::Text { .. } => {}
        PromptSpec::Ids(_) | PromptSpec::None => return None,
    }
    used.insert(
        "add_special_tokens".into(),
        local.adds_special_tokens(&spec).into(),
    );
    Some(used)
}
