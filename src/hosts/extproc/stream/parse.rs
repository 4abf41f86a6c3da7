//! The request body complete: the model rewrite (flow policy, `x-llm-d-model-name-rewrite`), the
//! body parsed for its API (the scanner's reading, or serde over the whole body), the tokenize job
//! handed to the host, and the body held to be echoed once the request is routed.
//!
//! It must not pick or book: what it decides is handed to [`super::route`].

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use tonic::Status;

use crate::observability::epp_metrics::Stage;
use crate::tokenize::body::scan::Scanned;
use crate::tokenize::body::{parse_request_body_for, BodyError, ParsedBody, Prompt};

use super::wire::body_error_message;
use super::{BodyTail, PendingRoute, Phase, Step, StreamMachine, TokenizeJob};

impl StreamMachine {
    /// The body parsed for its API (by the request path): what the scanner read while it
    /// arrived, or serde over the whole body when the scanner left it undecided (or the body was
    /// rewritten since). Timed, scanning included, as the EPP's parse stage.
    /// The scanner's layout of the body, when it read it whole, is kept for the tokenize job.
    pub(super) fn parse_body(&mut self) -> Result<Option<ParsedBody>, BodyError> {
        let endpoint = crate::tokenize::prompt::Endpoint::from_path(&self.path);
        let parse_started = Instant::now();
        let scanned = match self.scanner.take() {
            Some(scanner) => {
                let (scanned, layout) = scanner.finish_layout(&self.body.chunks);
                self.layout = layout;
                scanned
            }
            None => Scanned::Undecided(crate::tokenize::body::scan::Undecided::Incomplete),
        };
        let parsed = match scanned {
            Scanned::Parsed(parsed) => parsed,
            Scanned::Undecided(why) => {
                tracing::trace!(?why, "request body left to serde");
                let whole = self.body.contiguous();
                parse_request_body_for(endpoint, self.content_type.as_deref(), &whole)
            }
        };
        let seconds = (self.scan_time + parse_started.elapsed()).as_secs_f64();
        self.core.metrics().epp.stage(Stage::Parse, seconds);
        if let Ok(p) = &parsed {
            let model = p.as_ref().and_then(|p| p.model.as_deref());
            self.epp.body(model, self.body.len);
        }
        parsed
    }

    /// The model whose tokenizer reads this body, if one is configured. A body without a model
    /// (SGLang `/generate`) uses the tokenizer when only one is configured: the pool then serves
    /// that model.
    pub(super) fn tokenizer_model(&self, model: Option<&str>) -> Option<String> {
        match (model, self.settings.tokenizers.as_ref()) {
            (Some(m), Some(t)) => t.has(m).then(|| m.to_string()),
            (None, Some(t)) => t.sole_model().map(str::to_string),
            (_, None) => None,
        }
    }

    // `parsed` is checked to be `Some` at the top of the branch that moves it.
    #[allow(clippy::expect_used)]
    pub(super) fn finish_request(&mut self, body_end_of_stream: bool) -> Result<Step, Status> {
        let started = self.body_started.unwrap_or_else(Instant::now);
        if let Some(t) = &mut self.trace {
            t.body_done(self.body.len, self.body.chunks.len());
        }
        if let Some(step) = self.rewrite_model() {
            return Ok(step);
        }
        let mut parsed = match self.parse_body() {
            Ok(parsed) => parsed,
            Err(err) => return Ok(self.reject(400, &body_error_message(&err))),
        };
        if let Some(p) = &mut parsed {
            let tokenizer_model = self.tokenizer_model(p.model.as_deref());
            let wants_tokens = matches!(p.prompt, Prompt::Text(_)) && tokenizer_model.is_some();
            let model = tokenizer_model.unwrap_or_default();
            if wants_tokens
                && !self
                    .settings
                    .tokenizers
                    .as_ref()
                    .is_some_and(|t| t.admits_body(&model, self.body.len))
            {
                // Too big to tokenize: load-only, as for a failed tokenization, and no copy.
                p.prompt = Prompt::Absent;
            } else if wants_tokens {
                // The job needs its own contiguous copy (it runs off this task while the
                // chunks wait to be echoed): it is buffered body too, so it takes budget.
                let job_body = Bytes::from(self.body.contiguous().into_owned());
                if !self.body.lease.try_grow(job_body.len()) {
                    return Ok(self.reject_budget());
                }
                let job = TokenizeJob {
                    model,
                    path: self.path.clone(),
                    body: job_body,
                    layout: self.layout.take(),
                };
                self.pending = Some(PendingRoute {
                    parsed: parsed.expect("checked"),
                    started,
                    tail: self.held_body(body_end_of_stream),
                });
                self.phase = Phase::Tokenizing;
                self.tokenize_started = Some(Instant::now());
                if let Some(t) = &mut self.trace {
                    t.tokenize_started(&job.model);
                }
                return Ok(Step {
                    tokenize: Some(job),
                    ..Step::default()
                });
            }
        }
        // A step the host runs before the pick: a shared session's lookup, a remote index's
        // overlap (`route_pending` asks for whichever the request needs).
        let shared_session = self.core.shared().is_some() && self.session_id.is_some();
        let prefetch = shared_session || self.core.has_remote_index();
        if let Some(p) = parsed.take_if(|_| prefetch) {
            let tail = self.held_body(body_end_of_stream);
            return Ok(self.route_pending(PendingRoute {
                parsed: p,
                started,
                tail,
            }));
        }
        self.phase = Phase::Response;
        let step = self.route(parsed, started, false);
        if step.finished {
            return Ok(step);
        }
        let tail = self.held_body(body_end_of_stream);
        Ok(self.echo_after_route(step, tail))
    }

    /// The body buffered so far, taken to be echoed once the request is routed.
    pub(super) fn held_body(&mut self, end_of_stream: bool) -> BodyTail {
        let (body, lease) = self.body.take();
        BodyTail {
            body,
            lease,
            end_of_stream,
            trailers: false,
        }
    }

    /// The body echo after the headers response of a routed request; a queued request keeps it
    /// until [`StreamMachine::resume_after_queue`] routes it.
    pub(super) fn echo_after_route(&mut self, mut step: Step, tail: BodyTail) -> Step {
        match self.queued.as_mut() {
            Some(queued) => queued.tail = Some(tail),
            None => self.transfer_body(tail).echo(&mut step),
        }
        step
    }

    /// Model rewrite (`x-llm-d-model-name-rewrite`, then InferenceModelRewrite rules of the flow
    /// policy, as llm-d-router orders them: `flow::rewrite_request_body`), before the body is parsed,
    /// so tokenizer, partition and pick all see the target model and Envoy forwards the rewritten
    /// body. The target is chosen by a hash of the session id (a session stays on one target and
    /// keeps its KV cache), else of the client's `x-request-id` (a retry keeps its model), else at
    /// random. No `content-length` fix is needed: in FULL_DUPLEX_STREAMED Envoy
    /// removes it from the request whenever body mutation is possible (ext_proc
    /// `processing_mode.proto`). `Some` = a step to answer instead (budget exhausted).
    pub(super) fn rewrite_model(&mut self) -> Option<Step> {
        let policy = match (&self.settings.flow_policy, &self.model_rewrite) {
            (Some(rx), _) => rx.borrow().clone(),
            (None, Some(_)) => Arc::new(crate::sources::flow::FlowPolicy::default()),
            (None, None) => return None,
        };
        if policy.rules().is_empty() && self.model_rewrite.is_none() {
            return None; // no copy of a multi-chunk body when there is nothing to rewrite
        }
        let pick = match self.session_id.as_ref().or(self.request_id.as_ref()) {
            Some(id) => xxhash_rust::xxh3::xxh3_64(id.as_bytes()),
            None => rand::random(),
        };
        let rewritten = crate::sources::flow::rewrite_request_body(
            &policy,
            &self.body.contiguous(),
            pick,
            self.model_rewrite.as_deref(),
        )?;
        tracing::debug!(from = %rewritten.from, to = %rewritten.to, "model rewritten");
        self.epp.rewritten(&rewritten.from, &rewritten.to);
        let grow = rewritten.body.len().saturating_sub(self.body.len);
        if !self.body.lease.try_grow(grow) {
            return Some(self.reject_budget());
        }
        self.body.replace(rewritten.body);
        // The scanner read the body as sent: the rewritten one is parsed whole.
        self.scanner = None;
        None
    }
}

#[cfg(test)]
#[path = "parse_tests.rs"]
mod tests;
