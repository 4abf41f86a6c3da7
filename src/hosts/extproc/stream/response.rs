//! The response phase of an ext_proc stream: the rank's status and content type read from the
//! response headers (a 5xx counts against the rank), the served endpoint and session headers
//! set on them, the first response byte (prefill done, time to first byte), `usage` read from
//! the body (and the engine's cached tokens held against the pick's prediction: cache-view
//! accuracy, [`crate::observability::metrics::cache_view`]), and the booking freed when the response ends.
//!
//! It must not route or touch the request phase's state (body, pending or queued route).

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_response, CommonResponse, HeaderMutation, HeadersResponse, HttpBody, HttpHeaders,
};
use tonic::Status;

use crate::selection::session::SessionOutcome;
use crate::selection::Selection;
use crate::usage::{Usage, UsageTracker};

use super::super::codec::{BodySide, Outbound};
use super::wire::{header_value, one, set_header};
use super::{Phase, Step, StreamMachine, CONFORMANCE_SERVED_HEADER};

impl StreamMachine {
    /// True until the request is routed (or answered by kvpick or Envoy): the stream waits for
    /// its client's request messages, the only wait `--ext-proc-idle-timeout` bounds. Read
    /// here, not changed.
    pub fn awaits_request(&self) -> bool {
        matches!(self.phase, Phase::RequestHeaders | Phase::RequestBody)
    }

    pub(super) fn on_response_headers(&mut self, headers: HttpHeaders) -> Result<Step, Status> {
        // The rank's answer: a 5xx (Envoy's own 503/504 for connect failures and timeouts too)
        // counts against it, and only a 2xx makes its first byte a first token.
        let status = headers
            .headers
            .iter()
            .flat_map(|m| m.headers.iter())
            .find(|h| h.key == ":status")
            .and_then(|h| header_value(h).trim().parse::<u16>().ok());
        self.response_ok = status.is_some_and(|s| (200..300).contains(&s));
        if let (Some(status), Some(r)) = (status, &self.reservation) {
            r.response_status(status);
            self.epp.response_status(status);
        }
        if let (Some(status), Some(t)) = (status, &self.trace) {
            t.response_status(status);
        }
        let sse = headers
            .headers
            .iter()
            .flat_map(|m| m.headers.iter())
            .any(|h| {
                h.key.eq_ignore_ascii_case("content-type")
                    && header_value(h)
                        .to_ascii_lowercase()
                        .starts_with("text/event-stream")
            });
        self.usage = Some(UsageTracker::new(sse));
        self.epp.streaming(sse);
        let mut set = Vec::new();
        if let (Some(served), Some(reservation)) = (&self.served_endpoint, &self.reservation) {
            if let Ok(addr) = served.parse() {
                reservation.served_by(addr);
            }
        }
        if let (Some(id), Some(r)) = (&self.session_id, &self.reservation) {
            if matches!(
                r.selection().session,
                Some(SessionOutcome::Created | SessionOutcome::Reused | SessionOutcome::Released)
            ) {
                set.push(set_header("x-dynamo-session-id", id));
            }
        }
        if self.settings.conformance_test_mode {
            let served = self.served_endpoint.clone().or_else(|| {
                self.reservation
                    .as_ref()
                    .map(|r| r.selection().primary.endpoint.to_string())
            });
            if let Some(served) = served {
                set.push(set_header(CONFORMANCE_SERVED_HEADER, &served));
            }
        }
        if headers.end_of_stream {
            self.release();
        }
        let common = if set.is_empty() {
            None
        } else {
            Some(CommonResponse {
                header_mutation: Some(HeaderMutation {
                    set_headers: set,
                    remove_headers: vec![],
                }),
                ..Default::default()
            })
        };
        Ok(one(processing_response::Response::ResponseHeaders(
            HeadersResponse { response: common },
        )))
    }

    pub(super) fn on_response_body(&mut self, body: HttpBody, chunk: Bytes) -> Step {
        if !chunk.is_empty() && !self.first_byte_seen {
            self.first_byte_seen = true;
            if let Some(t) = &self.trace {
                t.first_byte();
            }
            if let Some(r) = &self.reservation {
                r.mark_prefill_complete();
                if let Some(at) = self.picked_at {
                    self.core
                        .metrics()
                        .extproc
                        .time_to_first_byte
                        .with_label_values(&[&r.selection().primary.worker_name])
                        .observe(at.elapsed().as_secs_f64());
                }
            }
        }
        if let Some(usage) = &mut self.usage {
            usage.feed(&chunk);
        }
        self.epp.response_chunk(chunk.len());
        let end = body.end_of_stream;
        let step = Step {
            responses: vec![Outbound::streamed_body(BodySide::Response, chunk, end)],
            ..Step::default()
        };
        if end {
            self.release();
        }
        step
    }

    /// Frees the booking (response complete) and records usage.
    pub(super) fn release(&mut self) {
        self.response_done = true;
        let usage = self.usage.as_mut().and_then(UsageTracker::finish);
        self.epp.completed(usage);
        if let Some(usage) = usage {
            let m = &self.core.metrics().extproc.usage_tokens;
            m.with_label_values(&["prompt"]).inc_by(usage.prompt_tokens);
            m.with_label_values(&["completion"])
                .inc_by(usage.completion_tokens);
            m.with_label_values(&["cached"]).inc_by(usage.cached_tokens);
            // The decode speed the engine reported (TPOT estimator, TPOT SLO attainment).
            if let Some(r) = &self.reservation {
                r.decode_complete(usage.completion_tokens);
                if self.comparable(&usage, r.selection()) {
                    let picked = &r.selection().primary;
                    self.core.metrics().cache_view.observe(
                        &picked.worker_name,
                        picked.key.dp_rank,
                        r.selection().predicted_cached_tokens,
                        usage.cached_tokens,
                    );
                }
            }
        }
        self.usage = None;
        if let Some(r) = self.reservation.take() {
            r.free();
        }
    }

    /// Whether the engine's reported cached tokens can be held against the pick's prediction:
    /// the engine reported them (vLLM: `--enable-prompt-tokens-details`), the pick knew the
    /// prompt's engine token ids (a text prompt's pseudo-tokens are not the engine's), the
    /// response succeeded, and the picked rank alone served it (no prefill/decode split, and
    /// Envoy did not fall back to another endpoint).
    fn comparable(&self, usage: &Usage, selection: &Selection) -> bool {
        let served_elsewhere = self
            .served_endpoint
            .as_deref()
            .and_then(|s| s.parse::<std::net::SocketAddr>().ok())
            .is_some_and(|served| served != selection.primary.endpoint);
        usage.cached_reported
            && self.routed_on_tokens
            && self.response_ok
            && selection.prefill.is_none()
            && !served_elsewhere
    }
}

#[cfg(test)]
#[path = "response_tests.rs"]
mod tests;
