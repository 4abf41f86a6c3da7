//! The tokenizer's settings as values: the bounds on what it may hold (`TokenizeLimits`), the
//! `--tokenizer-config` file and its per-model entries (`ModelEntry`), and how a request's token
//! ids were obtained (`Source`). A leaf: it reads nothing of the crate but the prompt's content
//! format, so every module may read it.

use std::path::PathBuf;
use std::time::Duration;

use serde::Deserialize;

use crate::prompt::ContentFormat;

/// Default of `--tokenize-max-body-bytes`: bodies over it are routed on load alone.
pub const DEFAULT_TOKENIZE_MAX_BODY_BYTES: usize = 4 << 20;
/// Default of `--tokenize-queue-max-bytes`, per tokenizer thread: one largest body each.
pub const DEFAULT_QUEUED_BYTES_PER_THREAD: usize = DEFAULT_TOKENIZE_MAX_BODY_BYTES;
/// Default of `--tokenize-stall-ms`.
pub const DEFAULT_TOKENIZE_STALL_TIMEOUT: Duration = Duration::from_secs(5);

/// Bounds on what the tokenizer may hold. Tokenization runs on a pool of one thread per core
/// (`pool`): a request waits for its tokens (a request routed without them is a cache miss), but
/// a flood of large bodies must not hold every request, and a stuck pool must not hold any.
#[derive(Debug, Clone, Copy)]
pub struct TokenizeLimits {
    /// Larger request bodies are not tokenized (load-only routing).
    pub max_body_bytes: usize,
    /// Bytes of request bodies the pool may have queued or running; a request that would go
    /// over is routed on load alone at once. `None`: [`DEFAULT_QUEUED_BYTES_PER_THREAD`] per
    /// tokenizer thread.
    pub max_queued_bytes: Option<usize>,
    /// A queued request is routed on load alone when no tokenizer thread has started or
    /// finished a job for this long (the pool is stuck, not busy).
    pub stall_timeout: Duration,
}

impl Default for TokenizeLimits {
    fn default() -> Self {
        TokenizeLimits {
            max_body_bytes: DEFAULT_TOKENIZE_MAX_BODY_BYTES,
            max_queued_bytes: None,
            stall_timeout: DEFAULT_TOKENIZE_STALL_TIMEOUT,
        }
    }
}

impl TokenizeLimits {
    /// No bounds (a checking tool that tokenizes one body at a time).
    pub fn unbounded() -> Self {
        TokenizeLimits {
            max_body_bytes: usize::MAX,
            max_queued_bytes: Some(usize::MAX),
            stall_timeout: Duration::from_secs(24 * 3600),
        }
    }
}

/// Default bound of each model's prefix cache, in tokens (~12 bytes per token plus the text).
pub const DEFAULT_PREFIX_CACHE_TOKENS: usize = 2_000_000;

/// The `--tokenizer-config` file.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerFile {
    pub tokenizers: Vec<ModelEntry>,
}

/// One model's tokenization settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelEntry {
    /// The request `model` this applies to.
    pub model: String,
    /// A HuggingFace model directory (relative paths: to the config file): its
    /// `tokenizer.json`, special tokens and chat template, read as `transformers` reads them
    /// (`tokenize::model_dir`). The fields below override what it provides.
    #[serde(default)]
    pub tokenizer_dir: Option<PathBuf>,
    /// Path to a HuggingFace `tokenizer.json` (relative paths: to the config file).
    #[serde(default)]
    pub tokenizer_json: Option<PathBuf>,
    /// Jinja chat template, inline.
    #[serde(default)]
    pub chat_template: Option<String>,
    /// Jinja chat template, from a file (or a JSON file such as `tokenizer_config.json` with
    /// `chat_template`, whose special tokens then apply too).
    #[serde(default)]
    pub chat_template_file: Option<PathBuf>,
    #[serde(default)]
    pub bos_token: Option<String>,
    #[serde(default)]
    pub eos_token: Option<String>,
    /// For completion prompts (vLLM default: true). Chat renders its own special tokens
    /// (default false); a body's `add_special_tokens` overrides both.
    #[serde(default = "yes")]
    pub add_special_tokens: bool,
    /// Engine base URL for the render endpoints (`http://host:port`): the source when no
    /// `tokenizer_json` is set, else the fallback when in-process tokenization fails.
    #[serde(default)]
    pub render_url: Option<String>,
    /// Prefix cache bound in tokens; 0 disables the cache.
    #[serde(default = "default_cache_tokens")]
    pub prefix_cache_tokens: usize,
    /// How message content lists reach the template: `string` (joined) or `openai` (as sent).
    #[serde(default)]
    pub content_format: ContentFormat,
    /// The `--model` the engine was started with (vLLM's `model_config.model`), which vLLM's image
    /// hashes include; default: `model`.
    #[serde(default)]
    pub engine_model: Option<String>,
}

fn yes() -> bool {
    true
}

fn default_cache_tokens() -> usize {
    DEFAULT_PREFIX_CACHE_TOKENS
}

impl ModelEntry {
    /// The entry a `--tokenizer-dir [MODEL=]DIR` argument stands for: the model directory with
    /// every other setting at its default. Without `MODEL=`, the model is DIR as written (vLLM's
    /// served model name when started with `--model DIR` and no `--served-model-name`).
    pub fn for_dir(arg: &str) -> anyhow::Result<Self> {
        let (model, dir) = match arg.split_once('=') {
            Some((model, dir)) => (model.trim(), dir.trim()),
            None => (arg.trim(), arg.trim()),
        };
        if model.is_empty() || dir.is_empty() {
            anyhow::bail!("--tokenizer-dir {arg:?}: expected [MODEL=]DIR");
        }
        Ok(ModelEntry {
            model: model.to_string(),
            tokenizer_dir: Some(PathBuf::from(dir)),
            tokenizer_json: None,
            chat_template: None,
            chat_template_file: None,
            bos_token: None,
            eos_token: None,
            add_special_tokens: true,
            render_url: None,
            prefix_cache_tokens: DEFAULT_PREFIX_CACHE_TOKENS,
            content_format: ContentFormat::default(),
            engine_model: None,
        })
    }
}

/// How token ids were obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The body carried ids.
    Body,
    /// In-process, tokenized from the start.
    Local,
    /// In-process, resumed from the prefix cache.
    Cached,
    /// The engine's render endpoint.
    Render,
}

impl Source {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Source::Body => "body",
            Source::Local => "ok",
            Source::Cached => "cached",
            Source::Render => "render",
        }
    }
}
