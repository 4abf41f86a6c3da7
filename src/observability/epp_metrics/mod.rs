//! The EPP metric contract: the series llm-d's endpoint picker documents (`llm_d_epp_*`, and on
//! request the older Gateway API Inference Extension names `inference_objective_*`,
//! `inference_pool_*`, `inference_extension_*`), computed from what kvpick already measures,
//! beside its own `kvpick_*` series; and `--metrics-families`, which chooses what `/metrics`
//! exports. It owns these series, the per-request recorder the ext_proc host drives
//! ([`EppRequest`]) and the pool gauges refreshed at each scrape ([`pool`]).
//!
//! It must not decide anything, nor read the core beyond the facts and readings it is handed.
//! Every label a client can choose is bounded: model names keep their own label only once a
//! request for them was routed (the catalog serves them) and at most [`MAX_MODELS`] of them;
//! fairness ids and priorities share [`BoundedLabel`]s; the rest is `other`.

pub mod pool;
pub mod series;

use std::sync::Arc;
use std::time::Instant;

use prometheus::Registry;

use crate::usage::Usage;
pub use series::{Generation, Series};

/// Distinct model names (and rewrite targets) with a label of their own.
pub const MAX_MODELS: usize = 64;
const MAX_FAIRNESS_IDS: usize = 32;
const MAX_PRIORITIES: usize = 16;

/// Distinct values a client-controlled label may take before the rest share `other`.
#[derive(Debug)]
pub struct BoundedLabel {
    max: usize,
    seen: std::sync::Mutex<std::collections::HashSet<String>>,
}

impl BoundedLabel {
    pub fn new(max: usize) -> Self {
        BoundedLabel {
            max,
            seen: std::sync::Mutex::new(std::collections::HashSet::new()),
        }
    }

    /// `value` itself while fewer than `max` values have been seen (or it is one of them), else
    /// `other`. First come, first labelled: a label, once given, stays.
    pub fn label(&self, value: &str) -> String {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.contains(value) {
            return value.to_string();
        }
        if seen.len() < self.max {
            seen.insert(value.to_string());
            return value.to_string();
        }
        "other".to_string()
    }
}

/// Which metric families `/metrics` exports (`--metrics-families`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Families {
    /// `kvpick_*` (and every series that is not an EPP one).
    pub kvpick: bool,
    /// `llm_d_epp_*`.
    pub epp: bool,
    /// `inference_objective_*`, `inference_pool_*`, `inference_extension_*` (deprecated upstream).
    pub igw: bool,
}

impl Default for Families {
    fn default() -> Self {
        Families {
            kvpick: true,
            epp: true,
            igw: false,
        }
    }
}

impl std::str::FromStr for Families {
    type Err = String;

    /// A comma-separated list of `kvpick`, `epp`, `igw` (at least one).
    fn from_str(s: &str) -> Result<Self, String> {
        let mut out = Families {
            kvpick: false,
            epp: false,
            igw: false,
        };
        for name in s.split(',').map(str::trim).filter(|n| !n.is_empty()) {
            match name {
                "kvpick" => out.kvpick = true,
                "epp" => out.epp = true,
                "igw" => out.igw = true,
                other => {
                    return Err(format!(
                        "unknown metric family {other:?}: choose from kvpick, epp, igw"
                    ))
                }
            }
        }
        if !(out.kvpick || out.epp || out.igw) {
            return Err("--metrics-families needs at least one of kvpick, epp, igw".into());
        }
        Ok(out)
    }
}

impl Families {
    /// Whether the metric family `name` is exported.
    pub fn exports(&self, name: &str) -> bool {
        if name.starts_with("llm_d_epp_") {
            self.epp
        } else if [
            "inference_objective_",
            "inference_pool_",
            "inference_extension_",
        ]
        .iter()
        .any(|p| name.starts_with(p))
        {
            self.igw
        } else {
            self.kvpick
        }
    }
}

/// Model names that have a label of their own: those of routed requests, first come first
/// labelled, at most [`MAX_MODELS`].
#[derive(Debug, Default)]
struct ModelLabels(std::sync::Mutex<std::collections::HashSet<String>>);

impl ModelLabels {
    fn lock(&self) -> std::sync::MutexGuard<'_, std::collections::HashSet<String>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The label of a routed request's model (labelled from now on, while there is room).
    fn admit(&self, model: &str) -> String {
        if model.is_empty() {
            return String::new();
        }
        let mut known = self.lock();
        if known.contains(model) || known.len() < MAX_MODELS {
            known.insert(model.to_string());
            return model.to_string();
        }
        "other".into()
    }

    /// The label of a request that was not routed: its model's if one was routed before.
    fn get(&self, model: &str) -> String {
        if model.is_empty() || self.lock().contains(model) {
            return model.to_string();
        }
        "other".into()
    }
}

/// The EPP series of the enabled generations, and the bounded labels they share. Cheap to
/// clone.
#[derive(Clone)]
pub struct EppMetrics {
    series: Arc<[Series]>,
    models: Arc<ModelLabels>,
    fairness: Arc<BoundedLabel>,
    priorities: Arc<BoundedLabel>,
    pool_name: Arc<std::sync::RwLock<String>>,
}

/// The labels of one request, already bounded.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RequestLabels {
    pub model: String,
    pub target: String,
    pub fairness: String,
    pub priority: String,
}

impl RequestLabels {
    /// The label values of `generation`'s request series (the request total's when `total`).
    fn request(&self, generation: Generation, total: bool) -> Vec<&str> {
        match (generation, total) {
            (Generation::LlmD, _) => {
                vec![&self.model, &self.target, &self.fairness, &self.priority]
            }
            (Generation::Igw, true) => vec![&self.model, &self.target, &self.priority],
            (Generation::Igw, false) => vec![&self.model, &self.target],
        }
    }

    fn error(&self, generation: Generation, code: &'static str) -> Vec<&str> {
        let mut v = self.request(generation, false);
        v.push(code);
        v
    }

    fn running(&self, generation: Generation) -> Vec<&str> {
        match generation {
            Generation::LlmD => self.request(generation, false),
            Generation::Igw => vec![&self.model],
        }
    }
}

/// A stage of kvpick's pick, reported as one EPP "plugin" (kvpick is one compiled scheduler:
/// these are its stages, not configurable plugins).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Parsing the request body (model, prompt, cache salt).
    Parse,
    /// Turning a text or chat prompt into engine token ids.
    Tokenize,
    /// The selection core's admission and pick (KV overlap, load, flow control).
    Pick,
}

impl Stage {
    /// `(extension_point, plugin_type, plugin_name)`.
    pub fn labels(self) -> [&'static str; 3] {
        match self {
            Stage::Parse => ["RequestParse", "body-parser", "openai"],
            Stage::Tokenize => ["DataProducer", "tokenizer", "kvpick-tokenizer"],
            Stage::Pick => ["Scheduling", "kv-cache-picker", "kvpick"],
        }
    }
}

/// The upstream `error_code` of an answer kvpick gave instead of routing (its HTTP status).
pub fn error_code(status: u16) -> &'static str {
    match status {
        404 => "BadConfiguration",
        429 => "InferencePoolResourceExhausted",
        503 => "ServiceUnavailable",
        400..=499 => "BadRequest",
        _ => "Internal",
    }
}

impl EppMetrics {
    /// Registers the generations `families` exports on `registry` (none: nothing registered,
    /// and every recording call is a no-op).
    pub fn register(registry: &Registry, families: Families) -> Self {
        let mut series = Vec::new();
        if families.epp {
            series.push(Series::register(registry, Generation::LlmD));
        }
        if families.igw {
            series.push(Series::register(registry, Generation::Igw));
        }
        for s in &series {
            s.pool
                .info
                .with_label_values(&[env!("CARGO_PKG_VERSION"), "kvpick"])
                .set(1);
        }
        EppMetrics {
            series: series.into(),
            models: Arc::default(),
            fairness: Arc::new(BoundedLabel::new(MAX_FAIRNESS_IDS)),
            priorities: Arc::new(BoundedLabel::new(MAX_PRIORITIES)),
            pool_name: Arc::new(std::sync::RwLock::new("default".into())),
        }
    }

    /// The generations registered.
    pub fn series(&self) -> &[Series] {
        &self.series
    }

    /// The value of the pool labels (`name`, `inference_pool`): the InferencePool's name.
    pub fn set_pool_name(&self, name: &str) {
        *self.pool_name.write().unwrap_or_else(|e| e.into_inner()) = name.to_string();
    }

    pub fn pool_name(&self) -> String {
        self.pool_name
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// A recorder for one request, received now.
    pub fn request(&self) -> EppRequest {
        EppRequest {
            metrics: self.clone(),
            received: Instant::now(),
            model: String::new(),
            target: None,
            fairness: String::new(),
            priority: 0,
            request_bytes: 0,
            response_bytes: 0,
            streaming: false,
            first_byte: None,
            labels: None,
            running: false,
            queued: None,
            done: false,
        }
    }

    /// The scheduler's end-to-end time for one pick.
    pub fn scheduled(&self, seconds: f64) {
        for s in self.series.iter() {
            s.pool.scheduler_e2e.observe(seconds);
        }
    }

    /// The time one stage of a pick took.
    pub fn stage(&self, stage: Stage, seconds: f64) {
        for s in self.series.iter() {
            s.pool
                .plugin_duration
                .with_label_values(&stage.labels())
                .observe(seconds);
        }
    }
}

/// One request's EPP series, driven by the ext_proc stream as the request goes: it counts the
/// request once (routed, or answered by kvpick), holds it in the running gauge while routed and
/// in the queue gauge while queued, and records latency, sizes and tokens at its end. Dropping
/// it (the stream ended) takes it out of the gauges.
pub struct EppRequest {
    metrics: EppMetrics,
    received: Instant,
    model: String,
    target: Option<String>,
    fairness: String,
    priority: i32,
    request_bytes: usize,
    response_bytes: u64,
    streaming: bool,
    first_byte: Option<Instant>,
    /// Fixed when the request is counted.
    labels: Option<RequestLabels>,
    running: bool,
    /// Labels of the queue gauge while the request waits in the queue.
    queued: Option<Vec<String>>,
    done: bool,
}

impl EppRequest {
    /// Flow control's classification of the request.
    pub fn classified(&mut self, priority: i32, fairness_key: &str) {
        self.priority = priority;
        self.fairness = fairness_key.to_string();
    }

    /// The request body: its size and the model it names.
    pub fn body(&mut self, model: Option<&str>, bytes: usize) {
        self.request_bytes = bytes;
        // After a rewrite the body names the target; the request asked for `rewritten`'s source.
        if let (Some(m), None) = (model, &self.target) {
            self.model = m.to_string();
        }
    }

    /// A model rewrite: the request asked for `from` and goes to `to`.
    pub fn rewritten(&mut self, from: &str, to: &str) {
        self.model = from.to_string();
        self.target = Some(to.to_string());
    }

    fn labels(&mut self, routed: bool) -> RequestLabels {
        if let Some(l) = &self.labels {
            return l.clone();
        }
        let target = self.target.clone().unwrap_or_else(|| self.model.clone());
        let m = &self.metrics;
        let (model, target) = if routed {
            (m.models.admit(&self.model), m.models.admit(&target))
        } else {
            (m.models.get(&self.model), m.models.get(&target))
        };
        let fairness = if self.fairness.is_empty() {
            "default".to_string()
        } else {
            m.fairness.label(&self.fairness)
        };
        let labels = RequestLabels {
            model,
            target,
            fairness,
            priority: m.priorities.label(&self.priority.to_string()),
        };
        self.labels = Some(labels.clone());
        labels
    }

    /// The request waits in the flow-control queue.
    pub fn queued(&mut self) {
        if self.queued.is_some() || self.metrics.series.is_empty() {
            return;
        }
        // Queued means the core found ranks for its model: it is served, as for a routed one.
        let l = self.labels(true);
        let pool = self.metrics.pool_name();
        let values = vec![l.fairness, l.priority, pool, l.model, l.target];
        for s in self.metrics.series.iter() {
            let v: Vec<&str> = values.iter().map(String::as_str).collect();
            s.pool.queue_size.with_label_values(&v).inc();
        }
        self.queued = Some(values);
    }

    fn dequeued(&mut self) {
        if let Some(values) = self.queued.take() {
            let v: Vec<&str> = values.iter().map(String::as_str).collect();
            for s in self.metrics.series.iter() {
                s.pool.queue_size.with_label_values(&v).dec();
            }
        }
    }

    /// Routed to a rank: counted, and running until it completes.
    pub fn routed(&mut self) {
        self.dequeued();
        if self.running || self.done {
            return;
        }
        let l = self.labels(true);
        for s in self.metrics.series.iter() {
            let g = s.generation;
            s.req
                .request_total
                .with_label_values(&l.request(g, true))
                .inc();
            s.req.running.with_label_values(&l.running(g)).inc();
        }
        self.running = true;
    }

    /// kvpick answered the request itself with `status` (refused, or a client error).
    pub fn rejected(&mut self, status: u16) {
        self.dequeued();
        if self.done || self.running {
            return;
        }
        self.done = true;
        let l = self.labels(false);
        let code = error_code(status);
        for s in self.metrics.series.iter() {
            let g = s.generation;
            s.req
                .request_total
                .with_label_values(&l.request(g, true))
                .inc();
            s.req
                .request_errors
                .with_label_values(&l.error(g, code))
                .inc();
        }
    }

    /// The rank's response status: a 5xx is a model-server error.
    pub fn response_status(&mut self, status: u16) {
        if status < 500 || !self.running {
            return;
        }
        let l = self.labels(true);
        for s in self.metrics.series.iter() {
            s.req
                .request_errors
                .with_label_values(&l.error(s.generation, "ModelServerError"))
                .inc();
        }
    }

    /// Whether the response streams (server-sent events).
    pub fn streaming(&mut self, streaming: bool) {
        self.streaming = streaming;
    }

    /// One response body chunk of `len` bytes passed by.
    pub fn response_chunk(&mut self, len: usize) {
        if len == 0 {
            return;
        }
        self.response_bytes = self.response_bytes.saturating_add(len as u64);
        if self.first_byte.is_none() && self.running {
            self.first_byte = Some(Instant::now());
            let seconds = self.received.elapsed().as_secs_f64();
            let l = self.labels(true);
            let streaming = if self.streaming { "true" } else { "false" };
            for s in self.metrics.series.iter() {
                if let Some(ttft) = &s.req.ttft {
                    let mut v = l.request(s.generation, false);
                    v.push(streaming);
                    ttft.with_label_values(&v).observe(seconds);
                }
            }
        }
    }

    /// The response is complete: latency, sizes, tokens (from the usage, when the engine
    /// reported one) and normalized time per output token.
    pub fn completed(&mut self, usage: Option<Usage>) {
        if !self.running || self.done {
            return;
        }
        self.done = true;
        let seconds = self.received.elapsed().as_secs_f64();
        let l = self.labels(true);
        for s in self.metrics.series.iter() {
            let g = s.generation;
            let v = l.request(g, false);
            s.req.duration.with_label_values(&v).observe(seconds);
            s.req
                .request_size
                .with_label_values(&v)
                .observe(self.request_bytes as f64);
            s.req
                .response_size
                .with_label_values(&v)
                .observe(self.response_bytes as f64);
            let Some(u) = usage else { continue };
            let t = &s.req.tokens;
            let observe = |h: &prometheus::HistogramVec, n: u64| {
                if n > 0 {
                    h.with_label_values(&v).observe(n as f64);
                }
            };
            observe(&t.input, u.prompt_tokens);
            observe(&t.cached, u.cached_tokens);
            observe(&t.output, u.completion_tokens);
            if u.completion_tokens > 0 {
                let per_token = seconds / u.completion_tokens as f64;
                t.ntpot.with_label_values(&v).observe(per_token);
            }
        }
        self.stop_running();
    }

    fn stop_running(&mut self) {
        if !self.running {
            return;
        }
        self.running = false;
        if let Some(l) = self.labels.clone() {
            for s in self.metrics.series.iter() {
                s.req
                    .running
                    .with_label_values(&l.running(s.generation))
                    .dec();
            }
        }
    }
}

impl Drop for EppRequest {
    fn drop(&mut self) {
        self.dequeued();
        self.stop_running();
    }
}

#[cfg(test)]
mod tests;
