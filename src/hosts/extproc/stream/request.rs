//! The request phase as it arrives: the ext_proc metadata (subset hint, served endpoint), the
//! request headers (path, content type, request id, session ids, pins, the body's declared
//! length, flow control's classification) and the body chunks buffered and scanned under
//! `max_body_bytes` and the body budget, until the body ends (end of stream or trailers) and
//! [`super::parse`] takes over.
//!
//! It must not route or answer the response: an error it finds in the headers is held and
//! answered (400) once the request would be routed.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use envoy_types::pb::envoy::config::core::v3::Metadata;
use envoy_types::pb::envoy::service::ext_proc::v3::{
    processing_response, HttpBody, HttpHeaders, TrailersResponse,
};
use tonic::Status;

use crate::selection::{EndpointFilter, Pin};
use crate::tokenize::body::scan::BodyScanner;
use kvpick_core::request::check_session_id_len;

use super::wire::{header_bytes, header_len, header_value, one, session_key, string_entries};
use super::{
    Phase, Step, StreamMachine, CONFORMANCE_SELECTION_HEADER, LB_NAMESPACE, SERVED_KEY, SUBSET_KEY,
    SUBSET_NAMESPACE,
};

impl StreamMachine {
    pub(super) fn read_metadata(&mut self, md: &Metadata) {
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

    pub(super) fn read_pin(&mut self, worker: Option<String>, rank: Option<String>) {
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

    pub(super) fn on_request_headers(&mut self, headers: HttpHeaders) -> Result<Step, Status> {
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

    pub(super) fn on_request_body(&mut self, body: HttpBody, chunk: Bytes) -> Result<Step, Status> {
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

    pub(super) fn on_request_trailers(&mut self) -> Result<Step, Status> {
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

    /// Flow control's classification of the request (`crate::sources::flow::classify`): priority from
    /// its objective and (with `--client-priority`) `x-dynamo-request-priority`, fairness key,
    /// SLOs. Malformed values are a 400 when the request would be routed.
    pub(super) fn classify(&mut self, headers: &HttpHeaders) {
        let policy = match &self.settings.flow_policy {
            Some(rx) => rx.borrow().clone(),
            None => Arc::new(crate::sources::flow::FlowPolicy::default()),
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
        match crate::sources::flow::classify(pairs, &policy, &self.settings.flow_settings) {
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
}

#[cfg(test)]
#[path = "request_tests.rs"]
mod tests;
