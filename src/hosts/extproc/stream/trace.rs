//! The stream machine's tracing hooks (`--tracing`): the seed a stream's span starts from (the
//! ext_proc call's and the HTTP request's trace context, when Envoy opened the stream), the span
//! started once the request headers arrive, and how the tokenize outcome is reported. The spans
//! themselves are `crate::observability::telemetry::request`'s.
//!
//! It must not change what the stream answers: tracing off, none of this runs.

use std::time::SystemTime;

use crate::observability::telemetry::{RequestTrace, TraceHeaders};
use crate::tokenize::TokenizeOutcome;

use super::StreamMachine;

/// What a stream's trace continues: the ext_proc call's trace context (gRPC metadata), the HTTP
/// request's, and when Envoy opened the stream.
pub(super) struct TraceSeed {
    pub(super) grpc: TraceHeaders,
    pub(super) http: TraceHeaders,
    opened: SystemTime,
}

impl TraceSeed {
    /// A seed for a stream Envoy opened now, with no trace context yet.
    pub(super) fn now() -> Box<TraceSeed> {
        Box::new(TraceSeed {
            grpc: TraceHeaders::default(),
            http: TraceHeaders::default(),
            opened: SystemTime::now(),
        })
    }
}

impl StreamMachine {
    /// Tracing on: the trace context of the ext_proc call itself (its gRPC metadata), which the
    /// stream span prefers to the HTTP request's `traceparent`.
    pub fn set_trace_context(&mut self, grpc: TraceHeaders) {
        if let Some(seed) = &mut self.trace_seed {
            seed.grpc = grpc;
        }
    }

    /// The stream is over (`end`: how, as in `kvpick_extproc_streams_total`): ends its spans.
    pub fn end_trace(&mut self, end: &'static str) {
        if let Some(trace) = self.trace.take() {
            trace.end(end);
        }
    }

    /// Tracing on: the stream's spans once its request headers arrived.
    pub fn trace(&self) -> Option<&RequestTrace> {
        self.trace.as_deref()
    }

    /// Tracing on: starts the stream's span from its seed (once the request headers arrived).
    pub(super) fn start_trace(&mut self) {
        let (Some(seed), Some(tracer)) = (self.trace_seed.take(), &self.settings.tracer) else {
            return;
        };
        self.trace = Some(Box::new(RequestTrace::start(
            tracer,
            &seed.grpc,
            &seed.http,
            seed.opened,
            &self.path,
            self.request_id.as_deref(),
        )));
    }
}

/// The tokenize span's outcome.
pub(super) fn trace_tokenize(trace: &mut RequestTrace, outcome: &TokenizeOutcome) {
    use std::borrow::Cow;
    match outcome {
        TokenizeOutcome::Tokens { ids, source, .. } => trace.tokenize_done(
            "tokens",
            Cow::Owned(format!("{source:?}").to_ascii_lowercase()),
            ids.len(),
        ),
        TokenizeOutcome::Fallback { reason } => {
            trace.tokenize_done("fallback", Cow::Borrowed(reason), 0)
        }
        TokenizeOutcome::Skipped { reason } => {
            trace.tokenize_done("skipped", Cow::Borrowed(reason), 0)
        }
        TokenizeOutcome::NotApplicable => {
            trace.tokenize_done("not_applicable", Cow::Borrowed(""), 0)
        }
    }
}

#[cfg(test)]
#[path = "trace_tests.rs"]
mod tests;
