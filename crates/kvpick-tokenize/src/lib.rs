//! kvpick-tokenize: token-exact prompts for text and chat requests (ARCHITECTURE.md §8). Per
//! model, from a YAML file (`--tokenizer-config`) or a model directory (`--tokenizer-dir`): an
//! in-process HuggingFace `tokenizer.json` plus chat template (rendered with HF semantics,
//! tokenized through a prefix cache) and/or a remote render endpoint.
//!
//! The crate root owns tokenizer configuration, the per-model registry, the order of sources and
//! the tokenization metrics. It never selects workers and never fails a request: any failure is
//! an outcome the host (`kvpick`) turns into load-only routing. It depends on `kvpick-core` only
//! for the image spans it hands back (`kvpick_core::hash::MediaSpan`); it never depends on the
//! host crate.
//!
//! # Layout (bottom to top)
//! - [`endpoint`], [`body`]: which API a body was sent to, and the request-body reader the host
//!   routes by (the streaming scanner, `body::scan`).
//! - [`json`]: the order-preserving JSON value templates see.
//! - [`media`], [`chat`] (the chat prompt's vocabulary and vLLM's per-message preprocessing),
//!   [`anthropic`], [`prompt`]: request body -> what to tokenize, as vLLM preprocesses it;
//!   [`conversation`]: bodies parsed reusing an earlier body's messages; [`properties`]: the
//!   one-parser property its fuzz target and seed test check.
//! - [`pretok`], [`fast`], [`boundary`], [`prefix_cache`]: tokenizing, resumed from cached
//!   checkpoints; [`template`], [`model_dir`], [`local`]: a model's tokenizer and chat templates.
//! - [`render`]: the engine's render endpoints; [`pool`]: the threads tokenization runs on.
//! - [`cli`]: `kvpick tokenize`.

#![forbid(unsafe_code)]

pub mod anthropic;
pub mod body;
pub mod boundary;
pub mod chat;
pub mod cli;
pub mod config;
pub mod conversation;
pub mod endpoint;
pub mod fast;
pub mod json;
pub mod local;
pub mod media;
pub mod model_dir;
pub mod pool;
pub mod prefix_cache;
pub mod pretok;
pub mod prompt;
pub mod properties;
pub mod render;
pub mod template;
#[cfg(test)]
mod test_shapes;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use prometheus::{
    HistogramOpts, HistogramVec, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry,
};

use body::layout::{fields_of, BodyLayout};
pub use config::{
    ModelEntry, Source, TokenizeLimits, TokenizerFile, DEFAULT_PREFIX_CACHE_TOKENS,
    DEFAULT_QUEUED_BYTES_PER_THREAD, DEFAULT_TOKENIZE_MAX_BODY_BYTES,
    DEFAULT_TOKENIZE_STALL_TIMEOUT,
};
use conversation::ConversationCache;
pub use endpoint::Endpoint;
use json::Json;
pub use local::{LocalTokenizer, Resolved};
use pool::{JobLimits, PoolError, TokenizerPool};
pub use prefix_cache::IncrementalTokenizer;
use prompt::{ContentFormat, PromptSpec};
use render::RenderClient;

/// Why a request was routed without tokenizing it (`kvpick_tokenize_skipped_total{reason}`).
pub const SKIP_BODY_TOO_LARGE: &str = "body_too_large";
pub const SKIP_QUEUE_FULL: &str = "queue_full";
pub const SKIP_QUEUE_STALLED: &str = "queue_stalled";

/// What tokenization produced for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenizeOutcome {
    /// Exact engine token ids, and the spans of the images they hold (placeholders expanded,
    /// `media`; empty for a text prompt).
    Tokens {
        ids: Vec<u32>,
        source: Source,
        media: Vec<kvpick_core::hash::MediaSpan>,
    },
    /// Tokenization failed (counted): route on load alone.
    Fallback { reason: String },
    /// Not tokenized because of a [`TokenizeLimits`] bound (counted, `reason` is the metric
    /// label): route on load alone.
    Skipped { reason: &'static str },
    /// The model has no tokenizer configured, or the body has no prompt: the caller keeps its
    /// default handling.
    NotApplicable,
}

/// One model's sources.
pub struct ModelTokenizer {
    pub model: String,
    pub local: Option<LocalTokenizer>,
    pub render: Option<RenderClient>,
    content_format: ContentFormat,
    /// The model's image layout (`media::MediaConfig`), when its directory gives one.
    media: Option<media::MediaConfig>,
    /// `kvpick_tokenize_images_total{model}` for exact and approximate identifiers.
    images: [prometheus::IntCounter; 2],
    /// Parsed conversations of recent bodies (with the in-process tokenizer's prefix cache).
    conversations: Option<ConversationCache>,
}

impl ModelTokenizer {
    /// In-process token ids for a request body, synchronously (benchmarks, tools): `Ok(None)`
    /// when the body has no prompt or the model has no in-process tokenizer.
    pub fn tokenize_body_blocking(
        &self,
        body: &Bytes,
    ) -> Result<Option<(Vec<u32>, Source)>, String> {
        self.tokenize_laid_out_blocking(Endpoint::Generate, body, None)
    }

    /// [`ModelTokenizer::tokenize_body_blocking`] for a body sent to `endpoint` and laid out as
    /// `layout` (the scanner's, as the host hands it over; `None`: found here).
    pub fn tokenize_laid_out_blocking(
        &self,
        endpoint: Endpoint,
        body: &Bytes,
        layout: Option<BodyLayout>,
    ) -> Result<Option<(Vec<u32>, Source)>, String> {
        match tokenize_job(self, endpoint, body, layout).1 {
            Ok(Local::Done(ids, source, _)) => Ok(Some((ids, source))),
            Ok(Local::Remote(_) | Local::Nothing) => Ok(None),
            Err((stage, e)) => Err(format!("{stage}: {e}")),
        }
    }
}

/// Tokenization metrics (registered on the process registry).
#[derive(Clone)]
pub struct TokenizeMetrics {
    /// Requests by model and outcome: ok (in-process, cold), cached (prefix cache hit), render,
    /// body (ids in the body), fallback (no ids: routed on load alone).
    pub outcomes: IntCounterVec,
    /// Failures by model and stage (body, template, tokenizer, render).
    pub errors: IntCounterVec,
    /// Time to obtain the ids, by model and source.
    pub seconds: HistogramVec,
    /// Requests not tokenized because of a [`TokenizeLimits`] bound, by model and reason.
    pub skipped: IntCounterVec,
    /// Time a request waited in the tokenizer queue before a thread started it, by model.
    pub queue_wait: HistogramVec,
    /// 1 per special token a model's chat template uses that nothing defines, by model and token.
    pub undefined_tokens: IntGaugeVec,
    /// Bytes of request bodies queued or being tokenized (bounded by `--tokenize-queue-max-bytes`).
    pub queued_bytes: IntGauge,
    /// Images of tokenized prompts by model and identifier (exact, approximate).
    pub images: IntCounterVec,
}

impl TokenizeMetrics {
    // Static metric definitions: an error is a programming error caught by any test.
    #[allow(clippy::unwrap_used)]
    pub fn register(registry: &Registry) -> Self {
        let outcomes = IntCounterVec::new(
            Opts::new(
                "kvpick_tokenize_total",
                "Text/chat prompts by tokenization outcome (ok, cached, render, body, fallback)",
            ),
            &["model", "outcome"],
        )
        .unwrap();
        let errors = IntCounterVec::new(
            Opts::new(
                "kvpick_tokenize_errors_total",
                "Tokenization failures by stage (body, template, tokenizer, render)",
            ),
            &["model", "stage"],
        )
        .unwrap();
        let seconds = HistogramVec::new(
            HistogramOpts::new(
                "kvpick_tokenize_seconds",
                "Time to obtain a prompt's token ids, by source",
            )
            .buckets(vec![
                1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                0.5, 1.0, 5.0,
            ]),
            &["model", "source"],
        )
        .unwrap();
        let skipped = IntCounterVec::new(
            Opts::new(
                "kvpick_tokenize_skipped_total",
                "Prompts routed on load alone without tokenizing, by reason (body_too_large, queue_full, queue_stalled)",
            ),
            &["model", "reason"],
        )
        .unwrap();
        let queue_wait = HistogramVec::new(
            HistogramOpts::new(
                "kvpick_tokenize_queue_wait_seconds",
                "Time a prompt waited in the tokenizer queue before a thread started it",
            )
            .buckets(vec![
                1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25,
                0.5, 1.0, 2.5, 5.0, 10.0,
            ]),
            &["model"],
        )
        .unwrap();
        let undefined_tokens = IntGaugeVec::new(
            Opts::new(
                "kvpick_tokenize_template_undefined_tokens",
                "1 per special token (bos_token, eos_token, ...) a model's chat template uses that no tokenizer file or setting defines: chat prompts will not match the engine's",
            ),
            &["model", "token"],
        )
        .unwrap();
        let _ = registry.register(Box::new(undefined_tokens.clone()));
        let images = IntCounterVec::new(
            Opts::new(
                "kvpick_tokenize_images_total",
                "Images of tokenized prompts by how they were identified: exact (vLLM's own identifier: a client uuid or the hash of a data URL's bytes) or approximate (an http URL, a malformed data URL, processor kwargs: its blocks never match the engine's events)",
            ),
            &["model", "identifier"],
        )
        .unwrap();
        let _ = registry.register(Box::new(images.clone()));
        let queued_bytes = IntGauge::new(
            "kvpick_tokenize_queued_bytes",
            "Bytes of request bodies queued for or being tokenized (bounded by --tokenize-queue-max-bytes)",
        )
        .unwrap();
        let _ = registry.register(Box::new(queued_bytes.clone()));
        // Registration fails only if registered twice on one registry (tests reuse metrics).
        let _ = registry.register(Box::new(queue_wait.clone()));
        let _ = registry.register(Box::new(skipped.clone()));
        let _ = registry.register(Box::new(outcomes.clone()));
        let _ = registry.register(Box::new(errors.clone()));
        let _ = registry.register(Box::new(seconds.clone()));
        TokenizeMetrics {
            outcomes,
            errors,
            seconds,
            skipped,
            queue_wait,
            undefined_tokens,
            queued_bytes,
            images,
        }
    }
}

/// Every configured model's tokenizer, plus the pool their CPU-bound work runs on.
pub struct Tokenizers {
    models: HashMap<String, Arc<ModelTokenizer>>,
    metrics: TokenizeMetrics,
    pool: TokenizerPool,
    limits: TokenizeLimits,
}

impl std::fmt::Debug for Tokenizers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut models: Vec<_> = self.models.keys().collect();
        models.sort();
        f.debug_struct("Tokenizers")
            .field("models", &models)
            .finish()
    }
}

impl Tokenizers {
    /// Loads and validates a `--tokenizer-config` file. Errors name the model and the field.
    pub fn load(path: &Path, registry: &Registry) -> anyhow::Result<Self> {
        Self::load_sources(Some(path), &[], registry)?
            .ok_or_else(|| anyhow::anyhow!("no tokenizer config"))
    }

    /// The tokenizers of a `--tokenizer-config` file and of `--tokenizer-dir` arguments
    /// (`[MODEL=]DIR`, relative to the working directory); `None` when neither is given.
    pub fn load_sources(
        config: Option<&Path>,
        dirs: &[String],
        registry: &Registry,
    ) -> anyhow::Result<Option<Self>> {
        let mut entries = Vec::new();
        if let Some(path) = config {
            let text = std::fs::read_to_string(path).map_err(|e| {
                anyhow::anyhow!("cannot read tokenizer config {}: {e}", path.display())
            })?;
            let file: TokenizerFile = serde_yaml::from_str(&text)
                .map_err(|e| anyhow::anyhow!("in tokenizer config {}: {e}", path.display()))?;
            let base = path.parent().unwrap_or(Path::new(".")).to_path_buf();
            let label = format!("in tokenizer config {}", path.display());
            entries.extend(
                file.tokenizers
                    .into_iter()
                    .map(|e| (e, base.clone(), label.clone())),
            );
        }
        for arg in dirs {
            let entry = ModelEntry::for_dir(arg)?;
            entries.push((entry, PathBuf::new(), format!("--tokenizer-dir {arg}")));
        }
        if config.is_none() && entries.is_empty() {
            return Ok(None);
        }
        Self::build(entries, registry).map(Some)
    }

    /// Builds the registry from entries (paths relative to `base`).
    pub fn from_entries(
        entries: &[ModelEntry],
        base: &Path,
        registry: &Registry,
    ) -> anyhow::Result<Self> {
        let entries = entries
            .iter()
            .map(|e| (e.clone(), base.to_path_buf(), String::new()))
            .collect();
        Self::build(entries, registry)
    }

    /// Entries with their base directory and where they were given (for errors).
    fn build(
        entries: Vec<(ModelEntry, PathBuf, String)>,
        registry: &Registry,
    ) -> anyhow::Result<Self> {
        let metrics = TokenizeMetrics::register(registry);
        let mut models = HashMap::new();
        for (entry, base, given) in entries {
            let in_source = |e: String| match given.is_empty() {
                true => anyhow::anyhow!(e),
                false => anyhow::anyhow!("{given}: {e}"),
            };
            let model = entry.model.trim();
            if model.is_empty() {
                return Err(in_source("a tokenizers entry has an empty `model`".into()));
            }
            if models.contains_key(model) {
                return Err(in_source(format!("model {model:?}: listed twice")));
            }
            let local = LocalTokenizer::from_entry(&entry, &base)
                .map_err(|e| in_source(format!("model {model:?}: {e}")))?;
            let render = entry
                .render_url
                .as_deref()
                .map(RenderClient::new)
                .transpose()
                .map_err(|e| in_source(format!("model {model:?}: {e}")))?;
            if local.is_none() && render.is_none() {
                return Err(in_source(format!(
                    "model {model:?}: set tokenizer_dir, tokenizer_json or render_url"
                )));
            }
            log_configured(model, local.as_ref(), render.is_some());
            if let Some(l) = &local {
                warn_missing(model, l.resolved(), &metrics);
            }
            // Bodies run about 4 bytes per token: the same bound as the token cache.
            let conversations = local
                .as_ref()
                .filter(|l| l.tokenizer.cache_enabled())
                .map(|_| ConversationCache::new(entry.prefix_cache_tokens.saturating_mul(4)));
            let media = media_config(&entry, &base, local.as_ref());
            if let Some(m) = &media {
                tracing::info!(
                    model,
                    image_token = m.image_token,
                    placeholder = %m.placeholder,
                    tokens_per_image = m.tokens_per_image,
                    engine_model = %m.model_id,
                    "images: placeholders expanded and keyed as vLLM keys them"
                );
            }
            models.insert(
                model.to_string(),
                Arc::new(ModelTokenizer {
                    model: model.to_string(),
                    local,
                    render,
                    content_format: entry.content_format,
                    media,
                    images: ["exact", "approximate"]
                        .map(|kind| metrics.images.with_label_values(&[model, kind])),
                    conversations,
                }),
            );
        }
        let pool = TokenizerPool::per_core()
            .map_err(|e| anyhow::anyhow!("cannot start the tokenizer threads: {e}"))?;
        pool.set_observer(queued_bytes_observer(&metrics));
        Ok(Tokenizers {
            models,
            metrics,
            pool,
            limits: TokenizeLimits::default(),
        })
    }

    /// The same registry on another pool (tests size it).
    pub fn with_pool(mut self, pool: TokenizerPool) -> Self {
        pool.set_observer(queued_bytes_observer(&self.metrics));
        self.pool = pool;
        self
    }

    /// The bound on outstanding body bytes in force.
    pub fn max_queued_bytes(&self) -> usize {
        self.limits
            .max_queued_bytes
            .unwrap_or_else(|| DEFAULT_QUEUED_BYTES_PER_THREAD.saturating_mul(self.pool.threads()))
    }

    /// The same registry with other [`TokenizeLimits`].
    pub fn with_limits(mut self, limits: TokenizeLimits) -> Self {
        self.limits = limits;
        self
    }

    pub fn limits(&self) -> TokenizeLimits {
        self.limits
    }

    /// Whether a body of `len` bytes is small enough to tokenize; if not, the skip is counted
    /// (the caller routes on load alone without copying the body for a job).
    pub fn admits_body(&self, model: &str, len: usize) -> bool {
        if len <= self.limits.max_body_bytes {
            return true;
        }
        self.skipped(model, SKIP_BODY_TOO_LARGE);
        false
    }

    fn skipped(&self, model: &str, reason: &str) {
        tracing::debug!(model, reason, "not tokenized: routing on load");
        self.metrics
            .skipped
            .with_label_values(&[model, reason])
            .inc();
        self.metrics
            .outcomes
            .with_label_values(&[model, "fallback"])
            .inc();
    }

    /// The one configured model, if exactly one is (for bodies that name no model).
    pub fn sole_model(&self) -> Option<&str> {
        let mut models = self.models.keys();
        match (models.next(), models.next()) {
            (Some(m), None) => Some(m),
            _ => None,
        }
    }

    pub fn has(&self, model: &str) -> bool {
        self.models.contains_key(model)
    }

    pub fn model(&self, model: &str) -> Option<&Arc<ModelTokenizer>> {
        self.models.get(model)
    }

    pub fn metrics(&self) -> &TokenizeMetrics {
        &self.metrics
    }

    /// Token ids for a request body to `model`: in-process first, then the render endpoint;
    /// never an error (failures are counted and become [`TokenizeOutcome::Fallback`]).
    pub async fn tokenize(&self, model: &str, body: Bytes) -> TokenizeOutcome {
        self.tokenize_request(Endpoint::Generate, model, body).await
    }

    /// [`Tokenizers::tokenize`] for a body sent to `endpoint` (its layout found on the pool).
    pub async fn tokenize_request(
        &self,
        endpoint: Endpoint,
        model: &str,
        body: Bytes,
    ) -> TokenizeOutcome {
        self.tokenize_laid_out(endpoint, model, body, None).await
    }

    /// [`Tokenizers::tokenize_request`] for a body laid out as `layout`: what the streaming
    /// scanner recorded while reading it for routing, so the body's structure is never read
    /// again, only the values the prompt needs decoded (`None`: found on the pool).
    pub async fn tokenize_laid_out(
        &self,
        endpoint: Endpoint,
        model: &str,
        body: Bytes,
        layout: Option<BodyLayout>,
    ) -> TokenizeOutcome {
        let Some(m) = self.models.get(model).cloned() else {
            return TokenizeOutcome::NotApplicable;
        };
        if !self.admits_body(model, body.len()) {
            return TokenizeOutcome::Skipped {
                reason: SKIP_BODY_TOO_LARGE,
            };
        }
        let started = Instant::now();
        let outcome = self.tokenize_model(&m, endpoint, body, layout).await;
        match &outcome {
            TokenizeOutcome::Tokens { source, .. } => {
                self.metrics
                    .outcomes
                    .with_label_values(&[model, source.label()])
                    .inc();
                self.metrics
                    .seconds
                    .with_label_values(&[model, source.label()])
                    .observe(started.elapsed().as_secs_f64());
            }
            TokenizeOutcome::Fallback { reason } => {
                tracing::debug!(model, reason, "tokenization failed: routing on load");
                self.metrics
                    .outcomes
                    .with_label_values(&[model, "fallback"])
                    .inc();
            }
            TokenizeOutcome::Skipped { reason } => self.skipped(model, reason),
            TokenizeOutcome::NotApplicable => {}
        }
        outcome
    }

    /// The in-process part (parse, render, tokenize) on the pool: its result, or the outcome
    /// when the pool gave none (queue deadline, full queue, shutdown).
    async fn run_local(
        &self,
        m: &Arc<ModelTokenizer>,
        endpoint: Endpoint,
        body: &Bytes,
        layout: Option<BodyLayout>,
    ) -> Result<Laid, TokenizeOutcome> {
        // 100k-token prompts take milliseconds: never on the reactor.
        let job_model = Arc::clone(m);
        let job_body = body.clone();
        let queued = Instant::now();
        let limits = JobLimits {
            bytes: body.len(),
            max_bytes: self.max_queued_bytes(),
            stall: self.limits.stall_timeout,
        };
        let ran = self
            .pool
            .run(limits, move || {
                let waited = queued.elapsed();
                (
                    waited,
                    tokenize_job(&job_model, endpoint, &job_body, layout),
                )
            })
            .await;
        match ran {
            Ok((waited, local)) => {
                self.metrics
                    .queue_wait
                    .with_label_values(&[&m.model])
                    .observe(waited.as_secs_f64());
                Ok(local)
            }
            Err(PoolError::Stalled) => Err(TokenizeOutcome::Skipped {
                reason: SKIP_QUEUE_STALLED,
            }),
            Err(PoolError::QueueFull) => Err(TokenizeOutcome::Skipped {
                reason: SKIP_QUEUE_FULL,
            }),
            Err(e @ PoolError::Panicked(_)) => Ok((None, Err(("tokenizer", e.to_string())))),
            Err(PoolError::Stopped) => Err(TokenizeOutcome::Fallback {
                reason: "shutting down".into(),
            }),
        }
    }

    async fn tokenize_model(
        &self,
        m: &Arc<ModelTokenizer>,
        endpoint: Endpoint,
        body: Bytes,
        layout: Option<BodyLayout>,
    ) -> TokenizeOutcome {
        let error = |stage: &str| {
            self.metrics
                .errors
                .with_label_values(&[&m.model, stage])
                .inc();
        };
        let (layout, local) = match self.run_local(m, endpoint, &body, layout).await {
            Ok(laid) => laid,
            Err(outcome) => return outcome,
        };
        let (spec, failure) = match local {
            Ok(Local::Done(ids, source, media)) => {
                return TokenizeOutcome::Tokens { ids, source, media };
            }
            Ok(Local::Nothing) => return TokenizeOutcome::NotApplicable,
            Ok(Local::Remote(spec)) => (spec, None),
            Err(("body", reason)) => {
                error("body");
                return TokenizeOutcome::Fallback { reason };
            }
            Err((stage, reason)) => {
                error(stage);
                (None, Some(reason))
            }
        };
        let Some(render) = &m.render else {
            return TokenizeOutcome::Fallback {
                reason: failure.unwrap_or_else(|| "no source".into()),
            };
        };
        let rendered = match endpoint {
            // vLLM has no embeddings render endpoint, and SGLang none at all.
            Endpoint::Embeddings | Endpoint::SglangGenerate => None,
            Endpoint::Generate => render::request_for(spec.as_ref(), &body, layout.as_ref()),
            Endpoint::Messages => render::chat_body(spec.as_ref(), &body, layout.as_ref()),
        };
        let (kind, payload) = match rendered {
            Some(r) => r,
            None => {
                error("render");
                return TokenizeOutcome::Fallback {
                    reason: "request cannot be rendered remotely".into(),
                };
            }
        };
        match render.render(kind, payload).await {
            Ok(ids) => TokenizeOutcome::Tokens {
                ids,
                source: Source::Render,
                media: Vec::new(),
            },
            Err(e) => {
                error("render");
                TokenizeOutcome::Fallback {
                    reason: e.to_string(),
                }
            }
        }
    }
}

/// A model's image layout from its directory (`media::MediaConfig::from_dir`), the hash's model id
/// being `engine_model` or else the model name.
fn media_config(
    entry: &ModelEntry,
    base: &Path,
    local: Option<&LocalTokenizer>,
) -> Option<media::MediaConfig> {
    let dir = base.join(entry.tokenizer_dir.as_ref()?);
    let tokenizer = local?.tokenizer.tokenizer();
    let model_id = entry.engine_model.as_deref().unwrap_or(&entry.model);
    media::MediaConfig::from_dir(&dir, |id| tokenizer.id_to_token(id), model_id)
}

/// The pool's outstanding bytes as `kvpick_tokenize_queued_bytes`.
fn queued_bytes_observer(metrics: &TokenizeMetrics) -> pool::Observer {
    let gauge = metrics.queued_bytes.clone();
    Arc::new(move |bytes| gauge.set(i64::try_from(bytes).unwrap_or(i64::MAX)))
}

/// The start-up line saying what a model's tokenizer resolved to.
fn log_configured(model: &str, local: Option<&LocalTokenizer>, render: bool) {
    let resolved = local.map(LocalTokenizer::resolved);
    let token = |name: &str| {
        resolved
            .and_then(|r| r.specials.get(name))
            .map(|t| format!("{:?} ({})", t.value, t.origin))
    };
    tracing::info!(
        model,
        tokenizer_json = resolved.map(|r| r.tokenizer_json.as_str()),
        chat_template = resolved.and_then(|r| r.template.as_deref()),
        tool_chat_template = resolved.and_then(|r| r.tool_template.as_deref()),
        bos_token = token("bos_token"),
        eos_token = token("eos_token"),
        add_special_tokens = resolved.map(|r| r.add_special_tokens),
        prefix_cache = local.is_some_and(|l| l.tokenizer.cache_enabled()),
        restart_rules = ?local
            .map(|l| l.tokenizer.restart_rules().names())
            .unwrap_or_default(),
        direct_encoder = local.is_some_and(|l| l.tokenizer.uses_fast_encoder()),
        render,
        "tokenizer configured"
    );
}

/// A template that reads a special token nobody defined renders it as empty text: the prompt
/// then differs from the engine's from its first token and no chat request ever matches the
/// engine's cache. Never silent: a WARN and `kvpick_tokenize_template_undefined_tokens`.
fn warn_missing(model: &str, resolved: &Resolved, metrics: &TokenizeMetrics) {
    for token in &resolved.missing {
        tracing::warn!(
            model,
            token,
            chat_template = resolved.template.as_deref(),
            "the chat template uses {token} but no tokenizer file or setting defines it: it renders as empty text, so chat prompts will not match the engine's (set tokenizer_dir, or {token} in the tokenizer config)"
        );
        metrics
            .undefined_tokens
            .with_label_values(&[model, token])
            .set(1);
    }
}

enum Local {
    Done(Vec<u32>, Source, Vec<kvpick_core::hash::MediaSpan>),
    /// No in-process source (or it failed): ask the render endpoint; the spec when parsed.
    Remote(Option<PromptSpec>),
    Nothing,
}

type StageError = (&'static str, String);

/// A job's layout (when the body has one) and its result.
type Laid = (Option<BodyLayout>, Result<Local, StageError>);

/// The pool job: the body's layout (the scanner's, else found here), then the prompt.
fn tokenize_job(
    m: &ModelTokenizer,
    endpoint: Endpoint,
    body: &Bytes,
    layout: Option<BodyLayout>,
) -> Laid {
    let layout = match layout.map_or_else(|| BodyLayout::of(endpoint, body), Ok) {
        Ok(layout) => layout,
        Err(e) => return (None, Err(("body", e))),
    };
    let local = tokenize_blocking(m, endpoint, body, &layout);
    (Some(layout), local)
}

fn tokenize_blocking(
    m: &ModelTokenizer,
    endpoint: Endpoint,
    body: &Bytes,
    layout: &BodyLayout,
) -> Result<Local, StageError> {
    let format = m
        .local
        .as_ref()
        .map_or(m.content_format, |l| l.content_format);
    let parsed = match &m.conversations {
        Some(cache) => cache.read(body, layout, endpoint, format),
        None => conversation::read(body, layout, endpoint, format),
    }
    .map_err(|e| ("body", e.to_string()))?;
    let spec = prompt::prompt_spec_parsed(endpoint, &parsed.top, parsed.items, format)
        .map_err(|e| ("body", e.to_string()))?;
    match &spec {
        PromptSpec::None => return Ok(Local::Nothing),
        PromptSpec::Ids(ids) => return Ok(Local::Done(ids.clone(), Source::Body, Vec::new())),
        _ => {}
    }
    let Some(local) = &m.local else {
        return Ok(Local::Remote(Some(spec)));
    };
    if let PromptSpec::Chat(chat) = &spec {
        let text = local.render_chat(chat).map_err(|e| ("template", e))?;
        if has_media(chat) {
            return media_prompt(m, endpoint, (body, layout), local, chat, &text);
        }
        let (ids, source) = local
            .tokenize_text(&text, chat.add_special_tokens)
            .map_err(|e| ("tokenizer", e))?;
        return Ok(Local::Done(ids, source, Vec::new()));
    }
    let (ids, source) = local.tokenize(&spec).map_err(|e| ("tokenizer", e))?;
    Ok(Local::Done(ids, source, Vec::new()))
}

/// Whether a converted conversation holds an image part (a placeholder of either content format).
fn has_media(chat: &prompt::ChatPrompt) -> bool {
    chat.messages.iter().any(|m| match m.get("content") {
        Some(Json::String(s)) => s.contains(media::IMAGE_SENTINEL),
        Some(Json::Array(parts)) => parts
            .iter()
            .any(|p| p.get("type").and_then(Json::as_str) == Some("image")),
        _ => false,
    })
}

/// A chat prompt with images: the model's placeholder in place of the conversion's sentinel,
/// tokenized, each placeholder token expanded to the model's count, and the images identified from
/// the body (`media`). A model without a known image layout is a body error (load-only routing).
fn media_prompt(
    m: &ModelTokenizer,
    endpoint: Endpoint,
    (body, layout): (&Bytes, &BodyLayout),
    local: &LocalTokenizer,
    chat: &prompt::ChatPrompt,
    text: &str,
) -> Result<Local, StageError> {
    let Some(config) = &m.media else {
        return Err((
            "body",
            "image parts, but the model's image token and count are unknown".into(),
        ));
    };
    let text = text.replace(media::IMAGE_SENTINEL, &config.placeholder);
    let (ids, source) = local
        .tokenize_text(&text, chat.add_special_tokens)
        .map_err(|e| ("tokenizer", e))?;
    // The converted messages hold placeholders, not images: decode the fields that hold them.
    let fields = fields_of(body, layout, media::BODY_FIELDS).map_err(|e| ("body", e))?;
    let items = media::items(endpoint, &fields, &config.model_id);
    drop(fields);
    let (ids, spans) = media::expand(&ids, config, &items).map_err(|e| ("body", e))?;
    let exact = items.iter().filter(|i| i.exact).count();
    m.images[0].inc_by(exact as u64);
    m.images[1].inc_by(items.len().saturating_sub(exact) as u64);
    Ok(Local::Done(ids, source, spans))
}

#[cfg(test)]
#[path = "limit_tests.rs"]
mod limit_tests;
