//! The per-stream ext_proc state machine (ARCHITECTURE.md §2). It turns each `ProcessingRequest` Envoy sends
//! into the responses to send back, synchronously, so it is unit-testable without Envoy or gRPC.
//! It holds the request's [`Reservation`]; dropping the machine (stream ended or client gone)
//! frees the booking.
//!
//! This file holds the machine's state and dispatch; each phase is a module of its own: the
//! request as it arrives (`request`), the body complete (`parse`: rewrite, parse, tokenize
//! job), routing (`route`, its headers `route_headers`, the refusals `reject`), and the
//! response (`response`); the messages as values are `wire`'s, the tracing hooks `trace`'s.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_request, processing_response, HeadersResponse, ProcessingResponse, TrailersResponse,
};
use tonic::Status;

use crate::observability::telemetry::RequestTrace;
use crate::selection::admission::Waiter;
use crate::selection::{EndpointFilter, Pin, Reservation, SelectionCore};
use crate::tokenize::body::layout::BodyLayout;
use crate::tokenize::body::scan::BodyScanner;
use crate::tokenize::body::ParsedBody;
use crate::usage::UsageTracker;

use super::budget::BodyLease;
use super::codec::{BodySide, Inbound, Outbound};
use super::ExtProcSettings;

mod parse;
mod reject;
mod request;
mod response;
mod route;
mod route_headers;
mod trace;
mod transfer;
mod wire;

use trace::TraceSeed;
pub use wire::immediate;
use wire::{body_chunks, check_protocol, one, BodyBuf};

/// Largest body chunk sent back to Envoy in one streamed_response.
pub const MAX_BODY_CHUNK: usize = 62_000;

/// What tonic and h2 may still hold of an echoed body once it is handed on: tonic's encode
/// buffer yields at 32 KiB, plus one more message of at most `MAX_BODY_CHUNK` bytes, and h2 takes
/// one such frame even from a client whose window is 1 byte. A stream keeps this much of its
/// [`super::budget::BodyLease`] until Envoy's next message shows the echo was read.
pub const ECHO_IN_FLIGHT_BYTES: usize = 32 * 1024 + MAX_BODY_CHUNK + 64;

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
    pub session_lookup: Option<crate::sources::shared::SessionLookupJob>,
    /// `--kv-index-remote`: the host must run this query
    /// ([`SelectionCore::fetch_remote_overlap`], at once with `session_lookup`), hand its answer
    /// to [`StreamMachine::set_remote_overlap`] and call [`StreamMachine::resume_after_lookup`].
    pub remote_query: Option<crate::selection::RemoteQuery>,
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
    /// Where the body's fields lie, as the scanner read them while routing did (`None` when
    /// it left the body to serde: the tokenizer finds it).
    pub layout: Option<BodyLayout>,
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
    /// Reads the request body as it arrives (`crate::tokenize::body::scan`); `None` once it is done.
    scanner: Option<BodyScanner>,
    /// The body's layout the scanner recorded, until the tokenize job takes it.
    layout: Option<BodyLayout>,
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
    /// `--kv-index-remote`: the remote index's answer for the pending request's pick.
    remote_overlap: Option<Arc<crate::selection::RemoteOverlap>>,
    /// Flow control: the fairness key and SLOs of the request (headers).
    fairness_key: Option<String>,
    slo_ttft_ms: Option<u64>,
    slo_tpot_ms: Option<u64>,
    /// The model the request's `x-llm-d-model-name-rewrite` names (`flow::MODEL_REWRITE_HEADERS`).
    model_rewrite: Option<String>,
    /// Routed once its [`Waiter`] is released.
    queued: Option<QueuedRoute>,
    /// The request's EPP series (`crate::observability::epp_metrics`).
    epp: crate::observability::epp_metrics::EppRequest,
    /// When the tokenize job was handed to the host.
    tokenize_started: Option<Instant>,
    /// Tracing on: what the stream span starts from, until the request headers arrive.
    trace_seed: Option<Box<TraceSeed>>,
    /// Tracing on: the stream's open spans (`crate::observability::telemetry::request`).
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
            layout: None,
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
            remote_overlap: None,
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
mod tests;
