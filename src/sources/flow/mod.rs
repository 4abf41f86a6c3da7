//! Flow-control classification policy (issue 18, host side): which objective, priority, fairness
//! key and SLO a request carries, and which model it is rewritten to. This module owns the
//! immutable [`FlowPolicy`] snapshot (objectives, model rewrite rules), its two sources (the
//! `--flow-config` YAML file, [`static_file`], and the Kubernetes InferenceObjective /
//! InferenceModelRewrite reflector, [`kube`]) merged into one `watch::Receiver<Arc<FlowPolicy>>`
//! ([`source`]), the pure header classifier [`classify`], the weighted [`FlowPolicy::rewrite`] and
//! the body helper [`rewrite_body_model`].
//!
//! It must not touch the selection core, bookings, the queue, scheduling state or the ext_proc
//! stream: it only reads headers and bodies handed to it and publishes policy snapshots. The queue,
//! bands, fairness and admission that *use* a [`Classification`] live elsewhere; the ext_proc host
//! calls [`rewrite_request_body`] once per request body (`StreamMachine::rewrite_model`).
//!
//! # The resources (schemas as published upstream; details and sources in [`crds`])
//! - **InferenceObjective**: `llm-d.ai/v1` (llm-d-router `apix/v1`: `priority`, `poolRefs` up to
//!   16, `poolSelector`), `llm-d.ai/v1alpha2` (llm-d's storage version: `priority`, `poolRef`, and
//!   in newer builds `poolRefs` / `poolSelector`) and the legacy GIE
//!   `inference.networking.x-k8s.io/v1alpha2` (`priority`, `poolRef`; older `criticality` /
//!   `targetModels` ignored). `priority` is `*int32`, higher first, negative allowed, unset = 0.
//! - **InferenceModelRewrite**: `llm-d.ai/v1alpha2` and GIE `inference.networking.x-k8s.io/v1alpha2`:
//!   `spec.poolRef`, `spec.rules[]` of `{matches: [{model: {type: Exact, value}}], targets:
//!   [{modelRewrite, weight}]}`. A rule matches when ANY match does; an empty `matches` matches
//!   every request no other rule matches; the first matching rule wins, rules of the *oldest*
//!   resource (creationTimestamp) first. Weights are 1..=1_000_000, proportions of their sum.
//!
//! # Merging
//! The static file is the base; Kubernetes objectives override file objectives of the same name.
//! Per kind only one group's objects count: `llm-d.ai` when any of its versions is installed,
//! else `inference.networking.x-k8s.io` (llm-d-router's rule, [`kube`]).
//! Rewrite rules: Kubernetes rules (oldest resource first, then namespace/name) come before the
//! file's, and for one model name the first rule that matches it exactly wins.

pub mod crds;
pub mod kube;
pub mod source;
pub mod static_file;

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

pub use source::{start, FlowSourceConfig};

/// Most objectives one policy holds (file and cluster together); more are dropped with a warning.
pub const MAX_OBJECTIVES: usize = 10_000;
/// Most rewrite rules one policy holds.
pub const MAX_REWRITE_RULES: usize = 1_024;
/// Most weighted targets one rewrite rule holds (GIE's TargetModels allowed 10).
pub const MAX_REWRITE_TARGETS: usize = 32;
/// Most match values one rewrite rule holds.
pub const MAX_REWRITE_MATCHES: usize = 64;
/// Largest rewrite weight (GIE: `Maximum=1000000`).
pub const MAX_WEIGHT: u32 = 1_000_000;
/// Longest objective name in bytes (a Kubernetes object name).
pub const MAX_OBJECTIVE_LEN: usize = 253;
/// Longest fairness id in bytes.
pub const MAX_FAIRNESS_ID_LEN: usize = 128;
/// Longest model name (request or rewrite target) in bytes.
pub const MAX_MODEL_LEN: usize = 256;
/// Largest accepted SLO header value, in milliseconds (one hour).
pub const MAX_SLO_MS: u64 = 3_600_000;
/// Fairness key of a request without a fairness id and without a known objective.
pub const DEFAULT_FAIRNESS_KEY: &str = "default";

/// Request headers read by [`classify`]: each list is one header, its current name first, then
/// its deprecated aliases in the order they are preferred (llm-d-router's `metadata.HeaderNames`:
/// the current name wins over an alias when a request sends both). Every name is listed in
/// `docs/headers.md`.
///
/// The objective: llm-d-router's `ObjectiveKey`, then its deprecated `OldObjectiveKey` (GIE's).
pub const OBJECTIVE_HEADERS: &[&str] = &[
    "x-llm-d-inference-objective",
    "x-gateway-inference-objective",
];
/// The fairness id: llm-d-router's `FlowFairnessIDKey`, its deprecated `OldFlowFairnessIDKey`
/// (GIE's), then kvpick's own former name (`x-llm-d-fairness-id`, never llm-d's: kept so
/// clients configured from kvpick's older docs keep their tenant).
pub const FAIRNESS_HEADERS: &[&str] = &[
    "x-llm-d-inference-fairness-id",
    "x-gateway-inference-fairness-id",
    "x-llm-d-fairness-id",
];
pub const PRIORITY_HEADER: &str = "x-dynamo-request-priority";
/// The TTFT SLO: llm-d-router's `TTFTSLOHeaderKey`, then its deprecated `OldTTFTSLOHeaderKey`.
pub const SLO_TTFT_HEADERS: &[&str] = &["x-llm-d-slo-ttft-ms", "x-slo-ttft-ms"];
/// The TPOT SLO: llm-d-router's `TPOTSLOHeaderKey`, then its deprecated `OldTPOTSLOHeaderKey`.
pub const SLO_TPOT_HEADERS: &[&str] = &["x-llm-d-slo-tpot-ms", "x-slo-tpot-ms"];
/// The model to forward to: llm-d-router's `ModelNameRewriteKey`, then its deprecated
/// `OldModelNameRewriteKey` (GIE's).
pub const MODEL_REWRITE_HEADERS: &[&str] =
    &["x-llm-d-model-name-rewrite", "x-gateway-model-name-rewrite"];
/// Where an objective or rule came from (for logs and precedence).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Origin {
    /// The `--flow-config` file.
    File,
    /// `inference.networking.x-k8s.io/v1alpha2`.
    Gie,
    /// `llm-d.ai` (`v1` or `v1alpha2`).
    LlmD,
}

/// One serving objective: what an `x-*-inference-objective` header names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Objective {
    /// The objective's name (the Kubernetes object name, or the file entry's `name`).
    pub name: String,
    /// Higher is served first; negative is sheddable. An unset `spec.priority` is 0.
    pub priority: i32,
    /// The pool it applies to (`None` in the static file: it applies to the pool kvpick serves).
    pub pool: Option<String>,
    pub origin: Origin,
}

/// A weighted rewrite target.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WeightedModel {
    pub model: String,
    /// 1..=[`MAX_WEIGHT`].
    pub weight: u32,
}

/// One rewrite rule: requested model names (empty = every model no other rule matches) to
/// weighted targets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RewriteRule {
    /// Where it came from, e.g. `ns/name#0` or `file#2` (logs only).
    pub source: String,
    pub matches: Vec<String>,
    pub targets: Vec<WeightedModel>,
}

impl RewriteRule {
    /// Checks the bounds (a rule from the cluster that fails is skipped, one from the file fails
    /// the file).
    pub fn validate(&self) -> Result<(), String> {
        if self.targets.is_empty() {
            return Err("a rewrite rule needs at least one target".into());
        }
        if self.targets.len() > MAX_REWRITE_TARGETS {
            return Err(format!(
                "a rewrite rule holds at most {MAX_REWRITE_TARGETS} targets"
            ));
        }
        if self.matches.len() > MAX_REWRITE_MATCHES {
            return Err(format!(
                "a rewrite rule holds at most {MAX_REWRITE_MATCHES} matches"
            ));
        }
        for m in &self.matches {
            check_model_name(m, "match")?;
        }
        for t in &self.targets {
            check_model_name(&t.model, "target model")?;
            if !(1..=MAX_WEIGHT).contains(&t.weight) {
                return Err(format!(
                    "target {:?}: weight must be 1..={MAX_WEIGHT}, got {}",
                    t.model, t.weight
                ));
            }
        }
        Ok(())
    }
}

fn check_model_name(name: &str, what: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err(format!("{what}: model name must not be empty"));
    }
    if name.len() > MAX_MODEL_LEN {
        return Err(format!(
            "{what}: model name longer than {MAX_MODEL_LEN} bytes"
        ));
    }
    Ok(())
}

/// The flags that shape classification (not part of the published policy: they do not change at
/// run time).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowSettings {
    /// `--client-priority`: honour `x-dynamo-request-priority` (the default, as before flow
    /// control). `false`: the header is ignored (not even validated) and only objectives set a
    /// priority.
    pub client_priority: bool,
}

impl Default for FlowSettings {
    fn default() -> Self {
        FlowSettings {
            client_priority: true,
        }
    }
}

/// An immutable snapshot of the flow policy, shared as `Arc<FlowPolicy>`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FlowPolicy {
    objectives: BTreeMap<String, Objective>,
    rules: Vec<RewriteRule>,
    /// Model name -> index of the first rule that names it.
    exact: HashMap<String, usize>,
    /// Index of the first rule with empty `matches`.
    wildcard: Option<usize>,
    /// The priority bands a request may be queued in, ascending: 0, [`SHEDDABLE_BAND`] and every
    /// objective's priority ([`FlowPolicy::band_for`]).
    bands: Vec<i32>,
}

/// The band of sheddable client priorities no objective names: a client asking to be shed first
/// stays sheddable.
pub const SHEDDABLE_BAND: i32 = -1;

impl FlowPolicy {
    /// A policy from objectives (later entries with the same name replace earlier ones) and rules
    /// in precedence order. Invalid rules and entries past the caps are dropped with a warning; the
    /// static file validates its own entries strictly before it gets here.
    pub fn new(
        objectives: impl IntoIterator<Item = Objective>,
        rules: impl IntoIterator<Item = RewriteRule>,
    ) -> FlowPolicy {
        let mut by_name = BTreeMap::new();
        for o in objectives {
            if by_name.len() >= MAX_OBJECTIVES && !by_name.contains_key(&o.name) {
                tracing::warn!(objective = %o.name, "more than {MAX_OBJECTIVES} objectives: dropped");
                continue;
            }
            by_name.insert(o.name.clone(), o);
        }
        let mut bands: Vec<i32> = by_name.values().map(|o| o.priority).collect();
        bands.extend([0, SHEDDABLE_BAND]);
        bands.sort_unstable();
        bands.dedup();
        let mut policy = FlowPolicy {
            objectives: by_name,
            bands,
            ..FlowPolicy::default()
        };
        for rule in rules {
            if let Err(err) = rule.validate() {
                tracing::warn!(rule = %rule.source, %err, "invalid rewrite rule skipped");
                continue;
            }
            if policy.rules.len() >= MAX_REWRITE_RULES {
                tracing::warn!(rule = %rule.source, "more than {MAX_REWRITE_RULES} rewrite rules: dropped");
                continue;
            }
            let index = policy.rules.len();
            if rule.matches.is_empty() {
                policy.wildcard.get_or_insert(index);
            }
            for m in &rule.matches {
                policy.exact.entry(m.clone()).or_insert(index);
            }
            policy.rules.push(rule);
        }
        policy
    }

    /// The band a client-chosen priority is queued in: the highest band at or below it (the
    /// lowest band when it is below all). So a client cannot open bands of its own — the queue's
    /// bands are the operator's — nor jump above every objective with `i32::MAX`, and a sheddable
    /// request stays sheddable.
    pub fn band_for(&self, requested: i32) -> i32 {
        let at_or_below = self.bands.partition_point(|&b| b <= requested);
        let index = at_or_below.saturating_sub(1);
        self.bands
            .get(index)
            .copied()
            .unwrap_or(if requested < 0 { SHEDDABLE_BAND } else { 0 })
    }

    /// The objective of this name, if any.
    pub fn objective(&self, name: &str) -> Option<&Objective> {
        self.objectives.get(name)
    }

    /// Every objective, by name.
    pub fn objectives(&self) -> impl Iterator<Item = &Objective> {
        self.objectives.values()
    }

    /// The rewrite rules in precedence order.
    pub fn rules(&self) -> &[RewriteRule] {
        &self.rules
    }

    /// The model a request for `model` goes to, or `None` when no rule applies or the chosen
    /// target is `model` itself. `pick` is a uniformly distributed value from the caller (a random
    /// number, or a hash of the request id for a stable choice): target *i* is chosen when `pick`
    /// falls in its share of the `u64` range, `weight_i / sum(weights)`.
    pub fn rewrite(&self, model: &str, pick: u64) -> Option<String> {
        self.rule_choice(model, pick)
            .filter(|chosen| *chosen != model)
            .map(str::to_string)
    }

    /// The target the rule matching `model` chooses for `pick` (possibly `model` itself); `None`
    /// when no rule matches.
    fn rule_choice(&self, model: &str, pick: u64) -> Option<&str> {
        let index = self.exact.get(model).copied().or(self.wildcard)?;
        let rule = self.rules.get(index)?;
        weighted_choice(&rule.targets, pick).map(|t| t.model.as_str())
    }
}

/// Target *i* for `pick` in `[start_i, start_i + weight_i)` of `pick * total / 2^64` (a
/// multiply-shift, so every target gets exactly its share of the u64 range, up to rounding).
fn weighted_choice(targets: &[WeightedModel], pick: u64) -> Option<&WeightedModel> {
    let total: u64 = targets.iter().map(|t| u64::from(t.weight)).sum();
    if total == 0 {
        return None;
    }
    let point = ((u128::from(pick) * u128::from(total)) >> 64) as u64;
    let mut start = 0u64;
    for t in targets {
        start += u64::from(t.weight);
        if point < start {
            return Some(t);
        }
    }
    targets.last()
}

/// What flow control knows about one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Classification {
    /// Higher is served first; negative = sheddable.
    pub priority: i32,
    /// The key fairness is kept over within a priority band.
    pub fairness_key: String,
    /// The objective the request named, when the policy knows it (an unknown name is `None`).
    pub objective: Option<String>,
    pub slo_ttft_ms: Option<u64>,
    pub slo_tpot_ms: Option<u64>,
    /// The model the request is forwarded to ([`MODEL_REWRITE_HEADERS`]), when it names one; an
    /// InferenceModelRewrite rule matching the body's model still wins
    /// ([`rewrite_request_body`]).
    pub model_rewrite: Option<String>,
}

/// A malformed flow header: the host answers 400 with [`ClassifyError`]'s message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClassifyError {
    #[error("{header} must be an integer (i32)")]
    Priority { header: &'static str },
    #[error("{header} must be whole milliseconds in 1..={max}")]
    Slo { header: &'static str, max: u64 },
    #[error("{header} is longer than {max} bytes")]
    TooLong { header: &'static str, max: usize },
    #[error("{header} must be printable ASCII without spaces")]
    BadChars { header: &'static str },
}

/// Classifies a request from its headers. `headers` yields `(name, value)` pairs as Envoy sent
/// them (names compared case-insensitively, values as raw bytes so length caps count what the
/// client sent). Empty values count as absent. For each header the first occurrence counts, and
/// of a header's names (current, then deprecated aliases) the first listed that the request sends
/// counts, wherever it stands in the request (`docs/headers.md`).
///
/// - **Objective** ([`OBJECTIVE_HEADERS`]): a known name gives its priority and
///   `objective: Some(name)`; an unknown name gives priority 0 and `objective: None` (it is not
///   an error: clients may name objectives before they are created, and a client-chosen unknown
///   name must not become a metric label).
/// - **Priority**: with [`FlowSettings::client_priority`] (default), `x-dynamo-request-priority`
///   *overrides* the objective's priority (the per-request header is the more specific), clamped
///   to the bands the policy defines ([`FlowPolicy::band_for`]); without it the header is ignored
///   and the objective alone decides (0 without one).
/// - **Fairness key** ([`FAIRNESS_HEADERS`]); absent, the known objective's name, else
///   [`DEFAULT_FAIRNESS_KEY`]. At most [`MAX_FAIRNESS_ID_LEN`] bytes of printable ASCII. The value
///   is client-controlled: whoever counts per key must bound them.
/// - **SLOs** ([`SLO_TTFT_HEADERS`], [`SLO_TPOT_HEADERS`]): whole milliseconds 1..=[`MAX_SLO_MS`].
/// - **Model rewrite** ([`MODEL_REWRITE_HEADERS`]): at most [`MAX_MODEL_LEN`] bytes of printable
///   ASCII.
pub fn classify<'a>(
    headers: impl IntoIterator<Item = (&'a str, &'a [u8])>,
    policy: &FlowPolicy,
    settings: &FlowSettings,
) -> Result<Classification, ClassifyError> {
    let mut objective = Named::new(OBJECTIVE_HEADERS);
    let mut fairness = Named::new(FAIRNESS_HEADERS);
    let mut ttft = Named::new(SLO_TTFT_HEADERS);
    let mut tpot = Named::new(SLO_TPOT_HEADERS);
    let mut rewrite = Named::new(MODEL_REWRITE_HEADERS);
    let mut priority = None::<&[u8]>;
    for (name, value) in headers {
        if value.is_empty() {
            continue;
        }
        if name.eq_ignore_ascii_case(PRIORITY_HEADER) {
            priority.get_or_insert(value);
            continue;
        }
        let _ = [
            &mut objective,
            &mut fairness,
            &mut ttft,
            &mut tpot,
            &mut rewrite,
        ]
        .into_iter()
        .any(|h| h.offer(name, value));
    }

    let objective_name = objective.token(MAX_OBJECTIVE_LEN)?;
    let fairness_id = fairness.token(MAX_FAIRNESS_ID_LEN)?;
    let model_rewrite = rewrite.token(MAX_MODEL_LEN)?.map(str::to_string);
    let known = objective_name.and_then(|n| policy.objective(n));
    if let (Some(name), None) = (objective_name, known) {
        tracing::debug!(
            objective = name,
            "request names an unknown objective: priority 0"
        );
    }
    let mut out_priority = known.map_or(0, |o| o.priority);
    if settings.client_priority {
        if let Some(raw) = priority {
            let requested = std::str::from_utf8(raw)
                .ok()
                .and_then(|s| s.trim().parse::<i32>().ok())
                .ok_or(ClassifyError::Priority {
                    header: PRIORITY_HEADER,
                })?;
            out_priority = policy.band_for(requested);
        }
    }
    let fairness_key = match (fairness_id, known) {
        (Some(id), _) => id.to_string(),
        (None, Some(o)) => o.name.clone(),
        (None, None) => DEFAULT_FAIRNESS_KEY.to_string(),
    };
    Ok(Classification {
        priority: out_priority,
        fairness_key,
        objective: known.map(|o| o.name.clone()),
        slo_ttft_ms: ttft.slo()?,
        slo_tpot_ms: tpot.slo()?,
        model_rewrite,
    })
}

/// One header under its names (current first, then deprecated aliases): the first value each
/// name was sent with.
struct Named<'a> {
    names: &'static [&'static str],
    values: [Option<&'a [u8]>; MAX_HEADER_NAMES],
}

/// Most names one header has (current + aliases).
const MAX_HEADER_NAMES: usize = 4;

impl<'a> Named<'a> {
    fn new(names: &'static [&'static str]) -> Self {
        debug_assert!(names.len() <= MAX_HEADER_NAMES);
        Named {
            names,
            values: [None; MAX_HEADER_NAMES],
        }
    }

    /// Takes the value when `name` is one of this header's names; `true` when it was.
    fn offer(&mut self, name: &str, value: &'a [u8]) -> bool {
        let Some(i) = self.names.iter().position(|n| n.eq_ignore_ascii_case(name)) else {
            return false;
        };
        if let Some(slot) = self.values.get_mut(i) {
            slot.get_or_insert(value);
        }
        true
    }

    /// The most preferred name sent, and its value.
    fn preferred(&self) -> Option<(&'static str, &'a [u8])> {
        self.names
            .iter()
            .zip(self.values.iter())
            .find_map(|(n, v)| v.map(|v| (*n, v)))
    }

    /// The preferred value as a token: at most `max` bytes of printable ASCII (0x21..=0x7e),
    /// surrounding spaces trimmed.
    fn token(&self, max: usize) -> Result<Option<&'a str>, ClassifyError> {
        let Some((header, raw)) = self.preferred() else {
            return Ok(None);
        };
        if raw.len() > max {
            return Err(ClassifyError::TooLong { header, max });
        }
        let text = std::str::from_utf8(raw)
            .map_err(|_| ClassifyError::BadChars { header })?
            .trim_matches(' ');
        if text.is_empty() {
            return Ok(None);
        }
        if !text.bytes().all(|b| (0x21..=0x7e).contains(&b)) {
            return Err(ClassifyError::BadChars { header });
        }
        Ok(Some(text))
    }

    fn slo(&self) -> Result<Option<u64>, ClassifyError> {
        match self.preferred() {
            None => Ok(None),
            Some((header, raw)) => slo(raw, header).map(Some),
        }
    }
}

fn slo(raw: &[u8], header: &'static str) -> Result<u64, ClassifyError> {
    std::str::from_utf8(raw)
        .ok()
        .map(str::trim)
        .filter(|s| !s.is_empty() && s.len() <= 10 && s.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|s| s.parse::<u64>().ok())
        .filter(|ms| (1..=MAX_SLO_MS).contains(ms))
        .ok_or(ClassifyError::Slo {
            header,
            max: MAX_SLO_MS,
        })
}

/// Why a body's `model` could not be rewritten.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RewriteBodyError {
    #[error("malformed JSON body: {0}")]
    Malformed(String),
    #[error("request body must be a JSON object")]
    NotAnObject,
    #[error("missing `model` in request body")]
    MissingModel,
    #[error("`model` must be a string")]
    NotAString,
    #[error("`model` appears more than once in the request body")]
    Duplicate,
    #[error("rewrite target model name must be 1..={MAX_MODEL_LEN} bytes")]
    BadTarget,
}

/// The body with its top-level `model` value replaced by `new_model` (JSON-escaped); every other
/// byte — key order, whitespace, numbers as written, nested `model` keys — is kept as sent. The
/// length changes: the host must fix `content-length` (see the module's caller notes).
pub fn rewrite_body_model(body: &[u8], new_model: &str) -> Result<Vec<u8>, RewriteBodyError> {
    check_model_name(new_model, "rewrite").map_err(|_| RewriteBodyError::BadTarget)?;
    let text = std::str::from_utf8(body)
        .map_err(|e| RewriteBodyError::Malformed(format!("body is not UTF-8: {e}")))?;
    let span = model_span(text)?;
    splice(body, span, new_model).map_err(|e| RewriteBodyError::Malformed(e.to_string()))
}

fn splice(
    body: &[u8],
    span: std::ops::Range<usize>,
    new_model: &str,
) -> Result<Vec<u8>, serde_json::Error> {
    let encoded = serde_json::to_string(new_model)?;
    let mut out = Vec::with_capacity(body.len() - (span.end - span.start) + encoded.len());
    out.extend_from_slice(&body[..span.start]);
    out.extend_from_slice(encoded.as_bytes());
    out.extend_from_slice(&body[span.end..]);
    Ok(out)
}

/// A request body whose model was rewritten.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RewrittenBody {
    /// The model the client asked for.
    pub from: String,
    /// The model it now names.
    pub to: String,
    /// The whole body with `model` replaced (see [`rewrite_body_model`]).
    pub body: Vec<u8>,
}

/// The ext_proc host's one call: the body with its model rewritten, else `None` — also for a
/// body that is not a JSON object with a string `model` (the host's own body parser then answers
/// it as usual). Free when the policy has no rules and the request names no target.
///
/// The target is llm-d-router's (`Director.modelRewriteIfNeeded`): the model the request's
/// [`MODEL_REWRITE_HEADERS`] name (`header_target`), else the body's; then a rule of `policy`
/// matching the body's model, when one does, chooses instead.
pub fn rewrite_request_body(
    policy: &FlowPolicy,
    body: &[u8],
    pick: u64,
    header_target: Option<&str>,
) -> Option<RewrittenBody> {
    if policy.rules.is_empty() && header_target.is_none() {
        return None;
    }
    let text = std::str::from_utf8(body).ok()?;
    let span = model_span(text).ok()?;
    let from: String = serde_json::from_str(text.get(span.clone())?).ok()?;
    let to = policy
        .rule_choice(&from, pick)
        .or(header_target)
        .filter(|to| *to != from)?
        .to_string();
    let body = splice(body, span, &to).ok()?;
    Some(RewrittenBody { from, to, body })
}

/// Byte range of the top-level `model` value inside `text`.
fn model_span(text: &str) -> Result<std::ops::Range<usize>, RewriteBodyError> {
    use serde::de::{Deserializer as _, MapAccess, Visitor};
    use serde_json::value::RawValue;

    struct Spans<'de>(Vec<&'de RawValue>);
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Spans<'de>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a JSON object")
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut found = Vec::new();
            while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
                let value: &'de RawValue = map.next_value()?;
                if key == "model" {
                    found.push(value);
                }
            }
            Ok(Spans(found))
        }
    }
    let trimmed = text.trim_start();
    if !trimmed.starts_with('{') {
        return Err(if trimmed.is_empty() {
            RewriteBodyError::Malformed("empty body".into())
        } else {
            RewriteBodyError::NotAnObject
        });
    }
    let mut de = serde_json::Deserializer::from_str(text);
    let spans = de
        .deserialize_map(V)
        .map_err(|e| RewriteBodyError::Malformed(e.to_string()))?;
    de.end()
        .map_err(|e| RewriteBodyError::Malformed(e.to_string()))?;
    let raw = match spans.0.as_slice() {
        [] => return Err(RewriteBodyError::MissingModel),
        [one] => *one,
        _ => return Err(RewriteBodyError::Duplicate),
    };
    if !raw.get().starts_with('"') {
        return Err(RewriteBodyError::NotAString);
    }
    // The raw value borrows from `text`: its offset is the distance between the two pointers.
    let start = (raw.get().as_ptr() as usize).wrapping_sub(text.as_ptr() as usize);
    let end = start + raw.get().len();
    if text.get(start..end) != Some(raw.get()) {
        return Err(RewriteBodyError::Malformed(
            "model value not in the body".into(),
        ));
    }
    Ok(start..end)
}

/// Shared handle type the host reads the current policy through.
pub type PolicyRx = tokio::sync::watch::Receiver<Arc<FlowPolicy>>;

#[cfg(test)]
mod headers_tests;
#[cfg(test)]
mod tests;
