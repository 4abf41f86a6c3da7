//! The per-stream ext_proc state machine (ARCHITECTURE.md §2). It turns each `ProcessingRequest` Envoy sends
//! into the responses to send back, synchronously, so it is unit-testable without Envoy or gRPC.
//! It holds the request's [`Reservation`]; dropping the machine (stream ended or client gone)
//! frees the booking.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::{HeaderValueOption, Metadata};
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, processing_response, HeadersResponse, HttpBody, HttpHeaders,
    ProcessingResponse, TrailersResponse,
};
use tonic::Status;

use crate::epp_metrics::Stage;
use crate::request::scan::{BodyScanner, Scanned};
use crate::request::{parse_request_body_for, BodyError, ParsedBody, Prompt};
use crate::selection::admission::{Admitted, Waiter};
use crate::selection::ToHttpStatus;
use crate::selection::{
    DuplicateId, EndpointFilter, Pin, PromptInput, Reservation, SelectError, SelectionCore,
    SelectionRequest,
};
use crate::telemetry::RequestTrace;
use crate::tokenize::TokenizeOutcome;
use crate::usage::UsageTracker;
use kvpick_core::request::check_session_id_len;

use super::budget::BodyLease;
use super::codec::{BodySide, Inbound, Outbound};
use super::ExtProcSettings;

mod response;
mod trace;
mod wire;

use trace::{trace_tokenize, TraceSeed};
pub use wire::immediate;
use wire::{
    body_chunks, body_error_message, check_protocol, header_bytes, header_len, header_value,
    headers_response, one, session_key, set_header, string_entries, BodyBuf,
};

/// Largest body chunk sent back to Envoy in one streamed_response.
pub const MAX_BODY_CHUNK: usize = 62_000;

pub const DESTINATION_HEADER: &str = "x-gateway-destination-endpoint";
pub const SERVED_KEY: &str = "x-gateway-destination-endpoint-served";
/// `envoy.lb` key of the candidates' scores (`--emit-endpoint-scores`; llm-d-router's
/// `DestinationEndpointScoresKey`): a struct, address -> number.
pub const SCORES_KEY: &str = "x-gateway-destination-endpoint-scores";
pub const SUBSET_NAMESPACE: &str = "envoy.lb.subset_hint";
pub const SUBSET_KEY: &str = "x-gateway-destination-endpoint-subset";
pub const LB_NAMESPACE: &str = "envoy.lb";
pub const CONFORMANCE_SELECTION_HEADER: &str = "test-epp-endpoint-selection";
pub const CONFORMANCE_SERVED_HEADER: &str = "x-conformance-test-served-endpoint";

/// Request headers a client must not be able to set: they steer routing.
const SPOOFABLE_PREFIXES: [&str; 3] = [
    "x-gateway-destination-endpoint",
    "x-gateway-inference-",
    "x-gateway-model-name-rewrite",
];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    RequestHeaders,
    RequestBody,
    /// The body is complete and its prompt is being tokenized by the async host, which hands
    /// the result to [`StreamMachine::resume`].
    Tokenizing,
    /// Routed; waiting for (or streaming) the response.
    Response,
    /// Envoy answered the request itself (a local reply such as 431 or 400) before it was
    /// routed, and sends that reply's response path to us: it is passed through unchanged.
    LocalReply,
    /// An immediate response was sent; nothing more is answered.
    Finished,
}

/// What one inbound message produced.
#[derive(Debug, Default)]
pub struct Step {
    pub responses: Vec<Outbound>,
    /// True after an ImmediateResponse: the stream is over for us.
    pub finished: bool,
    /// The host must tokenize this prompt and call [`StreamMachine::resume`] with the outcome
    /// before handing the machine another message.
    pub tokenize: Option<TokenizeJob>,
    /// `--shared-state`: the host must run this lookup ([`SelectionCore::prefetch_session`]) and
    /// call [`StreamMachine::resume_after_lookup`] before handing the machine another message.
    pub session_lookup: Option<crate::shared::SessionLookupJob>,
    /// The budget held by the body echoed in `responses`: the host drops it once they are sent,
    /// so the bytes count against the budget for as long as kvpick holds them.
    pub body_lease: Option<BodyLease>,
    /// Flow control: the request waits for capacity. The host awaits [`Waiter::wait`] (dropping
    /// it if Envoy goes away, which leaves the queue) and calls
    /// [`StreamMachine::resume_after_queue`] with the outcome.
    pub queue: Option<Waiter>,
}

/// What is left to answer once a queued request is routed.
struct QueuedRoute {
    request_id: String,
    started: Instant,
    header_only: bool,
    /// The body to echo (and its trailers) once routed; `None` for a header-only request.
    tail: Option<BodyTail>,
}

/// A request body held while its request is routed, echoed (with the answer to its trailers)
/// after the headers response.
struct BodyTail {
    body: Vec<Bytes>,
    lease: BodyLease,
    end_of_stream: bool,
    /// The body ended with trailers: answer them after routing.
    trailers: bool,
}

impl BodyTail {
    /// Appends the echo of the body (and the answer to its trailers) to `step`, which then holds
    /// the body's lease until it is sent.
    fn echo(self, step: &mut Step) {
        step.responses
            .extend(body_chunks(self.body, self.end_of_stream));
        step.body_lease = Some(self.lease);
        if self.trailers {
            step.responses.push(
                ProcessingResponse {
                    response: Some(processing_response::Response::RequestTrailers(
                        TrailersResponse::default(),
                    )),
                    ..Default::default()
                }
                .into(),
            );
        }
    }
}

/// A prompt to tokenize off the state machine (ARCHITECTURE.md §8).
#[derive(Debug, Clone)]
pub struct TokenizeJob {
    pub model: String,
    /// The request `:path` (tells embeddings `input` from responses `input`).
    pub path: String,
    pub body: bytes::Bytes,
}

/// A routed-to-be request waiting for its token ids.
struct PendingRoute {
    parsed: ParsedBody,
    started: Instant,
    /// The body as received, echoed once routed; the lease also covers the job's copy.
    tail: BodyTail,
}

pub struct StreamMachine {
    core: Arc<SelectionCore>,
    settings: Arc<ExtProcSettings>,
    phase: Phase,
    header_names: Vec<String>,
    path: String,
    content_type: Option<String>,
    request_id: Option<String>,
    conformance_filter: Option<EndpointFilter>,
    subset: Option<EndpointFilter>,
    body: BodyBuf,
    body_started: Option<Instant>,
    /// Reads the request body as it arrives (`crate::request::scan`); `None` once it is done.
    scanner: Option<BodyScanner>,
    /// Time spent scanning the body so far (the EPP parse stage).
    scan_time: std::time::Duration,
    reservation: Option<Reservation>,
    picked_at: Option<Instant>,
    first_byte_seen: bool,
    /// The response ended (its end of stream passed): the stream's work is done, however Envoy
    /// then closes the gRPC stream.
    response_done: bool,
    /// The request was routed on the prompt's engine token ids (given or tokenized): its
    /// response's cached tokens are comparable with the pick's prediction (cache-view accuracy).
    routed_on_tokens: bool,
    /// The upstream answered 2xx.
    response_ok: bool,
    usage: Option<UsageTracker>,
    served_endpoint: Option<String>,
    pin: Option<Pin>,
    priority: i32,
    /// A client error found in the headers, answered (400) once the request would be routed.
    header_error: Option<String>,
    session_id: Option<String>,
    /// The parent of a child session, and whether this is the session's last request.
    parent_session_id: Option<String>,
    session_final: bool,
    pending: Option<PendingRoute>,
    /// Flow control: the fairness key and SLOs of the request (headers).
    fairness_key: Option<String>,
    slo_ttft_ms: Option<u64>,
    slo_tpot_ms: Option<u64>,
    /// The model the request's `x-llm-d-model-name-rewrite` names (`flow::MODEL_REWRITE_HEADERS`).
    model_rewrite: Option<String>,
    /// Routed once its [`Waiter`] is released.
    queued: Option<QueuedRoute>,
    /// The request's EPP series (`crate::epp_metrics`).
    epp: crate::epp_metrics::EppRequest,
    /// When the tokenize job was handed to the host.
    tokenize_started: Option<Instant>,
    /// Tracing on: what the stream span starts from, until the request headers arrive.
    trace_seed: Option<Box<TraceSeed>>,
    /// Tracing on: the stream's open spans (`crate::telemetry::request`).
    trace: Option<Box<RequestTrace>>,
}

impl StreamMachine {
    pub fn new(core: Arc<SelectionCore>, settings: Arc<ExtProcSettings>) -> Self {
        let epp = core.metrics().epp.request();
        StreamMachine {
            core,
            phase: Phase::RequestHeaders,
            header_names: Vec::new(),
            path: String::new(),
            content_type: None,
            request_id: None,
            conformance_filter: None,
            subset: None,
            body: BodyBuf::new(settings.body_budget.lease()),
            body_started: None,
            scanner: None,
            scan_time: std::time::Duration::ZERO,
            reservation: None,
            picked_at: None,
            first_byte_seen: false,
            response_done: false,
            routed_on_tokens: false,
            response_ok: false,
            usage: None,
            served_endpoint: None,
            pin: None,
            priority: 0,
            header_error: None,
            session_id: None,
            parent_session_id: None,
            session_final: false,
            pending: None,
            fairness_key: None,
            slo_ttft_ms: None,
            slo_tpot_ms: None,
            model_rewrite: None,
            queued: None,
            epp,
            tokenize_started: None,
            trace_seed: settings.tracer.as_ref().map(|_| TraceSeed::now()),
            trace: None,
            settings,
        }
    }

    /// The booking held by this stream, if any.
    pub fn booking_id(&self) -> Option<&str> {
        self.reservation.as_ref().map(|r| r.booking_id())
    }

    /// The core this stream picks from.
    pub fn core(&self) -> &Arc<SelectionCore> {
        &self.core
    }

    pub fn settings(&self) -> &ExtProcSettings {
        &self.settings
    }

    /// True while the request waits in the flow-control queue (between the [`Step`] that
    /// carried its [`Waiter`] and [`StreamMachine::resume_after_queue`]).
    pub fn is_queued(&self) -> bool {
        self.queued.is_some()
    }

    /// True once the exchange is over for kvpick: the response ended, or kvpick answered the
    /// request itself. Envoy closing (or resetting) the stream after that is a normal end.
    pub fn is_complete(&self) -> bool {
        self.response_done || self.phase == Phase::Finished
    }

    /// Handles one message (a `ProcessingRequest`, or one read by [`super::codec`] with its body
    /// chunk apart). `Err` ends the gRPC stream with that status.
    pub fn handle(&mut self, message: impl Into<Inbound>) -> Result<Step, Status> {
        let Inbound {
            message,
            body: chunk,
        } = message.into();
        if let Some(config) = &message.protocol_config {
            check_protocol(config)?;
        }
        if let Some(md) = &message.metadata_context {
            self.read_metadata(md);
        }
        use processing_request::Request;
        let Some(request) = message.request else {
            // Flow-control-only messages carry nothing to answer.
            return Ok(Step::default());
        };
        if self.phase == Phase::Finished {
            return Ok(Step::default());
        }
        if self.phase == Phase::LocalReply {
            return Ok(self.on_local_reply(request, chunk));
        }
        match request {
            Request::RequestHeaders(h) => self.on_request_headers(h),
            Request::RequestBody(b) => self.on_request_body(b, chunk),
            Request::RequestTrailers(_) => self.on_request_trailers(),
            Request::ResponseHeaders(_)
            | Request::ResponseBody(_)
            | Request::ResponseTrailers(_)
                if self.phase != Phase::Response =>
            {
                self.start_local_reply();
                Ok(self.on_local_reply(request, chunk))
            }
            Request::ResponseHeaders(h) => self.on_response_headers(h),
            Request::ResponseBody(b) => Ok(self.on_response_body(b, chunk)),
            Request::ResponseTrailers(_) => {
                self.release();
                Ok(one(processing_response::Response::ResponseTrailers(
                    TrailersResponse::default(),
                )))
            }
        }
    }

    /// A response before the request was routed is Envoy's own answer (it replies locally,
    /// e.g. 431 for oversized headers, and still runs the response path through ext_proc).
    /// Nothing was booked; what was buffered of the request will never be routed.
    fn start_local_reply(&mut self) {
        tracing::debug!(phase = ?self.phase, "response before routing: Envoy's local reply, passed through");
        self.phase = Phase::LocalReply;
        drop(self.body.take());
        self.scanner = None;
        self.pending = None;
    }

    /// Passes a local reply's response messages through unchanged. Request messages after
    /// it are ignored: the request is over for Envoy, and failing the stream now would make
    /// Envoy reset the client instead of sending its status.
    fn on_local_reply(&mut self, request: processing_request::Request, chunk: Bytes) -> Step {
        use processing_request::Request;
        match request {
            Request::ResponseHeaders(_) => one(processing_response::Response::ResponseHeaders(
                HeadersResponse::default(),
            )),
            Request::ResponseBody(b) => Step {
                responses: vec![Outbound::streamed_body(
                    BodySide::Response,
                    chunk,
                    b.end_of_stream,
                )],
                ..Step::default()
            },
            Request::ResponseTrailers(_) => one(processing_response::Response::ResponseTrailers(
                TrailersResponse::default(),
            )),
            Request::RequestHeaders(_) | Request::RequestBody(_) | Request::RequestTrailers(_) => {
                Step::default()
            }
        }
    }

    fn read_metadata(&mut self, md: &Metadata) {
        if let Some(ns) = md.filter_metadata.get(SUBSET_NAMESPACE) {
            if let Some(value) = ns.fields.get(SUBSET_KEY) {
                self.subset = Some(EndpointFilter::parse(
                    string_entries(value).iter().map(String::as_str),
                ));
            }
        }
        if let Some(ns) = md.filter_metadata.get(LB_NAMESPACE) {
            if let Some(value) = ns.fields.get(SERVED_KEY) {
                if let Some(last) = string_entries(value).pop() {
                    self.served_endpoint = Some(last);
                }
            }
        }
    }

    fn read_pin(&mut self, worker: Option<String>, rank: Option<String>) {
        let parsed = match (worker, rank) {
            (None, None) => return,
            (None, Some(_)) => {
                Err("x-dynamo-dp-rank needs x-dynamo-worker-instance-id".to_string())
            }
            (Some(w), rank) => match (w.parse::<u64>(), rank.map(|r| r.parse::<u32>())) {
                (Err(_), _) => {
                    Err("x-dynamo-worker-instance-id must be a decimal worker id".into())
                }
                (_, Some(Err(_))) => Err("x-dynamo-dp-rank must be a non-negative integer".into()),
                (Ok(worker_id), rank) => Ok(Pin {
                    worker_id,
                    // An unparsable rank was refused by the arm above.
                    dp_rank: rank.and_then(Result::ok),
                }),
            },
        };
        match parsed {
            Ok(pin) => self.pin = Some(pin),
            Err(message) => {
                self.header_error.get_or_insert(message);
            }
        }
    }

    fn on_request_headers(&mut self, headers: HttpHeaders) -> Result<Step, Status> {
        if self.phase != Phase::RequestHeaders {
            return Err(Status::failed_precondition(
                "request headers received twice on one ext_proc stream",
            ));
        }
        let (mut worker_pin, mut rank_pin) = (None, None);
        let mut session_headers: Vec<(String, String)> = Vec::new();
        let mut declared_len: Option<u64> = None;
        for h in headers.headers.iter().flat_map(|m| m.headers.iter()) {
            let name = h.key.to_ascii_lowercase();
            let value = header_value(h);
            match name.as_str() {
                "content-type" => self.content_type = Some(value.to_string()),
                "content-length" => declared_len = value.trim().parse().ok(),
                ":path" => self.path = value.chars().take(1024).collect(),
                "x-request-id" if !value.is_empty() => {
                    self.request_id = Some(value.chars().take(256).collect())
                }
                CONFORMANCE_SELECTION_HEADER if self.settings.conformance_test_mode => {
                    self.conformance_filter = Some(EndpointFilter::parse(value.split(',')));
                }
                "x-dynamo-worker-instance-id" => worker_pin = Some(value.trim().to_string()),
                "x-dynamo-dp-rank" => rank_pin = Some(value.trim().to_string()),
                _ => {}
            }
            if let Some(seed) = &mut self.trace_seed {
                seed.http.offer(&name, header_bytes(h));
            }
            let ids = &self.settings.session_headers;
            if ids.names_session(&name) {
                // The limit is on the bytes the client sent: invalid UTF-8 grows when made
                // lossy (one byte becomes a 3-byte U+FFFD).
                if let Err(err) =
                    check_session_id_len(header_len(h), &format!("session id ({name})"))
                {
                    self.header_error.get_or_insert_with(|| err.to_string());
                } else {
                    session_headers.push((name.clone(), session_key(h)));
                }
            } else if ids.is_final_header(&name) {
                session_headers.push((name.clone(), value.chars().take(8).collect()));
            }
            self.header_names.push(name);
        }
        self.start_trace();
        // A body declared over the limit is refused before a byte of it is buffered.
        if declared_len.is_some_and(|n| n > self.settings.max_body_bytes as u64) {
            return Ok(self.reject_too_large());
        }
        let ids = self.settings.session_headers.resolve(&session_headers);
        (self.session_id, self.parent_session_id) = (ids.session, ids.parent);
        self.session_final = ids.last;
        self.classify(&headers);
        if self.core.config().allow_pins {
            self.read_pin(worker_pin, rank_pin);
        }
        if headers.end_of_stream {
            self.phase = Phase::Response;
            let started = Instant::now();
            return Ok(self.route(None, started, true));
        }
        self.phase = Phase::RequestBody;
        let endpoint = crate::tokenize::prompt::Endpoint::from_path(&self.path);
        self.scanner = Some(BodyScanner::new(endpoint, self.content_type.as_deref()));
        if let Some(t) = &mut self.trace {
            t.body_started();
        }
        Ok(Step::default())
    }

    fn on_request_body(&mut self, body: HttpBody, chunk: Bytes) -> Result<Step, Status> {
        if self.phase != Phase::RequestBody {
            return Err(Status::failed_precondition(
                "request body received outside the request body phase",
            ));
        }
        self.body_started.get_or_insert_with(Instant::now);
        if self.body.len + chunk.len() > self.settings.max_body_bytes {
            return Ok(self.reject_too_large());
        }
        if !self.body.lease.try_grow(chunk.len()) {
            return Ok(self.reject_budget());
        }
        if let Some(scanner) = &mut self.scanner {
            let started = Instant::now();
            scanner.feed(&chunk);
            self.scan_time += started.elapsed();
        }
        self.body.push(chunk);
        if !body.end_of_stream {
            return Ok(Step::default());
        }
        self.finish_request(true)
    }

    fn on_request_trailers(&mut self) -> Result<Step, Status> {
        let trailers = one(processing_response::Response::RequestTrailers(
            TrailersResponse::default(),
        ));
        match self.phase {
            Phase::RequestBody => {
                // The body ended with trailers instead of end_of_stream: route now.
                let mut step = self.finish_request(false)?;
                if let Some(pending) = &mut self.pending {
                    pending.tail.trailers = true;
                    return Ok(step);
                }
                if !step.finished {
                    step.responses.extend(trailers.responses);
                }
                Ok(step)
            }
            Phase::Response => Ok(trailers),
            _ => Err(Status::failed_precondition(
                "request trailers received before request headers",
            )),
        }
    }

    /// The body parsed for its API (by the request path): what the scanner read while it
    /// arrived, or serde over the whole body when the scanner left it undecided (or the body was
    /// rewritten since). Timed, scanning included, as the EPP's parse stage.
    fn parse_body(&mut self) -> Result<Option<ParsedBody>, BodyError> {
        let endpoint = crate::tokenize::prompt::Endpoint::from_path(&self.path);
        let parse_started = Instant::now();
        let scanned = match self.scanner.take() {
            Some(scanner) => scanner.finish(&self.body.chunks),
            None => Scanned::Undecided(crate::request::scan::Undecided::Incomplete),
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
    fn tokenizer_model(&self, model: Option<&str>) -> Option<String> {
        match (model, self.settings.tokenizers.as_ref()) {
            (Some(m), Some(t)) => t.has(m).then(|| m.to_string()),
            (None, Some(t)) => t.sole_model().map(str::to_string),
            (_, None) => None,
        }
    }

    // `parsed` is checked to be `Some` at the top of the branch that moves it.
    #[allow(clippy::expect_used)]
    fn finish_request(&mut self, body_end_of_stream: bool) -> Result<Step, Status> {
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
        let shared_session = self.core.shared().is_some() && self.session_id.is_some();
        if let Some(p) = parsed.take_if(|_| shared_session) {
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
    fn held_body(&mut self, end_of_stream: bool) -> BodyTail {
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
    fn echo_after_route(&mut self, mut step: Step, tail: BodyTail) -> Step {
        match self.queued.as_mut() {
            Some(queued) => queued.tail = Some(tail),
            None => tail.echo(&mut step),
        }
        step
    }

    /// Flow control's classification of the request (`crate::flow::classify`): priority from
    /// its objective and (with `--client-priority`) `x-dynamo-request-priority`, fairness key,
    /// SLOs. Malformed values are a 400 when the request would be routed.
    fn classify(&mut self, headers: &HttpHeaders) {
        let policy = match &self.settings.flow_policy {
            Some(rx) => rx.borrow().clone(),
            None => Arc::new(crate::flow::FlowPolicy::default()),
        };
        let pairs = headers
            .headers
            .iter()
            .flat_map(|m| m.headers.iter())
            .map(|h| {
                let value: &[u8] = if h.raw_value.is_empty() {
                    h.value.as_bytes()
                } else {
                    &h.raw_value
                };
                (h.key.as_str(), value)
            });
        match crate::flow::classify(pairs, &policy, &self.settings.flow_settings) {
            Ok(class) => {
                self.epp.classified(class.priority, &class.fairness_key);
                self.priority = class.priority;
                self.fairness_key = Some(class.fairness_key);
                self.slo_ttft_ms = class.slo_ttft_ms;
                self.slo_tpot_ms = class.slo_tpot_ms;
                self.model_rewrite = class.model_rewrite;
            }
            Err(err) => {
                self.header_error.get_or_insert_with(|| err.to_string());
            }
        }
    }

    /// Model rewrite (`x-llm-d-model-name-rewrite`, then InferenceModelRewrite rules of the flow
    /// policy, as llm-d-router orders them: `flow::rewrite_request_body`), before the body is parsed,
    /// so tokenizer, partition and pick all see the target model and Envoy forwards the rewritten
    /// body. The target is chosen by a hash of the session id (a session stays on one target and
    /// keeps its KV cache), else of the client's `x-request-id` (a retry keeps its model), else at
    /// random. No `content-length` fix is needed: in FULL_DUPLEX_STREAMED Envoy
    /// removes it from the request whenever body mutation is possible (ext_proc
    /// `processing_mode.proto`). `Some` = a step to answer instead (budget exhausted).
    fn rewrite_model(&mut self) -> Option<Step> {
        let policy = match (&self.settings.flow_policy, &self.model_rewrite) {
            (Some(rx), _) => rx.borrow().clone(),
            (None, Some(_)) => Arc::new(crate::flow::FlowPolicy::default()),
            (None, None) => return None,
        };
        if policy.rules().is_empty() && self.model_rewrite.is_none() {
            return None; // no copy of a multi-chunk body when there is nothing to rewrite
        }
        let pick = match self.session_id.as_ref().or(self.request_id.as_ref()) {
            Some(id) => xxhash_rust::xxh3::xxh3_64(id.as_bytes()),
            None => rand::random(),
        };
        let rewritten = crate::flow::rewrite_request_body(
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

    /// `--shared-state`: the Redis lookup this request's session needs before its pick.
    fn session_lookup_for(&self, parsed: &ParsedBody) -> Option<crate::shared::SessionLookupJob> {
        self.core.session_tree_lookup(
            parsed.model.as_deref(),
            "",
            self.session_id.as_deref(),
            self.parent_session_id.as_deref(),
        )
    }

    /// Routes a pending request, unless its session must be looked up first: then it stays
    /// pending and the step asks the host for the lookup.
    fn route_pending(&mut self, pending: PendingRoute) -> Step {
        if let Some(job) = self.session_lookup_for(&pending.parsed) {
            if let Some(t) = &mut self.trace {
                t.lookup_started();
            }
            self.pending = Some(pending);
            self.phase = Phase::Tokenizing;
            return Step {
                session_lookup: Some(job),
                ..Step::default()
            };
        }
        self.route_now(pending)
    }

    /// Finishes a request whose session was looked up (the binding found, if any, is installed).
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
    fn route_now(&mut self, pending: PendingRoute) -> Step {
        self.phase = Phase::Response;
        let step = self.route(Some(pending.parsed), pending.started, false);
        if step.finished {
            return step;
        }
        self.echo_after_route(step, pending.tail)
    }

    /// Selects, books, and builds the headers response.
    fn route(&mut self, body: Option<ParsedBody>, started: Instant, header_only: bool) -> Step {
        if let Some(message) = self.header_error.take() {
            return self.reject(400, &message);
        }
        if let Some(t) = &mut self.trace {
            t.pick_started();
        }
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
        let request = SelectionRequest {
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
        };
        let pick_started = Instant::now();
        let admitted = self.core.admit(&request);
        let seconds = pick_started.elapsed().as_secs_f64();
        self.core.metrics().epp.stage(Stage::Pick, seconds);
        match admitted {
            Ok(Admitted::Now(r)) => {
                self.routed(*r, &request.request_id, started, header_only, false)
            }
            Ok(Admitted::Queued(waiter)) => {
                tracing::debug!(ticket = waiter.ticket(), "queued for capacity");
                self.epp.queued();
                if let Some(t) = &mut self.trace {
                    t.queued(self.priority, self.fairness_key.as_deref());
                }
                self.queued = Some(QueuedRoute {
                    request_id: request.request_id,
                    started,
                    header_only,
                    tail: None,
                });
                Step {
                    queue: Some(waiter),
                    ..Step::default()
                }
            }
            Err(err) => self.reject_select(&err),
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
            tail.echo(&mut step);
        }
        step
    }

    /// The headers response for a booked pick. `waited`: the request came out of the queue (its
    /// wait is in `kvpick_queue_wait_seconds`, not the pick latency).
    fn routed(
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

    /// The routing headers of a pick: the destination (primary, then fallbacks), kvpick's
    /// picker headers, the upstream's trace context when tracing, a pair's prefill headers; and
    /// the client-sent headers that must not pass (spoofable routing headers, a stale DP rank,
    /// prefill headers the pair did not set).
    fn route_headers(
        &mut self,
        selection: &kvpick_core::Selection,
        request_id: &str,
    ) -> (String, Vec<HeaderValueOption>, Vec<String>) {
        let mut destination = selection.primary.endpoint.to_string();
        for f in &selection.fallbacks {
            destination.push(',');
            destination.push_str(&f.endpoint.to_string());
        }
        let primary = &selection.primary;
        let mut set = vec![
            set_header(DESTINATION_HEADER, &destination),
            set_header(
                "x-dynamo-worker-instance-id",
                &primary.key.worker_id.to_string(),
            ),
            set_header("x-dynamo-dp-rank", &primary.key.dp_rank.to_string()),
        ];
        if self.request_id.is_none() {
            set.push(set_header("x-request-id", request_id));
        }
        let mut remove: Vec<String> = self
            .header_names
            .iter()
            .filter(|n| {
                SPOOFABLE_PREFIXES.iter().any(|p| n.starts_with(p)) && *n != DESTINATION_HEADER
            })
            .cloned()
            .collect();
        if primary.multiplexed {
            set.push(set_header(
                "x-data-parallel-rank",
                &primary.key.dp_rank.to_string(),
            ));
        } else if self
            .header_names
            .iter()
            .any(|n| n == "x-data-parallel-rank")
        {
            remove.push("x-data-parallel-rank".into());
        }
        // Tracing on: the upstream's trace context names the pick span.
        if let Some(t) = &mut self.trace {
            for (name, value) in t.picked(selection, self.pin.is_some()) {
                set.push(set_header(name, &value));
            }
        }
        // The prefill/decode pair, in `--pd-protocol`'s headers; client-sent ones never pass.
        let pair = super::pd_headers::headers(selection, self.settings.pd_protocol);
        for (name, value) in &pair {
            set.push(set_header(name, value));
        }
        remove.extend(
            self.header_names
                .iter()
                .filter(|n| {
                    super::pd_headers::ALL.contains(&n.as_str())
                        && pair.iter().all(|(set, _)| set != n)
                })
                .cloned(),
        );
        remove.sort();
        remove.dedup();
        (destination, set, remove)
    }

    fn reject_too_large(&mut self) -> Step {
        let message = format!(
            "request body exceeds max_body_bytes ({} bytes)",
            self.settings.max_body_bytes
        );
        self.reject(413, &message)
    }

    fn reject_select(&mut self, err: &SelectError) -> Step {
        self.reject(err.http_status(), &err.to_string())
    }

    /// 503 for a body the global budget cannot hold: memory is shared by every stream, so a
    /// retry (elsewhere or later) can succeed where buffering more could starve the process.
    fn reject_budget(&mut self) -> Step {
        self.core.metrics().extproc.body_budget_rejected.inc();
        tracing::debug!(
            limit = self.settings.body_budget.limit(),
            "request body budget exhausted"
        );
        self.reject(503, "request body budget exhausted, retry later")
    }

    fn reject(&mut self, status: u16, message: &str) -> Step {
        self.epp.rejected(status);
        if let Some(t) = &mut self.trace {
            t.refused(status, message);
        }
        self.phase = Phase::Finished;
        drop(self.body.take());
        self.scanner = None;
        self.pending = None;
        self.queued = None;
        self.core
            .metrics()
            .extproc
            .requests
            .with_label_values(&[&status.to_string()])
            .inc();
        Step {
            responses: vec![immediate(status, message).into()],
            finished: true,
            ..Step::default()
        }
    }
}

impl Drop for StreamMachine {
    /// A routed request whose stream ends before its first response byte (the client went away,
    /// or Envoy reset the stream; after a 2xx's headers too: the engine may have aborted the
    /// prefill): the rank is not blamed, but the index entries predicted for it go.
    fn drop(&mut self) {
        if let (Some(r), false) = (&self.reservation, self.first_byte_seen) {
            r.response_reset();
        }
    }
}

#[cfg(test)]
#[path = "stream_tests.rs"]
mod tests;

#[cfg(test)]
#[path = "stream_cache_view_tests.rs"]
mod cache_view_tests;

#[cfg(test)]
#[path = "stream_scores_tests.rs"]
mod scores_tests;
