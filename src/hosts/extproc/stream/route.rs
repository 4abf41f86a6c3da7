//! The routing phase: the `--shared-state` session lookup, the tokenize outcome resumed, the pick
//! and booking ([`crate::selection::SelectionCore::admit`]), flow control's queue and its
//! resumption, and the headers response of a booked pick followed by the held body's echo.
//!
//! It must not read the request's messages or the response: it routes what the request phase
//! handed it. The routing headers are [`super::route_headers`]'s, the refusals [`super::reject`]'s.

use std::sync::Arc;
use std::time::Instant;

use crate::observability::epp_metrics::Stage;
use crate::selection::admission::{Admitted, Waiter};
use crate::selection::{
    DuplicateId, PromptInput, RemoteOverlap, RemoteQuery, Reservation, SelectError,
    SelectionRequest,
};
use crate::tokenize::body::{ParsedBody, Prompt};
use crate::tokenize::TokenizeOutcome;

use super::trace::trace_tokenize;
use super::wire::headers_response;
use super::{PendingRoute, Phase, QueuedRoute, Step, StreamMachine};

impl StreamMachine {
    /// `--shared-state`: the Redis lookup this request's session needs before its pick.
    pub(super) fn session_lookup_for(
        &self,
        parsed: &ParsedBody,
    ) -> Option<crate::sources::shared::SessionLookupJob> {
        self.core.session_tree_lookup(
            parsed.model.as_deref(),
            "",
            self.session_id.as_deref(),
            self.parent_session_id.as_deref(),
        )
    }

    /// `--kv-index-remote`: the remote index's query for this request's prompt (engine token
    /// ids only: text hashed without a tokenizer never matches an engine's blocks).
    fn remote_query_for(&self, parsed: &mut ParsedBody) -> Option<RemoteQuery> {
        if !self.core.has_remote_index() {
            return None;
        }
        let prompt = match std::mem::replace(&mut parsed.prompt, Prompt::Absent) {
            Prompt::TokenIds(ids) => PromptInput::Tokens(ids),
            Prompt::MediaTokenIds { ids, media } => PromptInput::MediaTokens { tokens: ids, media },
            other => {
                parsed.prompt = other;
                return None;
            }
        };
        let probe = SelectionRequest {
            model: parsed.model.clone(),
            prompt,
            cache_salt: parsed.cache_salt.clone(),
            ..SelectionRequest::default()
        };
        let query = self.core.remote_query(&probe);
        parsed.prompt = match probe.prompt {
            PromptInput::Tokens(ids) => Prompt::TokenIds(ids),
            PromptInput::MediaTokens { tokens, media } => {
                Prompt::MediaTokenIds { ids: tokens, media }
            }
            _ => Prompt::Absent,
        };
        query
    }

    /// Routes a pending request, unless its session must be looked up first or the remote
    /// index asked (`--kv-index-remote`): then it stays pending and the step asks the host for
    /// both at once.
    pub(super) fn route_pending(&mut self, mut pending: PendingRoute) -> Step {
        let lookup = self.session_lookup_for(&pending.parsed);
        let remote_query = self.remote_query_for(&mut pending.parsed);
        if lookup.is_none() && remote_query.is_none() {
            return self.route_now(pending);
        }
        if let (Some(t), true) = (&mut self.trace, lookup.is_some()) {
            t.lookup_started();
        }
        self.pending = Some(pending);
        self.phase = Phase::Tokenizing;
        Step {
            session_lookup: lookup,
            remote_query,
            ..Step::default()
        }
    }

    /// The remote index's answer for the pending request (`None`: approximate), read by its
    /// pick; the host then calls [`StreamMachine::resume_after_lookup`].
    pub fn set_remote_overlap(&mut self, overlap: Option<Arc<RemoteOverlap>>) {
        self.remote_overlap = overlap;
    }

    /// Finishes a request whose session was looked up (the binding found, if any, is installed)
    /// and whose remote overlap was asked for.
    pub fn resume_after_lookup(&mut self) -> Step {
        if let Some(t) = &mut self.trace {
            t.lookup_done();
        }
        match self.pending.take() {
            Some(pending) => self.route_now(pending),
            None => Step::default(),
        }
    }

    /// Finishes a request whose prompt was tokenized: exact ids route by KV overlap; a failed
    /// tokenization routes on load alone (the outcome is counted by the tokenizer registry).
    pub fn resume(&mut self, outcome: TokenizeOutcome) -> Step {
        let Some(pending) = self.pending.take() else {
            return Step::default();
        };
        if let Some(at) = self.tokenize_started.take() {
            let seconds = at.elapsed().as_secs_f64();
            self.core.metrics().epp.stage(Stage::Tokenize, seconds);
        }
        let mut parsed = pending.parsed;
        if let Some(t) = &mut self.trace {
            trace_tokenize(t, &outcome);
        }
        match outcome {
            TokenizeOutcome::Tokens { ids, media, .. } if media.is_empty() => {
                parsed.prompt = Prompt::TokenIds(ids)
            }
            TokenizeOutcome::Tokens { ids, media, .. } => {
                parsed.prompt = Prompt::MediaTokenIds { ids, media }
            }
            TokenizeOutcome::Fallback { .. } | TokenizeOutcome::Skipped { .. } => {
                parsed.prompt = Prompt::Absent
            }
            TokenizeOutcome::NotApplicable => {}
        }
        self.route_pending(PendingRoute { parsed, ..pending })
    }

    /// Routes a pending request and echoes its body (and trailers).
    pub(super) fn route_now(&mut self, pending: PendingRoute) -> Step {
        self.phase = Phase::Response;
        let step = self.route(Some(pending.parsed), pending.started, false);
        if step.finished {
            return step;
        }
        self.echo_after_route(step, pending.tail)
    }

    /// Selects, books, and builds the headers response.
    pub(super) fn route(
        &mut self,
        body: Option<ParsedBody>,
        started: Instant,
        header_only: bool,
    ) -> Step {
        if let Some(message) = self.header_error.take() {
            return self.reject(400, &message);
        }
        if let Some(t) = &mut self.trace {
            t.pick_started();
        }
        let request = self.selection_request(body);
        let pick_started = Instant::now();
        let admitted = self.core.admit(&request);
        let seconds = pick_started.elapsed().as_secs_f64();
        self.core.metrics().epp.stage(Stage::Pick, seconds);
        match admitted {
            Ok(Admitted::Now(r)) => {
                self.routed(*r, &request.request_id, started, header_only, false)
            }
            Ok(Admitted::Queued(waiter)) => {
                self.queue_for_capacity(waiter, request.request_id, started, header_only)
            }
            Err(err) => self.reject_select(&err),
        }
    }

    /// The core's request for this stream: the body's model, prompt and salt, and what the
    /// headers set (subset, pin, session, flow control, scores).
    fn selection_request(&mut self, body: Option<ParsedBody>) -> SelectionRequest {
        let subset = match (&self.subset, &self.conformance_filter) {
            (Some(s), _) => Some(s.clone()),
            (None, Some(c)) => Some(c.clone()),
            (None, None) => None,
        };
        let request_id = self
            .request_id
            .clone()
            .unwrap_or_else(|| uuid::Uuid::new_v4().to_string());
        let (model, prompt, cache_salt) = match body {
            Some(b) => (
                b.model,
                match b.prompt {
                    Prompt::TokenIds(ids) => {
                        self.routed_on_tokens = true;
                        PromptInput::Tokens(ids)
                    }
                    Prompt::MediaTokenIds { ids, media } => {
                        self.routed_on_tokens = true;
                        PromptInput::MediaTokens { tokens: ids, media }
                    }
                    Prompt::Text(text) => PromptInput::Text(text),
                    Prompt::Absent => PromptInput::None,
                },
                b.cache_salt,
            ),
            None => (None, PromptInput::None, None),
        };
        SelectionRequest {
            request_id,
            model,
            routing_group: String::new(),
            prompt,
            cache_salt,
            subset,
            pin: self.pin,
            fallbacks: self.settings.fallbacks,
            temperature: None,
            priority: self.priority,
            fairness_key: self.fairness_key.clone(),
            slo_ttft_ms: self.slo_ttft_ms,
            slo_tpot_ms: self.slo_tpot_ms,
            session_id: self.session_id.clone(),
            parent_session_id: self.parent_session_id.clone(),
            session_final: self.session_final,
            on_duplicate: DuplicateId::Suffix,
            holder: crate::selection::Holder::Stream,
            scores: self.settings.endpoint_scores,
            remote_overlap: self.remote_overlap.take(),
        }
    }

    /// No capacity now: the stream waits in the flow-control queue for its turn.
    fn queue_for_capacity(
        &mut self,
        waiter: Waiter,
        request_id: String,
        started: Instant,
        header_only: bool,
    ) -> Step {
        tracing::debug!(ticket = waiter.ticket(), "queued for capacity");
        self.epp.queued();
        if let Some(t) = &mut self.trace {
            t.queued(self.priority, self.fairness_key.as_deref());
        }
        self.queued = Some(QueuedRoute {
            request_id,
            started,
            header_only,
            tail: None,
        });
        Step {
            queue: Some(waiter),
            ..Step::default()
        }
    }

    /// Finishes a request that waited in the queue: routed (its headers answer, then the body it
    /// held), or refused (503 / 429).
    pub fn resume_after_queue(&mut self, outcome: Result<Reservation, SelectError>) -> Step {
        let Some(queued) = self.queued.take() else {
            return Step::default();
        };
        if let (Some(t), true) = (&mut self.trace, outcome.is_ok()) {
            t.queue_done(Ok(()));
        }
        let mut step = match outcome {
            Ok(r) => self.routed(
                r,
                &queued.request_id,
                queued.started,
                queued.header_only,
                true,
            ),
            Err(err) => self.reject_select(&err),
        };
        if step.finished {
            return step;
        }
        if let Some(tail) = queued.tail {
            self.transfer_body(tail).echo(&mut step);
        }
        step
    }

    /// The headers response for a booked pick. `waited`: the request came out of the queue (its
    /// wait is in `kvpick_queue_wait_seconds`, not the pick latency).
    pub(super) fn routed(
        &mut self,
        reservation: Reservation,
        request_id: &str,
        started: Instant,
        header_only: bool,
        waited: bool,
    ) -> Step {
        let (destination, set, remove) = self.route_headers(reservation.selection(), request_id);
        let response = headers_response(&destination, &reservation.selection().scores, set, remove);
        tracing::debug!(
            booking = reservation.booking_id(),
            endpoint = %destination,
            header_only,
            "picked"
        );
        self.reservation = Some(reservation);
        self.picked_at = Some(Instant::now());
        let metrics = self.core.metrics();
        metrics.extproc.requests.with_label_values(&["200"]).inc();
        self.epp.routed();
        if !waited {
            let seconds = started.elapsed().as_secs_f64();
            metrics.extproc.pick_latency.observe(seconds);
            metrics.epp.scheduled(seconds);
        }
        Step {
            responses: vec![response.into()],
            ..Step::default()
        }
    }
}

#[cfg(test)]
#[path = "route_tests.rs"]
mod tests;
