//! The Envoy ext_proc host: the `envoy.service.ext_proc.v3.ExternalProcessor` gRPC service
//! (tonic, with [`codec::ExtProcCodec`] so body chunks stay the received buffers) that runs one
//! [`StreamMachine`] per Envoy stream and forwards its answers. It translates protocol only;
//! every decision is the selection core's.

pub mod bounds;
pub mod budget;
pub mod cap;
pub mod codec;
pub mod pd_headers;
pub mod session_ids;
pub mod stream;

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use tokio::sync::watch;
use tonic::codegen::{http, Body, BoxFuture, Bytes, Context, Poll, Service, StdError};
use tonic::{Request, Response, Status, Streaming};

use crate::selection::SelectionCore;
use crate::tokenize::prompt::Endpoint;
use crate::tokenize::{TokenizeOutcome, Tokenizers};
pub use crate::transport::memory_account::{max_message_bytes, MESSAGE_HEADROOM_BYTES};
pub use budget::{BodyBudget, BodyLease, DEFAULT_BUDGET_BYTES};
use codec::{ExtProcCodec, Inbound, Outbound};
pub use pd_headers::PdProtocol;
pub use session_ids::{SessionHeaders, DEFAULT_SESSION_HEADERS};
pub use stream::StreamMachine;

/// Per-process ext_proc settings.
#[derive(Debug, Clone)]
pub struct ExtProcSettings {
    pub max_body_bytes: usize,
    pub fallbacks: usize,
    pub conformance_test_mode: bool,
    /// Request headers naming a session, its parent and its end, in order of preference.
    pub session_headers: SessionHeaders,
    /// Per-model tokenizers for text and chat prompts (`--tokenizer-config`).
    pub tokenizers: Option<Arc<Tokenizers>>,
    /// Request-body bytes all streams together may buffer (`--max-buffered-body-bytes`).
    pub body_budget: Arc<BodyBudget>,
    /// The flow policy (`crate::sources::flow`): model rewrites today; `None` = none.
    pub flow_policy: Option<crate::sources::flow::PolicyRx>,
    /// How requests are classified (`--client-priority`).
    pub flow_settings: crate::sources::flow::FlowSettings,
    /// Which headers carry a prefill/decode pair (`--pd-protocol`).
    pub pd_protocol: PdProtocol,
    /// `--kv-transfer-p2p-port`: a pick's KV transfer hint also goes into the body as vLLM's
    /// `kv_transfer_params.remote_kv_source` with this P2P connector port (+ the holder's DP
    /// rank); `None` = the header alone.
    pub kv_transfer_p2p_port: Option<u16>,
    /// OpenTelemetry tracing (`--otlp-endpoint`); `None` = off: no span, no `traceparent`.
    pub tracer: Option<crate::observability::telemetry::RequestTracer>,
    /// `--emit-endpoint-scores`: most endpoints whose scores the `envoy.lb` metadata carries
    /// (`--endpoint-scores-limit`); 0 = off, no scores computed.
    pub endpoint_scores: usize,
    /// Largest gRPC message accepted from Envoy (`--max-ext-proc-message-bytes`); a larger one
    /// ends its stream with OUT_OF_RANGE before tonic reserves room for it.
    pub max_message_bytes: usize,
    /// Open streams and the idle timeout before routing (`--max-ext-proc-streams`,
    /// `--ext-proc-idle-timeout`).
    pub streams: bounds::StreamBounds,
}

impl Default for ExtProcSettings {
    fn default() -> Self {
        ExtProcSettings {
            max_body_bytes: 32 << 20,
            fallbacks: 0,
            conformance_test_mode: false,
            session_headers: SessionHeaders::default(),
            tokenizers: None,
            body_budget: BodyBudget::unmetered(DEFAULT_BUDGET_BYTES),
            flow_policy: None,
            flow_settings: crate::sources::flow::FlowSettings::default(),
            pd_protocol: PdProtocol::default(),
            kv_transfer_p2p_port: None,
            tracer: None,
            endpoint_scores: 0,
            max_message_bytes: max_message_bytes(32 << 20),
            streams: bounds::StreamBounds::default(),
        }
    }
}

/// Counts the ext_proc streams being served, so a draining process can wait for them while
/// its listeners (and health answers) stay up.
#[derive(Clone, Debug)]
pub struct LiveStreams(Arc<watch::Sender<usize>>);

impl Default for LiveStreams {
    fn default() -> Self {
        LiveStreams(Arc::new(watch::channel(0).0))
    }
}

impl LiveStreams {
    pub fn count(&self) -> usize {
        *self.0.borrow()
    }

    /// Resolves once no stream is being served.
    pub async fn idle(&self) {
        let mut rx = self.0.subscribe();
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    fn enter(&self) -> LiveStream {
        self.0.send_modify(|n| *n += 1);
        LiveStream(self.clone())
    }
}

struct LiveStream(LiveStreams);

impl Drop for LiveStream {
    fn drop(&mut self) {
        self.0 .0.send_modify(|n| *n -= 1);
    }
}

#[derive(Clone)]
pub struct ExtProcService {
    core: Arc<SelectionCore>,
    settings: Arc<ExtProcSettings>,
    live: LiveStreams,
    /// True once the process drains: new streams are refused, open ones run to their end.
    draining: Option<watch::Receiver<bool>>,
}

impl ExtProcService {
    pub fn new(core: Arc<SelectionCore>, settings: ExtProcSettings) -> Self {
        ExtProcService {
            core,
            settings: Arc::new(settings),
            live: LiveStreams::default(),
            draining: None,
        }
    }

    /// Refuse new streams (UNAVAILABLE) once `draining` turns true.
    pub fn with_drain(mut self, draining: watch::Receiver<bool>) -> Self {
        self.draining = Some(draining);
        self
    }

    /// The streams being served by this service (and its clones).
    pub fn live_streams(&self) -> LiveStreams {
        self.live.clone()
    }

    pub fn into_server(self) -> ExtProcServer {
        ExtProcServer { service: self }
    }
}

/// The stream of answers to one Envoy stream.
pub type ResponseStream = Pin<Box<dyn Stream<Item = Result<Outbound, Status>> + Send>>;

/// Largest gRPC message kvpick sends: an echoed body chunk (at most [`stream::MAX_BODY_CHUNK`]
/// bytes) or an immediate response, far below this.
const MAX_SENT_MESSAGE_BYTES: usize = 4 << 20;

/// The gRPC method Envoy calls.
const PROCESS_PATH: &str = "/envoy.service.ext_proc.v3.ExternalProcessor/Process";

/// The ext_proc gRPC service, as `envoy-types`' generated `ExternalProcessorServer` serves it
/// (same name, method, message limits and status for an unknown method) but with
/// [`ExtProcCodec`], which keeps body chunks as the received bytes.
#[derive(Clone)]
pub struct ExtProcServer {
    service: ExtProcService,
}

impl tonic::server::NamedService for ExtProcServer {
    const NAME: &'static str = "envoy.service.ext_proc.v3.ExternalProcessor";
}

struct ProcessMethod(ExtProcService);

impl tonic::server::StreamingService<Inbound> for ProcessMethod {
    type Response = Outbound;
    type ResponseStream = ResponseStream;
    type Future = BoxFuture<Response<ResponseStream>, Status>;

    fn call(&mut self, request: Request<Streaming<Inbound>>) -> Self::Future {
        let service = self.0.clone();
        Box::pin(async move { service.process(request) })
    }
}

impl<B> Service<http::Request<B>> for ExtProcServer
where
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = std::convert::Infallible;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != PROCESS_PATH {
            return Box::pin(async { Ok(Status::unimplemented("").into_http()) });
        }
        let method = ProcessMethod(self.service.clone());
        let received = self.service.settings.max_message_bytes;
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ExtProcCodec)
                .apply_max_message_size_config(Some(received), Some(MAX_SENT_MESSAGE_BYTES));
            Ok(grpc.streaming(method, request).await)
        })
    }
}

impl ExtProcService {
    /// Serves one Envoy stream. The answer stream itself drives the stream's [`StreamMachine`]
    /// ([`Driver`]): hyper's task for the HTTP/2 stream polls it, reads the next message and
    /// encodes the answers in the same poll, so a message costs no hand-off to another task.
    fn process(
        &self,
        request: Request<Streaming<Inbound>>,
    ) -> Result<Response<ResponseStream>, Status> {
        if self.draining.as_ref().is_some_and(|d| *d.borrow()) {
            return Err(Status::unavailable("kvpick: shutting down"));
        }
        let Some(slot) = self
            .settings
            .streams
            .cap
            .try_open(bounds::conn_id(&request))
        else {
            let metrics = self.core.metrics();
            metrics
                .extproc
                .streams
                .with_label_values(&["over_stream_cap"])
                .inc();
            return Err(bounds::over_cap());
        };
        let live = self.live.enter();
        let mut machine = StreamMachine::new(Arc::clone(&self.core), Arc::clone(&self.settings));
        if self.settings.tracer.is_some() {
            machine.set_trace_context(grpc_trace_context(request.metadata()));
        }
        let driver = Driver {
            machine,
            inbound: request.into_inner(),
            outbox: Vec::new().into_iter(),
            lease: None,
            end: None,
            _live: live,
            slot,
        };
        let answers = futures::stream::unfold(driver, |mut driver| async move {
            let answer = driver.next_answer().await?;
            Some((answer, driver))
        });
        Ok(Response::new(Box::pin(answers)))
    }
}

/// One Envoy stream being served: its machine, its inbound messages and the answers not yet
/// handed to tonic. Dropping it (the stream ended, or hyper dropped the answer stream because
/// Envoy went away) counts how the stream ended, ends its trace and, with the machine, frees
/// any booking still held.
struct Driver {
    machine: StreamMachine,
    inbound: Streaming<Inbound>,
    outbox: std::vec::IntoIter<Outbound>,
    /// The budget held by the echoed body in `outbox`: all of it until handed on to tonic, then
    /// what tonic and h2 may still buffer of it (a client that never opens its window keeps it
    /// there) until Envoy's next message.
    lease: Option<BodyLease>,
    /// How the stream ended, once it has; dropped before that = Envoy went away (or, once the
    /// exchange is complete, the normal end: `completed`).
    end: Option<&'static str>,
    _live: LiveStream,
    /// Its place under `--max-ext-proc-streams`, evictable while it waits before routing.
    slot: bounds::StreamSlot,
}

impl Driver {
    /// The next answer to send, reading and handling inbound messages until there is one;
    /// `None` once the stream is over.
    async fn next_answer(&mut self) -> Option<Result<Outbound, Status>> {
        loop {
            if let Some(answer) = self.outbox.next() {
                return Some(Ok(answer));
            }
            if let Some(lease) = &mut self.lease {
                lease.keep_at_most(stream::ECHO_IN_FLIGHT_BYTES);
            }
            if self.end.is_some() {
                return None;
            }
            let waits = self.machine.awaits_request();
            let idle = self.machine.settings().streams.idle_timeout;
            let read = match bounds::read(&mut self.inbound, &mut self.slot, waits, idle).await {
                Ok(read) => read,
                Err(ended) => return Some(self.ended(ended)),
            };
            // Envoy's next message (or the stream's end) means it has read the echo.
            self.lease = None;
            match read {
                Ok(Some(message)) => match self.machine.handle(message) {
                    Ok(step) => {
                        let busy = step.tokenize.is_some()
                            || step.session_lookup.is_some()
                            || step.queue.is_some();
                        if busy || !self.machine.awaits_request() {
                            if let Err(ended) = bounds::hold(&mut self.slot) {
                                return Some(self.ended(ended));
                            }
                        }
                        self.run(step).await
                    }
                    Err(status) => {
                        tracing::warn!(code = ?status.code(), message = status.message(), "ext_proc stream rejected");
                        self.end = Some("protocol_error");
                        return Some(Err(status));
                    }
                },
                Ok(None) => self.end = Some("closed"),
                Err(status) => {
                    tracing::debug!(%status, "ext_proc stream ended by Envoy or unreadable");
                    // Answer with the error: when Envoy is gone nobody reads it, but for a
                    // message that cannot be decoded a clean end of stream would let Envoy
                    // carry on with the request without a pick.
                    self.end = Some("reset");
                    return Some(Err(status));
                }
            }
        }
    }

    /// Ends the stream without a message (idle before routing, or evicted at the stream cap).
    fn ended(&mut self, ended: bounds::Ended) -> Result<Outbound, Status> {
        tracing::debug!(status = %ended.status, end = ended.end, "ext_proc stream ended waiting");
        self.end = Some(ended.end);
        Err(ended.status)
    }

    /// Finishes what one message started (tokenizing, a shared-state session lookup, a wait
    /// in the queue) and queues its answers.
    async fn run(&mut self, mut step: stream::Step) {
        if let Some(job) = step.tokenize.take() {
            let outcome = match &self.machine.settings().tokenizers {
                Some(t) => {
                    t.tokenize_laid_out(
                        Endpoint::from_path(&job.path),
                        &job.model,
                        job.body,
                        job.layout,
                    )
                    .await
                }
                None => TokenizeOutcome::NotApplicable,
            };
            step = self.machine.resume(outcome);
        }
        let (lookup, remote) = (step.session_lookup.take(), step.remote_query.take());
        if lookup.is_some() || remote.is_some() {
            let core = Arc::clone(self.machine.core());
            // Both at once: the wait stays the longer one's.
            let (_, overlap) = futures::join!(
                async {
                    if let Some(job) = lookup {
                        core.prefetch_session(job).await;
                    }
                },
                async {
                    match remote {
                        Some(query) => core.fetch_remote_overlap(query).await,
                        None => None,
                    }
                }
            );
            self.machine.set_remote_overlap(overlap);
            step = self.machine.resume_after_lookup();
        }
        if let Some(waiter) = step.queue.take() {
            // Dropping the driver here (Envoy gone: the client disconnected) drops the
            // waiter, which takes the request out of the queue at once.
            let outcome = waiter.wait().await;
            step = self.machine.resume_after_queue(outcome);
        }
        self.outbox = std::mem::take(&mut step.responses).into_iter();
        self.lease = step.body_lease.take();
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        let end = match self.end {
            Some("protocol_error") => "protocol_error",
            // Envoy ends a finished stream its own way (end of stream, a reset, or its HTTP/2
            // stream gone before we read again): all of them are the normal end.
            _ if self.machine.is_complete() => "completed",
            Some(end) => end,
            None if self.machine.is_queued() => "gone_while_queued",
            None => "envoy_gone",
        };
        self.machine
            .core()
            .metrics()
            .extproc
            .streams
            .with_label_values(&[end])
            .inc();
        self.machine.end_trace(end);
    }
}

/// The W3C trace context of the ext_proc call: Envoy's span for it, when Envoy traces.
fn grpc_trace_context(
    metadata: &tonic::metadata::MetadataMap,
) -> crate::observability::telemetry::TraceHeaders {
    let mut headers = crate::observability::telemetry::TraceHeaders::default();
    for name in [
        crate::observability::telemetry::request::TRACEPARENT,
        crate::observability::telemetry::request::TRACESTATE,
    ] {
        if let Some(value) = metadata.get(name) {
            headers.offer(name, value.as_bytes());
        }
    }
    headers
}

#[cfg(test)]
mod host_tests;
