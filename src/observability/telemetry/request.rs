//! The spans of one ext_proc stream (docs/observability.md, "Tracing"): `kvpick.ext_proc`, the
//! stream, continuing the W3C trace context Envoy sent (the ext_proc call's gRPC metadata first,
//! then the HTTP request's `traceparent`), and its children `kvpick.body`, `kvpick.tokenize`,
//! `kvpick.session_lookup` (Redis), `kvpick.pick` (with `kvpick.queue` under it); and the
//! `traceparent` / `tracestate` the upstream gets, naming the pick span.
//!
//! Only the ext_proc state machine and its host drive a [`RequestTrace`]; it reads the pick's
//! [`Selection`] and never changes routing. It exists only when tracing is on.

use std::borrow::Cow;
use std::time::SystemTime;

use kvpick_core::{Selection, SessionOutcome};
use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator as _};
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt as _, Tracer as _};
use opentelemetry::{Context, KeyValue};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{SdkTracer, Span};

pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";
/// A longer `traceparent` is ignored (version 00 is 55 bytes; later versions may append fields).
pub const MAX_TRACEPARENT_BYTES: usize = 128;
/// A longer `tracestate` is dropped (W3C: at least 512 characters must be propagated; a vendor
/// may discard a longer one).
pub const MAX_TRACESTATE_BYTES: usize = 512;

/// Starts the spans of each stream; cheap to clone.
#[derive(Clone, Debug)]
pub struct RequestTracer {
    tracer: SdkTracer,
}

impl RequestTracer {
    pub fn new(tracer: SdkTracer) -> Self {
        RequestTracer { tracer }
    }
}

/// A `traceparent` / `tracestate` pair as one hop sent it (values over their limit left out).
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct TraceHeaders {
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

impl TraceHeaders {
    /// Records `name: value` if it is one of the two trace-context headers (`name` lower-case).
    pub fn offer(&mut self, name: &str, value: &[u8]) {
        let (slot, limit) = match name {
            TRACEPARENT => (&mut self.traceparent, MAX_TRACEPARENT_BYTES),
            TRACESTATE => (&mut self.tracestate, MAX_TRACESTATE_BYTES),
            _ => return,
        };
        if value.len() <= limit {
            if let Ok(v) = std::str::from_utf8(value) {
                *slot = Some(v.trim().to_string());
            }
        }
    }

    /// The remote span context these headers carry, if `traceparent` is valid.
    fn context(&self) -> Option<Context> {
        self.traceparent.as_ref()?;
        let cx = TraceContextPropagator::new().extract(self);
        cx.span().span_context().is_valid().then_some(cx)
    }
}

impl Extractor for TraceHeaders {
    fn get(&self, key: &str) -> Option<&str> {
        match key {
            TRACEPARENT => self.traceparent.as_deref(),
            TRACESTATE => self.tracestate.as_deref(),
            _ => None,
        }
    }

    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT, TRACESTATE]
    }
}

/// The headers the upstream gets: `traceparent`, and `tracestate` when there is one.
#[derive(Default)]
struct Outgoing(Vec<(&'static str, String)>);

impl Injector for Outgoing {
    fn set(&mut self, key: &str, value: String) {
        match key {
            TRACEPARENT => self.0.push((TRACEPARENT, value)),
            TRACESTATE if !value.is_empty() => self.0.push((TRACESTATE, value)),
            _ => {}
        }
    }
}

/// The open spans of one stream. Dropping it ends whatever is still open.
pub struct RequestTrace {
    tracer: SdkTracer,
    /// Holds the `kvpick.ext_proc` span: the parent of every other span.
    stream: Context,
    body: Option<Span>,
    tokenize: Option<Span>,
    lookup: Option<Span>,
    /// Holds the `kvpick.pick` span while the pick runs (the queue span's parent).
    pick: Option<Context>,
    queue: Option<Span>,
}

impl RequestTrace {
    /// The stream span, opened at `opened` (when Envoy opened the stream) as a child of the
    /// ext_proc call's context (`grpc`), else of the HTTP request's (`http`), else a new trace.
    pub fn start(
        tracer: &RequestTracer,
        grpc: &TraceHeaders,
        http: &TraceHeaders,
        opened: SystemTime,
        path: &str,
        request_id: Option<&str>,
    ) -> RequestTrace {
        let parent = grpc
            .context()
            .or_else(|| http.context())
            .unwrap_or_default();
        let mut span = tracer
            .tracer
            .span_builder("kvpick.ext_proc")
            .with_kind(SpanKind::Server)
            .with_start_time(opened)
            .start_with_context(&tracer.tracer, &parent);
        // An unsampled span records nothing: its attributes are not even built.
        if span.is_recording() {
            span.set_attribute(KeyValue::new("url.path", path.to_string()));
            if let Some(id) = request_id {
                span.set_attribute(KeyValue::new("kvpick.request_id", id.to_string()));
            }
        }
        RequestTrace {
            tracer: tracer.tracer.clone(),
            stream: parent.with_span(span),
            body: None,
            tokenize: None,
            lookup: None,
            pick: None,
            queue: None,
        }
    }

    fn child(&self, name: &'static str, kind: SpanKind, parent: &Context) -> Span {
        self.tracer
            .span_builder(name)
            .with_kind(kind)
            .start_with_context(&self.tracer, parent)
    }

    pub fn body_started(&mut self) {
        self.body = Some(self.child("kvpick.body", SpanKind::Internal, &self.stream));
    }

    pub fn body_done(&mut self, bytes: usize, chunks: usize) {
        if let Some(mut span) = self.body.take() {
            span.set_attribute(KeyValue::new("kvpick.body.bytes", bytes as i64));
            span.set_attribute(KeyValue::new("kvpick.body.chunks", chunks as i64));
            span.end();
        }
    }

    pub fn tokenize_started(&mut self, model: &str) {
        let mut span = self.child("kvpick.tokenize", SpanKind::Internal, &self.stream);
        if span.is_recording() {
            span.set_attribute(KeyValue::new("gen_ai.request.model", model.to_string()));
        }
        self.tokenize = Some(span);
    }

    /// `outcome`: `tokens` (with the count and where they came from), `fallback`, `skipped`.
    pub fn tokenize_done(&mut self, outcome: &'static str, detail: Cow<'_, str>, tokens: usize) {
        if let Some(mut span) = self.tokenize.take().filter(|s| s.is_recording()) {
            span.set_attribute(KeyValue::new("kvpick.tokenize.outcome", outcome));
            span.set_attribute(KeyValue::new("kvpick.tokenize.detail", detail.into_owned()));
            span.set_attribute(KeyValue::new("kvpick.prompt_tokens", tokens as i64));
            span.end();
        }
    }

    /// The Redis look-up of a session this replica has no binding for (`--shared-state`).
    pub fn lookup_started(&mut self) {
        let mut span = self.child("kvpick.session_lookup", SpanKind::Client, &self.stream);
        span.set_attribute(KeyValue::new("db.system.name", "redis"));
        span.set_attribute(KeyValue::new("db.operation.name", "GET"));
        self.lookup = Some(span);
    }

    pub fn lookup_done(&mut self) {
        if let Some(mut span) = self.lookup.take() {
            span.end();
        }
    }

    pub fn pick_started(&mut self) {
        let span = self.child("kvpick.pick", SpanKind::Internal, &self.stream);
        self.pick = Some(self.stream.with_span(span));
    }

    /// Flow control: the request waits for capacity (a child of the pick).
    pub fn queued(&mut self, priority: i32, fairness_key: Option<&str>) {
        let Some(pick) = &self.pick else { return };
        let mut span = self.child("kvpick.queue", SpanKind::Internal, pick);
        span.set_attribute(KeyValue::new("kvpick.priority", i64::from(priority)));
        if let Some(key) = fairness_key.filter(|_| span.is_recording()) {
            span.set_attribute(KeyValue::new("kvpick.fairness_key", key.to_string()));
        }
        self.queue = Some(span);
    }

    /// The queue let the request go: `Ok` dispatched, `Err(status)` refused.
    pub fn queue_done(&mut self, outcome: Result<(), u16>) {
        match outcome {
            Ok(()) => self.close_queue("dispatched", None),
            Err(status) => self.close_queue("refused", Some(status)),
        }
    }

    fn close_queue(&mut self, outcome: &'static str, status: Option<u16>) {
        if let Some(mut span) = self.queue.take() {
            span.set_attribute(KeyValue::new("kvpick.queue.outcome", outcome));
            if let Some(status) = status {
                span.set_attribute(KeyValue::new(
                    "http.response.status_code",
                    i64::from(status),
                ));
            }
            span.end();
        }
    }

    /// Ends the pick span with what was picked and why; returns the `traceparent` (and
    /// `tracestate`) for the upstream, naming the pick span, so the engine's own spans (vLLM's
    /// `--otlp-traces-endpoint`) are its children.
    pub fn picked(&mut self, selection: &Selection, pinned: bool) -> Vec<(&'static str, String)> {
        let Some(pick) = self.pick.take() else {
            return Vec::new();
        };
        let span = pick.span();
        if span.is_recording() {
            span.set_attributes(pick_attributes(selection, pinned));
        }
        let mut out = Outgoing::default();
        TraceContextPropagator::new().inject_context(&pick, &mut out);
        span.end();
        out.0
    }

    /// The request was answered by kvpick itself (`status`, e.g. 400, 413, 429, 503).
    pub fn refused(&mut self, status: u16, message: &str) {
        self.queue_done(Err(status));
        let status_attr = KeyValue::new("http.response.status_code", i64::from(status));
        if let Some(pick) = self.pick.take() {
            let span = pick.span();
            span.set_attribute(status_attr.clone());
            span.set_status(Status::error(message.to_string()));
            span.end();
        }
        let stream = self.stream.span();
        stream.set_attribute(status_attr);
        if status >= 500 {
            stream.set_status(Status::error(message.to_string()));
        }
    }

    /// The upstream's response status (Envoy's own for a connect failure).
    pub fn response_status(&self, status: u16) {
        let stream = self.stream.span();
        stream.set_attribute(KeyValue::new(
            "http.response.status_code",
            i64::from(status),
        ));
        if status >= 500 {
            stream.set_status(Status::error(format!("upstream answered {status}")));
        }
    }

    /// The first response body byte (the first token of a 2xx).
    pub fn first_byte(&self) {
        self.stream.span().add_event("first_byte", Vec::new());
    }

    /// Ends every span still open (a stream that ended before its pick: the client went away,
    /// or Envoy reset it); `end` is how the stream ended (`kvpick_extproc_streams_total`'s label).
    pub fn end(mut self, end: &'static str) {
        for mut span in [self.body.take(), self.tokenize.take(), self.lookup.take()]
            .into_iter()
            .flatten()
        {
            span.set_attribute(KeyValue::new("kvpick.abandoned", true));
            span.end();
        }
        self.close_queue("abandoned", None);
        if let Some(pick) = self.pick.take() {
            pick.span()
                .set_attribute(KeyValue::new("kvpick.abandoned", true));
            pick.span().end();
        }
        let stream = self.stream.span();
        stream.set_attribute(KeyValue::new("kvpick.stream.end", end));
        stream.end();
    }
}

/// Why this rank: the first rule that decided it.
pub fn pick_reason(selection: &Selection, pinned: bool) -> &'static str {
    if pinned {
        "pin"
    } else if selection.session == Some(SessionOutcome::Reused) {
        "session"
    } else if selection.prefill.is_some() {
        "pd_pair"
    } else if selection.overlap_blocks > 0 {
        "cache"
    } else {
        "load"
    }
}

fn pick_attributes(s: &Selection, pinned: bool) -> Vec<KeyValue> {
    let mut kv = vec![
        KeyValue::new("gen_ai.request.model", s.partition.model.clone()),
        KeyValue::new("kvpick.partition.model", s.partition.model.clone()),
        KeyValue::new(
            "kvpick.partition.routing_group",
            s.partition.routing_group.clone(),
        ),
        KeyValue::new("kvpick.candidates", i64::from(s.candidates)),
        KeyValue::new("kvpick.rank.worker", s.primary.worker_name.clone()),
        KeyValue::new("kvpick.rank.worker_id", s.primary.key.worker_id.to_string()),
        KeyValue::new("kvpick.rank.dp_rank", i64::from(s.primary.key.dp_rank)),
        KeyValue::new("kvpick.rank.endpoint", s.primary.endpoint.to_string()),
        KeyValue::new("kvpick.cached_blocks", i64::from(s.overlap_blocks)),
        KeyValue::new("kvpick.prompt_blocks", i64::from(s.prompt_blocks)),
        KeyValue::new("kvpick.prompt_tokens", s.prompt_tokens as i64),
        KeyValue::new("kvpick.predicted_ttft_ms", s.predicted_ttft_seconds * 1e3),
        KeyValue::new("kvpick.cost", s.cost),
        KeyValue::new("kvpick.reason", pick_reason(s, pinned)),
        KeyValue::new("kvpick.fallbacks", s.fallbacks.len() as i64),
    ];
    if let Some(outcome) = s.session {
        let name = outcome.as_str();
        kv.push(KeyValue::new("kvpick.session", name));
    }
    if let Some(prefill) = &s.prefill {
        kv.push(KeyValue::new(
            "kvpick.prefill.worker",
            prefill.worker_name.clone(),
        ));
        kv.push(KeyValue::new(
            "kvpick.prefill.endpoint",
            prefill.endpoint.to_string(),
        ));
    }
    kv
}
